"""Devices and the mesh: Pathways (single controller), multi-controller JAX, or local devices.

`JAX_PLATFORMS=proxy` or `runtime=pathways` initialises pathwaysutils before any other JAX call;
then `jax.devices()` is every chip of the slice and this is process 0. The mesh axes come from
MaxText's ici_*_parallelism flags and must multiply to the device count.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

import numpy as np

from serving.config import ConfigError, DevicesConfig
from serving.home import pathserve_home

log = logging.getLogger(__name__)

MESH_AXES = ("fsdp", "autoregressive", "tensor")


def compilation_cache_dir(setting: str) -> str:
    """The persistent compilation cache's directory for `jax_compilation_cache_dir`: "" none (or
    what JAX_COMPILATION_CACHE_DIR says, which JAX reads itself); "auto" $PATHSERVE_HOME/jax-cache
    unless JAX_COMPILATION_CACHE_DIR is set; a path, with ~ expanded."""
    if setting == "auto":
        return "" if os.environ.get("JAX_COMPILATION_CACHE_DIR") else str(pathserve_home() / "jax-cache")
    return os.path.expanduser(setting)


def init_runtime(cfg: DevicesConfig) -> str:
    """Bring up the JAX backend the config asks for; returns the runtime chosen.

    Call it before any other JAX call (pathwaysutils and jax.distributed must come first); a second
    call in the same process returns the runtime already up."""
    global _RUNTIME
    if _RUNTIME:
        return _RUNTIME
    runtime = cfg.runtime
    if runtime == "auto":
        runtime = "pathways" if os.environ.get("JAX_PLATFORMS", "") == "proxy" else "local"
    if runtime == "pathways":
        _init_pathways(cfg)
    elif runtime == "multicontroller":
        _init_multicontroller(cfg)
    import jax

    cache = compilation_cache_dir(cfg.jax_compilation_cache_dir)
    if cache and runtime != "pathways":
        jax.config.update("jax_compilation_cache_dir", cache)
        if not os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
            # every shape warmup compiles (JAX's default keeps only those over 1 s): a restart on a
            # warm cache loads the dozens of small CPU programs instead of compiling them again
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    if runtime == "multicontroller" and jax.process_index() != 0 and jax.default_backend() == "cpu":
        _write_cache_entries_here()
    summary = (
        f"runtime {runtime}: process {jax.process_index()} of {jax.process_count()}, "
        f"{jax.device_count()} devices ({jax.local_device_count()} local): "
        + ", ".join(str(d) for d in jax.devices()[:8])
        + (" ..." if jax.device_count() > 8 else "")
    )
    if runtime == "local":
        log.info(summary)
    else:  # which process this is, and what it sees, belongs in every multi-host log
        _say(summary)
    _RUNTIME = runtime
    return runtime


def _write_cache_entries_here() -> None:
    """Let this process (not process 0, on CPU) write its own persistent compilation cache entries.

    JAX writes entries from process 0 only (against write contention on shared filesystems), and
    its key hashes the devices' topology, whose fingerprint on CPU is each process's own: another
    process's key never matches an entry process 0 wrote, so it compiled every program on every
    start (a lockstep follower of the tiny model: ~2 s per program while process 0 waited at the
    first collective). Its keys being its own, nothing else writes them. JAX's private
    `compiler._cache_write` is wrapped; where it or `compilation_cache.put_executable_and_time` is
    not there (another jax), this does nothing and the process compiles as before."""
    from jax._src import compilation_cache, compiler
    from jax._src import config as jax_config

    original, put = getattr(compiler, "_cache_write", None), getattr(compilation_cache, "put_executable_and_time", None)
    if original is None or put is None or getattr(original, "pathserve_every_process", False):
        return

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        too_quick = compile_time_secs < jax_config.persistent_cache_min_compile_time_secs.value
        if host_callbacks or too_quick or backend.platform != "cpu":
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as exc:  # as JAX itself: a cache that cannot be written is no error
            log.warning("persistent compilation cache entry for %s not written: %s: %s", module_name, type(exc).__name__, exc)

    cache_write.pathserve_every_process = True
    compiler._cache_write = cache_write


_RUNTIME = ""  # the runtime this process brought up (JAX's backends are process-wide too)
DEFAULT_COORDINATOR_PORT = 8476  # JAX's own default for TPU slices


def _init_pathways(cfg: DevicesConfig) -> None:
    """pathwaysutils first: it registers the IFRT proxy backend (JAX_BACKEND_TARGET), Orbax's
    Pathways array handler (ENABLE_PATHWAYS_PERSISTENCE=1) and its profiler patches."""
    try:
        import pathwaysutils
    except ImportError:
        raise ConfigError(
            "runtime=pathways (or JAX_PLATFORMS=proxy) needs the pathwaysutils package: "
            "pip install 'pathserve[pathways]'"
        ) from None
    import jax

    if "proxy" not in (jax.config.jax_platforms or ""):
        jax.config.update("jax_platforms", "proxy")
    pathwaysutils.initialize()
    persistence = os.environ.get("ENABLE_PATHWAYS_PERSISTENCE", "") == "1"
    _say(
        f"pathwaysutils {pathwaysutils.__version__} initialized: Pathways backend used: "
        f"{bool(pathwaysutils.is_pathways_backend_used())}; Orbax restores through its handler: {persistence}"
    )
    if cfg.jax_compilation_cache_dir not in ("", "auto"):
        _say(
            f"jax_compilation_cache_dir={cfg.jax_compilation_cache_dir} does not apply on Pathways: "
            "pathwaysutils turns JAX's persistent compilation cache off; Pathways keeps its own under "
            "the proxy's --gcs_scratch_location"
        )
    target = jax.config.read("jax_backend_target") or os.environ.get("JAX_BACKEND_TARGET", "")
    try:
        jax.devices()
    except RuntimeError as exc:
        raise ConfigError(
            f"cannot reach the Pathways proxy at JAX_BACKEND_TARGET={target!r} "
            f"(set it to grpc://HOST:PORT of the pathways-proxy): {exc}"
        ) from None


def _say(message: str) -> None:
    print(f"pathserve: {message}", file=sys.stderr, flush=True)


def distributed_args(cfg: DevicesConfig, env: Mapping[str, str] = os.environ) -> dict:
    """jax.distributed.initialize's coordinator_address / num_processes / process_id from the config,
    else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, else an LWS pod's
    LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX; what none gives is left out (JAX then
    detects it on TPU VMs and GKE)."""
    lws_leader = env.get("LWS_LEADER_ADDRESS", "")
    address = (
        cfg.coordinator_address
        or env.get("JAX_COORDINATOR_ADDRESS", "")
        or (f"{lws_leader}:{DEFAULT_COORDINATOR_PORT}" if lws_leader else "")
    )
    count = cfg.num_processes or _env_int(env, "JAX_NUM_PROCESSES") or _env_int(env, "LWS_GROUP_SIZE")
    index = cfg.process_id if cfg.process_id >= 0 else _env_int(env, "JAX_PROCESS_ID", "LWS_WORKER_INDEX")
    args: dict = {}
    if address:
        args["coordinator_address"] = address
    if count:
        args["num_processes"] = count
    if index is not None:
        args["process_id"] = index
    if "process_id" in args and "num_processes" in args and not 0 <= args["process_id"] < count:
        raise ConfigError(f"process_id={args['process_id']} is not below num_processes={count}")
    return args


def _env_int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = env.get(name, "")
        if raw:
            try:
                return int(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not an integer") from None
    return None


def _init_multicontroller(cfg: DevicesConfig) -> None:
    """JAX's distributed runtime: every process sees the global devices; on CPU the collectives
    run over gloo (loopback or the pod network)."""
    import jax

    args = distributed_args(cfg)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU client's; TPUs use ICI
    # A peer's death must not abort this process from inside JAX's coordination client: process 0
    # fails its device loop (the next collective errors), answers /livez 503, ends its streams with
    # an error and then exits non-zero itself (serving.orchestrator.lockstep).
    jax.config.update("jax_enable_recoverability", True)
    _say("jax.distributed.initialize(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")")
    try:
        jax.distributed.initialize(
            **args,
            initialization_timeout=max(cfg.distributed_timeout_s, 60),
            heartbeat_timeout_seconds=cfg.distributed_timeout_s,
        )
    except (ValueError, RuntimeError) as exc:
        where = ", ".join(f"{k}={v!r}" for k, v in args.items()) or "nothing set"
        raise ConfigError(
            f"runtime=multicontroller: jax.distributed.initialize failed ({where}; set coordinator_address, "
            f"num_processes and process_id or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID): {exc}"
        ) from None


def make_mesh(cfg: DevicesConfig, devices=None):
    """Mesh(fsdp, autoregressive, tensor) over all devices; the product must match their count."""
    import jax
    from jax.sharding import Mesh

    from serving.config import resolve_parallelism

    devices = list(devices if devices is not None else jax.devices())
    shape = resolve_parallelism(
        (cfg.ici_fsdp_parallelism, cfg.ici_autoregressive_parallelism, cfg.ici_tensor_parallelism), len(devices)
    )
    if int(np.prod(shape)) != len(devices):
        raise ConfigError(
            f"ici_fsdp_parallelism x ici_autoregressive_parallelism x ici_tensor_parallelism = "
            f"{shape[0]} x {shape[1]} x {shape[2]} = {int(np.prod(shape))}, but there are {len(devices)} devices"
        )
    return Mesh(np.array(devices).reshape(shape), MESH_AXES)
