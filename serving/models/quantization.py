"""int8 weight quantization as a transform over the params pytree.

Symmetric, per output channel: ``w[in, out] ~= values[in, out] * scales[1, out]``. The embedding
[vocab, embed] is quantized per row (``scales[vocab, 1]``), which serves both the token lookup and,
when tied, the LM head's per-vocab output channel. Dequantization happens inside the compiled
computation, so no float copy of a weight is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Params entries that are matmul weights ([..., in, out]); embeddings and norms stay in float.
MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")
EMBEDDING = "embed"
QUANTIZED = (*MATMUL_WEIGHTS, EMBEDDING)


def scale_axis(name: str) -> int:
    """The axis a weight's int8 scales reduce over: `in` for matmuls, `embed` for the embedding."""
    return -1 if name == EMBEDDING else -2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """int8 values with one float scale per output channel (the last axis)."""

    values: jax.Array  # int8 [..., in, out] (embedding: [vocab, embed])
    scales: jax.Array  # float32 [..., 1, out] (embedding: [vocab, 1])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


def quantize_int8_numpy(weight: Any, axis: int = -2) -> tuple[np.ndarray, np.ndarray]:
    """int8 values and float32 scales (reduced over `axis`, kept as size 1) of a weight, on the host."""
    w = np.asarray(weight, dtype=np.float32)
    absmax = np.max(np.abs(w), axis=axis, keepdims=True)
    scales = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    values = np.clip(np.rint(w / scales), -127, 127).astype(np.int8)
    return values, scales


def quantize_int8(weight: Any, axis: int = -2) -> QuantizedWeight:
    """Quantize a [..., in, out] weight symmetrically per output channel (or per row, axis=-1)."""
    values, scales = quantize_int8_numpy(weight, axis)
    return QuantizedWeight(values=jnp.asarray(values), scales=jnp.asarray(scales))


def quantize_params(params: dict) -> dict:
    """Return params with every matmul weight and the embedding replaced by a `QuantizedWeight`."""

    def visit(tree: dict) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = visit(value)
            elif key in QUANTIZED and not isinstance(value, QuantizedWeight):
                out[key] = quantize_int8(value, scale_axis(key))
            else:
                out[key] = value
        return out

    return visit(params)
