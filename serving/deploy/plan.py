"""Capacity plan of a deployment: chips, mesh, HBM per chip, KV capacity and a decode roofline.

Checks that refuse a deployment before it reaches the cluster live here too: the topology must
fit the accelerator, the parallelism product must equal the chip count, the images' jax tags must
agree, and weights, KV cache and a step's temporaries must fit in the runtime's bytes_limit per
chip (serving.engine.memory), as MaxText would find out when it compiles.

A disaggregated server (serving.deploy.disaggregated) is planned side by side, each engine on its
own slice with its own mesh of the same flags: the prefill side holds the weights, a mirror of
the generate side's KV pool (prompts prefill into their pages there, and the prefix cache's pages
stay there) and one prefill call's activations; the generate side holds the weights, the KV
cache's pool and the slots, and an arriving prompt's KV. The plan's
engine fields (mesh, bytes per chip, KV cache, roofline) are then the generate side's, which
decodes; `sides` holds both.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from serving.config import ConfigError, ServingConfig, model_description
from serving.deploy.config import DeploymentConfig
from serving.deploy.disaggregated import check_split
from serving.deploy.errors import DeployError
from serving.disaggregation import INTERLEAVED
from serving.engine.memory import (
    MemoryUse,
    kv_pool_pages,
    memory_use,
    page_bytes_per_chip,
    shortfall,
    temporaries_per_chip,
)
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
class Side:
    """One engine of a disaggregated server on its own slice: its mesh and its bytes per chip."""

    role: str  # "prefill" or "generate"
    chips: int
    hosts: int
    mesh: dict[str, int]
    weight_bytes_per_chip: float
    kv_bytes_per_chip: float  # the KV cache's pool: the same pages on both sides (a mirror)
    # prefill: one call's layer and its logits; generate: the slots' logits and a moved prompt's
    # KV on its way into the pool
    activation_bytes_per_chip: float
    lora_bytes_per_chip: float
    headroom_bytes_per_chip: float  # bytes_limit - all of the above


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
    inference_server: str = INTERLEAVED  # MaxText's: interleaved, or disaggregated with `sides`
    sides: tuple[Side, ...] = ()  # a disaggregated server's prefill and generate engines

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


@dataclass(frozen=True)
class _Engine:
    """One engine's placement on its mesh and what it holds per chip."""

    mesh: dict[str, int]
    where: Placement
    num_pages: int  # its KV pool's (the prefill side mirrors the generate side's)
    use: MemoryUse  # params, KV pool, temporaries (activations)
    lora: int

    @property
    def used(self) -> int:
        return self.use.total + self.lora


def make_plan(cfg: DeploymentConfig) -> Plan:
    """The plan, or a DeployError naming the field that makes the deployment impossible."""
    slice_ = cfg.tpu.slice()
    versions = cfg.images.jax_versions()
    if len(set(versions.values())) > 1:
        shown = ", ".join(f"images.{k}=jax-{v}" for k, v in versions.items())
        raise DeployError(f"images: jax tags differ ({shown}); all images must run the same jax version")
    serving = cfg.serving_config()
    sides = check_split(cfg, serving)
    chips = slice_.chips * cfg.tpu.num_slices
    try:
        model = model_description(serving)
    except ConfigError as exc:
        raise DeployError(str(exc)) from None
    name = f"{cfg.model_name} on {cfg.tpu.accelerator} {cfg.tpu.topology}"
    limit = slice_.accelerator.bytes_limit
    if sides is None:
        whole = f"{cfg.tpu.accelerator} {cfg.tpu.topology} x {cfg.tpu.num_slices} slice(s) has {chips} chips"
        slots = _slots(serving, chips)
        engine = _decode_engine(model, serving, _mesh(serving, chips, whole), slots, limit, name, interleaved=True)
        return _plan(cfg, serving, model, engine, slots, chips, slice_.hosts * cfg.tpu.num_slices)
    one = f"one side's {cfg.tpu.accelerator} {cfg.tpu.topology} slice has {slice_.chips} chips"
    slots = _slots(serving, sides.generate_devices)
    mesh = _mesh(serving, slice_.chips, one)
    generate = _decode_engine(model, serving, mesh, slots, limit, f"the generate side ({name})", interleaved=False)
    prefill = _prefill_engine(model, serving, mesh, limit, f"the prefill side ({name})", generate.num_pages)
    both = tuple(
        _side(role, engine, slice_.chips, slice_.hosts, limit)
        for role, engine in (("prefill", prefill), ("generate", generate))
    )
    return _plan(cfg, serving, model, generate, slots, chips, slice_.hosts * cfg.tpu.num_slices, both)


def _mesh(serving: ServingConfig, chips: int, what: str) -> dict[str, int]:
    """The (fsdp, autoregressive, tensor) sizes over `chips`; their product must be the chips."""
    try:
        sizes = serving.parallelism(chips)
    except ConfigError as exc:
        raise DeployError(str(exc)) from None
    mesh = dict(zip(MESH_AXES, sizes, strict=True))
    product = mesh["fsdp"] * mesh["autoregressive"] * mesh["tensor"]
    if product != chips:
        raise DeployError(
            f"serving: ici_fsdp_parallelism x ici_autoregressive_parallelism x ici_tensor_parallelism = "
            f"{mesh['fsdp']} x {mesh['autoregressive']} x {mesh['tensor']} = {product}, but {what}"
        )
    return mesh


def _slots(serving: ServingConfig, chips: int) -> int:
    """Decode slots: per_device_batch_size on each chip that decodes."""
    slots = serving.per_device_batch_size * chips
    if slots < 1 or slots != int(slots):
        raise DeployError(
            f"serving.per_device_batch_size: {serving.per_device_batch_size} x {chips} chips is not a whole number of slots"
        )
    return int(slots)


def _prefill_tokens(serving: ServingConfig) -> int:
    return serving.prefill_batch_tokens or serving.max_prefill_predict_length


def _decode_engine(
    model: ModelConfig, serving: ServingConfig, mesh: dict[str, int], slots: int, limit: int, name: str,
    interleaved: bool,
) -> _Engine:
    """The engine that holds the slots and the KV cache's pool, as the engine sizes it (the
    interleaved engine, whose temporaries are a prefill call's; or the generate side, whose are
    the slots' logits and a moved prompt's KV)."""
    num_pages = kv_pool_pages(serving, model, numerics(serving), mesh, slots)
    where = placement(model, numerics(serving), mesh, num_pages, serving.prefix_block_size)
    if interleaved:
        use = memory_use(model, where, serving.dtype, _prefill_tokens(serving), slots)
    else:
        moved = _prompt_kv_bytes(model, serving, mesh)
        logits = temporaries_per_chip(model, where, serving.dtype, 0, slots)
        use = MemoryUse(where.params_bytes_per_chip(), where.cache_bytes_per_chip(), logits + moved)
    refusal = shortfall(use, limit, name)
    if refusal:
        raise DeployError(_does_not_fit(refusal, serving, where, use, limit, math.prod(mesh.values())))
    return _with_lora(model, serving, mesh, where, num_pages, use, limit)


def _prefill_engine(
    model: ModelConfig, serving: ServingConfig, mesh: dict[str, int], limit: int, name: str, num_pages: int
) -> _Engine:
    """The prefill side: the weights, a pool of the generate side's `num_pages` (it mirrors the
    generate engine's, serving.orchestrator.disaggregated: prompts are prefilled into their pages
    there, and its cached prefix pages are read there), and one prefill call's activations."""
    where = placement(model, numerics(serving), mesh, num_pages, serving.prefix_block_size)
    tokens = _prefill_tokens(serving)
    call = temporaries_per_chip(model, where, serving.dtype, tokens, 1)
    use = MemoryUse(where.params_bytes_per_chip(), where.cache_bytes_per_chip(), call)
    refusal = shortfall(use, limit, name)
    if refusal:
        room = limit - use.params
        advice = (
            f"a prefill call of {tokens} tokens needs {call / 1e9:.2f} GB beside the weights, {room / 1e9:.2f} GB "
            "are left: a smaller max_prefill_predict_length or prefill_batch_tokens"
            if room > 0 else "the weights alone do not fit"
        )
        raise DeployError(f"{refusal}; {advice}")
    return _with_lora(model, serving, mesh, where, num_pages, use, limit)


def _prompt_kv_bytes(model: ModelConfig, serving: ServingConfig, mesh: dict[str, int]) -> int:
    """Per chip, the KV of one prefill call's tokens in pages, split as the pool's pages are."""
    per_page, split = page_bytes_per_chip(model, numerics(serving), mesh, serving.prefix_block_size)
    pages = -(-_prefill_tokens(serving) // serving.prefix_block_size)
    return -(-pages // split) * per_page


def _with_lora(
    model: ModelConfig, serving: ServingConfig, mesh: dict[str, int], where: Placement, num_pages: int,
    use: MemoryUse, limit: int,
) -> _Engine:
    lora = _lora_bytes(model, serving, where)
    if use.total + lora > limit:
        raise DeployError(
            f"serving.max_loras: {serving.lora.max_loras} adapter slots of rank {serving.max_lora_rank} take "
            f"{lora / 1e9:.2f} GB per chip, more than the {(limit - use.total) / 1e9:.2f} GB the weights, KV cache "
            "and temporaries leave"
        )
    return _Engine(mesh, where, num_pages, use, lora)


def _side(role: str, engine: _Engine, chips: int, hosts: int, limit: int) -> Side:
    return Side(
        role=role,
        chips=chips,
        hosts=hosts,
        mesh=engine.mesh,
        weight_bytes_per_chip=float(engine.use.params),
        kv_bytes_per_chip=float(engine.use.kv_cache),
        activation_bytes_per_chip=float(engine.use.temporaries),
        lora_bytes_per_chip=float(engine.lora),
        headroom_bytes_per_chip=float(limit - engine.used),
    )


def _plan(
    cfg: DeploymentConfig, serving: ServingConfig, model: ModelConfig, engine: _Engine, slots: int,
    chips: int, hosts: int, sides: tuple[Side, ...] = (),
) -> Plan:
    """The plan from the engine that decodes (`engine`, on its own chips) and the deployment's."""
    acc = cfg.tpu.slice().accelerator
    where, mesh, use = engine.where, engine.mesh, engine.use
    decode_chips = math.prod(mesh.values())
    page_size = serving.prefix_block_size
    k = where.cache[("k",)]
    kv_heads_per_chip = model.num_kv_heads // math.prod(mesh[a] for a in k.spec[3])
    pages_per_chip = engine.num_pages // math.prod(mesh[a] for a in k.spec[1])
    kv_token_chip = use.kv_cache / (pages_per_chip * page_size)
    weights_per_chip = float(use.params)
    memory_time = (weights_per_chip + use.kv_cache) / acc.hbm_bandwidth
    compute_time = 2 * model.num_params * slots / (decode_chips * acc.bf16_flops)
    step = max(memory_time, compute_time)
    return Plan(
        accelerator=cfg.tpu.accelerator,
        topology=cfg.tpu.topology,
        num_slices=cfg.tpu.num_slices,
        chips=chips,
        hosts=hosts,
        mesh=mesh,
        weight_format="int8" if serving.quantization == "int8" else serving.weight_dtype,
        weight_bytes=float(sum(leaf.nbytes for leaf in where.params.values())),
        weight_bytes_per_chip=weights_per_chip,
        slots=slots,
        max_target_length=serving.max_target_length,
        kv_format="int8" if serving.quantize_kvcache else serving.dtype,
        kv_bytes_per_token=kv_bytes_per_token(model, serving, model.num_kv_heads),
        kv_heads_per_chip=kv_heads_per_chip,
        page_size=page_size,
        num_pages=engine.num_pages,
        pages_per_chip=pages_per_chip,
        kv_bytes_per_chip=float(use.kv_cache),
        kv_capacity_tokens=(engine.num_pages - 1) * page_size,
        kv_tokens_that_fit_per_chip=int(
            (acc.bytes_limit - weights_per_chip - use.temporaries - engine.lora) // kv_token_chip
        ),
        hbm_bytes_per_chip=acc.hbm_bytes,
        bytes_limit_per_chip=float(acc.bytes_limit),
        temporaries_bytes_per_chip=float(use.temporaries),
        lora_bytes_per_chip=float(engine.lora),
        headroom_bytes_per_chip=float(acc.bytes_limit - engine.used),
        step_time_s=step,
        bound="memory" if memory_time >= compute_time else "compute",
        tokens_per_s=slots / step,
        replicas=cfg.replicas,
        shardings=_shardings(where),
        replication=list(where.notes),
        inference_server=serving.inference_server,
        sides=sides,
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
    refusal: str, serving: ServingConfig, where: Placement, use: MemoryUse, limit: int, chips: int
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
