"""Weights as the compiled steps read them: matmul weights packed for the CPU kernels
(serving.kernels.cpu_matmul) where they run, layers unstacked when scan_layers=false.

The engine and the single-request generator share this, so `pathserve generate` and `pathserve
serve` compute the same way.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from serving.config import ConfigError, ServingConfig
from serving.kernels import cpu_matmul, library
from serving.models.llama import FUSED, unstack_layers
from serving.models.quantization import EMBEDDING, MATMUL_WEIGHTS, QuantizedWeight

log = logging.getLogger(__name__)


def use_cpu_kernels(cfg: ServingConfig, devices: list) -> bool:
    """Whether matmuls and decode attention run through the CPU kernels (`cpu_kernels`); logs why
    not."""
    if cfg.cpu_kernels == "off" or cfg.quantize_activations:
        return False
    if cfg.quantization != "int8" and cfg.weight_dtype != "float32":
        reason = f"they take float32 or int8 weights, not {cfg.weight_dtype}"
    elif len(devices) != 1 or devices[0].platform != "cpu":
        reason = f"they run on one CPU device, not {len(devices)} {devices[0].platform} device(s)"
    else:
        status = library.status()
        if status.available:
            log.info("matmuls run through the CPU kernels (%s)", status.detail)
            return True
        reason = status.detail
    if cfg.cpu_kernels == "on":
        raise ConfigError(f"cpu_kernels=on, but the CPU kernels cannot be used: {reason}")
    log.info("matmuls use XLA's dot; the CPU kernels are not used: %s", reason)
    return False


def _kernel_operands(value) -> tuple[jax.Array, jax.Array | None] | None:
    """(values [..., in, out], per-output scales or None) of a float32 or weight-only int8 matmul
    weight; None for a weight the kernels do not take (bfloat16, w8a8)."""
    if isinstance(value, QuantizedWeight):
        return None if value.activations else (value.values, value.scales[..., 0, :])
    return (value, None) if value.dtype == jnp.float32 else None


def pack_for_cpu_kernels(params: dict) -> dict:
    """params with every float32 and weight-only int8 matmul weight packed for the CPU kernels,
    the projections that share an input fused (llama.FUSED: q, k, v; gate, up).

    A tied embedding is also packed, transposed, as `lm_head`: the embedding stays for the token
    lookup, so the head costs one more copy of the table.
    """

    def fused(parts: list):
        """One packed weight for matmuls of the same input: fewer, larger kernel calls."""
        operands = [_kernel_operands(p) for p in parts]
        if any(o is None for o in operands) or len({o[1] is None for o in operands}) != 1:
            return None
        values = jnp.concatenate([v for v, _ in operands], axis=-1)
        scales = None if operands[0][1] is None else jnp.concatenate([s for _, s in operands], axis=-1)
        return cpu_matmul.pack(values, scales)

    def visit(tree: dict) -> dict:
        out = {}
        for name, members in FUSED.items():
            if all(m in tree for m in members) and (p := fused([tree[m] for m in members])) is not None:
                out[name] = p
        done = {m for name in out for m in FUSED[name]}
        for key, value in tree.items():
            if key in done:
                continue
            if isinstance(value, dict):
                out[key] = visit(value)
            elif key in MATMUL_WEIGHTS and (operands := _kernel_operands(value)) is not None:
                out[key] = cpu_matmul.pack(*operands)
            else:
                out[key] = value
        return out

    result = visit(params)
    embed = params.get(EMBEDDING)
    if "lm_head" not in params and embed is not None:
        # The table is [vocab, embed] with one scale per row (token): the head's output columns.
        if isinstance(embed, QuantizedWeight):
            head = None if embed.activations else cpu_matmul.pack(embed.values.T, embed.scales[:, 0])
        else:
            head = cpu_matmul.pack(embed.T) if embed.dtype == jnp.float32 else None
        if head is not None:
            result["lm_head"] = head
    return result


def prepare(params: dict, cfg: ServingConfig, cpu_kernels: bool) -> dict:
    """params (already placed) packed and unstacked as configured."""
    if cpu_kernels:
        params = jax.jit(pack_for_cpu_kernels)(params)
    if not cfg.scan_layers:
        params = jax.jit(unstack_layers)(params)
    return params
