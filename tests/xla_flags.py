"""The XLA flags of every process the suite starts (tests/conftest.py puts them in XLA_FLAGS before
anything imports JAX).

Every process: XLA CPU's loop emitters instead of its newer fusion emitters. The suite compiles over
a thousand programs; its compile time falls to about 55% (a tiny model's warmup 48.7 -> 30.1 s, the
whole suite's compiles 2,670 -> 1,480 s) and the programs run as fast (SmolLM2's 256
teacher-forced positions: 37 s against 40 s on a 2-core AMD EPYC).

A process of the tiny models only that serves a few requests (`ServerProcess.pathserve`'s servers
but the shared tiny server, every process on virtual CPU devices: `cpu_devices`): LLVM's
optimization level 0 besides (`tiny_model_flags`). Its programs compile in half the time (a tiny
model's warmup 21.7 -> 10.3 s) and run slower, which a few requests do not notice; the shared tiny
server's thousands (schemathesis: 123 s against 16) and the pytest workers, which run SmolLM2 too
(its 256 positions: 190 s against 40), would.

The programs mean the same either way; only the machine code that runs them differs.
`PATHSERVE_TEST_XLA_FLAGS` replaces the first (empty: XLA's defaults, as `pathserve` runs outside
the suite), `PATHSERVE_TEST_TINY_XLA_FLAGS` the second."""

from __future__ import annotations

import os

FLAGS = os.environ.get("PATHSERVE_TEST_XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
TINY = os.environ.get("PATHSERVE_TEST_TINY_XLA_FLAGS", "--xla_backend_optimization_level=0")


def with_suite_flags(flags: str = "") -> str:
    """`flags` after the suite's own (a later flag wins in XLA_FLAGS), each once: XLA_FLAGS is part
    of every compilation cache key, and pytest-xdist's workers inherit the flags conftest already
    set in the controller (twice over, the workers and their servers missed every entry a plain
    `pytest` run wrote)."""
    words = flags.split()
    return " ".join([f for f in FLAGS.split() if f not in words] + words)


def tiny_model_flags(flags: str) -> str:
    """XLA_FLAGS `flags` (the suite's already in them) for a process that runs only tiny models."""
    return flags if not TINY or TINY in flags else " ".join(f for f in (flags, TINY) if f)


def cpu_devices(count: int) -> dict[str, str]:
    """The environment of a process of the tiny models on `count` virtual CPU devices."""
    flags = tiny_model_flags(with_suite_flags(f"--xla_force_host_platform_device_count={count}"))
    return {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
