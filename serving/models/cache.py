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
    cache: KVCache, index: jax.Array | int, dtype: jnp.dtype, window: int
) -> tuple[jax.Array, jax.Array]:
    """Layer `index` keys and values [batch, window, kv_heads, head_dim] in the compute dtype."""

    def layer(x: jax.Array) -> jax.Array:
        start = (index,) + (0,) * (x.ndim - 1)
        return jax.lax.dynamic_slice(x, start, (1, x.shape[1], window, *x.shape[3:]))[0].astype(dtype)

    if not cache.quantized:
        return layer(cache.k), layer(cache.v)
    return layer(cache.k) * layer(cache.k_scale), layer(cache.v) * layer(cache.v_scale)
