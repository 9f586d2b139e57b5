"""Capacity plan of a deployment: chips, mesh, HBM per chip, KV capacity and a decode roofline.

Checks that refuse a deployment before it reaches the cluster live here too: the topology must
fit the accelerator, the parallelism product must equal the chip count, the images' jax tags must
agree, and weights plus KV cache must fit in HBM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from serving.config import ConfigError, ServingConfig, load_model_config
from serving.deploy.accelerators import tpu_slice
from serving.deploy.config import DeploymentConfig
from serving.deploy.errors import DeployError
from serving.models.config import ModelConfig

# Share of HBM we let weights and KV cache take; the rest is for activations and XLA's workspace.
HBM_USABLE_FRACTION = 0.9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SCALE_BYTES = 4  # float32 scales of int8 weights and int8 KV


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
    kv_bytes_per_chip: float
    kv_capacity_tokens: int  # slots x max_target_length
    kv_tokens_that_fit_per_chip: int
    hbm_bytes_per_chip: float
    hbm_usable_per_chip: float
    step_time_s: float
    bound: str  # "memory" or "compute"
    tokens_per_s: float  # per replica, all slots decoding at full context

    def to_dict(self) -> dict:
        return asdict(self)


def weight_bytes(model: ModelConfig, serving: ServingConfig) -> float:
    """Bytes of all weights: int8 matmuls and embedding with float32 per-channel (per-row) scales,
    norms in weight_dtype; without quantization everything in weight_dtype."""
    e, d, n = model.embed_dim, model.head_dim, model.num_layers
    dtype = DTYPE_BYTES[serving.weight_dtype]
    per_layer_in_out = [
        (e, model.num_heads * d),
        (e, model.num_kv_heads * d),
        (e, model.num_kv_heads * d),
        (model.num_heads * d, e),
        (e, model.mlp_dim),
        (e, model.mlp_dim),
        (model.mlp_dim, e),
    ]
    matmuls = [(i, o) for i, o in per_layer_in_out for _ in range(n)]
    if not model.tie_embeddings:
        matmuls.append((e, model.vocab_size))
    norms = (2 * n + 1) * e * dtype
    if serving.quantization == "int8":
        matmul_bytes = sum(i * o + o * SCALE_BYTES for i, o in matmuls)
        embed = model.vocab_size * (e + SCALE_BYTES)
    else:
        matmul_bytes = sum(i * o * dtype for i, o in matmuls)
        embed = model.vocab_size * e * dtype
    return float(matmul_bytes + embed + norms)


def kv_bytes_per_token(model: ModelConfig, serving: ServingConfig, kv_heads: int) -> float:
    """KV bytes for one token over all layers, for `kv_heads` heads."""
    if serving.quantize_kvcache:
        per_head = model.head_dim * 1 + SCALE_BYTES
    else:
        per_head = model.head_dim * DTYPE_BYTES[serving.dtype]
    return float(model.num_layers * 2 * kv_heads * per_head)


def make_plan(cfg: DeploymentConfig) -> Plan:
    """The plan, or a DeployError naming the field that makes the deployment impossible."""
    slice_ = tpu_slice(cfg.tpu.accelerator, cfg.tpu.topology)
    versions = cfg.images.jax_versions()
    if len(set(versions.values())) > 1:
        shown = ", ".join(f"images.{k}=jax-{v}" for k, v in versions.items())
        raise DeployError(f"images: jax tags differ ({shown}); all images must run the same jax version")
    serving = cfg.serving_config()
    try:
        model = load_model_config(cfg.model_name)
    except ConfigError as exc:
        raise DeployError(str(exc)) from None
    chips = slice_.chips * cfg.tpu.num_slices
    mesh = {
        "fsdp": serving.ici_fsdp_parallelism,
        "autoregressive": serving.ici_autoregressive_parallelism,
        "tensor": serving.ici_tensor_parallelism,
    }
    product = mesh["fsdp"] * mesh["autoregressive"] * mesh["tensor"]
    if product != chips:
        raise DeployError(
            f"serving: ici_fsdp_parallelism x ici_autoregressive_parallelism x ici_tensor_parallelism = "
            f"{mesh['fsdp']} x {mesh['autoregressive']} x {mesh['tensor']} = {product}, but "
            f"{cfg.tpu.accelerator} {cfg.tpu.topology} x {cfg.tpu.num_slices} slice(s) has {chips} chips"
        )
    tp = mesh["tensor"]
    if (
        model.num_heads % tp
        or (tp <= model.num_kv_heads and model.num_kv_heads % tp)
        or (tp > model.num_kv_heads and tp % model.num_kv_heads)
    ):
        raise DeployError(
            f"serving.ici_tensor_parallelism: {tp} does not divide {model.name}'s {model.num_heads} heads "
            f"and {model.num_kv_heads} kv heads evenly"
        )
    slots = serving.per_device_batch_size * chips
    if slots < 1 or slots != int(slots):
        raise DeployError(
            f"serving.per_device_batch_size: {serving.per_device_batch_size} x {chips} chips is not a whole number of slots"
        )
    slots = int(slots)
    if slots % mesh["autoregressive"]:
        raise DeployError(
            f"serving.ici_autoregressive_parallelism: {slots} slots do not split {mesh['autoregressive']} ways"
        )

    weights = weight_bytes(model, serving)
    weights_per_chip = weights / (tp * mesh["fsdp"])
    kv_heads_per_chip = max(1, model.num_kv_heads // tp)  # fewer kv heads than chips: replicated
    kv_token_chip = kv_bytes_per_token(model, serving, kv_heads_per_chip)
    slots_per_chip = slots // mesh["autoregressive"]
    kv_per_chip = slots_per_chip * serving.max_target_length * kv_token_chip
    hbm = slice_.accelerator.hbm_bytes
    usable = hbm * HBM_USABLE_FRACTION
    if weights_per_chip + kv_per_chip > usable:
        raise DeployError(
            f"{cfg.model_name} does not fit on {cfg.tpu.accelerator} {cfg.tpu.topology}: weights "
            f"{weights_per_chip / 1e9:.1f} GB + KV cache {kv_per_chip / 1e9:.1f} GB per chip exceed the usable "
            f"{usable / 1e9:.1f} GB of {hbm / 1e9:.0f} GB HBM; try serving.quantization=int8, "
            f"serving.quantize_kvcache=true, a smaller serving.max_target_length or "
            f"serving.per_device_batch_size, or a larger tpu.topology"
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
        kv_bytes_per_chip=kv_per_chip,
        kv_capacity_tokens=slots * serving.max_target_length,
        kv_tokens_that_fit_per_chip=int((usable - weights_per_chip) // kv_token_chip),
        hbm_bytes_per_chip=hbm,
        hbm_usable_per_chip=usable,
        step_time_s=step,
        bound="memory" if memory_time >= compute_time else "compute",
        tokens_per_s=slots / step,
    )


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
        (
            "decode slots x max_target_length",
            f"{plan.slots} x {plan.max_target_length} = {plan.kv_capacity_tokens} tokens",
        ),
        (
            "KV cache",
            f"{plan.kv_format}: {plan.kv_bytes_per_token / 1e3:.1f} kB per token, {plan.kv_heads_per_chip} kv head(s) per chip, {plan.kv_bytes_per_chip / gb:.2f} GB per chip",
        ),
        (
            "HBM per chip",
            f"{(plan.weight_bytes_per_chip + plan.kv_bytes_per_chip) / gb:.2f} GB used of {plan.hbm_usable_per_chip / gb:.1f} GB usable ({plan.hbm_bytes_per_chip / gb:.0f} GB)",
        ),
        ("KV tokens that fit per chip", f"{plan.kv_tokens_that_fit_per_chip}"),
        ("decode step (roofline)", f"{plan.step_time_s * 1e3:.2f} ms, {plan.bound}-bound"),
        ("decode throughput (roofline)", f"{plan.tokens_per_s:.0f} tokens/s per replica"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
