"""Accelerator memory per chip: what the params, the KV cache and a step's temporaries take, checked
against what the runtime gives (`bytes_limit`), by `pathserve deploy plan` and by `serve` alike.

MaxText applies no fraction of HBM: a recipe whose arrays do not fit fails to compile. So the
check is the placement's bytes per chip (serving.engine.partitioning) plus an estimate of the
largest temporaries of a step against the runtime's limit, and a refusal names the figures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from serving.engine.partitioning import DTYPE_BYTES, Numerics, Placement, placement
from serving.errors import ConfigError
from serving.models.config import ModelConfig

ACTIVATION_DTYPE_BYTES = DTYPE_BYTES
FLOAT32 = 4


@dataclass(frozen=True)
class MemoryUse:
    """Bytes on one chip."""

    params: int
    kv_cache: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.params + self.kv_cache + self.temporaries


def temporaries_per_chip(
    cfg: ModelConfig, where: Placement, dtype: str, prefill_tokens: int, slots: int
) -> int:
    """An estimate of a step's largest live temporaries on one chip: one layer of a prefill call of
    `prefill_tokens` tokens (its residual and normed input, q/k/v, the MLP's gate and up, and the
    float32 attention scores over the call's tokens), plus float32 logits of every slot. The
    model-parallel dimensions are divided as their weights are (heads, mlp, vocab)."""
    heads_ways = _ways(where, "wq", -1)
    mlp_ways = _ways(where, "w_gate", -1)
    vocab_ways = _ways(where, "lm_head", -1) if _leaf(where, "lm_head") in where.params else _ways(where, "embed", 0)
    act = ACTIVATION_DTYPE_BYTES[dtype]
    t, e, d = prefill_tokens, cfg.embed_dim, cfg.head_dim
    per_token = 2 * e + 2 * cfg.mlp_dim // mlp_ways + (cfg.num_heads + 2 * cfg.num_kv_heads) * d // heads_ways
    scores = t * t * max(1, cfg.num_heads // heads_ways) * FLOAT32
    logits = max(slots, 1) * (cfg.vocab_size // vocab_ways) * FLOAT32
    return t * per_token * act + scores + logits


def _leaf(where: Placement, name: str) -> tuple[str, ...]:
    """The params path of a weight: stacked or not, int8 (its values) or not."""
    for path in (("layers", name), ("layers", name, "values"), (name,), (name, "values")):
        if path in where.params:
            return path
    return (name,)


def _ways(where: Placement, name: str, dim: int) -> int:
    """Into how many pieces weight `name`'s dimension `dim` is split."""
    return max(1, math.prod(where.axes[a] for a in where.params[_leaf(where, name)].spec[dim]))


def page_bytes_per_chip(cfg: ModelConfig, numerics: Numerics, axes: Mapping[str, int], page_size: int) -> tuple[int, int]:
    """(bytes one page of the KV pool takes on each chip that holds it, every layer's keys and
    values and scales; into how many pieces the pool's pages are split over the mesh)."""
    chips = math.prod(axes.values())
    where = placement(cfg, numerics, axes, chips, page_size)  # pages divide over any split
    split = max(1, math.prod(axes[a] for a in where.cache[("k",)].spec[1]))
    return max(1, where.cache_bytes_per_chip() * split // chips), split


def default_pool_pages(slots: int, max_pages: int, chips: int) -> int:
    """The pool without kv_cache_bytes_per_chip: every slot's max_target_length at once and the
    scratch page, rounded up to a multiple of the chips (so any split of the pages divides it)."""
    return -(-(slots * max_pages + 1) // chips) * chips


def pool_pages(cfg: ModelConfig, numerics: Numerics, axes: Mapping[str, int], page_size: int, kv_bytes_per_chip: int) -> int:
    """Pages of a KV pool that takes `kv_bytes_per_chip` on each chip (the scratch page included),
    a multiple of the pieces the pages are split into."""
    per_page, split = page_bytes_per_chip(cfg, numerics, axes, page_size)
    return max(1, kv_bytes_per_chip // per_page) * split


def kv_pool_pages(config, cfg: ModelConfig, numerics: Numerics, axes: Mapping[str, int], slots: int) -> int:
    """The pages of the engine's KV pool for `config` (an EngineConfig or ServingConfig): MaxText's
    pagedattn_num_pages with attention=paged, else kv_cache_bytes_per_chip's worth, else every
    slot's max_target_length at once (`default_pool_pages`)."""
    if config.attention == "paged":
        return config.pagedattn_num_pages
    page = config.prefix_block_size
    if config.kv_cache_bytes_per_chip:
        return pool_pages(cfg, numerics, axes, page, config.kv_cache_bytes_per_chip)
    return default_pool_pages(slots, -(-config.max_target_length // page), math.prod(axes.values()))


def memory_use(cfg: ModelConfig, where: Placement, dtype: str, prefill_tokens: int, slots: int) -> MemoryUse:
    return MemoryUse(
        where.params_bytes_per_chip(),
        where.cache_bytes_per_chip(),
        temporaries_per_chip(cfg, where, dtype, prefill_tokens, slots),
    )


FLAGS_TO_CHANGE = (
    "quantization=int8, quantize_kvcache=true, a smaller max_target_length or per_device_batch_size, "
    "other ici_tensor_parallelism / ici_autoregressive_parallelism / ici_fsdp_parallelism, or more chips"
)


def shortfall(use: MemoryUse, bytes_limit: int, where: str) -> str | None:
    """None when `use` fits in `bytes_limit`, else the refusal: the figures and what to change."""
    if use.total <= bytes_limit:
        return None
    gb = 1e9
    return (
        f"{where} does not fit: params {use.params / gb:.2f} GB + KV cache {use.kv_cache / gb:.2f} GB + temporaries "
        f"{use.temporaries / gb:.2f} GB = {use.total / gb:.2f} GB per chip exceed its bytes_limit of "
        f"{bytes_limit / gb:.2f} GB by {(use.total - bytes_limit) / gb:.2f} GB; try {FLAGS_TO_CHANGE}"
    )


def device_limit(devices) -> int | None:
    """The smallest `memory_stats()["bytes_limit"]` the devices report (None: none reports one, as
    CPUs)."""
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # backends without memory stats raise or return None
            stats = None
        if (stats or {}).get("bytes_limit"):
            limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


COMPILED_FLAGS_TO_CHANGE = (
    "a smaller per_device_batch_size, max_target_length, prefill_chunk_size, prefill_batch_tokens, "
    "history_batch_tokens or max_prefill_predict_length, quantize_kvcache=true, quantization=int8w"
)


class PlanTooLarge(ConfigError):
    """A compiled memory plan over the devices' bytes_limit (the plan and the limit kept: start-up
    may size the serving profile's slots down to what fits, serving.launch)."""

    def __init__(self, message: str, plan, limit: int):
        super().__init__(message)
        self.plan, self.limit = plan, limit


def check_compiled(plan, bytes_limit: int, where: str) -> None:
    """A CompiledPlan (serving.engine.compiled_memory) against `bytes_limit`: ConfigError naming
    each figure and what to lower, before any weight is loaded."""
    if plan.total <= bytes_limit:
        return
    gb = 1e9
    raise PlanTooLarge(
        f"{where} does not fit: params and KV cache {plan.resident / gb:.2f} GB as the chip lays them out + the "
        f"compiled programs' temporaries {plan.programs[plan.largest] / gb:.2f} GB (the largest: {plan.largest}) = "
        f"{plan.total / gb:.2f} GB per chip exceed its bytes_limit of {bytes_limit / gb:.2f} GB by "
        f"{(plan.total - bytes_limit) / gb:.2f} GB; try {COMPILED_FLAGS_TO_CHANGE}",
        plan, bytes_limit,
    )


def check_devices(cfg: ModelConfig, where: Placement, dtype: str, prefill_tokens: int, slots: int, devices) -> None:
    """Before anything is allocated: the same sum as `deploy plan` against each live device's
    `memory_stats()["bytes_limit"]` (devices that report none, as CPUs, are not checked); a
    shortfall raises ConfigError naming the figures."""
    from serving.config import ConfigError

    use = memory_use(cfg, where, dtype, prefill_tokens, slots)
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # backends without memory stats raise or return None
            stats = None
        limit = (stats or {}).get("bytes_limit")
        if not limit:
            continue
        refusal = shortfall(use, int(limit), f"{device}")
        if refusal:
            raise ConfigError(refusal)
