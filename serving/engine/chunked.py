"""Prompts straight into their slots: chunked, batched prefill and the prefix cache's KV blocks.

`prefill_slots` runs one compiled call for several rows, each the next chunk of one prompt:
tokens [rows, bucket] at positions start + 0..bucket-1 of their slot, attending to that slot's
cached positions [0, start) (gathered from the decode state's cache: [layers, rows, window, ...],
the smallest history window holding every row's start) and to themselves. Their KV is written into
the slots; a final row samples its first token (the PRNG key and rule of the whole `prefill`) and
makes its slot active. Compiled once per (rows bucket, length bucket, history window): by the jit
at first use, or ahead of time by `precompile_prefill_slots` (the warmup's background thread), whose
executables a call of that shape then runs.

A prefix block is a copy of one slot's KV at [start, start + prefix_block): `save_block` slices it
out, `load_blocks` writes blocks back to back into a slot. They stay on the device, sharded as the
cache is, so every host of a slice holds its own shard of the same blocks.

Mixed into `serving.engine.engine.Engine`, whose sampling, shardings and limits it uses.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine import penalties
from serving.engine.api import PrefillRow
from serving.engine.sharding import replicated
from serving.engine.state import DecodeState, TokenHistory, is_stop, stacked_sampling
from serving.lora import stack as lora_stack
from serving.models import KVCache, prefill
from serving.models.cache import gather_history, store_chunks

if TYPE_CHECKING:
    from serving.engine.warmup import BackgroundWarmup


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Row counts a prefill_slots call is compiled for: powers of two below `max_rows`, and it."""
    rows, n = {max_rows}, 1
    while n < max_rows:
        rows.add(n)
        n *= 2
    return tuple(sorted(rows))


class ChunkedPrefill:
    """prefill_slots, save_block, load_blocks (see the module docstring)."""

    def _init_chunked(self, static: dict) -> None:
        state_shardings = self._state_shardings()
        self.row_buckets = row_buckets(self.limits.max_prefill_batch)
        self._prefill_slots_fn = jax.jit(
            partial(self._prefill_slots_impl, static=static),
            donate_argnums=(1,),
            out_shardings=(state_shardings, replicated(self.mesh)),
            static_argnames=("window",),
        )
        block = self.limits.prefix_block
        self._save_block_fn = jax.jit(partial(_save_block, block=block))
        self._load_block_fn = jax.jit(self._load_block_impl, donate_argnums=(0,), out_shardings=state_shardings)
        # (rows bucket, length bucket, history window) -> an executable compiled ahead of time, and
        # the shapes the jit compiled at first use (no need to compile those again)
        self._precompiled: dict[tuple[int, int, int], Any] = {}
        self._jit_shapes: set[tuple[int, int, int]] = set()
        self._shapes_lock = threading.Lock()
        self.background_warmup: BackgroundWarmup | None = None  # started by the warmup

    # -- the contract --------------------------------------------------------------------------

    def prefill_slots(
        self, params: dict, decode_state: DecodeState, rows: Sequence[PrefillRow]
    ) -> tuple[DecodeState, tuple[int | None, ...]]:
        if not rows:
            return decode_state, ()
        inputs, shape = self._slot_inputs(rows)
        with self._shapes_lock:
            compiled = self._precompiled.get(shape)
            if compiled is None:
                self._jit_shapes.add(shape)
        if compiled is not None:
            state, first = compiled(params, decode_state, *inputs)
        else:
            state, first = self._prefill_slots_fn(params, decode_state, *inputs, window=shape[2])
        first = np.asarray(first)
        return state, tuple(int(first[i]) if row.final else None for i, row in enumerate(rows))

    def _slot_inputs(self, rows: Sequence[PrefillRow]) -> tuple[tuple, tuple[int, int, int]]:
        """The compiled call's host inputs for `rows` (tokens [count, bucket]; slots, starts,
        lengths, final [count]; keys [count, 2]; sampling [count, ...]; padding rows dropped) and
        its shape (count, bucket, history window)."""
        limits = self.limits
        if len(rows) > limits.max_prefill_batch:
            raise ValueError(f"{len(rows)} rows in one prefill_slots call, at most {limits.max_prefill_batch}")
        count = next(b for b in self.row_buckets if b >= len(rows))
        bucket = limits.bucket_for(max(len(r.tokens) for r in rows))
        tokens = np.zeros((count, bucket), np.int32)
        slots = np.full((count,), limits.max_concurrent_decodes, np.int32)  # padding rows: dropped
        starts, lengths = np.zeros((count,), np.int32), np.ones((count,), np.int32)
        final = np.zeros((count,), bool)
        for i, row in enumerate(rows):
            if len(row.tokens) > limits.prefill_chunk_size:
                raise ValueError(f"a chunk of {len(row.tokens)} tokens, more than prefill_chunk_size")
            if row.start + len(row.tokens) > limits.max_target_length:
                raise ValueError(f"a chunk ending at {row.start + len(row.tokens)}, past max_target_length")
            tokens[i, : len(row.tokens)] = row.tokens
            slots[i], starts[i], lengths[i], final[i] = row.slot, row.start, len(row.tokens), row.final
        sampling = stacked_sampling([r.sampling for r in rows], count)
        keys = sampling.key  # the request's own seed: choice 0's key, as `prefill` draws it
        inputs = (tokens, slots, starts, lengths, final, keys, sampling)
        return inputs, (count, bucket, self.history_window(int(starts.max())))

    def precompile_prefill_slots(self, params: dict, state_spec: DecodeState, rows: Sequence[PrefillRow]) -> bool:
        """Compile, ahead of time and from any thread, the prefill_slots call `rows` make (a decode
        state shaped and placed as `state_spec`, e.g. `jax.ShapeDtypeStruct`s): later calls of that
        shape run it instead of compiling. False when that shape was compiled already."""
        inputs, shape = self._slot_inputs(rows)
        with self._shapes_lock:
            if shape in self._precompiled or shape in self._jit_shapes:
                return False
        compiled = self._prefill_slots_fn.lower(params, state_spec, *inputs, window=shape[2]).compile()
        with self._shapes_lock:
            if shape in self._jit_shapes:  # the jit compiled it meanwhile: keep one executable per shape
                return False
            self._precompiled.setdefault(shape, compiled)
        return True

    def history_window(self, start: int) -> int:
        """Cached positions a chunk starting at `start` reads: 0 (none) or the smallest attention
        window holding [0, start)."""
        if start == 0:
            return 0
        return next(w for w in self.history_windows if w >= start)

    @property
    def prefix_block_bytes(self) -> int:
        cfg = self.model.config
        per_token = cfg.num_layers * cfg.num_kv_heads * 2  # k and v
        if self.config.quantize_kvcache:
            per_token *= cfg.head_dim + 4  # int8 values and a float32 scale
        else:
            per_token *= cfg.head_dim * self._dtype.itemsize
        return per_token * self.limits.prefix_block

    def save_block(self, decode_state: DecodeState, slot: int, start: int) -> KVCache:
        if not 0 <= start <= self.limits.max_target_length - self.limits.prefix_block:
            raise ValueError(f"a prefix block at {start} does not fit in the cache")
        return self._save_block_fn(decode_state.cache, jnp.int32(slot), jnp.int32(start))

    def load_blocks(self, decode_state: DecodeState, slot: int, blocks: Sequence[KVCache]) -> DecodeState:
        for i, block in enumerate(blocks):
            decode_state = self._load_block_fn(decode_state, block, jnp.int32(slot), jnp.int32(i * self.limits.prefix_block))
        return decode_state

    # -- compiled bodies -----------------------------------------------------------------------

    def _prefill_slots_impl(
        self, params, state: DecodeState, tokens, slots, starts, lengths, final, keys, sampling, static, window
    ) -> tuple[DecodeState, jax.Array]:
        """tokens [rows, bucket]; slots, starts, lengths, final [rows]; keys [rows, 2]; sampling
        [rows, ...]. Returns the state and every row's first token [rows] (replicated)."""
        history = gather_history(state.cache, slots, window) if window else None
        logits, kv = prefill(
            params,
            tokens,
            lengths,
            **static,
            starts=starts if window else None,
            history=history,
            quantized_kv=state.cache.quantized,
            lora=lora_stack.lora_batch(params, sampling.lora_slot),
        )
        count = tokens.shape[0]
        rows = jnp.arange(count)
        last = self._decodable(logits[rows, lengths - 1], None)  # [rows, vocab]
        # Nothing generated yet, and no repetition penalty here (limits.prefills_whole): the
        # penalties change nothing; bad words, min_tokens and the bias apply.
        nothing = jnp.zeros((count,), jnp.int32)
        last = penalties.process(last, sampling, nothing, penalties.no_recent(count), None, final)
        first = self._sample(last, jax.vmap(lambda k: jax.random.fold_in(k, 0))(keys), sampling)
        finished = is_stop(first, sampling.stop_ids) | (sampling.max_tokens <= 1)
        parked = self.config.max_target_length - 1  # an inactive row's harmless write position

        def put(old, new):
            return old.at[slots].set(new.astype(old.dtype), mode="drop")

        # a final row's sequence starts: its first token, no prompt tokens kept (other rows drop)
        started = jnp.where(final, slots, self.max_concurrent_decodes)
        counts, recent = penalties.started(first, last.shape[-1])
        history = TokenHistory(
            counts=state.history.counts.at[started].set(counts, mode="drop"),
            prompt=state.history.prompt.at[started].set(False, mode="drop"),
            recent=state.history.recent.at[started].set(recent, mode="drop"),
        )

        new_state = DecodeState(
            cache=store_chunks(state.cache, kv, slots, starts),
            tokens=put(state.tokens, first),
            positions=put(state.positions, jnp.where(final, starts + lengths, parked)),
            generated=put(state.generated, jnp.ones_like(first)),
            active=put(state.active, final & ~finished),
            sampling=jax.tree.map(put, state.sampling, sampling._replace(key=keys)),
            history=history,
        )
        return new_state, jax.lax.with_sharding_constraint(first, replicated(self.mesh))

    def _load_block_impl(self, state: DecodeState, block: KVCache, slot, start) -> DecodeState:
        at = (0, slot, start, 0, 0)
        cache = KVCache(
            *(None if c is None else jax.lax.dynamic_update_slice(c, b, at) for c, b in zip(state.cache, block, strict=True))
        )
        parked = self.config.max_target_length - 1
        return state._replace(
            cache=cache,
            positions=state.positions.at[slot].set(parked),
            active=state.active.at[slot].set(False),
        )


def _save_block(cache: KVCache, slot, start, block: int) -> KVCache:
    """[layers, 1, block, kv_heads, head_dim] (and scales) of row `slot` from `start`."""

    def cut(c: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice(c, (0, slot, start, 0, 0), (c.shape[0], 1, block, *c.shape[3:]))

    return KVCache(*(None if c is None else cut(c) for c in cache))
