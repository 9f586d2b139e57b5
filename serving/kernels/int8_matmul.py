"""Weight-only int8 matmul for TPU (Pallas): x @ (values * scales), each int8 weight block read
once from HBM into VMEM, dequantized there (to x's dtype, the MXU's bfloat16 on a TPU) and
multiplied, the scales applied to the float32 sum at the end.

Why: a decode step of a small batch reads every weight once and does little else, so its speed is
the rate at which the weights stream in. XLA's int8w matmul (the convert fused into the dot's
operand, serving.models.layers.matmul) read 1.24 GB a token of the 1B shape at batch 1 at 509 GB/s
on a v5e, where its bfloat16 weights (2.47 GB) streamed at 665 GB/s and W8A8's int8 dots at 611:
the int8 bytes, half of bfloat16's, should take about half the time.

The layout of a call: x [M, K] (M rows padded to whole sublane tiles inside), values [K, N] int8
or a stack [layers, K, N] with the layer's index (scalar-prefetched, so that a layer loop's weight
is read in place from its stack, never sliced out and copied), scales [(layers,) 1, N] float32.
The grid walks N in blocks of `block_n` ("parallel") and, within each, K in blocks of `block_k`
("arbitrary": the float32 sum of a column block is carried in VMEM across them); Pallas copies
the next weight block from HBM while the last one is multiplied. Shapes whose K or N no block
size divides are not served (`blocks` says None): the caller keeps XLA's matmul for them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Block sides tried, largest first: an int8 block of block_k x block_n bytes, at most BLOCK_BYTES
# (a few MiB keeps each copy long enough to stream at HBM's rate), and everything a step holds in
# VMEM (`vmem_bytes`) within VMEM_BUDGET, under a v5e's default scoped VMEM (16 MiB).
BLOCK_SIDES = (2048, 1024, 512, 256, 128)
BLOCK_BYTES = 2 << 20
VMEM_BUDGET = 12 << 20
MAX_ROWS = 256  # larger calls (a prefill's) are the MXU's work, not the weights': XLA's matmul


def vmem_bytes(rows: int, block_k: int, block_n: int, x_bytes: int = 2, out_bytes: int = 2) -> int:
    """What a step holds in VMEM: x's and the weight's blocks (two each: the next one copies in
    while this one computes), the dequantized weight (x's dtype), the output's blocks (two), the
    float32 sum and the dot's float32 result, rows padded to whole sublane tiles."""
    rows = -(-rows // 16) * 16
    return (
        2 * rows * block_k * x_bytes + 2 * block_k * block_n + block_k * block_n * x_bytes
        + 2 * rows * block_n * out_bytes + 2 * rows * block_n * 4
    )


def blocks(k: int, n: int, rows: int = 1, x_bytes: int = 2, out_bytes: int = 2) -> tuple[int, int] | None:
    """(block_k, block_n) for a [k, n] int8 weight and `rows` rows of x (`x_bytes` a value; the
    output's `out_bytes`), or None where no block side divides k or n (int8 tiles are 32 x 128 on
    a TPU: every side here is a multiple of 128), none fits VMEM_BUDGET, or the rows exceed
    MAX_ROWS."""
    if rows > MAX_ROWS:
        return None
    for block_n in (b for b in BLOCK_SIDES if n % b == 0):
        for block_k in (b for b in BLOCK_SIDES if k % b == 0 and b * block_n <= BLOCK_BYTES):
            if vmem_bytes(rows, block_k, block_n, x_bytes, out_bytes) <= VMEM_BUDGET:
                return block_k, block_n
    return None


def _kernel(layer_ref, x_ref, w_ref, s_ref, o_ref, acc_ref, *, transposed: bool):
    """One (column block, row block of K) step: acc += x_block @ dequantized w_block (its
    transpose: w_block [block_n, block_k]); the last K block writes acc x scales."""
    del layer_ref  # read by the index maps
    k = pl.program_id(1)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    x = x_ref[...]
    w = w_ref[...].astype(x.dtype)
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    acc_ref[...] += jax.lax.dot_general(x, w, (contract, ((), ())), preferred_element_type=jnp.float32)

    @pl.when(k == pl.num_programs(1) - 1)
    def _():
        o_ref[...] = (acc_ref[...] * s_ref[...]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("transposed", "out_dtype", "interpret"))
def int8_matmul(
    x: jax.Array, values: jax.Array, scales: jax.Array, layer: jax.Array | int = 0, *, transposed: bool = False,
    out_dtype=None, interpret: bool = False,
) -> jax.Array:
    """x [..., K] @ (values [K, N] int8 x scales [1, N]) in `out_dtype` (default x's: the sum and
    the scaling are float32 either way), or of layer `layer` of a stack values [layers, K, N],
    scales [layers, 1, N]; `transposed`: values [(layers,) N, K] (an embedding table [vocab,
    embed] as the LM head, whose logits are float32), scales still [(layers,) 1, N]. ValueError
    where `blocks` serves no such shape (check it first)."""
    lead, k = x.shape[:-1], x.shape[-1]
    stacked = values.ndim == 3
    if not stacked:
        values, scales = values[None], scales[None]
    n, k_w = values.shape[1:] if transposed else values.shape[:0:-1]
    if k_w != k or scales.shape[1:] != (1, n):
        raise ValueError(f"x [..., {k}] against values {values.shape[1:]} and scales {scales.shape[1:]}")
    rows = math.prod(lead)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    found = blocks(k, n, rows, x.dtype.itemsize, out_dtype.itemsize)
    if found is None:
        raise ValueError(f"no block of {BLOCK_SIDES} serves a [{k}, {n}] weight for {rows} rows")
    block_k, block_n = found
    tile = 16 if x.dtype == jnp.bfloat16 else 8  # whole sublane tiles of x's rows
    padded = -(-rows // tile) * tile
    flat = jnp.pad(x.reshape(rows, k), ((0, padded - rows), (0, 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(n // block_n, k // block_k),
        in_specs=[
            pl.BlockSpec((padded, block_k), lambda j, i, layer_ref: (0, i)),
            pl.BlockSpec((None, block_n, block_k), lambda j, i, layer_ref: (layer_ref[0], j, i)) if transposed
            else pl.BlockSpec((None, block_k, block_n), lambda j, i, layer_ref: (layer_ref[0], i, j)),
            pl.BlockSpec((None, 1, block_n), lambda j, i, layer_ref: (layer_ref[0], 0, j)),
        ],
        out_specs=pl.BlockSpec((padded, block_n), lambda j, i, layer_ref: (0, j)),
        scratch_shapes=[pltpu.VMEM((padded, block_n), jnp.float32)],
    )
    out = pl.pallas_call(
        functools.partial(_kernel, transposed=transposed),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((padded, n), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
    )(jnp.asarray(layer, jnp.int32).reshape(1), flat, values, scales.astype(jnp.float32))
    return out[:rows].reshape(*lead, n)


class Int8MatmulKernel:
    """`int8_matmul` as a backend's ops call it (serving.models.ops.TpuXlaOps' `int8_matmul`):
    the shapes `blocks` serves, in Pallas' interpret mode where asked (a CPU's tests)."""

    def __init__(self, interpret: bool = False):
        self.interpret = interpret

    def serves(self, x: jax.Array, values: jax.Array, transposed: bool = False, out_dtype=None) -> bool:
        rows = math.prod(x.shape[:-1])
        n, k = values.shape[-2:] if transposed else values.shape[:-3:-1]
        out_bytes = jnp.dtype(out_dtype or x.dtype).itemsize
        return k == x.shape[-1] and blocks(k, n, rows, x.dtype.itemsize, out_bytes) is not None

    def __call__(
        self, x: jax.Array, values: jax.Array, scales: jax.Array, layer: jax.Array | int = 0, transposed: bool = False,
        out_dtype=None,
    ) -> jax.Array:
        return int8_matmul(
            x, values, scales, layer, transposed=transposed, out_dtype=out_dtype, interpret=self.interpret
        )
