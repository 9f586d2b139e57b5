"""int8 weight quantization as a transform over the params pytree.

Symmetric, per output channel: ``w[in, out] ~= values[in, out] * scales[out]``. Dequantization
happens inside the compiled matmul (`layers.matmul`), so no float copy of a weight is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Params entries that are matmul weights ([..., in, out]); embeddings and norms stay in float.
MATMUL_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """int8 values with one float scale per output channel (the last axis)."""

    values: jax.Array  # int8 [..., in, out]
    scales: jax.Array  # float32 [..., 1, out]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)


def quantize_int8_numpy(weight: Any) -> tuple[np.ndarray, np.ndarray]:
    """int8 values [..., in, out] and float32 scales [..., 1, out] of a weight, on the host."""
    w = np.asarray(weight, dtype=np.float32)
    absmax = np.max(np.abs(w), axis=-2, keepdims=True)
    scales = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
    values = np.clip(np.rint(w / scales), -127, 127).astype(np.int8)
    return values, scales


def quantize_int8(weight: Any) -> QuantizedWeight:
    """Quantize a [..., in, out] weight symmetrically per output channel."""
    values, scales = quantize_int8_numpy(weight)
    return QuantizedWeight(values=jnp.asarray(values), scales=jnp.asarray(scales))


def quantize_params(params: dict) -> dict:
    """Return params with every matmul weight replaced by a `QuantizedWeight`."""

    def visit(tree: dict) -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = visit(value)
            elif key in MATMUL_WEIGHTS and not isinstance(value, QuantizedWeight):
                out[key] = quantize_int8(value)
            else:
                out[key] = value
        return out

    return visit(params)
