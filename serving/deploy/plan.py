"""Capacity plan of a deployment: chips, mesh, HBM per chip, KV capacity and a decode roofline.

Checks that refuse a deployment before it reaches the cluster live here too: the topology must
fit the accelerator, the parallelism product must equal the chip count, the images' jax tags must
agree, and weights, KV cache and a step's temporaries must fit in the runtime's bytes_limit per
chip (serving.engine.memory), as MaxText would find out when it compiles.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from serving.config import ConfigError, ServingConfig, model_description
from serving.deploy.config import DeploymentConfig
from serving.deploy.errors import DeployError
from serving.engine.memory import kv_pool_pages, memory_use, shortfall
from serving.engine.partitioning import (
    DTYPE_BYTES,
    MESH_AXES,
    SCALE_DTYPE,
    Numerics,
    Placement,
    describe,
    placement,
)
from serving.lora.layout import stack_bytes
from serving.models.config import ModelConfig
from serving.models.params import LAYER_MATMULS


@dataclass(frozen=True)
class Plan:
    accelerator: str
    topology: str
    num_slices: int
    chips: int
    hosts: int
    mesh: dict[str, int]
    weight_format: str
    weight_bytes: float
    weight_bytes_per_chip: float
    slots: int
    max_target_length: int
    kv_format: str
    kv_bytes_per_token: float  # whole model, all layers and kv heads
    kv_heads_per_chip: int
    page_size: int  # positions per page of the KV cache's pool (prefix_block_size)
    num_pages: int  # pages of the pool, the scratch page included
    pages_per_chip: int  # the pages a chip holds (cache_batch's split of the pool)
    kv_bytes_per_chip: float
    kv_capacity_tokens: int  # (num_pages - 1) x page_size: positions the pool holds for sequences
    kv_tokens_that_fit_per_chip: int  # cache positions the bytes_limit left would hold
    hbm_bytes_per_chip: float  # physical HBM
    bytes_limit_per_chip: float  # what the runtime lets a program use
    temporaries_bytes_per_chip: float  # estimate: one prefill call's layer, logits
    lora_bytes_per_chip: float  # LoRA adapters' device slots: max_loras x max_lora_rank, split as the weights
    headroom_bytes_per_chip: float  # bytes_limit - (weights + KV cache + temporaries)
    step_time_s: float
    bound: str  # "memory" or "compute"
    tokens_per_s: float  # per replica, all slots decoding at full context
    replicas: int  # LeaderWorkerSet groups: the totals below are per replica times this
    shardings: dict[str, str]  # weight family / "kv cache" -> the mesh axes of each dimension
    replication: list[str]  # where a dimension does not divide over its axes and is replicated

    def to_dict(self) -> dict:
        return asdict(self)


def numerics(serving: ServingConfig) -> Numerics:
    return Numerics.of(serving)


def weight_bytes(model: ModelConfig, serving: ServingConfig) -> float:
    """Bytes of all weights (int8 matmuls and embedding with float32 per-channel or per-row scales,
    norms in weight_dtype; without quantization everything in weight_dtype), from the leaves the
    engine places."""
    where = placement(model, numerics(serving), dict.fromkeys(MESH_AXES, 1), 1, 1)
    return float(sum(leaf.nbytes for leaf in where.params.values()))


def kv_bytes_per_token(model: ModelConfig, serving: ServingConfig, kv_heads: int) -> float:
    """KV bytes for one token over all layers, for `kv_heads` heads (int8 values and a float32
    scale per head, or one per token with kv_quant_axis=heads_and_dkv)."""
    if not serving.quantize_kvcache:
        return float(model.num_layers * 2 * kv_heads * model.head_dim * DTYPE_BYTES[serving.dtype])
    scales = kv_heads if serving.kv_quant_axis != "heads_and_dkv" else 1
    values = kv_heads * model.head_dim * DTYPE_BYTES["int8"]
    return float(model.num_layers * 2 * (values + scales * DTYPE_BYTES[SCALE_DTYPE]))


# The weight families `plan` shows, each by one of its leaves.
FAMILIES = {
    "embed [vocab, embed]": ("embed",),
    "wq [embed, heads]": ("layers", "wq"),
    "wk, wv [embed, kv_heads]": ("layers", "wk"),
    "wo [heads, embed]": ("layers", "wo"),
    "w_gate, w_up [embed, mlp]": ("layers", "w_gate"),
    "w_down [mlp, embed]": ("layers", "w_down"),
    "lm_head [embed, vocab]": ("lm_head",),
}


def _shardings(where: Placement) -> dict[str, str]:
    out = {}
    for family, path in FAMILIES.items():
        leaf = where.params.get(path) or where.params.get((*path, "values"))
        if leaf is not None:
            out[family] = describe(leaf.spec[-2:])
    k = where.cache[("k",)]
    out["kv cache [pages, page_size, kv_heads, head_dim]"] = describe(k.spec[1:])
    return out


def make_plan(cfg: DeploymentConfig) -> Plan:
    """The plan, or a DeployError naming the field that makes the deployment impossible."""
    slice_ = cfg.tpu.slice()
    versions = cfg.images.jax_versions()
    if len(set(versions.values())) > 1:
        shown = ", ".join(f"images.{k}=jax-{v}" for k, v in versions.items())
        raise DeployError(f"images: jax tags differ ({shown}); all images must run the same jax version")
    serving = cfg.serving_config()
    chips = slice_.chips * cfg.tpu.num_slices
    try:
        model = model_description(serving)
        sizes = serving.parallelism(chips)
    except ConfigError as exc:
        raise DeployError(str(exc)) from None
    mesh = dict(zip(MESH_AXES, sizes, strict=True))
    product = mesh["fsdp"] * mesh["autoregressive"] * mesh["tensor"]
    if product != chips:
        raise DeployError(
            f"serving: ici_fsdp_parallelism x ici_autoregressive_parallelism x ici_tensor_parallelism = "
            f"{mesh['fsdp']} x {mesh['autoregressive']} x {mesh['tensor']} = {product}, but "
            f"{cfg.tpu.accelerator} {cfg.tpu.topology} x {cfg.tpu.num_slices} slice(s) has {chips} chips"
        )
    slots = serving.per_device_batch_size * chips
    if slots < 1 or slots != int(slots):
        raise DeployError(
            f"serving.per_device_batch_size: {serving.per_device_batch_size} x {chips} chips is not a whole number of slots"
        )
    slots = int(slots)
    # The engine's own placement (serving.engine.partitioning): bytes per chip from its specs, the
    # KV cache a pool of pages as the engine sizes it.
    page_size = serving.prefix_block_size
    num_pages = kv_pool_pages(serving, model, numerics(serving), mesh, slots)
    where = placement(model, numerics(serving), mesh, num_pages, page_size)
    weights = float(sum(leaf.nbytes for leaf in where.params.values()))
    weights_per_chip = float(where.params_bytes_per_chip())
    kv_per_chip = float(where.cache_bytes_per_chip())
    k = where.cache[("k",)]
    kv_heads_per_chip = model.num_kv_heads // math.prod(mesh[a] for a in k.spec[3])
    pages_per_chip = num_pages // math.prod(mesh[a] for a in k.spec[1])
    kv_token_chip = kv_per_chip / (pages_per_chip * page_size)
    hbm = slice_.accelerator.hbm_bytes
    limit = slice_.accelerator.bytes_limit
    prefill_tokens = serving.prefill_batch_tokens or serving.max_prefill_predict_length
    use = memory_use(model, where, serving.dtype, prefill_tokens, slots)
    refusal = shortfall(use, limit, f"{cfg.model_name} on {cfg.tpu.accelerator} {cfg.tpu.topology}")
    if refusal:
        raise DeployError(_does_not_fit(refusal, serving, where, use, limit, chips))
    lora = _lora_bytes(model, serving, where)
    if use.total + lora > limit:
        raise DeployError(
            f"serving.max_loras: {serving.lora.max_loras} adapter slots of rank {serving.max_lora_rank} take "
            f"{lora / 1e9:.2f} GB per chip, more than the {(limit - use.total) / 1e9:.2f} GB the weights, KV cache "
            "and temporaries leave"
        )
    memory_time = (weights_per_chip + kv_per_chip) / slice_.accelerator.hbm_bandwidth
    compute_time = 2 * model.num_params * slots / (chips * slice_.accelerator.bf16_flops)
    step = max(memory_time, compute_time)
    return Plan(
        accelerator=cfg.tpu.accelerator,
        topology=cfg.tpu.topology,
        num_slices=cfg.tpu.num_slices,
        chips=chips,
        hosts=slice_.hosts * cfg.tpu.num_slices,
        mesh=mesh,
        weight_format="int8" if serving.quantization == "int8" else serving.weight_dtype,
        weight_bytes=weights,
        weight_bytes_per_chip=weights_per_chip,
        slots=slots,
        max_target_length=serving.max_target_length,
        kv_format="int8" if serving.quantize_kvcache else serving.dtype,
        kv_bytes_per_token=kv_bytes_per_token(model, serving, model.num_kv_heads),
        kv_heads_per_chip=kv_heads_per_chip,
        page_size=page_size,
        num_pages=num_pages,
        pages_per_chip=pages_per_chip,
        kv_bytes_per_chip=kv_per_chip,
        kv_capacity_tokens=(num_pages - 1) * page_size,
        kv_tokens_that_fit_per_chip=int((limit - weights_per_chip - use.temporaries - lora) // kv_token_chip),
        hbm_bytes_per_chip=hbm,
        bytes_limit_per_chip=float(limit),
        temporaries_bytes_per_chip=float(use.temporaries),
        lora_bytes_per_chip=float(lora),
        headroom_bytes_per_chip=float(limit - use.total - lora),
        step_time_s=step,
        bound="memory" if memory_time >= compute_time else "compute",
        tokens_per_s=slots / step,
        replicas=cfg.replicas,
        shardings=_shardings(where),
        replication=list(where.notes),
    )


def _lora_bytes(model: ModelConfig, serving: ServingConfig, where: Placement) -> int:
    """Bytes per chip of the stacked LoRA adapters (serving.lora.layout) in the compute dtype, each
    matmul's a split as its weight's input dimension and b as its output (serving.lora.stack)."""
    lora = serving.lora
    if not lora.enabled:
        return 0
    splits = {}
    for name in LAYER_MATMULS:
        layers, fan_in, fan_out = where.weight_spec(name)
        split = [math.prod(where.axes[a] for a in (*layers, *dim)) for dim in (fan_in, fan_out)]
        splits[name] = (split[0], split[1])
    return stack_bytes(model, lora.max_loras, lora.max_lora_rank, DTYPE_BYTES[serving.dtype], splits)


def _does_not_fit(
    refusal: str, serving: ServingConfig, where: Placement, use, limit: int, chips: int
) -> str:
    """The refusal: the figures, how many slots (or KV bytes) would fit, and where a dimension is
    replicated."""
    room = limit - use.params - use.temporaries
    slots = serving.per_device_batch_size * chips
    fitting = int(slots * room / use.kv_cache) if room > 0 and use.kv_cache else 0
    if fitting:
        advice = (
            f"{fitting} slots of {serving.max_target_length} tokens would fit "
            f"(per_device_batch_size <= {fitting / chips:g}, not {serving.per_device_batch_size:g}), or a KV "
            f"pool of kv_cache_bytes_per_chip <= {room:.0f} shared by the slots as they grow"
        )
    else:
        advice = "the weights alone do not fit"
    replicated = f"; replicated: {'; '.join(where.notes)}" if where.notes else ""
    return f"{refusal}; {advice}{replicated}"


def format_plan(plan: Plan) -> str:
    """A human-readable table."""
    gb = 1e9
    rows = [
        ("slice", f"{plan.accelerator} {plan.topology} x {plan.num_slices}"),
        ("chips / hosts", f"{plan.chips} / {plan.hosts}"),
        (
            "mesh (fsdp, autoregressive, tensor)",
            f"{plan.mesh['fsdp']}, {plan.mesh['autoregressive']}, {plan.mesh['tensor']}",
        ),
        (
            "weights",
            f"{plan.weight_format}: {plan.weight_bytes / gb:.2f} GB total, {plan.weight_bytes_per_chip / gb:.2f} GB per chip",
        ),
        ("decode slots, max_target_length", f"{plan.slots}, {plan.max_target_length}"),
        (
            "KV cache (paged)",
            f"{plan.kv_format}: {plan.kv_bytes_per_token / 1e3:.1f} kB per token; {plan.num_pages} pages of "
            f"{plan.page_size} positions ({plan.kv_capacity_tokens} tokens for sequences); per chip "
            f"{plan.pages_per_chip} pages ({plan.pages_per_chip * plan.page_size} tokens) of "
            f"{plan.kv_heads_per_chip} kv head(s), {plan.kv_bytes_per_chip / gb:.2f} GB",
        ),
        ("temporaries (estimate)", f"{plan.temporaries_bytes_per_chip / gb:.2f} GB per chip"),
        *((("LoRA adapter slots", f"{plan.lora_bytes_per_chip / gb:.3f} GB per chip"),) if plan.lora_bytes_per_chip else ()),
        (
            "memory per chip",
            f"{(plan.bytes_limit_per_chip - plan.headroom_bytes_per_chip) / gb:.2f} GB of the bytes_limit "
            f"{plan.bytes_limit_per_chip / gb:.2f} GB ({plan.hbm_bytes_per_chip / 2**30:.0f} GiB HBM), "
            f"headroom {plan.headroom_bytes_per_chip / gb:.2f} GB",
        ),
        (
            "KV tokens that fit",
            f"{plan.kv_tokens_that_fit_per_chip} in what the weights, temporaries and adapters leave "
            f"({plan.kv_tokens_that_fit_per_chip // plan.max_target_length} slots of {plan.max_target_length})",
        ),
        ("decode step (roofline)", f"{plan.step_time_s * 1e3:.2f} ms, {plan.bound}-bound"),
        ("decode throughput (roofline)", f"{plan.tokens_per_s:.0f} tokens/s per replica"),
        (
            f"{plan.replicas} replica(s)",
            f"{plan.chips * plan.replicas} chips, {plan.slots * plan.replicas} slots, "
            f"{plan.tokens_per_s * plan.replicas:.0f} tokens/s in all at that batch",
        ),
        *((f"sharding: {family}", axes) for family, axes in plan.shardings.items()),
        *(("replicated", note) for note in plan.replication),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
