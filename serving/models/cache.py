"""The KV cache: a pool of pages shared by every sequence, float or int8 with per-token scales.

Every layer holds `num_pages` pages of `page_size` positions; page i is the same index in every
layer (one table serves them all). A sequence's positions live wherever its block table says:
row b's position t is at page `pages[b, t // page_size]`, offset `t % page_size`. Page 0 is
scratch: no sequence keeps anything in it, unused table entries and rows that must write nowhere
(padding rows, parked slots) point at it, so a write there harms nothing and a read of it is masked.

Reads gather whole pages ([rows, pages read, page_size, ...] and reshaped to positions), so
attention code sees a row's positions in order, as a contiguous cache would give them.

Two stored layouts of the same values, chosen by the backend (`init_pool(layout=...)`; every
function here tells them apart by the arrays' rank):
- "tokens": k, v [layers, num_pages, page_size, kv_heads, head_dim], scales [..., kv_heads or 1, 1]
  (what the CPU kernels and JAX's Pallas paged-attention wrapper read).
- "lanes" (TPU): k, v [layers, num_pages, page_size, kv_heads * head_dim], an int8 cache's values
  packed four to an int32 lane ([..., kv_heads * head_dim // 4]), scales [layers, num_pages,
  kv_heads * page_size] (head-major, so that a split of the heads over chips splits them too; per
  token: [layers, num_pages, page_size]). A TPU tiles an array's two
  minor dimensions by (8, 128) (int8: (32, 128)): kv_heads x head_dim = 8 x 64 of the tokens
  layout padded 2-8x, and XLA relaid the whole pool out (copies of it in and out of every
  generate call: 4 copies and 2x the pool in temporaries, measured on the 1B shape for a v5e,
  loadtest.tpu_probe); an int8 pool stored as int8 was copied between (8, 128) and (32, 128)
  tiles. In this layout, written by one scatter at explicit (layer, page, offset) indices, the
  generate program has no copy of the pool (tests/test_tpu.py reads its compiled HLO).
The same values in both (the lanes scales head-major); a TPU pads a lanes minor axis that is not a
multiple of 128 lanes (kv_heads x head_dim below 512 in int8), which the memory plan counts
(serving.engine.compiled_memory).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from serving.models.config import ModelConfig
from serving.models.paging import SCRATCH_PAGE, dedicated_pages, pages_for

__all__ = ["SCRATCH_PAGE", "KVCache", "dedicated_pages", "init_pool", "pages_for"]

Layout = Literal["tokens", "lanes"]
PACK = 4  # int8 values per int32 lane of the lanes layout


class KVCache(NamedTuple):
    """Keys and values. As the page pool: [layers, num_pages, page_size, kv_heads, head_dim]; as a
    prefill's output or gathered history: [layers, batch, seq, kv_heads, head_dim].

    With an int8 cache, `k`/`v` hold int8 values and `k_scale`/`v_scale` float scales, MaxText's
    kv_quant_axis layouts: [..., kv_heads, 1] one per token and head ("dkv"), or [..., 1, 1] one
    per token ("heads_and_dkv"); for a float cache the scales are None.
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def lanes(self) -> bool:
        """The pool is stored in the lanes layout (see the module docstring)."""
        return self.k.ndim == 4

    @property
    def scale_per_head(self) -> bool:
        """An int8 cache's scales are per token and head (dkv), not per token (heads_and_dkv)."""
        if self.k_scale is None:
            return False
        if self.lanes:  # [layers, pages, heads * page_size]: per head when heads > 1
            return self.k_scale.shape[-1] > self.k.shape[2]
        return self.k_scale.shape[-2] > 1 or self.k.shape[-2] == 1


def init_pool(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: jnp.dtype = jnp.float32,
    quantized: bool = False,
    scale_per_head: bool = True,
    layout: Layout = "tokens",
) -> KVCache:
    """A zeroed pool of `num_pages` pages (page 0, scratch, included) of `page_size` positions;
    int8 with scales per token and head (`scale_per_head`, kv_quant_axis=dkv) or per token,
    stored in `layout` (see the module docstring)."""
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    if layout == "lanes":
        return _init_lanes(cfg, shape, dtype, quantized, scale_per_head)
    if not quantized:
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    scale_shape = (*shape[:-2], cfg.num_kv_heads if scale_per_head else 1, 1)
    return KVCache(
        jnp.zeros(shape, jnp.int8),
        jnp.zeros(shape, jnp.int8),
        jnp.zeros(scale_shape, jnp.float32),
        jnp.zeros(scale_shape, jnp.float32),
    )


def _init_lanes(cfg: ModelConfig, shape: tuple, dtype, quantized: bool, scale_per_head: bool) -> KVCache:
    width = cfg.num_kv_heads * cfg.head_dim
    if not quantized:
        return KVCache(jnp.zeros((*shape[:3], width), dtype), jnp.zeros((*shape[:3], width), dtype))
    if width % PACK:
        raise ValueError(f"an int8 lanes pool packs {PACK} values a lane: kv_heads x head_dim = {width}")
    values = (*shape[:3], width // PACK)
    scales = (*shape[:2], (cfg.num_kv_heads if scale_per_head else 1) * shape[2])
    return KVCache(
        jnp.zeros(values, jnp.int32),
        jnp.zeros(values, jnp.int32),
        jnp.zeros(scales, jnp.float32),
        jnp.zeros(scales, jnp.float32),
    )


def to_lanes(x: jax.Array, stored: jax.Array) -> jax.Array:
    """Values x [..., kv_heads, head_dim] as the lanes array `stored` holds them:
    [..., kv_heads * head_dim], int8 packed PACK to an int32 lane where `stored` is int32."""
    if stored.dtype == jnp.int32:
        flat = x.astype(jnp.int8).reshape(*x.shape[:-2], -1, PACK)
        return jax.lax.bitcast_convert_type(flat, jnp.int32)
    return x.reshape(*x.shape[:-2], -1).astype(stored.dtype)


def from_lanes(x: jax.Array, kv_heads: int) -> jax.Array:
    """Gathered lanes values [..., width] (int32 lanes of int8, or floats) as [..., kv_heads, head_dim]."""
    if x.dtype == jnp.int32:
        # byte k of each lane, sign-extended by two shifts: elementwise, so XLA fuses it into the
        # dequantization (a bitcast to int8 made a TPU materialize [..., width, 4] of uint32)
        pieces = [jax.lax.shift_right_arithmetic(jax.lax.shift_left(x, 24 - 8 * k), 24) for k in range(PACK)]
        x = jnp.stack(pieces, axis=-1).reshape(*x.shape[:-1], -1)
    return x.reshape(*x.shape[:-1], kv_heads, -1)


def quantize_kv(x: jax.Array, per_head: bool = True) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 of x [..., kv_heads, head_dim]: x ~= values * scale, one scale per token and
    head over head_dim (`per_head`: MaxText's kv_quant_axis=dkv, scale [..., kv_heads, 1]) or per
    token over heads and head_dim (heads_and_dkv, scale [..., 1, 1]). pathserve's numbers, not
    MaxText's: scale = absmax / 127 in float32, values round(x / scale) clipped to +-127 (MaxText
    stores the absmax in bfloat16 and values round(x * 127.5 / absmax)); the layouts are MaxText's."""
    axes = -1 if per_head else (-2, -1)
    absmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / 127.0, 1.0)
    values = jnp.clip(jnp.round(x.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8)
    return values, scale


def token_index(pages: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Flat index into a layer's [num_pages * page_size] positions of rows' `positions`
    [batch, n] through their tables `pages` [batch, max_pages]; a position past the table is the
    scratch page's."""
    max_pages = pages.shape[1]
    column = positions // page_size
    page = jnp.take_along_axis(pages, jnp.clip(column, 0, max_pages - 1), axis=1)
    page = jnp.where((column >= 0) & (column < max_pages), page, SCRATCH_PAGE)
    return page * page_size + positions % page_size


def _flat(c: jax.Array) -> jax.Array:
    """[layers, pages, page_size, ...] as [layers, pages * page_size, ...] (a free reshape)."""
    return c.reshape(c.shape[0], c.shape[1] * c.shape[2], *c.shape[3:])


def _write(cache: KVCache, pages: jax.Array, positions: jax.Array, values: tuple) -> KVCache:
    """Write values [layers, batch, n, ...] (as `_stored` gives them) at positions [batch, n] of
    the rows whose tables are `pages` [batch, max_pages], in every layer. Each row's positions are
    consecutive (a chunk, a verify's tokens, a decode step's one): a lanes pool's scales are
    written by whole page rows from the first (`_write_scale_rows`)."""
    if cache.lanes:
        return _write_lanes(cache, pages, positions, values)
    return _scatter(cache, token_index(pages, positions, cache.k.shape[2]), values)


def _write_lanes(cache: KVCache, pages: jax.Array, positions: jax.Array, values: tuple) -> KVCache:
    """`_write` into a lanes pool (each row's positions consecutive): values by one scatter at
    explicit (layer, page, offset) indices (through a flat [layers, pages * page_size] view XLA
    relays the pool out on a TPU), scales by whole page rows (`_write_scale_rows`)."""
    page_size, max_pages = cache.k.shape[2], pages.shape[1]
    column = positions // page_size
    page = jnp.take_along_axis(pages, jnp.clip(column, 0, max_pages - 1), axis=1)
    page = jnp.where((column >= 0) & (column < max_pages), page, SCRATCH_PAGE)[None]  # [1, batch, n]
    offset = (positions % page_size)[None]
    layer = jnp.arange(cache.k.shape[0])[:, None, None]  # [layers, 1, 1]
    out = []
    for c, x in zip(cache, values, strict=True):
        if c is None:
            out.append(None)
        elif c.ndim == 4:  # values
            out.append(c.at[layer, page, offset].set(to_lanes(x, c)))
        else:  # scales [layers, pages, heads * page_size] of x [..., heads, 1] (heads 1: per token)
            out.append(_write_scale_rows(c, pages, positions, x[..., 0]))
    return KVCache(*out)


def _write_scale_rows(c: jax.Array, table: jax.Array, positions: jax.Array, x: jax.Array) -> jax.Array:
    """Scales x [layers, batch, n, heads] at positions [batch, n] (consecutive in each row) of the
    rows whose tables are `table` [batch, max_pages], into c [layers, pages, heads * page_size]:
    each page row a row's positions touch read, changed where they fall and written back whole. A
    scatter of single values had XLA on a TPU flatten the whole scale pool to one dimension and
    back, two copies of it every call; whole rows keep its layout. Rows write distinct pages (a
    padding row's, the scratch page, is anyone's)."""
    batch, n = positions.shape
    heads = x.shape[-1]
    page_size = c.shape[-1] // heads
    span = 1 if n == 1 else -(-n // page_size) + 1  # page rows n consecutive positions can touch
    columns = positions[:, :1] // page_size + jnp.arange(span)[None, :]  # [batch, span]
    max_pages = table.shape[1]
    page = jnp.take_along_axis(table, jnp.clip(columns, 0, max_pages - 1), axis=1)
    page = jnp.where((columns >= 0) & (columns < max_pages), page, SCRATCH_PAGE)[None]  # [1, batch, span]
    lane = jnp.arange(heads * page_size)  # head lane // page_size, offset lane % page_size
    token = columns[..., None] * page_size + lane % page_size - positions[:, :1, None]  # [batch, span, lanes]
    inside = (token >= 0) & (token < n)
    new = x[:, jnp.arange(batch)[:, None, None], jnp.clip(token, 0, n - 1), lane // page_size]  # [layers, batch, span, lanes]
    layer = jnp.arange(c.shape[0])[:, None, None]
    return c.at[layer, page].set(jnp.where(inside[None], new.astype(c.dtype), c[layer, page]))


def _scatter(cache: KVCache, index: jax.Array, values: tuple) -> KVCache:
    """Write values [layers, *index.shape, ...] at flat positions `index` of every layer."""
    out = []
    for c, x in zip(cache, values, strict=True):
        if c is None:
            out.append(None)
            continue
        out.append(_flat(c).at[:, index].set(x.astype(c.dtype)).reshape(c.shape))
    return KVCache(*out)


def _stored(kv: KVCache, cache: KVCache) -> tuple:
    """Float KV as `cache` holds it: (k, v, None, None), or int8 values with scales in its layout."""
    if not cache.quantized:
        return (kv.k, kv.v, None, None)
    per_head = cache.scale_per_head
    (kq, ks), (vq, vs) = quantize_kv(kv.k, per_head), quantize_kv(kv.v, per_head)
    return (kq, vq, ks, vs)


def store_chunks(cache: KVCache, chunk: KVCache, pages: jax.Array, starts: jax.Array) -> KVCache:
    """Write chunks' float KV [layers, batch, seq, kv_heads, head_dim] at positions
    starts[b] + 0..seq-1 of the rows whose tables are `pages` [batch, max_pages] (a padding row's
    table is all scratch)."""
    seq = chunk.k.shape[2]
    return _write(cache, pages, starts[:, None] + jnp.arange(seq)[None, :], _stored(chunk, cache))


def store_prefix(cache: KVCache, prefix: KVCache, pages: jax.Array) -> KVCache:
    """Write a prompt's float KV [layers, 1, seq, kv_heads, head_dim] at positions 0..seq-1 of the
    row whose table is `pages` [max_pages]."""
    return store_chunks(cache, prefix, pages[None], jnp.zeros((1,), jnp.int32))


def write_new_tokens(cache: KVCache, positions: jax.Array, new: KVCache, pages: jax.Array) -> KVCache:
    """Store every layer's new token, new.k/v [layers, batch, kv_heads, head_dim] (as the cache
    holds them), at each row's position through its table `pages` [batch, max_pages]."""
    return _write(cache, pages, positions[:, None], tuple(None if x is None else x[:, :, None] for x in new))


def read_layer(
    cache: KVCache, index: jax.Array | int, dtype: jnp.dtype, window: int, pages: jax.Array, kv_heads: int
) -> tuple[jax.Array, jax.Array]:
    """Layer `index` keys and values [rows, window, kv_heads, head_dim] in the compute dtype, of
    the rows whose tables are `pages` [rows, max_pages]: one gather of whole pages."""
    keys, values, scales = read_layer_scaled(cache, index, dtype, window, pages, kv_heads)
    if scales is None:
        return keys, values
    return keys * scales[0][..., None].astype(dtype), values * scales[1][..., None].astype(dtype)


def read_layer_scaled(
    cache: KVCache, index: jax.Array | int, dtype: jnp.dtype, window: int, pages: jax.Array, kv_heads: int
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None]:
    """`read_layer`, an int8 lanes pool's values left unscaled: keys and values [rows, window,
    kv_heads, head_dim] in the compute dtype (int8 values cast exactly) and their scales (k_scale,
    v_scale [rows, window, kv_heads] float32), which attention applies to its scores and
    probabilities (serving.models.layers.attention); None for any other pool, whose keys and values
    come dequantized. On a TPU, a cast of the gathered scales alone is one XLA moves before the
    gather, casting the whole scale pool every step; multiplied in float32 they stay gathered."""
    n = pages_for(window, cache.k.shape[2])
    if cache.lanes:
        return _read_lanes(cache, index, dtype, window, pages[:, :n], kv_heads)

    def layer(x: jax.Array) -> jax.Array:
        got = x[index, pages[:, :n]]  # [rows, n, page_size, ...]
        return got.reshape(got.shape[0], -1, *got.shape[3:])[:, :window].astype(dtype)

    if not cache.quantized:
        return layer(cache.k), layer(cache.v), None
    return layer(cache.k) * layer(cache.k_scale), layer(cache.v) * layer(cache.v_scale), None


def _read_lanes(
    cache: KVCache, index, dtype: jnp.dtype, window: int, pages: jax.Array, kv_heads: int
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None]:
    """`read_layer_scaled` of a lanes pool: the gathered pages unpacked to [rows, window, kv_heads,
    head_dim], an int8 pool's scales beside them."""
    rows = pages.shape[0]

    def positions(x: jax.Array) -> jax.Array:  # [rows, n, page_size, ...] -> [rows, window, ...]
        got = x[index, pages]
        return got.reshape(rows, -1, *got.shape[3:])[:, :window]

    def values(x: jax.Array) -> jax.Array:
        return from_lanes(positions(x), kv_heads).astype(dtype)

    if not cache.quantized:
        return values(cache.k), values(cache.v), None

    def scales(x: jax.Array) -> jax.Array:
        got = x[index, pages]  # [rows, n, heads * page_size] (heads: kv_heads, or 1 per token)
        page_size = cache.k.shape[2]
        heads = got.shape[-1] // page_size
        got = jnp.swapaxes(got.reshape(rows, -1, heads, page_size), -1, -2)  # [rows, n, page_size, heads]
        return jnp.broadcast_to(got.reshape(rows, -1, heads)[:, :window], (rows, window, kv_heads))

    return values(cache.k), values(cache.v), (scales(cache.k_scale), scales(cache.v_scale))
