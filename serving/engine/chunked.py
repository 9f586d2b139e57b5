"""Prompts straight into their slots: chunked, batched prefill and the prefix cache's KV blocks.

`prefill_slots` runs two compiled calls for several rows, each the next chunk of one prompt.
The first, the model's: tokens [rows, bucket] at positions start + 0..bucket-1 of their slot,
attending to that slot's cached positions [0, start) (gathered through the slot's block table from
the page pool: [layers, rows, window, ...], the smallest history window holding every row's start)
and to themselves (a backend that reads the pool in place, the CPU kernels, takes fresh chunks
too: causal over their own positions); their KV is written into the slots' pages, and each row's
last logits come back on the device. Compiled once per (rows bucket, length bucket, history
window): by the jit at first use, or ahead of time by `precompile_prefill_slots` (the warmup's
background thread), whose executables a call of that shape then runs. The second, once per rows bucket: a final row samples
its first token (the PRNG key and rule of the whole `prefill`; for a sequence resumed after
preemption, the next token, as a generate step would) and makes its slot active. The sampler is
most of a small model's program (penalties, min-p, top-k, top-p, the draw): in a call of its own it
compiles once per rows bucket instead of once per shape.

The block tables it reads are the scheduler's (the engine's `set_pages`, serving.orchestrator.pages):
a prefix cache hit is a table entry naming a page another sequence filled, so nothing is copied.

A part the engine is built from (`serving.engine.engine.Engine.chunks`), over what it is given:
the engine's limits, sampler, mesh and decode state's placement, its history windows, whether its
backend reads chunks' history in place, the model call's static arguments and the engine's
`compile_ahead` (its executable store); the engine's contract methods of these names call it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from serving.engine import penalties
from serving.engine.api import PrefillRow
from serving.engine.executables import InFlight
from serving.engine.limits import Limits
from serving.engine.sampler import Sampler
from serving.engine.sharding import replicated
from serving.engine.state import DecodeState, Logprobs, TokenHistory, host_logprobs, is_stop, stacked_sampling
from serving.lora import stack as lora_stack
from serving.models import prefill
from serving.models.cache import SCRATCH_PAGE, store_chunks
from serving.request import TokenLogprob


def _model_inputs(inputs: tuple) -> tuple:
    """The model call's share of `_slot_inputs`' inputs: tokens, slots, starts, lengths and the
    rows' LoRA slots (the rest are the first-token call's)."""
    tokens, slots, starts, lengths, *_, sampling = inputs
    return tokens, slots, starts, lengths, sampling.lora_slot


class ChunkedPrefill:
    """prefill_slots (see the module docstring)."""

    def __init__(
        self, limits: Limits, sampler: Sampler, mesh: Mesh, state_shardings: DecodeState, history_windows: list[int],
        cache_in_place: bool, static: dict, compile_ahead: Callable, one_window: bool = False,
    ):
        """`history_windows`: the cached positions a chunk may read; `cache_in_place`: the
        backend's chunk attention reads the pool in place (fresh chunks too); `one_window`: it
        reads each row's cached positions through the block table whatever their number (the
        ragged kernel), so that `history_windows` is one and every call takes it (`history_window`);
        `static`: the model call's static arguments (config, layers' scan, dtype, ops);
        `compile_ahead(name, args, lower)`: the engine's compile or load."""
        if one_window and (len(history_windows) != 1 or not cache_in_place):
            raise ValueError("one_window: one history window, read in place")
        self.limits, self.sampler, self.mesh = limits, sampler, mesh
        self.history_windows, self.cache_in_place, self.one_window = history_windows, cache_in_place, one_window
        self.compile_ahead = compile_ahead
        self.row_buckets = limits.row_buckets
        self._prefill_slots_fn = jax.jit(
            partial(self._prefill_chunks_impl, static=static),
            donate_argnums=(1,),
            # the pool placed as every other call places it (a compiled call is keyed by its
            # inputs' shardings); the logits [rows, vocab] whole on every device, as sampling reads them
            out_shardings=(state_shardings.cache, replicated(mesh)),
            static_argnames=("window",),
        )
        # The rows' first tokens: a decode state without its cache (None), which the call above owns.
        self._start_rows_fn = jax.jit(
            self._start_rows_impl,
            donate_argnums=(0,),
            out_shardings=(state_shardings._replace(cache=None), replicated(mesh)),
        )
        # A chunk that scores the prompt (one row): the same model call, every position's logits kept
        # and scored against the prompt's next tokens; compiled at first use (a rows bucket of 1)
        self._score_chunk_fn = jax.jit(
            partial(self._prefill_chunks_impl, static=static),
            donate_argnums=(1,),
            out_shardings=(state_shardings.cache, replicated(mesh), replicated(mesh)),
            static_argnames=("window",),
        )
        # (rows bucket, length bucket, history window) -> an executable compiled ahead of time, and
        # the shapes the jit compiled at first use (no need to compile those again)
        self._precompiled: dict[tuple[int, int, int], Any] = {}
        self._jit_shapes: set[tuple[int, int, int]] = set()
        self._start_compiled: dict[int, Any] = {}  # rows bucket -> `_start_rows_fn`'s executable (None: compiling)
        self._scored_compiled: dict[tuple[int, int, int], Any] = {}  # shape -> `_score_chunk_fn`'s executable
        self._shapes_lock = threading.Lock()
        self._compiling = InFlight()  # shapes being compiled ahead

    # -- the contract --------------------------------------------------------------------------

    def prefill_slots(
        self, params: dict, decode_state: DecodeState, rows: Sequence[PrefillRow]
    ) -> tuple[DecodeState, tuple[int | None, ...], tuple[TokenLogprob | None, ...]]:
        if not rows:
            return decode_state, (), ()
        inputs, shape = self._slot_inputs(rows)
        chunks = _model_inputs(inputs)
        with self._shapes_lock:
            compiled = self._precompiled.get(shape)
            if compiled is None:
                self._jit_shapes.add(shape)
        if compiled is not None:
            cache, last = compiled(params, decode_state.cache, decode_state.pages, *chunks)
        else:
            cache, last = self._prefill_slots_fn(params, decode_state.cache, decode_state.pages, *chunks, window=shape[2])
        start = self._start_compiled.get(shape[0]) or self._start_rows_fn
        state, out = start(decode_state._replace(cache=None), last, *inputs[1:])
        state = state._replace(cache=cache)
        wants = [row.final and row.sampling.wants_logprobs for row in rows]
        logprobs: tuple[TokenLogprob | None, ...] = (None,) * len(rows)
        if not any(row.final for row in rows):
            # middle chunks only: no first token to read, so the host does not wait for the call
            # (the next generate call is dispatched behind it, not after it)
            return state, (None,) * len(rows), logprobs
        if any(wants):
            first, *rest = jax.device_get(out)  # one transfer
            every = host_logprobs(Logprobs(first, *rest))
            logprobs = tuple(every[i] if want else None for i, want in enumerate(wants))
        else:
            first = np.asarray(out[0])
        return state, tuple(int(first[i]) if row.final else None for i, row in enumerate(rows)), logprobs

    def prefill_slots_scored(
        self, params: dict, decode_state: DecodeState, row: PrefillRow
    ) -> tuple[DecodeState, int | None, TokenLogprob | None, tuple[TokenLogprob, ...]]:
        """`prefill_slots` of one row that scores the prompt (`row.score`): the state, its first
        token and logprob (a final row's; None otherwise), and the logprob of each prompt token its
        positions predict, in order (tokens[1:], then `score_next` unless final; TokenLogprob with
        the top MAX_LOGPROBS and the rank, over the whole vocabulary at temperature 1: the whole
        `prefill`'s prompt logprobs)."""
        if not row.score:
            raise ValueError("prefill_slots_scored takes a row that scores the prompt (score=True)")
        inputs, shape = self._slot_inputs([row])
        following = np.full((shape[0],), -1, np.int32)
        following[0] = -1 if row.final else row.score_next
        held = self._scored_compiled.get(shape)  # compiled ahead (the memory plan's), else the jit's
        args = (params, decode_state.cache, decode_state.pages, *_model_inputs(inputs), following)
        cache, last, scored = held(*args) if held is not None else self._score_chunk_fn(*args, window=shape[2])
        start = self._start_compiled.get(shape[0]) or self._start_rows_fn
        state, out = start(decode_state._replace(cache=None), last, *inputs[1:])
        state = state._replace(cache=cache)
        out, scored = jax.device_get((out, scored))
        count = len(row.tokens) - (1 if row.final else 0)  # positions with a prompt token to predict
        scores = tuple(host_logprobs(Logprobs(*(x[0, :count] for x in scored)))) if count else ()
        if not row.final:
            return state, None, None, scores
        logprob = host_logprobs(Logprobs(*(x[:1] for x in out)))[0] if row.sampling.wants_logprobs else None
        return state, int(out[0][0]), logprob, scores

    def compile_scored_chunk(self, params: dict, state_spec: DecodeState, row: PrefillRow):
        """The model call of `prefill_slots_scored` for `row`'s shape, compiled (or loaded from the
        executable store) against `state_spec` (abstract or real) and kept: calls of that shape run
        it; the memory plan reads its footprint."""
        inputs, shape = self._slot_inputs([row])
        following = np.full((shape[0],), -1, np.int32)
        args = (params, state_spec.cache, state_spec.pages, *_model_inputs(inputs), following)
        compiled = self.compile_ahead(
            f"prefill_slots_scored window={shape[2]}", args, lambda: self._score_chunk_fn.lower(*args, window=shape[2])
        )
        with self._shapes_lock:
            return self._scored_compiled.setdefault(shape, compiled)

    def _slot_inputs(self, rows: Sequence[PrefillRow]) -> tuple[tuple, tuple[int, int, int]]:
        """The compiled call's host inputs for `rows` (tokens [count, bucket]; slots, starts,
        lengths, final, generated [count]; keys [count, 2]; prompt [count, max_target_length], -1
        padded; masks [count, words], -1 (all allowed) but under a grammar; sampling [count, ...]; padding rows
        write to the scratch page) and its shape (count, bucket, history window)."""
        limits = self.limits
        if len(rows) > limits.max_prefill_batch:
            raise ValueError(f"{len(rows)} rows in one prefill_slots call, at most {limits.max_prefill_batch}")
        count = next(b for b in self.row_buckets if b >= len(rows))
        bucket = limits.bucket_for(max(len(r.tokens) for r in rows))
        tokens = np.zeros((count, bucket), np.int32)
        slots = np.full((count,), limits.max_concurrent_decodes, np.int32)  # padding rows: dropped
        starts, lengths = np.zeros((count,), np.int32), np.ones((count,), np.int32)
        final = np.zeros((count,), bool)
        generated = np.zeros((count,), np.int32)
        # a final row's whole prompt under a repetition penalty (-1: none), its cached and earlier
        # chunks included: the penalty's prompt tokens, kept in the slot's history
        prompt = np.full((count, limits.max_target_length), -1, np.int32)
        masks = np.full((count, (self.sampler.num_decodable + 31) // 32), -1, np.int32)  # a grammar's first mask
        for i, row in enumerate(rows):
            if len(row.tokens) > limits.prefill_chunk_size:
                raise ValueError(f"a chunk of {len(row.tokens)} tokens, more than prefill_chunk_size")
            if row.start + len(row.tokens) > limits.max_target_length:
                raise ValueError(f"a chunk ending at {row.start + len(row.tokens)}, past max_target_length")
            tokens[i, : len(row.tokens)] = row.tokens
            slots[i], starts[i], lengths[i], final[i] = row.slot, row.start, len(row.tokens), row.final
            generated[i] = row.generated
            if row.prompt_ids:
                if not row.final or len(row.prompt_ids) >= limits.max_target_length:
                    raise ValueError("a row's prompt_ids go with its final chunk, shorter than max_target_length")
                prompt[i, : len(row.prompt_ids)] = row.prompt_ids
            if row.mask is not None:
                if not row.final:
                    raise ValueError("a row's mask goes with its final chunk")
                masks[i] = np.asarray(row.mask)[: masks.shape[1]]  # a tokenizer's words past the decodable vocabulary: dropped
        sampling = stacked_sampling([r.sampling for r in rows], count)
        keys = sampling.key  # the request's own seed: choice 0's key, as `prefill` draws it
        inputs = (tokens, slots, starts, lengths, final, generated, keys, prompt, masks, sampling)
        return inputs, (count, bucket, self.history_window(int(starts.max())))

    def precompile_prefill_slots(self, params: dict, state_spec: DecodeState, rows: Sequence[PrefillRow]) -> bool:
        """Compile, ahead of time and from any thread, the prefill_slots call `rows` make (a decode
        state shaped and placed as `state_spec`, e.g. `jax.ShapeDtypeStruct`s): later calls of that
        shape run it instead of compiling. False when that shape was compiled already."""
        return self.compile_prefill_slots(params, state_spec, rows)[1]

    def compile_prefill_slots(
        self, params: dict, state_spec: DecodeState, rows: Sequence[PrefillRow]
    ) -> tuple[Any, bool]:
        """`precompile_prefill_slots`, returning (the executable later calls of that shape run, or
        None where the jit compiled that shape itself; whether this call compiled it): the memory
        plan reads its memory_analysis and keeps it for warmup and requests."""
        inputs, shape = self._slot_inputs(rows)

        def found() -> tuple[bool, tuple[Any, bool]]:
            with self._shapes_lock:
                return shape in self._precompiled or shape in self._jit_shapes, (self._precompiled.get(shape), False)

        return self._compiling.once(shape, found, lambda: self._compile_slots(params, state_spec, inputs, shape))

    def _compile_slots(self, params: dict, state_spec: DecodeState, inputs: tuple, shape: tuple[int, int, int]):
        """`compile_prefill_slots` of a shape this thread claimed and found not compiled."""
        args = (params, state_spec.cache, state_spec.pages, *_model_inputs(inputs))
        compiled = self.compile_ahead(
            f"prefill_slots window={shape[2]}", args, lambda: self._prefill_slots_fn.lower(*args, window=shape[2])
        )
        with self._shapes_lock:  # the rows' first tokens: one program per rows bucket, one thread compiles it
            start = shape[0] not in self._start_compiled
            if start:
                self._start_compiled[shape[0]] = None
        if start:
            logits = compiled.out_info[1]
            last = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=replicated(self.mesh))
            rows = (state_spec._replace(cache=None), last, *inputs[1:])
            self._start_compiled[shape[0]] = self.compile_ahead("start_rows", rows, lambda: self._start_rows_fn.lower(*rows))
        with self._shapes_lock:
            if shape in self._jit_shapes:  # the jit compiled it meanwhile: keep one executable per shape
                return compiled, False
            kept = self._precompiled.setdefault(shape, compiled)
        return kept, kept is compiled

    def history_window(self, start: int) -> int:
        """Cached positions a chunk starting at `start` reads: 0 (none) or the smallest attention
        window holding [0, start). With `one_window`, that window for every start, 0 included: the
        kernel reads a row's [0, start) whatever the window (it bounds only a mask the kernel does
        not use), so a fresh prompt's call and a prefix hit's rest of the same rows and length
        are one program, not two (the 1B shape's TPU profile: 14 programs before ready, not 23)."""
        if self.one_window:
            return self.history_windows[0]
        if start == 0:
            return 0
        return next(w for w in self.history_windows if w >= start)

    # -- compiled bodies -----------------------------------------------------------------------

    def _prefill_chunks_impl(
        self, params, cache, pages_table, tokens, slots, starts, lengths, lora_slot, following=None, *, static, window,
    ):
        """tokens [rows, bucket]; slots, starts, lengths, lora_slot [rows]; pages_table [slots,
        max_pages]. Returns the page pool with the rows' KV written and each row's logits at its
        last token [rows, decodable vocab]; with `following` [rows] (the prompt token after each
        row's chunk, -1: none), also every position's score of the prompt token it predicts
        (Logprobs [rows, bucket]: tokens[1:], then `following`; the prompt's logprobs)."""
        total = self.limits.max_concurrent_decodes
        real = slots < total  # padding rows carry slot `total`: their table is all scratch
        pages = jnp.where(real[:, None], pages_table[jnp.clip(slots, 0, total - 1)], SCRATCH_PAGE)  # [rows, max_pages]
        # Fresh chunks (nothing cached) too go to the backend's chunk attention where it reads the
        # pool in place: causal over each row's own positions up to its length, where XLA's
        # attention computes the whole [bucket, bucket] square and masks what it does not need.
        history = window > 0 or self.cache_in_place
        logits, kv = prefill(
            params,
            tokens,
            lengths,
            **static,
            starts=starts if history else None,
            cache=cache if history else None,
            pages=pages,
            window=window,
            quantized_kv=cache.quantized,
            kv_scale_per_head=cache.scale_per_head,
            lora=lora_stack.lora_batch(params, lora_slot),
            last=lengths - 1 if following is None else None,
        )
        if following is None:
            return store_chunks(cache, kv, pages, starts), self.sampler.decodable(logits, None)
        # the prompt's logprobs: every position's logits [rows, bucket, vocab], as the whole prefill scores them
        rows, bucket, vocab = logits.shape
        at = jnp.arange(bucket)[None, :]
        shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((rows, 1), tokens.dtype)], axis=1)
        targets = jnp.where(at == lengths[:, None] - 1, jnp.maximum(following, 0)[:, None], shifted)
        flat = self.sampler.prompt_scores(logits.reshape(rows * bucket, vocab), targets.reshape(-1))
        scored = Logprobs(*(x.reshape(rows, bucket, *x.shape[1:]) for x in flat))
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return store_chunks(cache, kv, pages, starts), self.sampler.decodable(last, None), scored

    def _start_rows_impl(
        self, state: DecodeState, last, slots, starts, lengths, final, generated, keys, prompt, masks, sampling,
    ) -> tuple[DecodeState, jax.Array]:
        """state: a decode state whose cache is None; last [rows, vocab]; slots, starts, lengths,
        final, generated [rows]; keys [rows, 2]; prompt [rows, max_target_length] (-1 padded); masks
        [rows, words] (a grammar's first-token mask; -1: every token); sampling [rows, ...]. Returns the state and, replicated, every row's first token [rows] and,
        when a final row wants logprobs, their logprobs as `prefill` computes them (chosen [rows],
        top ids and logprobs [rows, num_top]; zeros otherwise)."""
        total = self.limits.max_concurrent_decodes
        real = slots < total
        held = jnp.clip(slots, 0, total - 1)
        count, vocab = last.shape
        # A fresh prompt has generated nothing: its counts are 0, and its prompt tokens are those
        # its final row carries (a repetition penalty's; none otherwise), so bad words, min_tokens,
        # the bias and the repetition penalty apply. A resumed sequence's row reads its slot's
        # token history, which preemption kept.
        resumed = real & (generated > 0)
        recent = jnp.where(resumed[:, None], state.history.recent[held], penalties.no_recent(count))
        row = jnp.arange(count)[:, None]
        fresh_prompt = jax.lax.cond(  # the scatter only when some row carries its prompt
            jnp.any(prompt >= 0),
            lambda: jnp.zeros((count, vocab), bool).at[row, jnp.where(prompt >= 0, prompt, vocab)].set(True, mode="drop"),
            lambda: jnp.zeros((count, vocab), bool),
        )

        def kept() -> tuple[jax.Array, jax.Array]:
            return (
                jnp.where(resumed[:, None], state.history.counts[held], 0),
                jnp.where(resumed[:, None], state.history.prompt[held], fresh_prompt),
            )

        last = self.sampler.process(self.sampler.decodable(last, masks), sampling, generated, recent, kept, final)
        first = self.sampler.sample(last, jax.vmap(jax.random.fold_in)(keys, generated), sampling)
        finished = is_stop(first, sampling.stop_ids) | (generated + 1 >= sampling.max_tokens)
        parked = self.limits.max_target_length - 1  # an inactive row's position (it writes to scratch)

        def put(old, new):
            return old.at[slots].set(new.astype(old.dtype), mode="drop")

        # a final row's fresh sequence starts: its first token, the prompt tokens it carries; a resumed
        # one appends its token to the history it kept (other rows drop)
        started = jnp.where(final & ~resumed, slots, total)
        counts, fresh_recent = penalties.started(first, vocab)
        history = TokenHistory(
            counts=state.history.counts.at[started].set(counts, mode="drop"),
            prompt=state.history.prompt.at[started].set(fresh_prompt, mode="drop"),
            recent=state.history.recent.at[started].set(fresh_recent, mode="drop"),
        )
        history = penalties.record(
            history, jnp.where(final & resumed, slots, total), first[:, None], jnp.ones((count, 1), bool)
        )

        new_state = DecodeState(
            cache=None,
            pages=state.pages,
            tokens=put(state.tokens, first),
            positions=put(state.positions, jnp.where(final, starts + lengths, parked)),
            generated=put(state.generated, generated + 1),
            active=put(state.active, final & ~finished),
            sampling=jax.tree.map(put, state.sampling, sampling._replace(key=keys)),
            history=history,
        )
        logprobs = self.sampler.logprobs_if(jnp.any(final & sampling.logprobs), last, first, sampling.temperature)
        return new_state, jax.lax.with_sharding_constraint((first, *logprobs), replicated(self.mesh))
