"""`pathserve deploy plan`'s table: a Plan (serving.deploy.plan) as rows of text."""

from __future__ import annotations

from serving.deploy.plan import Plan, Side

GB = 1e9


def format_plan(plan: Plan) -> str:
    """A human-readable table; a disaggregated server's sides each get their own memory row."""
    rows = [
        ("slice", f"{plan.accelerator} {plan.topology} x {plan.num_slices}"),
        ("chips / hosts", f"{plan.chips} / {plan.hosts}"),
        *(_sides(plan) if plan.sides else _engine(plan)),
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


def _mesh(mesh: dict[str, int]) -> str:
    return f"{mesh['fsdp']}, {mesh['autoregressive']}, {mesh['tensor']}"


def _kv_cache(plan: Plan) -> str:
    return (
        f"{plan.kv_format}: {plan.kv_bytes_per_token / 1e3:.1f} kB per token; {plan.num_pages} pages of "
        f"{plan.page_size} positions ({plan.kv_capacity_tokens} tokens for sequences); per chip "
        f"{plan.pages_per_chip} pages ({plan.pages_per_chip * plan.page_size} tokens) of "
        f"{plan.kv_heads_per_chip} kv head(s), {plan.kv_bytes_per_chip / GB:.2f} GB"
    )


def _limit(plan: Plan, headroom: float) -> str:
    return (
        f"{(plan.bytes_limit_per_chip - headroom) / GB:.2f} GB of the bytes_limit {plan.bytes_limit_per_chip / GB:.2f} "
        f"GB ({plan.hbm_bytes_per_chip / 2**30:.0f} GiB HBM), headroom {headroom / GB:.2f} GB"
    )


def _engine(plan: Plan) -> list[tuple[str, str]]:
    """The interleaved engine's rows: one mesh over every chip."""
    return [
        ("mesh (fsdp, autoregressive, tensor)", _mesh(plan.mesh)),
        (
            "weights",
            f"{plan.weight_format}: {plan.weight_bytes / GB:.2f} GB total, {plan.weight_bytes_per_chip / GB:.2f} GB per chip",
        ),
        ("decode slots, max_target_length", f"{plan.slots}, {plan.max_target_length}"),
        ("KV cache (paged)", _kv_cache(plan)),
        ("temporaries (estimate)", f"{plan.temporaries_bytes_per_chip / GB:.2f} GB per chip"),
        *((("LoRA adapter slots", f"{plan.lora_bytes_per_chip / GB:.3f} GB per chip"),) if plan.lora_bytes_per_chip else ()),
        ("memory per chip", _limit(plan, plan.headroom_bytes_per_chip)),
    ]


def _sides(plan: Plan) -> list[tuple[str, str]]:
    """A disaggregated server's rows: what both sides share, then each side's memory per chip."""
    prefill, generate = plan.sides
    return [
        (
            "server",
            f"{plan.inference_server}: prefill on {prefill.chips} chips ({prefill.hosts} host(s)), generate on "
            f"{generate.chips} ({generate.hosts}), one slice each",
        ),
        ("mesh (fsdp, autoregressive, tensor)", f"{_mesh(generate.mesh)} on each side's {generate.chips} chips"),
        ("weights", f"{plan.weight_format}: {plan.weight_bytes / GB:.2f} GB total, a copy on each side"),
        ("decode slots, max_target_length", f"{plan.slots}, {plan.max_target_length} (generate side)"),
        ("KV cache (paged, generate side)", _kv_cache(plan)),
        *(_side(plan, side) for side in plan.sides),
    ]


def _side(plan: Plan, side: Side) -> tuple[str, str]:
    what = (
        "prefill call (estimate: a layer, the logits, the prompt's KV)"
        if side.role == "prefill"
        else "temporaries (estimate: the slots' logits, a moved prompt's KV)"
    )
    parts = [f"weights {side.weight_bytes_per_chip / GB:.2f} GB"]
    if side.kv_bytes_per_chip:
        parts.append(f"KV cache {side.kv_bytes_per_chip / GB:.2f} GB")
    parts.append(f"{what} {side.activation_bytes_per_chip / GB:.2f} GB")
    if side.lora_bytes_per_chip:
        parts.append(f"LoRA adapter slots {side.lora_bytes_per_chip / GB:.3f} GB")
    return f"{side.role} side, per chip", f"{' + '.join(parts)}: {_limit(plan, side.headroom_bytes_per_chip)}"
