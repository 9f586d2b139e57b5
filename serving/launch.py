"""Bring up the engine behind an orchestrator: runtime, model, params on the mesh, warmup, device loop.

The one start-up path for everything that serves requests (the HTTP server, the batch runner,
`pathserve generate` and `chat`).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from serving import heap
from serving.checkpoints.model_source import LoadedModel
from serving.config import ConfigError, ServingConfig
from serving.engine.engine import Engine, engine_limits
from serving.engine.memory import (
    COMPILED_FLAGS_TO_CHANGE,
    PlanTooLarge,
    check_compiled,
    check_devices,
    device_limit,
)
from serving.engine.speculative import Verifier
from serving.orchestrator import Orchestrator
from serving.orchestrator.disaggregated import DisaggregatedExecutor
from serving.orchestrator.executor import Executor
from serving.orchestrator.lockstep import LockstepExecutor, PlanChannel, exit_when_loop_dies, follow
from serving.orchestrator.transfer import ProcessGroups, meet_after_warmup
from serving.runtime import init_runtime, make_mesh
from serving.startup.plan import LaunchPlan, plan_launch

log = logging.getLogger(__name__)


@dataclass
class Launched:
    plan: LaunchPlan
    model: LoadedModel
    engine: Engine
    orchestrator: Orchestrator
    warmup_s: float
    startup_s: float
    prefill: PrefillSide | None = None  # a disaggregated server's prefill engine (`engine` generates)
    # a disaggregated server over multi-controller process groups: `engine` is this process's
    # (process 0's: the prefill engine, mirroring the generate engine's limits)
    groups: ProcessGroups | None = None
    phases: dict[str, float] = field(default_factory=dict)  # bring_up's, in order (BroughtUp.phases)

    @property
    def model_name(self) -> str:
        return self.model.config.name

    @property
    def model_load_s(self) -> float:
        """Seconds reading the weights and placing them on the devices (JetStream's model load time)."""
        return self.phases.get("load", 0.0) + self.phases.get("placement", 0.0)

    def describe(self) -> str:
        from serving.engine.partitioning import describe

        what = self.engine.summary()
        leaf = self.engine.placement.cache[("k",)]
        cache = describe(leaf.spec)
        limits, axes = self.engine.limits, self.engine.placement.axes
        per_chip = limits.num_pages // max(1, math.prod(axes[a] for a in leaf.spec[1]))
        return (
            f"{self.model.config.name} from {self.model.source} ({self.model.format}), "
            f"{self.engine.max_concurrent_decodes} slots, "
            f"kv cache {limits.num_pages} pages of {limits.page_size} ({per_chip} pages, "
            f"{per_chip * limits.page_size} tokens per chip), "
            f"quantization={what['quantization']}, kv cache {what['kv_cache']} placed {cache} over "
            f"{self.engine.placement.axes}, {what['backend']} backend; {self._sides()}"
            f"warmup {self.warmup_s:.1f} s, start-up {self.startup_s:.1f} s{self._phases()}; "
            f"from: {self.plan.origins_line()}"
        )

    def _phases(self) -> str:
        if not self.phases:
            return ""
        return " (" + ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.phases.items()) + ")"

    def _sides(self) -> str:
        if (groups := self.groups) is not None:
            return (
                f"disaggregated over processes: prefill {list(groups.prefill)} on {self.engine.mesh.size} devices, "
                f"generate {list(groups.generate)}, KV moved by jax.experimental.transfer; "
            )
        if self.prefill is None:
            return ""
        prefiller = self.prefill.engine
        return (
            f"disaggregated: prefill on {prefiller.mesh.size} devices over {prefiller.placement.axes} "
            f"({prefiller.summary()['backend']} backend), generate on {self.engine.mesh.size}; "
        )


def launch(cfg: ServingConfig, source: str | None, origins: Mapping[str, str] | None = None) -> Launched:
    """Everything up to a running device loop; raises the loader's errors (ConfigError, CheckpointError, ...).
    `origins`: where each key of `cfg` came from (serving.startup.profile), for the ready line and
    for sizing the serving profile's slots to the memory.

    On a multi-controller slice this is process 0's path: its executor broadcasts every plan to the
    followers (`follow_plans`), and the process exits non-zero if the lockstep breaks."""
    started = time.perf_counter()
    up = bring_up(cfg, source, origins)
    plan, model, engine, params, warmup, prefill = up.plan, up.model, up.engine, up.params, up.warmup_s, up.prefill
    cfg = plan.config
    make_executor, lockstep, groups = Executor, None, process_groups(cfg)
    if prefill is not None:

        def make_executor(engine, params, adapter_weights):
            return DisaggregatedExecutor(prefill.engine, prefill.params, engine, params, adapter_weights)

    if is_multiprocess():
        if not is_leader():
            raise RuntimeError("launch() runs on process 0; the other processes run follow_plans()")

        def make_executor(engine, params, adapter_weights):
            nonlocal lockstep
            lockstep = LockstepExecutor(_own_executor(groups, engine, params, adapter_weights), PlanChannel())
            return lockstep

    adapters = None
    if cfg.lora.enabled:
        from serving.lora.serving import make_registry

        adapters = make_registry(cfg.lora, model.config)
    orchestrator = Orchestrator(
        engine, params, model.tokenizer, cfg.orchestrator, make_executor, adapters=adapters
    ).start()
    if is_multiprocess():
        exit_when_loop_dies(
            lambda: orchestrator.alive,
            lambda: lockstep is not None and lockstep.closed,
            lambda: time.monotonic() - orchestrator.last_progress if orchestrator.has_work else 0.0,
            max_stall_s=cfg.liveness_timeout_s + cfg.distributed_timeout_s,
        )
    phases = {**up.phases, "device loop": time.perf_counter() - started - sum(up.phases.values())}
    return Launched(plan, model, engine, orchestrator, warmup, time.perf_counter() - started, prefill, groups, phases)


def follow_plans(cfg: ServingConfig, source: str | None, origins: Mapping[str, str] | None = None) -> int:
    """A follower process of a multi-controller slice: the same bring-up as process 0 (every
    compiled call is collective), then execute process 0's plans until it stops; returns the
    number of plans executed. Raises when the leader is gone (a failed collective)."""
    up = bring_up(cfg, source, origins)
    plan, model, engine, params = up.plan, up.model, up.engine, up.params
    log.info("process %d: %s ready; following process 0", _process_index(), model.config.name)
    adapter_weights = None
    if plan.config.lora.enabled:  # each adapter load of process 0's plans, read from its path
        from serving.lora.serving import storage_reader

        adapter_weights = storage_reader(plan.config.lora, model.config)
    return follow(_own_executor(process_groups(plan.config), engine, params, adapter_weights), PlanChannel())


def _own_executor(groups: ProcessGroups | None, engine: Engine, params, adapter_weights) -> Executor:
    """A multi-controller process's executor: this process's side of a disaggregated server over
    process `groups` (serving.orchestrator.split), else the whole plan on the one global mesh."""
    if groups is None:
        return Executor(engine, params, adapter_weights)
    from serving.orchestrator.split import SplitExecutor
    from serving.orchestrator.transfer import Link

    return SplitExecutor(engine, params, Link(groups, _LINK_TIMEOUT_S), adapter_weights)


# How long one side waits for the other at start-up (its warmup) and for a move: long, since a
# peer's death fails the next plan broadcast or the coordination service's heartbeat first.
_LINK_TIMEOUT_S = 1800.0


def process_groups(cfg: ServingConfig) -> ProcessGroups | None:
    """The prefill and generate process groups of a disaggregated server on a multi-controller
    slice (serving.orchestrator.transfer); None on one controller or an interleaved server."""
    if (split := cfg.devices.disaggregation) is None or not is_multiprocess():
        return None
    import jax

    prefill_devices, generate_devices = split.split(jax.devices())
    return ProcessGroups.of(prefill_devices, generate_devices, jax.process_index())


@dataclass
class PrefillSide:
    """A disaggregated server's prefill engine, on its own devices, and its params there."""

    engine: Engine
    params: dict


@dataclass
class BroughtUp:
    """What `bring_up` made: the plan it ran, the model without its loaded params (config and
    tokenizer: the placed params are the only copy), the engine and its params on the mesh, the
    seconds of warmup in the foreground, a disaggregated server's prefill side (else None), and
    the seconds of each phase in order (runtime, plan, load, memory plan, placement, warmup: what
    the ready line breaks start-up into, so that a slow start names its phase)."""

    plan: LaunchPlan
    model: LoadedModel
    engine: Engine
    params: dict
    warmup_s: float
    prefill: PrefillSide | None = None
    phases: dict[str, float] = field(default_factory=dict)


def bring_up(cfg: ServingConfig, source: str | None, origins: Mapping[str, str] | None = None) -> BroughtUp:
    """Runtime, the one plan, placement and restore, the engine, warmup, in that order: the one
    bring-up of `serve`, a follower and the offline engine `bench overhead` compares with. On a
    disaggregated server (serving.disaggregation) behind one controller the engine is the generate
    engine, on the generate devices, and a `PrefillSide` comes last (else None): the same loaded
    model placed again on the prefill devices (device to device), with the generate engine's
    slots and pool pages (a mirror: one plan's ids name the same slot and page on both). Over
    multi-controller process groups (`process_groups`) the engine is this process's side's alone
    (a prefill process's mirrors the limits of the generate engine the other processes hold) and
    there is no `PrefillSide`."""
    phases, last = {}, time.perf_counter()

    def phase(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        phases[name], last = phases.get(name, 0.0) + now - last, now

    init_runtime(cfg.devices)  # first: on Pathways it must precede every other JAX call
    import jax

    devices, prefill_devices = jax.devices(), None
    if (split := cfg.devices.disaggregation) is not None:
        prefill_devices, devices = split.split(devices)
    groups = process_groups(cfg)  # multi-controller: this process drives its own side's engine only
    phase("runtime")
    plan = plan_launch(cfg, source, devices, origins)
    cfg = plan.config
    phase("plan")
    generate_mesh = make_mesh(cfg.devices, devices)
    mesh = generate_mesh
    if groups is not None and groups.on_prefill:
        mesh = make_mesh(cfg.devices, prefill_devices)
    # On a mesh of more than one device (a Pathways slice behind one controller, or the processes of
    # a multi-controller one) each array is restored straight onto its shards: never the whole
    # model on one device (405B in int8 is 8x a v6e chip's memory) or, per process, every shard.
    shardings = restore_shardings(plan, mesh) if mesh.size > 1 else None
    if shardings is not None:
        what = (
            f"process {_process_index()} restores only the shards its devices hold" if is_multiprocess()
            else f"each array restored onto its shards over {mesh.size} devices"
        )
        print(f"pathserve: {what}", file=sys.stderr, flush=True)
    loaded = plan.load(shardings)
    draft = None
    if cfg.speculative_method == "draft":
        from serving.engine.draft import load_draft

        draft = load_draft(cfg, plan.engine, mesh, loaded.tokenizer, plan.model.num_params)
    verifier = Verifier.of(cfg)  # the verify calls its warmup compiles, where it speculates
    mirror = None
    if groups is not None and groups.on_prefill:  # the generate engine's limits: it lives in other processes
        mirror = engine_limits(loaded, plan.engine, generate_mesh)
    engine = Engine(loaded, plan.engine, mesh, draft=draft, verifier=verifier, mirror=mirror)
    phase("load")
    # each engine is charged for what it runs: a disaggregated generate engine no prefill, a
    # multi-controller prefill group no generate
    generates = groups is None or not groups.on_prefill
    prefills = prefill_devices is None or (groups is not None and groups.on_prefill)
    chips = list(mesh.devices.flat)
    try:
        check_memory(engine, plan.model, cfg.dtype, chips, generates, prefills, _warms_ahead(cfg, engine))
    except PlanTooLarge as exc:  # the profile's slots, sized before the programs' temporaries were known
        refit = slots_that_fit(plan, engine, exc.plan, exc.limit)
        if refit is None or mirror is not None:
            raise
        log.warning("memory plan: %s", refit.origins["per_device_batch_size"])
        plan, cfg = refit, refit.config
        engine = Engine(loaded, plan.engine, mesh, draft=draft, verifier=verifier)
        check_memory(engine, plan.model, cfg.dtype, chips, generates, prefills, _warms_ahead(cfg, engine))
    phase("memory plan")
    params = engine.load_params()
    prefill = None
    if prefill_devices is not None and groups is None:
        prefill_engine = Engine(loaded, plan.engine, make_mesh(cfg.devices, prefill_devices), mirror=engine.limits)
        check_memory(prefill_engine, plan.model, cfg.dtype, list(prefill_engine.mesh.devices.flat), False, True)
        prefill = PrefillSide(prefill_engine, prefill_engine.load_params())
        prefill_engine.release_loaded_params()
    model = engine.release_loaded_params()  # the placed params are the only copy from here on
    phase("placement")
    warmup = 0.0
    if cfg.enable_model_warmup and groups is not None:  # each group its own side's calls
        from serving.engine.warmup import warm_generate_alone

        warmup = engine.warmup(params, generate=False) if groups.on_prefill else warm_generate_alone(engine, params)
    elif cfg.enable_model_warmup and prefill is None:
        warmup = engine.warmup(params)
    elif cfg.enable_model_warmup:  # each side its own calls, and the moves between them
        from serving.engine.warmup import warm_generate_side

        warmup = prefill.engine.warmup(prefill.params, generate=False)
        warmup += warm_generate_side(engine, params, prefill.engine, prefill.params)
    if groups is not None:
        meet_after_warmup(groups, engine.limits, timeout_s=_LINK_TIMEOUT_S)
    heap.log_long_pauses()
    heap.settle()  # start-up's objects out of the collector's scans (serving.heap says why)
    phase("warmup")
    return BroughtUp(plan, model, engine, params, warmup, prefill, phases)


# Of the devices' bytes_limit, what a plan sized from its compiled footprint leaves free (XLA's own
# allocations, fragmentation).
REFIT_MARGIN = 0.02


def slots_that_fit(plan: LaunchPlan, engine: Engine, compiled, limit: int) -> LaunchPlan | None:
    """The launch plan with the serving profile's slots sized down to what `limit` holds beside
    the params and the compiled programs' largest temporaries (`compiled`, a CompiledPlan of
    `engine` that did not fit), or None where the slots were given (never changed: refused) or
    not even one fits. The profile sized them from a share of the memory before any program was
    compiled (serving.startup.slots); this sizes them from what XLA said."""
    from dataclasses import replace

    from serving.startup.profile import FROM_PROFILE

    given = plan.origins.get("per_device_batch_size", "")
    if not given.startswith(FROM_PROFILE) or plan.config.runtime == "multicontroller":
        return None
    where, slots = engine.placement, engine.max_concurrent_decodes
    devices = engine.mesh.size
    kv = where.cache_bytes_per_chip()
    room = int(limit * (1 - REFIT_MARGIN)) - (compiled.resident - kv) - compiled.programs[compiled.largest]
    per_device = room * slots // max(1, kv) // devices
    if per_device < 1 or per_device * devices >= slots:
        return None
    why = (
        f"{FROM_PROFILE} (sized to the compiled programs: {slots} slots needed {compiled.total / 1e9:.2f} GB of "
        f"{limit / 1e9:.2f}, their largest temporaries {compiled.programs[compiled.largest] / 1e9:.2f} GB "
        f"({compiled.largest}); {per_device * devices} fit)"
    )
    config = plan.config.model_copy(update={"per_device_batch_size": float(per_device)})
    return replace(plan, config=config, origins=MappingProxyType({**plan.origins, "per_device_batch_size": why}))


def _warms_ahead(cfg: ServingConfig, engine: Engine) -> bool:
    """Whether the memory plan compiles warmup's programs with its own (where warmup compiles on
    the host's cores: serving.engine.warmup.parallel_workers), while no weight is placed yet."""
    from serving.engine.warmup import parallel_workers

    return cfg.enable_model_warmup and parallel_workers(engine) > 0


def check_memory(
    engine: Engine, model, dtype: str, devices: list, generate: bool = True, prefill: bool = True, warm: bool = False
) -> None:
    """Before the weights are placed: the params, the KV cache and the largest programs the engine
    runs (`generate`, `prefill`: its roles), compiled for its devices (serving.engine.compiled_memory;
    with `warm`, warmup's other programs in the same batch), against the devices' bytes_limit,
    refused with the figures; where the devices report none (CPUs), the params cannot be abstract
    or the compile fails (logged), the placement's estimate (serving.engine.memory.check_devices)."""
    limit = device_limit(devices)
    plan = None
    if limit is not None:
        from serving.engine.compiled_memory import compiled_plan

        try:
            plan = compiled_plan(engine, generate, prefill, warm)
        except Exception as exc:  # a runtime whose compiles report no memory analysis, say
            if "RESOURCE_EXHAUSTED" in str(exc):  # XLA refused a program the chip cannot hold
                raise ConfigError(
                    f"{devices[0]} does not fit a program this config runs: {str(exc).splitlines()[0]}; "
                    f"try {COMPILED_FLAGS_TO_CHANGE}"
                ) from exc
            log.warning("memory plan: the programs could not be compiled ahead (%s); checking the estimate", exc)
    if plan is None:
        check_devices(
            model, engine.placement, dtype, engine.limits.prefill_batch_tokens, engine.max_concurrent_decodes, devices
        )
        return
    log.info(
        "memory plan per chip: params and KV cache %.2f GB, %s; bytes_limit %.2f GB",
        plan.resident / 1e9, ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in plan.programs.items()), limit / 1e9,
    )
    check_compiled(plan, limit, f"{devices[0]}")


def restore_shardings(plan: LaunchPlan, mesh) -> dict | None:
    """For a converted or MaxText checkpoint restored as stored (no quantization on load): each
    params leaf's NamedSharding on `mesh`, as the engine will place it, so that every process reads
    only the chunks of its own shards. None where the weights are built on the host instead."""
    if not plan.restored_as_stored():
        return None  # not a checkpoint, or quantized while loading: the whole tensor is needed on the host
    from jax.sharding import NamedSharding

    from serving.engine.sharding import engine_placement, partition_spec

    e = plan.engine
    slots = max(1, int(e.per_device_batch_size * mesh.size))
    where = engine_placement(plan.model, plan.numerics(), mesh, slots, e.max_target_length)
    return {path: NamedSharding(mesh, partition_spec(leaf.spec)) for path, leaf in where.params.items()}


def is_multiprocess() -> bool:
    """More than one JAX process drives the mesh (runtime=multicontroller)."""
    import jax

    return jax.process_count() > 1


def is_leader() -> bool:
    return _process_index() == 0


def _process_index() -> int:
    import jax

    return jax.process_index()
