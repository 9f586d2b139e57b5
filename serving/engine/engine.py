"""Engine: the model on a device mesh behind JetStream's contract (serving.engine.api.EngineAPI).

- `prefill(params, padded_tokens, true_length, sampling, mask)` runs one prompt (padded to a
  power-of-two bucket) and samples the first token of each of its `sampling.n` choices (within a
  grammar's `mask`); it returns a `Prefix` holding the prompt's KV, and with `sampling.logprobs` /
  `prompt_logprobs` the logprobs, computed in the same compiled call (`prefill_outputs` reads them).
- `insert(prefix, decode_state, slot, choice)` writes that KV into slot `slot` of the preallocated
  cache, with that choice's first token and seed.
- `generate(params, decode_state, max_position, masks)` advances every active slot by
  `decode_steps_per_call` tokens in one compiled call (one, with grammar `masks`), attending over
  the smallest cache window that holds `max_position` plus those steps; a slot stops at a stop id,
  at its max_tokens, or at max_target_length. Slots that asked for logprobs get them from the same
  call: log_softmax of the logits after the mask, the logit processing and temperature, before
  min-p / top-k / top-p.
- `free_resource(decode_state, slot)` deactivates a slot (a cancelled request).
- `write_adapter(params, slot, weights)` writes a LoRA adapter into its device slot (serving.lora.stack).
- `prompt_logprobs(params, padded_tokens, true_length)` scores a prompt (perplexity).

Every sampling call (both prefills, generate, verify) first processes each row's logits: bad words,
min_tokens, logit bias and penalties (serving.engine.penalties), over the slot's token history that
the decode state keeps and each step updates; logprobs are those of the processed logits.

All shapes are static; the decode state is donated to the compiled steps and comes back updated.
The compute backend (XLA's ops or the CPU kernels) is chosen once here, with its weight layout.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from serving.checkpoints.model_source import LoadedModel
from serving.config import DevicesConfig, EngineConfig
from serving.engine import penalties
from serving.engine.api import PrefillOutputs, PrefillRow, Proposer, ResultTokens
from serving.engine.chunked import ChunkedPrefill
from serving.engine.executables import ExecutableStore, InFlight
from serving.engine.handoff import Handoff, Handoffs
from serving.engine.limits import Limits
from serving.engine.memory import kv_pool_pages
from serving.engine.paged_cache import PagedCache, PoolFormat
from serving.engine.partitioning import Numerics
from serving.engine.sampler import Sampler
from serving.engine.sampling import token_logprobs
from serving.engine.sharding import (
    engine_placement,
    mesh_axes,
    param_shardings,
    replicated,
    unstacked_shardings,
)
from serving.engine.speculative import Verifier
from serving.engine.state import (
    DecodeState,
    Logprobs,
    Prefix,
    SlotSampling,
    TokenHistory,
    host_key,
    host_logprobs,
    is_stop,
    slot_sampling,
    stacked_sampling,
)
from serving.errors import GenerationError
from serving.kernels import backend
from serving.lora import stack as lora_stack
from serving.lora.peft import LoraWeights
from serving.models import decode_step, prefill, store_prefix
from serving.models.cache import SCRATCH_PAGE
from serving.models.llama import unstack_layers
from serving.models.params import LAYER_MATMULS
from serving.models.quantization import int8_names
from serving.request import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from serving.engine.warmup import BackgroundWarmup

log = logging.getLogger(__name__)

MIN_WINDOW = 128
ROWS_KEPT = 256  # call_rows' device arrays kept (the slot sets decoding lately)


def attention_windows(max_target_length: int, min_window: int = MIN_WINDOW, growth: int = 2) -> list[int]:
    """Cache lengths a generate call may attend over: min_window x growth^i up to the limit (the
    backend's ladder: serving.models.ops.XlaOps).

    Each is compiled once; a call uses the smallest that holds its longest live sequence, so short
    requests do not pay for reading a cache sized for the longest one.
    """
    windows, n = [], min_window
    while n < max_target_length:
        windows.append(n)
        n *= growth
    return [*windows, max_target_length]


def select_ops(config: EngineConfig, mesh: Mesh):
    """The compute backend for `config` on `mesh`'s devices (serving.kernels.backend.select)."""
    return backend.select(
        config.cpu_kernels,
        config.quantization.mode,
        config.weight_dtype,
        list(mesh.devices.flat),
        pages_per_compute_block=config.pagedattn_pages_per_compute_block,
        attention=config.attention,
        ragged_pages=config.ragged_block_size // config.prefix_block_size if config.use_ragged_attention else 0,
        int8_matmul_kernel=config.int8_matmul_kernel,
    )


def model_ops(model: LoadedModel, config: EngineConfig, mesh: Mesh):
    """`select_ops`' backend where its kernels serve `model`'s shapes; where the ragged kernel
    cannot (XlaOps.serves: its VMEM over a model of many kv heads; logged), the backend selected
    without use_ragged_attention (XLA's, or JAX's paged kernel with attention=paged)."""
    ops = select_ops(config, mesh)
    if ops.serves(model.config, config.quantize_kvcache, jnp.dtype(config.dtype), config.prefix_block_size):
        return ops
    return select_ops(dataclasses.replace(config, use_ragged_attention=False), mesh)


def engine_limits(model: LoadedModel, config: EngineConfig, mesh: Mesh, ops=None) -> Limits:
    """The limits an engine of `model` on `mesh` runs with: slots from per_device_batch_size, the
    page pool from the KV cache's memory, the prefill ladder from the backend `ops` (default: the
    one `mesh` selects). A function of its own so that a multi-controller prefill group can mirror
    a generate engine that lives only in the other processes."""
    ops = ops or model_ops(model, config, mesh)
    slots = max(1, int(config.per_device_batch_size * mesh.size))
    numerics = Numerics.of(config, int8=int8_names(model.params), pool_layout=ops.pool_layout)
    return Limits(
        max_concurrent_decodes=slots,
        max_prefill_length=config.max_prefill_predict_length,
        max_target_length=config.max_target_length,
        prefill_chunk_size=config.prefill_chunk_size,
        max_prefill_batch=config.max_prefill_batch,
        prefill_batch_tokens=config.prefill_batch_tokens,
        history_batch_tokens=config.history_batch_tokens,
        prefix_block=config.prefix_block_size,
        decode_buckets=config.decode_slot_buckets,
        num_pages=kv_pool_pages(config, model.config, numerics, mesh_axes(mesh), slots),
        min_bucket=ops.min_prefill_bucket,
        bucket_growth=ops.shape_growth,
        length_growth=ops.length_growth,
    )


class Engine:
    """Prefill / insert / generate for one model on one mesh (and `prefill_slots`: prompts
    prefilled in chunks straight into their slots, by its `chunks`; `verify`: speculative
    decoding's proposals scored and accepted in one call, by its `verifier`), built from parts:
    its sampler, paged cache, verifier, chunked prefill and handoffs."""

    def __init__(
        self,
        model: LoadedModel,
        config: EngineConfig,
        mesh: Mesh | None = None,
        *,
        draft: Proposer | None = None,
        verifier: Verifier | None = None,
        mirror: Limits | None = None,
        sampler: Sampler | None = None,
        paged_cache: PagedCache | None = None,
    ):
        """`mesh`: the device mesh (serving.runtime.make_mesh); by default the first device alone.
        `draft`: speculative decoding's draft model (serving.engine.draft.load_draft), on the same
        mesh. `verifier`: speculative decoding's verify (serving.engine.speculative.Verifier; by
        default one that warms up no verify shape: the server does not speculate). `mirror`:
        another engine's limits, taken whole (a disaggregated server's prefill engine mirrors its
        generate engine: the same slots and pool pages, so that the scheduler's slot and page ids
        name the same on both).
        `sampler`: what turns logits into tokens (serving.engine.sampler; by default over the
        tokens both the model and the tokenizer have). `paged_cache`: the KV page pool and block
        tables (serving.engine.paged_cache; by default the one `config` and this engine's limits,
        backend and placement make; one given must be that one's geometry and format: the memory
        plan and the backend were chosen for it)."""
        from serving.runtime import make_mesh

        self.model = model
        self.config = config
        self.draft = draft
        self.mesh = mesh if mesh is not None else make_mesh(DevicesConfig(), jax.devices()[:1])
        self.ops = model_ops(model, config, self.mesh)
        numerics = Numerics.of(config, int8=int8_names(model.params), pool_layout=self.ops.pool_layout)
        self.limits = mirror or engine_limits(model, config, self.mesh, self.ops)
        self.max_concurrent_decodes = self.limits.max_concurrent_decodes
        # Where every params and cache leaf lives: the same placement `pathserve deploy plan` reads.
        self.placement = engine_placement(
            model.config,
            numerics,
            self.mesh,
            self.limits.num_pages,
            self.limits.page_size,
        )
        self._dtype = jnp.dtype(config.dtype)
        made = PagedCache(model.config, self.limits, self.placement, self.mesh, PoolFormat.of(config, self.ops.pool_layout))
        if paged_cache is not None and not paged_cache.same_as(made):
            raise ValueError(
                f"a paged cache of {paged_cache.limits.num_pages} pages ({paged_cache.format}) for an engine whose "
                f"model, limits, placement and backend make {made.limits.num_pages} ({made.format})"
            )
        self.paged_cache = paged_cache or made
        self.sampler = sampler or Sampler(min(model.config.vocab_size, model.tokenizer.vocab_size))
        self.verifier = verifier or Verifier()
        static = dict(cfg=model.config, scan_layers=config.scan_layers, dtype=self._dtype, ops=self.ops)
        self._prefill_fn = jax.jit(
            partial(self._prefill_impl, static=static), static_argnames=("choices", "logprobs", "prompt_logprobs")
        )
        self._logprobs_fn = jax.jit(partial(self._prompt_logprobs_impl, static=static))
        state_shardings = self._state_shardings()
        self._insert_fn = jax.jit(self._insert_impl, donate_argnums=(6,), out_shardings=state_shardings)
        cache_dtype = jnp.int8 if self.paged_cache.format.quantized else self._dtype
        self.cache_in_place = self.ops.reads_cache_in_place(model.config, cache_dtype, self._dtype)
        if self.cache_in_place:
            self.windows = [config.max_target_length]  # attention reads only each row's positions
        else:
            self.windows = attention_windows(config.max_target_length, self.ops.min_window, self.ops.shape_growth)
        self._generate_fn = jax.jit(
            partial(self._generate_impl, static=static),
            donate_argnums=(1,),
            # Tokens replicated: every process of a multi-host slice reads them (lockstep).
            out_shardings=(state_shardings, replicated(self.mesh)),
            static_argnames=("window", "steps"),
        )
        self._free_fn = jax.jit(self._free_impl, donate_argnums=(0,), out_shardings=state_shardings)
        self._generate_compiled: dict[tuple[int, int, int], object] = {}  # (rows, window, steps) -> executable
        self._compiling = InFlight()  # generate programs being compiled ahead, by that key
        self._rows_on_device: dict[tuple[int, ...], jax.Array] = {}  # call_rows' arrays, by their slots
        one_window = self.cache_in_place and self.ops.chunks_in_place  # chunks read their rows' positions in place
        self.history_windows = (  # what a chunk may read
            [config.max_target_length] if one_window
            else attention_windows(config.max_target_length, self.ops.min_window, self.ops.shape_growth)
        )
        self.chunks = ChunkedPrefill(
            self.limits, self.sampler, self.mesh, state_shardings, self.history_windows, self.cache_in_place, static,
            self.compile_ahead, one_window=one_window,
        )
        self.background_warmup: BackgroundWarmup | None = None  # started by the warmup
        self._verify_fn = jax.jit(
            partial(self._verify_impl, static=static),
            donate_argnums=(1,),
            out_shardings=(state_shardings, replicated(self.mesh)),
            static_argnames=("window",),
        )
        self.handoffs = Handoffs(self.mesh, state_shardings, self.paged_cache)
        # where compiled ahead (the memory plan's and warmup's programs), kept on disk and loaded
        # back without tracing (None: no persistent compilation cache)
        self.executables = ExecutableStore.for_engine(self)

    # -- the contract --------------------------------------------------------------------------

    def load_params(self) -> dict:
        """The model's params placed on the mesh as `self.placement` says (serving.engine.partitioning),
        in the backend's layout (`ops.prepare`), layers unstacked when scan_layers=false."""
        shardings = param_shardings(self.model.params, self.mesh, self.placement)
        params = self.ops.prepare(jax.device_put(self.model.params, shardings))
        if not self.config.scan_layers:
            # A backend's own layout runs on one device only; on a mesh each layer keeps its spec.
            out = unstacked_shardings(shardings, self.model.config.num_layers) if self.mesh.size > 1 else None
            params = jax.jit(unstack_layers, out_shardings=out)(params)
        if self.config.max_loras:  # the LoRA adapters' device slots, all zeros (serving.lora.stack)
            specs = {name: self.placement.weight_spec(name) for name in LAYER_MATMULS}
            params[lora_stack.KEY] = lora_stack.init_stack(
                self.model.config, self.config.max_loras, self.config.max_lora_rank, self._dtype,
                lora_stack.stack_shardings(self.mesh, specs),
            )
        return params

    def release_loaded_params(self) -> LoadedModel:
        """Drop this engine's hold on the loaded params once `load_params` has placed them: where
        placing made new arrays (layers unstacked for scan_layers=false, a backend's layout), the
        loaded ones would otherwise stay alive beside them, twice the weights in device memory.
        Returns the model without params (config and tokenizer); load_params cannot run again."""
        self.model = dataclasses.replace(self.model, params={})
        return self.model

    def summary(self) -> dict[str, str]:
        """What runs: the weights' quantization, the KV cache's format, the compute backend."""
        return {
            "quantization": self.config.quantization.mode or "none",
            "kv_cache": self.paged_cache.format.name,
            "backend": self.ops.name,
        }

    def init_decode_state(self) -> DecodeState:
        slots = self.max_concurrent_decodes
        cache = self.paged_cache.init_pool()

        def zeros():  # a buffer of its own for each field: they are donated one by one
            return jnp.zeros((slots,), jnp.int32)

        state = DecodeState(
            cache=cache,
            pages=jnp.asarray(self.paged_cache.default_tables()),
            tokens=zeros(),
            positions=zeros(),
            generated=zeros(),
            active=jnp.zeros((slots,), bool),
            sampling=jax.tree.map(jnp.asarray, stacked_sampling([], slots)),  # neutral, inactive
            history=self.sampler.init_history(slots),
        )
        return jax.device_put(state, self._state_shardings())

    def prefill(
        self, params: dict, padded_tokens, true_length: int, sampling: SamplingParams, mask=None
    ) -> tuple[Prefix, int]:
        """KV for one padded prompt and the first sampled token of each choice (choice 0's returned)."""
        self.limits.check(true_length, sampling)
        self.limits.bucket_for(true_length)  # the whole prompt in one call: at most max_prefill_predict_length
        keys = np.stack([host_key(sampling.choice_seed(i)) for i in range(sampling.n)])
        tokens = jnp.asarray(padded_tokens, jnp.int32)[None]
        args = (params, tokens, jnp.int32(true_length), slot_sampling(sampling), jnp.asarray(keys))
        prefix = self._prefill_fn(
            *args,
            None if mask is None else jnp.asarray(mask, jnp.int32)[None],
            choices=sampling.n,
            logprobs=sampling.wants_logprobs,
            prompt_logprobs=sampling.prompt_logprobs is not None,
        )
        return prefix, int(prefix.first_tokens[0])

    def prefill_outputs(self, prefix: Prefix) -> PrefillOutputs:
        """The first tokens and logprobs of a prefix, read back in one transfer."""
        host = jax.device_get((prefix.first_tokens, prefix.first_logprobs, prefix.prompt_logprobs, prefix.length))
        first_tokens, first, prompt, length = host
        first_logprobs = None if first is None else tuple(host_logprobs(first))
        prompt_logprobs = None
        if prompt is not None:
            prompt_logprobs = (None, *host_logprobs(prompt)[: int(length) - 1])
        return PrefillOutputs(tuple(int(t) for t in first_tokens), first_logprobs, prompt_logprobs)

    def prompt_logprobs(self, params: dict, padded_tokens, true_length: int) -> np.ndarray:
        """log p(token i | tokens before it) for i in 1..true_length-1 of one padded prompt, float32
        [true_length - 1]: the prefill's own computation (a scoring call; no KV is kept)."""
        if true_length < 2:
            raise GenerationError("a prompt of fewer than 2 tokens has no token to score", field="prompt")
        self.limits.bucket_for(true_length)
        tokens = jnp.asarray(padded_tokens, jnp.int32)[None]
        return np.asarray(self._logprobs_fn(params, tokens, jnp.int32(true_length)))[: true_length - 1]

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, choice: int = 0) -> DecodeState:
        first, keys = prefix.first_tokens, prefix.keys
        if first.shape[0] != 1:  # one choice of several: its token and key as a single choice's (one program for any n)
            first, keys, choice = first[choice][None], keys[choice][None], 0
        args = (prefix.kv, prefix.length, first, keys, prefix.sampling, prefix.prompt_seen)
        return self._insert_fn(*args, decode_state, jnp.int32(slot), jnp.int32(choice))

    @property
    def page_bytes(self) -> int:
        """Device bytes of one page of the KV pool on each chip (every layer's keys, values, scales)."""
        return self.paged_cache.page_bytes

    @property
    def decode_steps_per_call(self) -> int:
        return self.config.decode_steps_per_call

    def generate(
        self, params: dict, decode_state: DecodeState, max_position: int | None = None, masks=None,
        num_slots: int | None = None, slots: Sequence[int] | None = None,
    ) -> tuple[DecodeState, ResultTokens]:
        steps = self.config.decode_steps_per_call
        if masks is not None:
            masks, steps = jnp.asarray(masks, jnp.int32), 1
        rows = self.call_rows(num_slots, slots)
        window = self.window_for(max_position, steps)
        compiled = self._generate_compiled.get((rows.shape[0], window, steps)) if masks is None else None
        if compiled is not None:
            return compiled(params, decode_state, None, rows)
        return self._generate_fn(params, decode_state, masks, rows, window=window, steps=steps)

    def verify(
        self, params: dict, decode_state: DecodeState, proposals, num_proposed, max_position: int | None = None,
        num_slots: int | None = None, slots: Sequence[int] | None = None,
    ) -> tuple[DecodeState, ResultTokens]:
        """Score and accept `proposals` (int [slots, k]; `num_proposed` [slots] of each row are
        real) for every active slot in one call over `slots` (as `generate` takes them; default
        the first `num_slots`); results of k + 1 steps (serving.engine.speculative)."""
        proposals = np.asarray(proposals, np.int32)
        rows = self.call_rows(num_slots, slots)
        if proposals.ndim != 2 or proposals.shape[0] != self.max_concurrent_decodes or proposals.shape[1] < 1:
            raise ValueError(f"proposals must be [{self.max_concurrent_decodes}, k >= 1], got {proposals.shape}")
        window = self.verify_window(max_position)
        return self._verify_fn(
            params, decode_state, jnp.asarray(proposals), jnp.asarray(num_proposed, jnp.int32), rows, window=window,
        )

    def warm_verify(self, params: dict, decode_state: DecodeState) -> DecodeState:
        """Compile the verify calls of the verifier's `warmup`: every slot bucket up to its slot
        count, at every history window (no slot active: nothing changes)."""
        if self.verifier.warmup is None:
            return decode_state
        k, most = self.verifier.warmup
        proposals = jnp.zeros((self.max_concurrent_decodes, k), jnp.int32)
        counts = jnp.zeros((self.max_concurrent_decodes,), jnp.int32)
        # a verify call computes the speculating slots padded to a bucket: the one holding `most`
        widest = self.limits.decode_slots(max(1, min(most, self.max_concurrent_decodes)))
        for num_slots in (b for b in self.limits.decode_buckets if b <= widest):
            for window in self.history_windows:
                decode_state, _ = self._verify_fn(
                    params, decode_state, proposals, counts, self.call_rows(num_slots, None), window=window
                )
        return decode_state

    def verify_window(self, max_position: int | None) -> int:
        """The cached positions a verify call reads: a chunk's history window (`history_window`)
        holding [0, max_position), at least the narrowest; None: the widest."""
        widest = self.history_windows[-1]
        return widest if max_position is None else self.history_window(min(max(max_position, 1), widest))

    def precompile_generate(self, params, state_spec: DecodeState, num_slots: int, window: int):
        """Compile, ahead of time and from any thread, generate of `num_slots` rows over `window`
        positions (no masks; a decode state shaped and placed as `state_spec`): later calls of that
        shape run it (serving.engine.warmup compiles them in parallel). Returns the executable
        (the memory plan reads its memory_analysis); a shape compiled already is not compiled again."""
        steps = self.config.decode_steps_per_call
        key = (num_slots, window, steps)
        rows = jax.ShapeDtypeStruct((num_slots,), jnp.int32, sharding=replicated(self.mesh))

        def found() -> tuple[bool, object]:
            compiled = self._generate_compiled.get(key)
            return compiled is not None, compiled

        def make():
            compiled = self.compile_ahead(
                f"generate window={window} steps={steps}", (params, state_spec, rows),
                lambda: self._generate_fn.lower(params, state_spec, None, rows, window=window, steps=steps),
            )
            return self._generate_compiled.setdefault(key, compiled)

        return self._compiling.once(key, found, make)

    def compile_ahead(self, name: str, args, lower):
        """`lower()`'s program compiled, or loaded from `executables` (serving.engine.executables)
        where it was stored under `name` (the function and its static arguments) and `args`."""
        if self.executables is None:
            return lower().compile()
        return self.executables.compile(name, args, lower)

    def call_rows(self, num_slots: int | None, slots: Sequence[int] | None) -> jax.Array:
        """int32 [bucket]: the slots a decode call computes: `slots` (distinct, as many as a bucket
        of `limits.decode_buckets`), or else the first `num_slots` (None: all); ValueError otherwise."""
        total = self.max_concurrent_decodes
        if slots is None:
            rows = np.arange(total if num_slots is None else num_slots, dtype=np.int32)
        else:
            rows = np.asarray(slots, np.int32).reshape(-1)
            if num_slots is not None and num_slots != len(rows):
                raise ValueError(f"num_slots={num_slots} but {len(rows)} slots given")
            if len(set(rows.tolist())) != len(rows) or (len(rows) and not 0 <= rows.min() <= rows.max() < total):
                raise ValueError(f"slots must be distinct slots of 0..{total - 1}, got {rows.tolist()}")
        if len(rows) not in self.limits.decode_buckets:
            raise ValueError(f"{len(rows)} slots is not one of the decode buckets {self.limits.decode_buckets}")
        key = tuple(rows.tolist())
        placed = self._rows_on_device.get(key)
        if placed is None:  # uploaded once while the same slots decode call after call
            if len(self._rows_on_device) >= ROWS_KEPT:
                self._rows_on_device.clear()
            placed = self._rows_on_device[key] = jnp.asarray(rows)
        return placed

    def window_for(self, max_position: int | None, steps: int | None = None) -> int:
        """The smallest attention window holding every active slot through one generate call of
        `steps` (default decode_steps_per_call), when no active slot's position exceeds
        `max_position` (None: the whole cache)."""
        if max_position is None:
            return self.windows[-1]
        needed = max_position + (steps or self.config.decode_steps_per_call)
        return next((w for w in self.windows if w >= needed), self.windows[-1])

    def handoff(self, decode_state: DecodeState, slot: int, pages: Sequence[int]) -> Handoff:
        """Slot `slot`'s state row and the KV of `pages`, for another engine (serving.engine.handoff)."""
        return self.handoffs.handoff(decode_state, slot, pages)

    def accept(self, decode_state: DecodeState, handoff: Handoff, slot: int, pages: Sequence[int]) -> DecodeState:
        """The state with another engine's `handoff` written at `slot` and `pages`."""
        return self.handoffs.accept(decode_state, handoff, slot, pages)

    def receive(self, prefix: Prefix) -> Prefix:
        """Another engine's whole-prompt prefix on this engine's mesh, for `insert`."""
        return self.handoffs.receive(prefix)

    def gathered(self, tree):
        """`tree` (a Handoff or a Prefix) whole on every device of this mesh, for another process group."""
        return self.handoffs.gathered(tree)

    # -- prompts in chunks (serving.engine.chunked) ---------------------------------------------------

    def prefill_slots(
        self, params: dict, decode_state: DecodeState, rows: Sequence[PrefillRow]
    ) -> tuple[DecodeState, tuple[int | None, ...], tuple[TokenLogprob | None, ...]]:
        """Each row's chunk into its slot; a final row's first token (and logprobs) (EngineAPI)."""
        return self.chunks.prefill_slots(params, decode_state, rows)

    def prefill_slots_scored(
        self, params: dict, decode_state: DecodeState, row: PrefillRow
    ) -> tuple[DecodeState, int | None, TokenLogprob | None, tuple[TokenLogprob, ...]]:
        """One row that scores the prompt: its first token and logprob, and its positions' scores."""
        return self.chunks.prefill_slots_scored(params, decode_state, row)

    def precompile_prefill_slots(self, params: dict, state_spec: DecodeState, rows: Sequence[PrefillRow]) -> bool:
        """Compile ahead the prefill_slots call `rows` make; False when that shape was compiled."""
        return self.chunks.precompile_prefill_slots(params, state_spec, rows)

    def compile_prefill_slots(self, params: dict, state_spec: DecodeState, rows: Sequence[PrefillRow]):
        """(the executable later calls of `rows`' shape run, whether this call compiled it)."""
        return self.chunks.compile_prefill_slots(params, state_spec, rows)

    def compile_scored_chunk(self, params: dict, state_spec: DecodeState, row: PrefillRow):
        """The scored chunk's model call for `row`'s shape, compiled ahead and kept."""
        return self.chunks.compile_scored_chunk(params, state_spec, row)

    def history_window(self, start: int) -> int:
        """Cached positions a chunk starting at `start` reads (0: none)."""
        return self.chunks.history_window(start)

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """The row counts a prefill_slots call is padded to."""
        return self.chunks.row_buckets

    def set_pages(self, decode_state: DecodeState, pages: np.ndarray) -> DecodeState:
        """The decode state with every slot's block table `pages` (int32 [slots, max_pages]; the
        same host values on every process of a slice), checked and placed by the paged cache."""
        return decode_state._replace(pages=self.paged_cache.tables(pages))

    def free_resource(self, decode_state: DecodeState, slot: int) -> DecodeState:
        return self._free_fn(decode_state, jnp.int32(slot))

    def write_adapter(self, params: dict, slot: int, weights: LoraWeights) -> dict:
        """`params` itself, its adapter stack replaced by one holding `weights` in `slot` (so that
        whoever else holds the dict, the orchestrator or a test, sees the adapters served)."""
        lora_stack.write_slot(params, slot, weights)
        return params

    def warmup(self, params: dict, generate: bool = True) -> float:
        """Compile every shape serving runs (serving.engine.warmup; a prefix hit's partial chunks on
        `background_warmup`, after it returns); returns the seconds spent in the foreground.
        `generate` false: none of generate's shapes (a disaggregated server's prefill engine)."""
        from serving.engine.warmup import warmup

        seconds, self.background_warmup = warmup(self, params, generate)
        return seconds

    # -- compiled bodies -----------------------------------------------------------------------

    def _state_shardings(self) -> DecodeState:
        # Slots are not split (MaxText's cache_batch): per-slot scalars are on every device.
        slots = rows = replicated(self.mesh)
        return DecodeState(
            cache=self.paged_cache.shardings,
            pages=rows,
            tokens=slots,
            positions=slots,
            generated=slots,
            active=slots,
            sampling=SlotSampling(*(rows for _ in SlotSampling._fields)),
            history=TokenHistory(*(rows for _ in TokenHistory._fields)),
        )

    def _prefill_impl(
        self, params, tokens, true_length, sampling: SlotSampling, keys, mask, static, choices, logprobs,
        prompt_logprobs,
    ) -> Prefix:
        logits, kv = prefill(
            params, tokens, true_length[None], **static, quantized_kv=self.paged_cache.format.quantized,
            kv_scale_per_head=self.paged_cache.format.scale_per_head,
            lora=lora_stack.lora_batch(params, sampling.lora_slot[None]),
            last=None if prompt_logprobs else true_length[None] - 1,  # the prompt's logprobs read every position
        )
        if prompt_logprobs:
            last = jax.lax.dynamic_index_in_dim(logits[0], true_length - 1, keepdims=False)[None]
        else:
            last = logits
        last = self.sampler.decodable(last, mask)
        vocab = last.shape[-1]
        seen = penalties.prompt_tokens(tokens[0], true_length, vocab)
        batched = jax.tree.map(lambda x: jnp.broadcast_to(x, (choices, *jnp.shape(x))), sampling)
        nothing = jnp.zeros((choices,), jnp.int32)
        last = self.sampler.process(
            jnp.broadcast_to(last, (choices, vocab)),  # [choices, vocab]
            batched,
            nothing,
            penalties.no_recent(choices),
            lambda: (jnp.zeros((choices, vocab), jnp.int32), jnp.broadcast_to(seen, (choices, vocab))),
            jnp.ones((choices,), bool),
        )
        first = self.sampler.sample(last, jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys), batched)
        first_logprobs = None
        if logprobs:
            first_logprobs = Logprobs(first, *token_logprobs(last, first, batched.temperature))
        scored = None
        if prompt_logprobs:  # the prompt as given, over the whole vocabulary: no temperature, no mask
            scored = self.sampler.prompt_scores(logits[0, :-1], tokens[0, 1:])
        # What the host reads back, replicated: every process of a multi-host slice reads it.
        first, first_logprobs, scored = jax.lax.with_sharding_constraint(
            (first, first_logprobs, scored), replicated(self.mesh)
        )
        return Prefix(kv, true_length, first, keys, sampling, first_logprobs, scored, seen)

    def _prompt_logprobs_impl(self, params, tokens, true_length, static) -> jax.Array:
        logits, _ = prefill(
            params, tokens, true_length[None], **static, quantized_kv=self.paged_cache.format.quantized,
            kv_scale_per_head=self.paged_cache.format.scale_per_head,
        )
        logprobs = jax.nn.log_softmax(logits[0, :-1], axis=-1)  # [bucket - 1, vocab]
        return jnp.take_along_axis(logprobs, tokens[0, 1:, None], axis=-1)[:, 0]

    def _insert_impl(
        self, kv, length, first_tokens, keys, one: SlotSampling, seen, state: DecodeState, slot, choice
    ) -> DecodeState:
        """A prefix's choice `choice` (its first token and PRNG key) into `slot`."""
        first, one = first_tokens[choice], one._replace(key=keys[choice])
        finished = is_stop(first, one.stop_ids) | (one.max_tokens <= 1)
        sampling = jax.tree.map(lambda all_, x: all_.at[slot].set(x), state.sampling, one)
        counts, recent = penalties.started(first[None], seen.shape[0])
        history = TokenHistory(
            counts=state.history.counts.at[slot].set(counts[0]),
            prompt=state.history.prompt.at[slot].set(seen),
            recent=state.history.recent.at[slot].set(recent[0]),
        )
        return DecodeState(
            cache=store_prefix(state.cache, kv, state.pages[slot]),
            pages=state.pages,
            tokens=state.tokens.at[slot].set(first),
            positions=state.positions.at[slot].set(length),
            generated=state.generated.at[slot].set(1),
            active=state.active.at[slot].set(~finished),
            sampling=sampling,
            history=history,
        )

    def _free_impl(self, state: DecodeState, slot) -> DecodeState:
        return state._replace(active=state.active.at[slot].set(False))

    def _verify_impl(
        self, params, full: DecodeState, proposals, num_proposed, rows, static, window: int
    ) -> tuple[DecodeState, ResultTokens]:
        """The verifier's step over this engine's model: each row's token and proposals at its
        position over its cached positions [0, window), through its block table."""

        def forward(fed, counted, starts, pages, lora_slot):
            return prefill(
                params, fed, counted, **static, starts=starts, cache=full.cache, pages=pages, window=window,
                quantized_kv=full.cache.quantized, kv_scale_per_head=full.cache.scale_per_head,
                lora=lora_stack.lora_batch(params, lora_slot),
            )

        return self.verifier.step(
            forward, self.sampler, full, proposals, num_proposed, rows, self.config.max_target_length
        )

    def _generate_impl(
        self, params, full: DecodeState, masks, rows, static, window: int, steps: int
    ) -> tuple[DecodeState, ResultTokens]:
        """Decode the slots `rows` (int32 [bucket], distinct; the cache stays whole: other slots
        are neither read nor written); the results are widened to every slot, the rest never valid."""
        max_len = self.config.max_target_length
        total = self.max_concurrent_decodes

        def gathered(x):
            return x[rows]

        # The token history stays whole (a [slots, vocab] copy per call would cost what a step
        # of a small batch does): its `rows` are read and written in place.
        state = full._replace(
            tokens=gathered(full.tokens),
            positions=gathered(full.positions),
            generated=gathered(full.generated),
            active=gathered(full.active),
            sampling=jax.tree.map(gathered, full.sampling),
        )
        pages = full.pages[rows]
        if masks is not None:
            masks = masks[rows]
        def step(state: DecodeState, _):
            # An inactive row (free, prefilling, finished) attends to nothing and writes into the
            # scratch page: at position 0, its attention reads no cached position at all.
            positions = jnp.where(state.active, jnp.minimum(state.positions, max_len - 1), 0)
            logits, cache = decode_step(
                params, state.tokens, positions, state.cache, **static, window=window,
                lora=lora_stack.lora_batch(params, state.sampling.lora_slot),
                pages=pages, write_pages=jnp.where(state.active[:, None], pages, SCRATCH_PAGE),
                active=state.active,
            )
            keys = jax.vmap(jax.random.fold_in)(state.sampling.key, state.generated)
            # Free and finished slots are not drawn: greedy, whatever their request asked.
            sampling = state.sampling._replace(
                temperature=jnp.where(state.active, state.sampling.temperature, 0.0)
            )
            logits = self.sampler.decodable(logits, masks)
            history = state.history
            logits = self.sampler.process(
                logits, sampling, state.generated, history.recent[rows],
                lambda: (history.counts[rows], history.prompt[rows]), state.active,
            )
            token = self.sampler.sample(logits, keys, sampling)
            wants = state.active & state.sampling.logprobs
            chosen, top_ids, top = self.sampler.logprobs_if(jnp.any(wants), logits, token, sampling.temperature)
            valid = state.active
            generated = state.generated + valid
            done = valid & (
                is_stop(token, state.sampling.stop_ids)
                | (generated >= state.sampling.max_tokens)
                | (positions + 1 >= max_len)
            )
            new_state = DecodeState(
                cache=cache,
                pages=state.pages,
                tokens=jnp.where(valid, token, state.tokens),
                positions=jnp.where(valid, positions + 1, state.positions),
                generated=generated,
                active=valid & ~done,
                sampling=state.sampling,
                history=penalties.record(
                    history, rows, token[:, None], valid[:, None], penalties.reads_history(state.sampling)
                ),
            )
            return new_state, ResultTokens(token, valid, done, chosen, top_ids, top)

        state, result = jax.lax.scan(step, state, None, length=steps)

        def widen(x):  # [steps, bucket, ...] -> [steps, total, ...], zero (not valid) elsewhere
            return jnp.zeros((steps, total, *x.shape[2:]), x.dtype).at[:, rows].set(x)

        def back(whole, part):
            return whole.at[rows].set(part)

        full = DecodeState(
            cache=state.cache,
            pages=full.pages,
            tokens=back(full.tokens, state.tokens),
            positions=back(full.positions, state.positions),
            generated=back(full.generated, state.generated),
            active=back(full.active, state.active),
            sampling=full.sampling,
            history=state.history,
        )
        return full, ResultTokens(*(widen(x) for x in result))
