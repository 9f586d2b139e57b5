"""Weights as the compiled steps read them: matmul weights packed for the CPU kernels
(serving.kernels.cpu_matmul) where they run, layers unstacked when scan_layers=false.

The engine and the single-request generator share this, so `pathserve generate` and `pathserve
serve` compute the same way.
"""

from __future__ import annotations

import functools
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


def bf16_pair_weights(params: dict) -> frozenset[tuple[str, ...]]:
    """Key paths of the float32 matmul weights (and a float32 embedding, the tied head) whose
    values are each exactly two bfloat16 (`cpu_matmul.splits_exactly`): where AMX-BF16 runs, the
    kernels multiply those on AMX, exactly. Empty where it does not run.

    Decided on the concrete values, before packing is traced: the layout depends on the answer.
    """
    if not library.status().amx_bf16:
        return frozenset()
    candidates: dict[tuple[str, ...], jax.Array] = {}

    def visit(tree: dict, path: tuple[str, ...]) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                visit(value, (*path, key))
            elif key in (*MATMUL_WEIGHTS, EMBEDDING) and getattr(value, "dtype", None) == jnp.float32:
                candidates[(*path, key)] = value

    visit(params, ())
    exact = jax.device_get(
        jax.jit(lambda c: {p: cpu_matmul.splits_exactly(v) for p, v in c.items()})(candidates)
    )
    return frozenset(path for path, ok in exact.items() if ok)


def pack_for_cpu_kernels(params: dict, amx_f32: frozenset[tuple[str, ...]] = frozenset()) -> dict:
    """params with every float32 and weight-only int8 matmul weight packed for the CPU kernels,
    the projections that share an input fused (llama.FUSED: q, k, v; gate, up). float32 weights
    whose key paths are in `amx_f32` (see `bf16_pair_weights`) take the AMX layout.

    A tied embedding is also packed, transposed, as `lm_head`: the embedding stays for the token
    lookup, so the head costs one more copy of the table.
    """

    def pack(operands: tuple[jax.Array, jax.Array | None], paths: list[tuple[str, ...]]):
        values, scales = operands
        amx = None if scales is not None else all(p in amx_f32 for p in paths)
        return cpu_matmul.pack(values, scales, amx=amx)

    def fused(parts: list, paths: list[tuple[str, ...]]):
        """One packed weight for matmuls of the same input: fewer, larger kernel calls."""
        operands = [_kernel_operands(p) for p in parts]
        if any(o is None for o in operands) or len({o[1] is None for o in operands}) != 1:
            return None
        values = jnp.concatenate([v for v, _ in operands], axis=-1)
        scales = None if operands[0][1] is None else jnp.concatenate([s for _, s in operands], axis=-1)
        return pack((values, scales), paths)

    def visit(tree: dict, path: tuple[str, ...]) -> dict:
        out = {}
        for name, members in FUSED.items():
            paths = [(*path, m) for m in members]
            if (
                all(m in tree for m in members)
                and (p := fused([tree[m] for m in members], paths)) is not None
            ):
                out[name] = p
        done = {m for name in out for m in FUSED[name]}
        for key, value in tree.items():
            if key in done:
                continue
            if isinstance(value, dict):
                out[key] = visit(value, (*path, key))
            elif key in MATMUL_WEIGHTS and (operands := _kernel_operands(value)) is not None:
                out[key] = pack(operands, [(*path, key)])
            else:
                out[key] = value
        return out

    result = visit(params, ())
    embed = params.get(EMBEDDING)
    if "lm_head" not in params and embed is not None:
        # The table is [vocab, embed] with one scale per row (token): the head's output columns.
        if isinstance(embed, QuantizedWeight):
            head = None if embed.activations else cpu_matmul.pack(embed.values.T, embed.scales[:, 0])
        else:
            head = pack((embed.T, None), [(EMBEDDING,)]) if embed.dtype == jnp.float32 else None
        if head is not None:
            result["lm_head"] = head
    return result


def prepare(params: dict, cfg: ServingConfig, cpu_kernels: bool) -> dict:
    """params (already placed) packed and unstacked as configured."""
    if cpu_kernels:
        amx_f32 = bf16_pair_weights(params)
        if amx_f32:
            log.info(
                "float32 weights exact in two bfloat16 each run on AMX-BF16: %s",
                ", ".join("/".join(p) for p in sorted(amx_f32)),
            )
        params = jax.jit(functools.partial(pack_for_cpu_kernels, amx_f32=amx_f32))(params)
    if not cfg.scan_layers:
        params = jax.jit(unstack_layers)(params)
    return params
