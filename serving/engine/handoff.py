"""One sequence moved between two engines on different devices: a disaggregated server's prefill
engine hands a prompt it prefilled (its pages of KV and its slot's state) to the generate engine,
and the generate engine hands a preempted sequence's slot state back (its pages are recomputed).

`handoff(state, slot, pages)` reads slot `slot`'s state row and the given pages of the pool
([layers, n, page_size, kv_heads, head_dim], int8 scales included) in one compiled call;
`accept(state, handoff, slot, pages)` places them on this engine's mesh (`jax.device_put`:
the KV with the pool's layer and kv-head placement, one buffer for every layer as MaxText's
stack_prefill_result_cache sends it; the rest replicated) and writes them at the same slot and
pages. Between the process groups of a multi-controller server (serving.orchestrator.transfer)
the sender sends `gathered(...)` (whole on each of its devices) and the receiver's copy, on one
of its own devices, is spread over this engine's mesh, each process placing its own shards. Both sides' pools are the same size and the scheduler's page ids name the same page on
both, so the move needs no second table. Page lists are padded with the scratch page to a power of
two (one compile per length bucket, scratch copied onto scratch).

A part the engine is built from (`serving.engine.engine.Engine.handoffs`, over its mesh, state
shardings and paged cache); the engine's contract methods of these names call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from serving.engine.paged_cache import PagedCache
from serving.engine.sharding import replicated
from serving.engine.state import DecodeState, Prefix, SlotSampling, TokenHistory
from serving.models.cache import SCRATCH_PAGE, KVCache


class Handoff(NamedTuple):
    """One slot's sequence in flight between engines: its pages (None: none moved) and state row."""

    kv: KVCache | None  # [layers, pages, page_size, kv_heads, head_dim] (+ scales)
    token: jax.Array  # int32 []: the next token fed
    position: jax.Array  # int32 []
    generated: jax.Array  # int32 []
    active: jax.Array  # bool []
    sampling: SlotSampling  # one row
    history: TokenHistory  # one row


def padded_pages(pages: Sequence[int]) -> np.ndarray:
    """int32 [a power of two >= len(pages)]: `pages`, then the scratch page (none: empty)."""
    if not pages:
        return np.zeros((0,), np.int32)
    out = np.full((1 << (len(pages) - 1).bit_length(),), SCRATCH_PAGE, np.int32)
    out[: len(pages)] = pages
    return out


class Handoffs:
    """One engine's side of the moves (module docstring): its `mesh`, where its decode state lives
    (`state_shardings`) and its `paged_cache` (the pool's placement, for a handoff's KV)."""

    def __init__(self, mesh: Mesh, state_shardings: DecodeState, paged_cache: PagedCache):
        self.mesh = mesh
        self.paged_cache = paged_cache
        self._handoff_fn = jax.jit(_read_handoff)
        self._gather_fn = jax.jit(lambda tree: tree, out_shardings=replicated(mesh))
        self._accept_fn = jax.jit(_write_handoff, donate_argnums=(0,), out_shardings=state_shardings)

    def handoff(self, decode_state: DecodeState, slot: int, pages: Sequence[int]) -> Handoff:
        """Slot `slot`'s state row and the KV of `pages` (dispatched: still on this engine's devices)."""
        return self._handoff_fn(decode_state, jnp.int32(slot), jnp.asarray(padded_pages(pages)))

    def accept(self, decode_state: DecodeState, handoff: Handoff, slot: int, pages: Sequence[int]) -> DecodeState:
        """The state with another engine's `handoff` written at `slot` and `pages` (those it was
        read from there, in the same order)."""
        kv = None if handoff.kv is None else _place(handoff.kv, self.paged_cache.like_pool(handoff.kv))
        rest = _place(handoff._replace(kv=None), replicated(self.mesh))
        return self._accept_fn(decode_state, rest._replace(kv=kv), jnp.int32(slot), jnp.asarray(padded_pages(pages)))

    def receive(self, prefix: Prefix) -> Prefix:
        """Another engine's whole-prompt prefix on this engine's mesh, for `insert` (the same
        placement as a handoff's KV; asynchronous: the next call on this mesh waits for it)."""
        kv = _place(prefix.kv, self.paged_cache.like_pool(prefix.kv))
        rest = _place(prefix._replace(kv=None), replicated(self.mesh))
        return rest._replace(kv=kv)

    def gathered(self, tree):
        """`tree` (a Handoff or a Prefix on this engine's mesh) whole on every device of it, for
        another process group to pull (dispatched)."""
        return self._gather_fn(tree)


def _place(tree, shardings):
    """`jax.device_put(tree, shardings)`; where a sharding spans other processes' devices (a
    multi-controller mesh) and a leaf is whole on one of this process's, each of this process's
    shards is cut from it."""

    def one(x, sharding):
        if sharding.is_fully_addressable or not x.is_fully_addressable:
            return jax.device_put(x, sharding)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)


def _read_handoff(state: DecodeState, slot: jax.Array, pages: jax.Array) -> Handoff:
    kv = None
    if pages.shape[0]:
        kv = KVCache(*(None if x is None else x[:, pages] for x in state.cache))
    return Handoff(
        kv,
        state.tokens[slot],
        state.positions[slot],
        state.generated[slot],
        state.active[slot],
        jax.tree.map(lambda x: x[slot], state.sampling),
        jax.tree.map(lambda x: x[slot], state.history),
    )


def _write_handoff(state: DecodeState, handoff: Handoff, slot: jax.Array, pages: jax.Array) -> DecodeState:
    cache = state.cache
    if handoff.kv is not None:
        cache = KVCache(*(x if y is None else x.at[:, pages].set(y) for x, y in zip(state.cache, handoff.kv, strict=True)))

    def put(all_, one):
        return all_.at[slot].set(one)

    return DecodeState(
        cache=cache,
        pages=state.pages,
        tokens=put(state.tokens, handoff.token),
        positions=put(state.positions, handoff.position),
        generated=put(state.generated, handoff.generated),
        active=put(state.active, handoff.active),
        sampling=jax.tree.map(put, state.sampling, handoff.sampling),
        history=jax.tree.map(put, state.history, handoff.history),
    )
