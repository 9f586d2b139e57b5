"""Devices and the mesh: Pathways (single controller), multi-controller JAX, or local devices.

`JAX_PLATFORMS=proxy` or `runtime=pathways` initialises pathwaysutils before any other JAX call;
then `jax.devices()` is every chip of the slice and this is process 0. The mesh axes come from
MaxText's ici_*_parallelism flags and must multiply to the device count.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from serving.config import ConfigError, DevicesConfig

log = logging.getLogger(__name__)

MESH_AXES = ("fsdp", "autoregressive", "tensor")


def init_runtime(cfg: DevicesConfig) -> str:
    """Bring up the JAX backend the config asks for; returns the runtime chosen."""
    runtime = cfg.runtime
    if runtime == "auto":
        runtime = "pathways" if os.environ.get("JAX_PLATFORMS", "") == "proxy" else "local"
    if runtime == "pathways":
        try:
            import pathwaysutils
        except ImportError:
            raise ConfigError("runtime=pathways needs the pathwaysutils package") from None
        pathwaysutils.initialize()
    elif runtime == "multicontroller":
        import jax

        jax.distributed.initialize()
    import jax

    if cfg.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cfg.jax_compilation_cache_dir)
    log.info(
        "runtime %s: process %d of %d, %d devices: %s",
        runtime,
        jax.process_index(),
        jax.process_count(),
        jax.device_count(),
        ", ".join(str(d) for d in jax.devices()[:8]) + (" ..." if jax.device_count() > 8 else ""),
    )
    return runtime


def make_mesh(cfg: DevicesConfig, devices=None):
    """Mesh(fsdp, autoregressive, tensor) over all devices; the product must match their count."""
    import jax
    from jax.sharding import Mesh

    devices = list(devices if devices is not None else jax.devices())
    shape = (cfg.ici_fsdp_parallelism, cfg.ici_autoregressive_parallelism, cfg.ici_tensor_parallelism)
    if int(np.prod(shape)) != len(devices):
        raise ConfigError(
            f"ici_fsdp_parallelism x ici_autoregressive_parallelism x ici_tensor_parallelism = "
            f"{shape[0]} x {shape[1]} x {shape[2]} = {int(np.prod(shape))}, but there are {len(devices)} devices"
        )
    return Mesh(np.array(devices).reshape(shape), MESH_AXES)
