"""The stacked adapters' shapes and bytes, without JAX (`pathserve deploy plan` counts them on a
laptop): per layer matmul, a [layers, max_loras + 1, in, max_lora_rank] and
b [layers, max_loras + 1, max_lora_rank, out] (slot 0: the base model's zeros)."""

from __future__ import annotations

import math

from serving.models.config import ModelConfig
from serving.models.params import LAYER_MATMULS, param_shapes


def stack_shapes(cfg: ModelConfig, max_loras: int, max_rank: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """name -> (a's shape, b's shape) of the stacked adapters."""
    shapes = param_shapes(cfg)
    slots = max_loras + 1
    return {
        name: ((cfg.num_layers, slots, shapes[name][0], max_rank), (cfg.num_layers, slots, max_rank, shapes[name][1]))
        for name in LAYER_MATMULS
    }


def stack_bytes(
    cfg: ModelConfig, max_loras: int, max_rank: int, dtype_bytes: int, splits: dict[str, tuple[int, int]] | None = None
) -> int:
    """Device bytes of the stacked adapters, per chip when `splits` says over how many chips each
    matmul's a and b are split (their base weight's input and output splits; serving.lora.stack)."""
    splits = splits or {}
    total = 0
    for name, (a, b) in stack_shapes(cfg, max_loras, max_rank).items():
        split_a, split_b = splits.get(name, (1, 1))
        total += math.prod(a) // split_a + math.prod(b) // split_b
    return total * dtype_bytes
