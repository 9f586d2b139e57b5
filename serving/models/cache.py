"""The KV cache: preallocated keys and values per layer, float or int8 with per-token scales."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from serving.models.config import ModelConfig


class KVCache(NamedTuple):
    """Preallocated keys and values [layers, batch, cache, kv_heads, head_dim].

    With an int8 cache, `k`/`v` hold int8 values and `k_scale`/`v_scale` [layers, batch, cache,
    kv_heads, 1] one float scale per token and head; for a float cache the scales are None.
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None


def init_cache(
    cfg: ModelConfig, batch: int, length: int, dtype: jnp.dtype = jnp.float32, quantized: bool = False
) -> KVCache:
    """Zeroed cache for `batch` sequences of up to `length` tokens."""
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    if not quantized:
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    scale_shape = (*shape[:-1], 1)
    return KVCache(
        jnp.zeros(shape, jnp.int8),
        jnp.zeros(shape, jnp.int8),
        jnp.zeros(scale_shape, jnp.float32),
        jnp.zeros(scale_shape, jnp.float32),
    )


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per token and head over head_dim: x ~= values * scale."""
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    values = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8)
    return values, scale


def store_chunks(cache: KVCache, chunk: KVCache, rows: jax.Array, starts: jax.Array) -> KVCache:
    """Write chunks' float KV [layers, batch, seq, kv_heads, head_dim] into cache rows `rows`
    [batch] at positions starts[b] + 0..seq-1. A row index or position past the cache is dropped
    (padding rows of a batch carry an out-of-range row)."""
    seq = chunk.k.shape[2]
    where = (rows[:, None], starts[:, None] + jnp.arange(seq)[None, :])  # [batch, seq] each
    if cache.quantized:
        (kq, ks), (vq, vs) = quantize_kv(chunk.k), quantize_kv(chunk.v)
        values = (kq, vq, ks, vs)
    else:
        values = (chunk.k, chunk.v, None, None)
    return KVCache(
        *(
            None if c is None else c.at[:, where[0], where[1]].set(x.astype(c.dtype), mode="drop")
            for c, x in zip(cache, values, strict=True)
        )
    )


def gather_history(cache: KVCache, rows: jax.Array, window: int) -> KVCache:
    """Cache rows `rows` [batch] at positions [0, window), as stored: [layers, batch, window, ...]."""
    safe = jnp.clip(rows, 0, cache.k.shape[1] - 1)
    return KVCache(*(None if c is None else c[:, safe, :window] for c in cache))


def read_history(history: KVCache, index: jax.Array | int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Layer `index` of gathered history, keys and values [batch, window, kv_heads, head_dim] in
    the compute dtype."""

    def layer(x: jax.Array) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(x, index, 0, keepdims=False).astype(dtype)

    if not history.quantized:
        return layer(history.k), layer(history.v)
    return layer(history.k) * layer(history.k_scale), layer(history.v) * layer(history.v_scale)


def store_prefix(cache: KVCache, prefix: KVCache, row: int | jax.Array) -> KVCache:
    """Write a prompt's float KV [layers, 1, seq, kv_heads, head_dim] into `row` at positions 0..seq-1."""
    start = (0, row, 0, 0, 0)
    if not cache.quantized:
        return KVCache(
            jax.lax.dynamic_update_slice(cache.k, prefix.k.astype(cache.k.dtype), start),
            jax.lax.dynamic_update_slice(cache.v, prefix.v.astype(cache.v.dtype), start),
        )
    (kq, ks), (vq, vs) = quantize_kv(prefix.k), quantize_kv(prefix.v)
    return KVCache(
        *(jax.lax.dynamic_update_slice(c, x, start) for c, x in zip(cache, (kq, vq, ks, vs), strict=True))
    )


def write_new_tokens(cache: KVCache, positions: jax.Array, new: KVCache) -> KVCache:
    """Store every layer's new token, new.k/v [layers, batch, kv_heads, head_dim], at per-row positions."""
    rows = jnp.arange(positions.shape[0])
    return KVCache(
        *(
            None if old is None else old.at[:, rows, positions].set(value.astype(old.dtype))
            for old, value in zip(cache, new, strict=True)
        )
    )


def read_layer(
    cache: KVCache, index: jax.Array | int, dtype: jnp.dtype, window: int, rows: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """Layer `index` keys and values [rows, window, kv_heads, head_dim] in the compute dtype: the
    first `rows` rows of the cache (None: all)."""
    rows = cache.k.shape[1] if rows is None else rows

    def layer(x: jax.Array) -> jax.Array:
        start = (index,) + (0,) * (x.ndim - 1)
        return jax.lax.dynamic_slice(x, start, (1, rows, window, *x.shape[3:]))[0].astype(dtype)

    if not cache.quantized:
        return layer(cache.k), layer(cache.v)
    return layer(cache.k) * layer(cache.k_scale), layer(cache.v) * layer(cache.v_scale)
