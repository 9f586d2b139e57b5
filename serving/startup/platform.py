"""Which platform the model commands will run on, decided before JAX is imported (the serving
profile is chosen with the config, before any work starts).

`PATHSERVE_PLATFORM` (tpu, cpu, gpu) wins; then JAX_PLATFORMS' first entry (`proxy`, Pathways'
IFRT proxy, is a TPU slice); then a TPU host's own marks: its accelerator device files (/dev/accel*),
or VFIO devices or the TPU_* variables a TPU VM sets, beside an installed libtpu. Anything else is a CPU.
"""

from __future__ import annotations

import glob
import importlib.util
import os

PLATFORM_ENV = "PATHSERVE_PLATFORM"
PLATFORMS = ("tpu", "cpu", "gpu")
_JAX_NAMES = {"tpu": "tpu", "proxy": "tpu", "cpu": "cpu", "cuda": "gpu", "gpu": "gpu", "rocm": "gpu"}


def detect_platform() -> str:
    """tpu, cpu or gpu (see the module docstring); ValueError for an unknown PATHSERVE_PLATFORM."""
    forced = os.environ.get(PLATFORM_ENV, "").strip().lower()
    if forced:
        if forced not in PLATFORMS:
            raise ValueError(f"{PLATFORM_ENV}={forced!r}: one of {', '.join(PLATFORMS)}")
        return forced
    first = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if first in _JAX_NAMES:
        return _JAX_NAMES[first]
    if glob.glob("/dev/accel[0-9]*"):
        return "tpu"
    # VFIO binds GPUs passed through and DPDK NICs too: a TPU only beside an installed libtpu
    marks = glob.glob("/dev/vfio/[0-9]*") or any(name.startswith("TPU_") for name in os.environ)
    return "tpu" if marks and _has_libtpu() else "cpu"


def _has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None
