"""Decode attention over the paged KV cache on TPU, through JAX's Pallas `paged_attention` kernel
(jax.experimental.pallas.ops.tpu.paged_attention).

`PallasPagedOps.decode_attention` runs, per layer and decode step:

1. **The layer's pool into the kernel's layout** [kv_heads, num_pages, page_size, head_dim]: a
   slice and a transpose of the pool's layer [num_pages, page_size, kv_heads, head_dim]. This is
   a copy of the layer's whole pool, live pages or not (XLA hands a kernel whole buffers, not
   strided views): on TPU, HBM traffic of twice the layer's pool bytes, for every layer of every
   step. Where the pool is much larger than the live tokens, this copy costs more than the
   kernel, which reads only the live pages. The copy is there because the pool is stored
   token-major (the layout XLA's gather and the CPU kernel read). head_dim is zero-padded up to
   `head_dim_alignment` (128 lanes, MaxText's `pagedattn_head_dim_alignment`) in the same copy.
   Zeros in q and k change no score, and zeros in v give output columns that are cut off.
2. **The row's own token into that copy**: k_new, v_new at position positions[b], that is page
   pages[b, positions[b] // page_size], offset positions[b] % page_size. The kernel reads only
   pages, and the model writes the token into the pool only after the layer loop. This is a
   scatter of batch x kv_heads x head_dim elements into the fresh copy, in place, so it is cheap.
   The page must be one the row owns, or scratch page 0, so that no other row reads the entry.
3. **int8 pools** go in as a `QuantizedTensor`. The kernel dequantizes `int8 * scale / 127.5`,
   and pathserve's scale is absmax/127 with value = int8 * scale, so the layer's scales are copied
   times 127.5. The own token is quantized as the cache will hold it. The kernel's wrapper
   broadcasts the float32 scales over head_dim, which materialises 4 bytes per cached element
   next to the 1-byte value. The kernel then reads 5 bytes per cached element, against 2 for a
   bfloat16 pool: with this kernel an int8 pool saves HBM capacity, not bandwidth. Dequantizing
   to bfloat16 during the copy of step 1 would read 2 bytes, but rounds the values.
4. **The kernel**: for each row and kv head, `ceil(length / (block * page_size))` flash blocks of
   `block` pages each (block = `pages_per_compute_block`), with double-buffered page DMAs. It
   casts float K/V to bfloat16 as it loads them, so a float32 pool attends as bfloat16 (about
   1e-2 from XLA's float32 attention; int8 pages dequantize in float32). q is pre-scaled by
   1/sqrt(head_dim) in float32; the kernel computes in float32 and launches q in float32
   whenever groups is not a multiple of 8. The kernel pairs kv head h with q heads
   [h * groups, (h + 1) * groups), which is our kv-major q layout flattened.

Lengths are positions + 1, capped at the table's max_pages * page_size so that the kernel never
reads past a row's table. A row whose first page is scratch page 0 holds no sequence (page 0 is
never handed out, and a live row's first page holds its position 0). Such a row gets length 0:
the kernel skips it and returns zeros, instead of attending over a parked position.

What would remove the copy of step 1: a pool stored in the kernel's layout across layers,
[kv_heads, layers * num_pages, page_size, head_dim], read whole with the page table offset by
layer * num_pages, and the new token written before attention instead of after the layer loop.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8, QuantizedTensor

from serving.models.cache import KVCache, quantize_kv
from serving.models.ops import XlaOps


class PallasPagedOps(XlaOps):
    """XLA's ops, except decode attention: JAX's Pallas paged-attention kernel over the page pool.

    `pages_per_compute_block`: pages per flash block of the kernel (MaxText's
    `pagedattn_pages_per_compute_block`). The kernel uses the largest divisor of the table's
    max_pages that is not above it. `head_dim_alignment`: head_dim is zero-padded up to a multiple
    of this for the kernel (0: no padding). `reads_cache_in_place` is XLA's (False), so the engine
    keeps its windows; this op reads each row's length and ignores `window`."""

    name = "pallas-tpu"

    def __init__(self, pages_per_compute_block: int = 4, head_dim_alignment: int = 128):
        if pages_per_compute_block < 1:
            raise ValueError(f"pages_per_compute_block must be at least 1, got {pages_per_compute_block}")
        if head_dim_alignment < 0:
            raise ValueError(f"head_dim_alignment must be 0 or more, got {head_dim_alignment}")
        self.pages_per_compute_block = pages_per_compute_block
        self.head_dim_alignment = head_dim_alignment

    def decode_attention(
        self,
        q: jax.Array,
        cache: KVCache,
        layer: jax.Array | int,
        positions: jax.Array,
        k_new: jax.Array,
        v_new: jax.Array,
        window: int,
        pages: jax.Array,
    ) -> jax.Array:
        """q [batch, 1, kv_heads, groups, head_dim] over layer `layer` of the page pool (k, v
        [layers, num_pages, page_size, kv_heads, head_dim]) at each row's positions
        [0, positions[b]) through its page table pages [batch, max_pages], then the token's own
        k_new, v_new [batch, kv_heads, head_dim]. Returns [batch, 1, kv_heads, groups, head_dim].
        `window` is unused: the kernel reads each row's own length."""
        batch, _, kv_heads, groups, head_dim = q.shape
        page_size, max_pages = cache.k.shape[2], pages.shape[1]
        width = _aligned(head_dim, self.head_dim_alignment)
        where = _own_entry(pages, positions, page_size)
        k_pages = _layer_pages(cache.k, cache.k_scale, layer, k_new, where, width)
        v_pages = _layer_pages(cache.v, cache.v_scale, layer, v_new, where, width)
        scaled = _pad(q[:, 0].astype(jnp.float32) / math.sqrt(head_dim), width)
        out = paged_attention(
            scaled.reshape(batch, kv_heads * groups, width),  # q head kv * groups + g: kernel's order
            k_pages,
            v_pages,
            _lengths(pages, positions, page_size),
            pages.astype(jnp.int32),
            pages_per_compute_block=compute_block(max_pages, self.pages_per_compute_block),
        )  # [batch, kv_heads * groups, width]
        return out.reshape(batch, 1, kv_heads, groups, width)[..., :head_dim].astype(q.dtype)

    def describe(self) -> str:
        return (
            "JAX's Pallas paged-attention kernel on TPU "
            f"(up to {self.pages_per_compute_block} pages per compute block), XLA's dots"
        )


def compute_block(max_pages: int, limit: int) -> int:
    """The largest divisor of max_pages not above `limit`: the kernel needs the table's width
    to be a multiple of its pages per compute block."""
    return max(size for size in range(1, min(limit, max_pages) + 1) if max_pages % size == 0)


def _aligned(head_dim: int, alignment: int) -> int:
    return -(-head_dim // alignment) * alignment if alignment else head_dim


def _pad(x: jax.Array, width: int) -> jax.Array:
    """x [..., head_dim] zero-padded to [..., width]."""
    extra = width - x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)]) if extra else x


def _own_entry(pages: jax.Array, positions: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
    """(page, offset) [batch] each: where position positions[b] of row b lives."""
    index = (positions // page_size)[:, None]
    page = jnp.take_along_axis(pages, index, axis=1, mode="clip")[:, 0]
    return page, positions % page_size


def _lengths(pages: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """Positions each row attends to, its own token included: 0 for a row without pages."""
    lengths = jnp.minimum(positions + 1, pages.shape[1] * page_size)
    return jnp.where(pages[:, 0] == 0, 0, lengths).astype(jnp.int32)


def _layer_pages(
    values: jax.Array,
    scales: jax.Array | None,
    layer: jax.Array | int,
    new: jax.Array,
    where: tuple[jax.Array, jax.Array],
    width: int,
) -> jax.Array | QuantizedTensor:
    """One pool's (k or v) layer in the kernel's layout [kv_heads, num_pages, page_size, width],
    with each row's new token [batch, kv_heads, head_dim] at `where`."""
    if scales is None:
        return _place(_kernel_layout(values, layer, width), where, _pad(new, width))
    # the kernel reads one scale per kv head: a per-token layout (heads_and_dkv) is broadcast
    per_head = scales.shape[-2] == values.shape[-2]
    new_values, new_scales = quantize_kv(new, per_head)
    scales = jnp.broadcast_to(scales, (*values.shape[:-1], 1))
    new_scales = jnp.broadcast_to(new_scales, (*new.shape[:-1], 1))
    return QuantizedTensor(
        weight=_place(_kernel_layout(values, layer, width), where, _pad(new_values, width)),
        scales=_place(_kernel_layout(scales, layer, 1), where, new_scales) * MAX_INT8,
    )


def _kernel_layout(pool: jax.Array, layer: jax.Array | int, width: int) -> jax.Array:
    """pool [layers, num_pages, page_size, kv_heads, d] -> layer [kv_heads, num_pages, page_size,
    width] (a copy)."""
    x = jax.lax.dynamic_index_in_dim(pool, layer, 0, keepdims=False)
    return _pad(jnp.transpose(x, (2, 0, 1, 3)), width)


def _place(pages: jax.Array, where: tuple[jax.Array, jax.Array], new: jax.Array) -> jax.Array:
    """pages [kv_heads, num_pages, page_size, d] with new [batch, kv_heads, d] at (page, offset)."""
    page, offset = where
    return pages.at[:, page, offset].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype))
