"""float32, int8 and W8A8 weight matmuls on x86 CPUs through XLA FFI kernels (cpu_matmul.cc and
cpu_int8.cc say why; serving.kernels.library builds them and says which instruction set runs)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from serving.kernels import library

F32_TARGET = "pathserve_f32_matmul"
INT8_TARGET = "pathserve_int8_matmul"
INT8_AMX_TARGET = "pathserve_int8_amx_matmul"
F32_AMX_TARGET = "pathserve_f32_amx_matmul"
F32_BLOCKS_AMX_TARGET = "pathserve_f32_blocks_amx_matmul"
INT8_AVX2_TARGET = "pathserve_int8_avx2_matmul"
W8A8_TARGET = "pathserve_w8a8_matmul"  # AVX-512 VNNI
W8A8_AVX2_TARGET = "pathserve_w8a8_avx2_matmul"
W8A8_AMX_TARGET = "pathserve_w8a8_amx_matmul"
QUAD = 4  # W8A8: input rows per column group (kTile columns x 4 rows of int8)
TILE = 64  # output columns per packed tile (kTile in the C++ source)
AMX_TILE = 16  # int8 on AMX: output columns per tile (kAmxCols)
AMX_DEPTH = 64  # int8 on AMX: input rows padded to a multiple of this (kAmxDepth)
AMX_MAX_DEPTH = 65536  # int8 on AMX: the most input rows whose int32 sums cannot overflow
BF16_DEPTH = 32  # float32 on AMX: input rows padded to a multiple of this (kBf16Depth)
# float32 weights the AMX kernel reads as integers per block of 32 inputs and column (a dequantized
# GGUF tensor blocked along the inputs): w = integer * scale + offset, per format (levels, offset):
BLOCK_FORMATS = {
    "blocks8": (127, False),  # Q8_0: integers in [-127, 127], scale = largest magnitude / 127
    "blocks4": (15, True),  # Q4_1: integers in [0, 15], offset = the smallest, scale = range / 15
}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """A [..., in, out] matmul weight in the kernels' layout, 64 output columns per tile.

    float32: values [..., tiles, in, 64] and no scales; or, with `amx`, bfloat16 values
    [..., tiles, blocks * 32, 16, 2] for the AMX kernel: 16 columns per tile, input rows padded to
    blocks of 32, each block the weights' high bfloat16 halves then their low halves (16 row pairs
    each, a pair's two rows side by side per column); or, in blocks (`pack_blocks`), bfloat16
    integers [..., tiles, blocks * 16, 16, 2] with scales and offsets [..., tiles, blocks, 2, 16],
    `amx` set. int8: values [..., tiles, pairs, 64, 2] (input rows paired) with per-output scales
    [..., tiles * 64]; or, with `amx`, values
    [..., tiles, quads, 16, 4] (16 columns per tile, input rows in fours, padded to a multiple of
    64) with scales [..., tiles * 16], for the AMX kernel. W8A8 (`w8a8`, activations quantized to
    int8 per row by the kernel): values [..., tiles, quads, 64, 4] (input rows in fours per column),
    scales and each column's weight sum `sums` (int32) [..., tiles * 64], in that one layout for
    every kernel (`amx`: the AMX kernel reads it). `in_features` and `out_features` are the sizes
    before padding.

    Stacked layers stay stacked inside a scan: `at_layer(i)` names the layer the kernel reads, where
    a slice would make XLA copy the weight out of the stack before every call.
    """

    values: jax.Array
    scales: jax.Array | None
    in_features: int = field(metadata={"static": True})
    out_features: int = field(metadata={"static": True})
    layer: jax.Array | None = None
    amx: bool = field(default=False, metadata={"static": True})
    # Output columns of each weight fused into this one (matmuls sharing an input), in order.
    parts: tuple[int, ...] = field(default=(), metadata={"static": True})
    sums: jax.Array | None = None
    w8a8: bool = field(default=False, metadata={"static": True})

    def at_layer(self, index: jax.Array | int) -> PackedWeight:
        return replace(self, layer=jnp.asarray(index, jnp.int32))


def pack(values: jax.Array, scales: jax.Array | None = None, amx: bool | None = None) -> PackedWeight:
    """Pack a [..., in, out] weight (any leading axes, e.g. stacked layers): float32 values, or int8
    values with per-output `scales` [..., out]. Columns are padded to a multiple of 64 and, for
    int8, input rows to an even count.

    `amx` picks the AMX layout. int8: by default where the AMX kernel runs (`library.status().amx`).
    float32: only when asked (`amx=True`), for values the caller found to `splits_exactly`. Not
    checked here, where the values may be traced: other values would lose their low bits."""
    *lead, k, n = values.shape
    tiles, nd = -(-n // TILE), len(lead)
    pad = [(0, 0)] * nd
    if scales is None:
        if amx:
            return _pack_bf16_pairs(values)
        v = jnp.pad(values.astype(jnp.float32), [*pad, (0, 0), (0, tiles * TILE - n)])
        v = v.reshape(*lead, k, tiles, TILE).transpose(*range(nd), nd + 1, nd, nd + 2)
        return PackedWeight(values=v, scales=None, in_features=k, out_features=n)
    if (library.status().amx if amx is None else amx) and k <= AMX_MAX_DEPTH:
        return _pack_amx(values, scales)
    pairs = -(-k // 2)
    v = jnp.pad(values, [*pad, (0, 2 * pairs - k), (0, tiles * TILE - n)])
    v = v.reshape(*lead, pairs, 2, tiles, TILE).transpose(*range(nd), nd + 2, nd, nd + 3, nd + 1)
    s = jnp.pad(scales.reshape(*lead, n).astype(jnp.float32), [*pad, (0, tiles * TILE - n)])
    return PackedWeight(values=v, scales=s, in_features=k, out_features=n)


def pack_w8a8(values: jax.Array, scales: jax.Array, amx: bool | None = None) -> PackedWeight:
    """int8 values [..., in, out] with per-output `scales` [..., out] for the W8A8 kernels:
    [..., tiles, quads, 64, 4], four input rows side by side per column (input rows padded to a
    multiple of 4, columns to 64), with each column's sum of its weights (VNNI's unsigned-offset
    correction). `amx` (default: where the AMX kernel runs, `library.status().amx`) sends it to the
    AMX kernel, which reads the same layout (16 quads of 16 columns are one tile at a stride)."""
    *lead, k, n = values.shape
    tiles, nd, quads = -(-n // TILE), len(lead), -(-k // QUAD)
    pad = [(0, 0)] * nd
    v = jnp.pad(values, [*pad, (0, quads * QUAD - k), (0, tiles * TILE - n)])
    sums = jnp.sum(v.astype(jnp.int32), axis=-2)  # [..., tiles * 64]
    v = v.reshape(*lead, quads, QUAD, tiles, TILE).transpose(*range(nd), nd + 2, nd, nd + 3, nd + 1)
    s = jnp.pad(scales.reshape(*lead, n).astype(jnp.float32), [*pad, (0, tiles * TILE - n)])
    amx = library.status().amx if amx is None else amx
    return PackedWeight(values=v, scales=s, in_features=k, out_features=n, sums=sums, w8a8=True, amx=amx)


def _halves(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 values as the bits of their high bfloat16 half (the top 16 bits) and of what is
    left, cut to its top 16 bits."""
    values = values.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(values, jnp.uint32)
    high = bits & jnp.uint32(0xFFFF0000)
    rest = values - jax.lax.bitcast_convert_type(high, jnp.float32)
    return high, jax.lax.bitcast_convert_type(rest, jnp.uint32)


def splits_exactly(values: jax.Array) -> jax.Array:
    """Whether every value is finite and exactly the sum of two bfloat16 (16 significant bits or
    fewer): then the AMX kernel multiplies the float32 weights themselves. True of weights that
    came from bfloat16 or float16 checkpoints, and of dequantized 4-bit GGUF blocks."""
    _, rest = _halves(values)
    return jnp.all(jnp.isfinite(values)) & jnp.all((rest & jnp.uint32(0xFFFF)) == 0)


def _pack_bf16_pairs(values: jax.Array) -> PackedWeight:
    """float32 values [..., in, out] (each exactly two bfloat16) as [..., tiles, blocks * 32, 16, 2]
    bfloat16: per tile of 16 columns and block of 32 input rows, one 1 KB AMX operand of the high
    halves and one of the low halves, input rows 2i and 2i + 1 side by side for each column."""
    *lead, k, n = values.shape
    tiles, nd, depth = -(-n // AMX_TILE), len(lead), -(-k // BF16_DEPTH) * BF16_DEPTH
    high, rest = _halves(values)
    parts = jnp.stack([high >> 16, rest >> 16], axis=nd).astype(jnp.uint16)  # [..., 2, k, n]
    parts = jnp.pad(parts, [(0, 0)] * (nd + 1) + [(0, depth - k), (0, tiles * AMX_TILE - n)])
    parts = parts.reshape(*lead, 2, depth // BF16_DEPTH, BF16_DEPTH // 2, 2, tiles, AMX_TILE)
    # [..., half, block, pair, row of pair, tile, column] -> [..., tile, block, half, pair, column, row]
    v = parts.transpose(*range(nd), nd + 4, nd + 1, nd, nd + 2, nd + 5, nd + 3)
    v = jax.lax.bitcast_convert_type(v.reshape(*lead, tiles, depth, AMX_TILE, 2), jnp.bfloat16)
    return PackedWeight(values=v, scales=None, in_features=k, out_features=n, amx=True)


def _divide(x: jax.Array, d: int) -> jax.Array:
    """x / d, exactly where x is d times a float32: XLA:CPU's division is not correctly rounded
    (a float16 scale times 15, divided by 15, came back 1 ulp off in most cases)."""
    q = x / d
    for direction in (jnp.inf, -jnp.inf):
        near = q
        for _ in range(2):
            near = jnp.nextafter(near, jnp.asarray(direction, q.dtype))
            q = jnp.where((q * d != x) & (near * d == x), near, q)
    return q


def _blocks(values: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """float32 values [..., in, out] in blocks of 32 inputs per column, as BLOCK_FORMATS[fmt] cuts
    them: (values [..., blocks, 32, out], the inputs padded; integers (not yet rounded);
    scales and offsets [..., blocks, out])."""
    levels, with_offset = BLOCK_FORMATS[fmt]
    *lead, k, n = values.shape
    depth = -(-k // BF16_DEPTH) * BF16_DEPTH
    # padded with the last input's weights: the last block's range stays its own (x is zero there)
    v = jnp.pad(values.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, depth - k), (0, 0)], mode="edge")
    v = v.reshape(*lead, depth // BF16_DEPTH, BF16_DEPTH, n)
    if with_offset:
        offsets = jnp.min(v, axis=-2)
        scales = _divide(jnp.max(v, axis=-2) - offsets, levels)
    else:
        offsets = jnp.zeros((*v.shape[:-2], n), jnp.float32)
        scales = _divide(jnp.max(jnp.abs(v), axis=-2), levels)
    integers = (v - offsets[..., None, :]) / jnp.where(scales > 0, scales, 1)[..., None, :]
    return v, integers, scales, offsets


def in_blocks_exactly(values: jax.Array, fmt: str) -> jax.Array:
    """Whether every value is finite and exactly integer * scale + offset in format `fmt` (see
    BLOCK_FORMATS), with no rounding in that product or sum: then the AMX kernel reads the integers
    as bfloat16, about half the bytes of float32, and x . w = scale * (x . integers) + offset * sum(x)
    per block, each product exact. True of dequantized Q8_0 (blocks8) and Q4_1 (blocks4) GGUF
    tensors, blocked along the inputs."""
    v, integers, scales, offsets = _blocks(values, fmt)
    levels, with_offset = BLOCK_FORMATS[fmt]
    q = jnp.round(integers)
    low = -levels if not with_offset else 0
    product = q * scales[..., None, :]
    total = product + offsets[..., None, :]
    # exact: scales of 16 significant bits or fewer (times 8-bit integers: 24 bits), and the sum's
    # rounding error (two-sum) zero
    scale_bits = jax.lax.bitcast_convert_type(scales, jnp.uint32) & jnp.uint32(0xFF)
    back = total - product
    error = (product - (total - back)) + (offsets[..., None, :] - back)
    return (
        jnp.all(jnp.isfinite(values))
        & jnp.all((q >= low) & (q <= levels))
        & jnp.all(scale_bits == 0)
        & jnp.all(total == v)
        & jnp.all(error == 0)
    )


def pack_blocks(values: jax.Array, fmt: str) -> PackedWeight:
    """float32 values [..., in, out] that are `in_blocks_exactly(values, fmt)` (the caller checks:
    here they may be traced) as bfloat16 integers [..., tiles, blocks * 16, 16, 2] (per tile of 16
    columns and block of 32 inputs one 1 KB AMX operand, input rows 2i and 2i + 1 side by side for
    each column) and float32 scales and offsets [..., tiles, blocks, 2, 16]."""
    *lead, k, n = values.shape
    tiles, nd = -(-n // AMX_TILE), len(lead)
    _, integers, scales, offsets = _blocks(values, fmt)
    blocks = integers.shape[-3]
    pad = [(0, 0)] * (nd + 2) + [(0, tiles * AMX_TILE - n)]
    q = jnp.pad(jnp.round(integers), pad).astype(jnp.bfloat16)
    q = q.reshape(*lead, blocks, BF16_DEPTH // 2, 2, tiles, AMX_TILE)
    # [..., block, pair, row of pair, tile, column] -> [..., tile, block, pair, column, row]
    q = q.transpose(*range(nd), nd + 3, nd, nd + 1, nd + 4, nd + 2)
    s = jnp.pad(jnp.stack([scales, offsets], axis=-2), pad)  # [..., blocks, 2, columns]
    s = s.reshape(*lead, blocks, 2, tiles, AMX_TILE).transpose(*range(nd), nd + 2, nd, nd + 1, nd + 3)
    return PackedWeight(
        values=q.reshape(*lead, tiles, blocks * BF16_DEPTH // 2, AMX_TILE, 2),
        scales=s,
        in_features=k,
        out_features=n,
        amx=True,
    )


def _pack_amx(values: jax.Array, scales: jax.Array) -> PackedWeight:
    """int8 values [..., in, out] as [..., tiles, quads, 16, 4]: a tile's 64 input rows are one
    1 KB AMX operand, four input rows side by side for each column."""
    *lead, k, n = values.shape
    tiles, nd, depth = -(-n // AMX_TILE), len(lead), -(-k // AMX_DEPTH) * AMX_DEPTH
    pad = [(0, 0)] * nd
    v = jnp.pad(values, [*pad, (0, depth - k), (0, tiles * AMX_TILE - n)])
    v = v.reshape(*lead, depth // 4, 4, tiles, AMX_TILE).transpose(*range(nd), nd + 2, nd, nd + 3, nd + 1)
    s = jnp.pad(scales.reshape(*lead, n).astype(jnp.float32), [*pad, (0, tiles * AMX_TILE - n)])
    return PackedWeight(values=v, scales=s, in_features=k, out_features=n, amx=True)


def matmul(x: jax.Array, w: PackedWeight, isa: str | None = None, counts: jax.Array | None = None) -> jax.Array:
    """x[..., in] @ w as float32 [..., out]. With int8 weights x is quantized per row to int16, with
    W8A8 weights to int8 (as XLA's W8A8 path does, serving.models.quantization.int8_dot). The
    handler follows the instruction set the kernels run with (library.status().isa; `isa` "avx2"
    picks the AVX2 handlers on an AVX-512 CPU too, for tests), or is the AMX kernel for weights
    packed for it (`w.amx`).

    `counts` (int32 [G], G dividing x's rows M): the rows that count. x's rows, flattened, fall in G
    groups of M / G consecutive rows, and only each group's first counts[g] are computed (a
    prompt's padding past its true length, a decode row that is not active); the others come back
    as zeros. Default: all. The AMX kernels for int8w and float32 weights compute every row (their
    results there are not zeros, but no caller reads them); W8A8's takes the counts."""
    library.require()
    avx512 = (isa or library.status().isa) == "avx512"
    lead = x.shape[:-1]
    rows = x.reshape(-1, w.in_features).astype(jnp.float32)
    layer = jnp.zeros((), jnp.int32) if w.layer is None else w.layer
    if counts is not None and (counts.size < 1 or rows.shape[0] % counts.size):
        raise ValueError(f"{counts.size} row counts do not split {rows.shape[0]} rows into equal groups")
    counted = jnp.full((1,), rows.shape[0], jnp.int32) if counts is None else counts.astype(jnp.int32).reshape(-1)
    result = jax.ShapeDtypeStruct((rows.shape[0], w.out_features), jnp.float32)
    if w.w8a8:
        target = W8A8_AMX_TARGET if w.amx else W8A8_TARGET if avx512 else W8A8_AVX2_TARGET
        out = jax.ffi.ffi_call(target, result)(rows, w.values, w.scales, w.sums, layer, counted)
    elif w.scales is None and w.amx:
        out = jax.ffi.ffi_call(F32_AMX_TARGET, result)(rows, w.values, layer)
    elif w.scales is None:
        out = jax.ffi.ffi_call(F32_TARGET, result)(rows, w.values, layer, counted)
    elif w.values.dtype == jnp.bfloat16:
        out = jax.ffi.ffi_call(F32_BLOCKS_AMX_TARGET, result)(rows, w.values, w.scales, layer)
    elif w.amx:
        out = jax.ffi.ffi_call(INT8_AMX_TARGET, result)(rows, w.values, w.scales, layer)
    else:
        target = INT8_TARGET if avx512 else INT8_AVX2_TARGET
        out = jax.ffi.ffi_call(target, result)(rows, w.values, w.scales, layer, counted)
    return out.reshape(*lead, w.out_features)
