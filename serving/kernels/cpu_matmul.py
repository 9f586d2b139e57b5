"""float32 and int8 weight matmuls on x86 CPUs through XLA FFI kernels (cpu_matmul.cc says why;
serving.kernels.library builds them)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from serving.kernels import library

F32_TARGET = "pathserve_f32_matmul"
INT8_TARGET = "pathserve_int8_matmul"
INT8_AMX_TARGET = "pathserve_int8_amx_matmul"
TILE = 64  # output columns per packed tile (kTile in the C++ source)
AMX_TILE = 16  # int8 on AMX: output columns per tile (kAmxCols)
AMX_DEPTH = 64  # int8 on AMX: input rows padded to a multiple of this (kAmxDepth)
AMX_MAX_DEPTH = 65536  # int8 on AMX: the most input rows whose int32 sums cannot overflow


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """A [..., in, out] matmul weight in the kernels' layout, 64 output columns per tile.

    float32: values [..., tiles, in, 64] and no scales. int8: values [..., tiles, pairs, 64, 2]
    (input rows paired) with per-output scales [..., tiles * 64]; or, with `amx`, values
    [..., tiles, quads, 16, 4] (16 columns per tile, input rows in fours, padded to a multiple of
    64) with scales [..., tiles * 16], for the AMX kernel. `in_features` and `out_features` are the
    sizes before padding.

    Stacked layers stay stacked inside a scan: `at_layer(i)` names the layer the kernel reads, where
    a slice would make XLA copy the weight out of the stack before every call.
    """

    values: jax.Array
    scales: jax.Array | None
    in_features: int = field(metadata={"static": True})
    out_features: int = field(metadata={"static": True})
    layer: jax.Array | None = None
    amx: bool = field(default=False, metadata={"static": True})

    def at_layer(self, index: jax.Array | int) -> PackedWeight:
        return replace(self, layer=jnp.asarray(index, jnp.int32))


def pack(values: jax.Array, scales: jax.Array | None = None, amx: bool | None = None) -> PackedWeight:
    """Pack a [..., in, out] weight (any leading axes, e.g. stacked layers): float32 values, or int8
    values with per-output `scales` [..., out]. Columns are padded to a multiple of 64 and, for
    int8, input rows to an even count. int8 weights take the AMX layout where `amx` (default:
    where the AMX kernel runs, `library.status().amx`)."""
    *lead, k, n = values.shape
    tiles, nd = -(-n // TILE), len(lead)
    pad = [(0, 0)] * nd
    if scales is not None and (library.status().amx if amx is None else amx) and k <= AMX_MAX_DEPTH:
        return _pack_amx(values, scales)
    if scales is None:
        v = jnp.pad(values.astype(jnp.float32), [*pad, (0, 0), (0, tiles * TILE - n)])
        v = v.reshape(*lead, k, tiles, TILE).transpose(*range(nd), nd + 1, nd, nd + 2)
        return PackedWeight(values=v, scales=None, in_features=k, out_features=n)
    pairs = -(-k // 2)
    v = jnp.pad(values, [*pad, (0, 2 * pairs - k), (0, tiles * TILE - n)])
    v = v.reshape(*lead, pairs, 2, tiles, TILE).transpose(*range(nd), nd + 2, nd, nd + 3, nd + 1)
    s = jnp.pad(scales.reshape(*lead, n).astype(jnp.float32), [*pad, (0, tiles * TILE - n)])
    return PackedWeight(values=v, scales=s, in_features=k, out_features=n)


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


def matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x[..., in] @ w as float32 [..., out]. With int8 weights x is quantized per row to int16."""
    library.require()
    lead = x.shape[:-1]
    rows = x.reshape(-1, w.in_features).astype(jnp.float32)
    layer = jnp.zeros((), jnp.int32) if w.layer is None else w.layer
    result = jax.ShapeDtypeStruct((rows.shape[0], w.out_features), jnp.float32)
    if w.scales is None:
        out = jax.ffi.ffi_call(F32_TARGET, result)(rows, w.values, layer)
    else:
        target = INT8_AMX_TARGET if w.amx else INT8_TARGET
        out = jax.ffi.ffi_call(target, result)(rows, w.values, w.scales, layer)
    return out.reshape(*lead, w.out_features)
