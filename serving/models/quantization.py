"""int8 weight quantization as a transform over the params pytree.

Symmetric, per output channel: ``w[in, out] ~= values[in, out] * scales[1, out]``. The embedding
[vocab, embed] is quantized per row (``scales[vocab, 1]``), which serves both the token lookup and,
when tied, the LM head's per-vocab output channel. Dequantization happens inside the compiled
computation, so no float copy of a weight is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serving.models.params import EMBEDDING, int8_entries

# Params entries quantized to int8: the matmul weights ([..., in, out]) and the embedding; the
# norms stay in float.
QUANTIZED = int8_entries("int8w")


def scale_axis(name: str) -> int:
    """The axis a weight's int8 scales reduce over: `in` for matmuls, `embed` for the embedding."""
    return -1 if name == EMBEDDING else -2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """int8 values with one float scale per output channel (the last axis).

    With `activations`, a matmul also quantizes its input per row (per token) to int8 and multiplies
    int8 x int8 into int32 (w8a8): several times faster than dequantizing the weight where the
    backend has fast int8 dot products (XLA:CPU does), at some cost in accuracy: a few outlier
    channels set each row's scale (in SmolLM2 one holds ~20x the row's RMS), leaving the others
    only a few of the 127 steps. On SmolLM2: perplexity +5.5% (sd 1.3%), top-1 agreement 87%, each
    result a draw that one-ulp changes upstream redraw (see tests/test_w8a8.py).
    """

    values: jax.Array  # int8 [..., in, out] (embedding: [vocab, embed])
    scales: jax.Array  # float32 [..., 1, out] (embedding: [vocab, 1])
    activations: bool = field(default=False, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


def quantize_int8_numpy(weight: Any, axis: int = -2) -> tuple[np.ndarray, np.ndarray]:
    """int8 values and float32 scales (reduced over `axis`, kept as size 1) of a weight, on the host:
    ``clip(rint(w / scale), -127, 127)`` with ``scale = max|w| / 127`` (1 where a channel is all
    zero). One float32 copy of the weight, worked on in place: each temporary of the plain formula
    was a fresh allocation of the weight's size, and first-touching those pages took most of the
    time (a [4096, 14336] bfloat16 weight: 1.23 s -> 0.13 s; 2.3x over a loader's run of
    tensors on two threads), where Llama 3.1 8B's int8w quantizes 14 GB of them at start-up."""
    w = np.array(weight, dtype=np.float32)  # a copy, never the caller's array
    absmax = np.maximum(w.max(axis=axis, keepdims=True), -w.min(axis=axis, keepdims=True))  # max |w|
    scales = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    np.divide(w, scales, out=w)
    np.rint(w, out=w)
    np.clip(w, -127, 127, out=w)
    return w.astype(np.int8), scales


def quantize_int8(weight: Any, axis: int = -2) -> QuantizedWeight:
    """Quantize a [..., in, out] weight symmetrically per output channel (or per row, axis=-1)."""
    values, scales = quantize_int8_numpy(weight, axis)
    return QuantizedWeight(values=jnp.asarray(values), scales=jnp.asarray(scales))


def quantize_params(params: dict, names: tuple[str, ...] = QUANTIZED) -> dict:
    """Return params with the float entries among `names` (by default every matmul weight and the
    embedding) replaced by a `QuantizedWeight`; entries already in int8 stay as they are."""

    def visit(tree: dict) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = visit(value)
            elif key in names and not isinstance(value, QuantizedWeight):
                out[key] = quantize_int8(value, scale_axis(key))
            else:
                out[key] = value
        return out

    return visit(params)


def int8_names(params: dict) -> tuple[str, ...]:
    """The params entries (top-level and per layer) held as `QuantizedWeight`s."""
    layers = params.get("layers", {})
    layer = layers[0] if isinstance(layers, list) else layers
    found = [k for k, v in {**params, **layer}.items() if isinstance(v, QuantizedWeight)]
    return tuple(sorted(found))


def with_int8_activations(params: dict) -> dict:
    """params whose int8 weights also quantize their matmul inputs (w8a8; see QuantizedWeight)."""
    return jax.tree.map(
        lambda w: replace(w, activations=True) if isinstance(w, QuantizedWeight) else w,
        params,
        is_leaf=lambda w: isinstance(w, QuantizedWeight),
    )


# Rows are padded to this many before an int8 dot: XLA:CPU's int8 matrix-vector path is several
# times slower than its small-matrix one, so a single row costs more than four.
MIN_INT8_ROWS = 4


def int8_dot(x: jax.Array, values: jax.Array, scales: jax.Array, transposed: bool = False) -> jax.Array:
    """x[..., in] @ values[in, out] * scales[out], x quantized per row to int8; a float32 result.

    `transposed`: values is [out, in] (a tied embedding used as the LM head).
    """
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width).astype(jnp.float32)
    count = rows.shape[0]
    if count < MIN_INT8_ROWS:
        rows = jnp.pad(rows, ((0, MIN_INT8_ROWS - count), (0, 0)))
    row_scales = jnp.maximum(jnp.max(jnp.abs(rows), axis=1, keepdims=True), 1e-30) / 127.0
    quantized = jnp.clip(jnp.round(rows / row_scales), -127, 127).astype(jnp.int8)
    contract = ((1,), (1,)) if transposed else ((1,), (0,))
    acc = jax.lax.dot_general(quantized, values, (contract, ((), ())), preferred_element_type=jnp.int32)
    out = acc.astype(jnp.float32) * row_scales * scales
    return out[:count].reshape(*lead, -1)
