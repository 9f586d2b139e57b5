"""Attention over the paged KV cache on x86 CPUs (AVX-512, or AVX2 and FMA) through XLA FFI kernels that read the
cache in place (cpu_attention.cc says why; serving.kernels.library builds them): one decode step, or several query
positions per row (a prompt's chunk after its cached positions, speculative verify)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from serving.kernels import library

F32_TARGET = "pathserve_f32_decode_attention"
INT8_TARGET = "pathserve_int8_decode_attention"
F32_AVX2_TARGET = "pathserve_f32_decode_attention_avx2"
INT8_AVX2_TARGET = "pathserve_int8_decode_attention_avx2"
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)  # query heads per kv head the kernel is built for


def supports(cache_dtype: jnp.dtype, head_dim: int, groups: int) -> bool:
    """Whether the kernel handles this cache and head layout (else the model keeps XLA's ops)."""
    return jnp.dtype(cache_dtype) in (jnp.float32, jnp.int8) and head_dim % 16 == 0 and groups in GROUPS


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_scale: jax.Array | None,
    v_scale: jax.Array | None,
    layer: jax.Array | int,
    lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    pages: jax.Array,
    counts: jax.Array | None = None,
    isa: str | None = None,
) -> jax.Array:
    """Attention over layer `layer` of a paged KV cache, read in place: one decode step, or S
    query positions per row (a prompt's chunk after its cached positions, speculative verify).

    q: [batch, kv_heads, groups, head_dim] (one position) or [batch, S, kv_heads, groups,
    head_dim]. k, v: the page pool [layers, num_pages, page_size, kv_heads, head_dim], float32, or
    int8 with k_scale, v_scale [layers, num_pages, page_size, kv_heads or 1, 1] (None for float32).
    pages: the block table, int32 [batch, max_pages]: position t of row b lies in page
    pages[b, t // page_size] at offset t % page_size (page 0 is the scratch page; unused entries
    are 0, and every entry must be in [0, num_pages) or the call fails). lengths: [batch]; query
    position s of row b attends to its cached positions [0, lengths[b]) (clamped to max_pages *
    page_size), then causally to the call's own k_new, v_new [batch, (S,) kv_heads, head_dim] of
    positions 0..s, not yet in the cache. counts: [batch], the query positions of each row that
    count (a chunk's true length; default all S): the others are not computed and come back as
    zeros. Returns float32 shaped like q, scaled by 1/sqrt(head_dim).

    The handler follows library.status().isa (`isa` "avx2": the AVX2 one on an AVX-512 CPU too,
    for tests)."""
    library.require()
    avx512 = (isa or library.status().isa) == "avx512"
    result = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    args = (jnp.asarray(layer, jnp.int32), lengths.astype(jnp.int32))
    if counts is None:
        counts = jnp.full((q.shape[0],), q.shape[1] if q.ndim == 5 else 1, jnp.int32)
    new = (k_new.astype(jnp.float32), v_new.astype(jnp.float32), pages.astype(jnp.int32), counts.astype(jnp.int32))
    q = q.astype(jnp.float32)
    if k_scale is None:
        return jax.ffi.ffi_call(F32_TARGET if avx512 else F32_AVX2_TARGET, result)(q, k, v, *args, *new)
    target = INT8_TARGET if avx512 else INT8_AVX2_TARGET
    return jax.ffi.ffi_call(target, result)(q, k, v, k_scale, v_scale, *args, *new)
