"""Which compute backend a test's model runs on, on this machine, and the suite's switch between them.

`PATHSERVE_CPU_KERNELS=off make test` runs everything on XLA's ops (`on`: on the CPU kernels,
failing where this CPU cannot run them); unset or `auto`, each model takes the kernels where they
run (one x86 CPU device with AVX-512 VNNI and a C++ compiler) and XLA's ops elsewhere. The
`pathserve` processes the tests start read the variable themselves (serving.cli); engines built
inside the test process follow it through `switch_in_process` (tests/conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "PATHSERVE_CPU_KERNELS"
CHOICES = ("auto", "on", "off")


def choice() -> str:
    """The suite's setting: auto, on or off."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: one of {', '.join(CHOICES)}")
    return value


def kernels_run_here() -> tuple[bool, str]:
    """Whether the CPU kernels build and run on this machine, and why not (builds them once)."""
    from serving.kernels import library

    status = library.status()
    return status.available, status.detail


def expected_backend(quantization: str = "int8w") -> str:
    """The backend name the ready line and `--json` report for a model of float32 weights under
    `quantization` (by default the serving default's, int8w) under cpu_kernels=auto on one CPU
    device: the kernels where they run here and take those weights (float32: AVX-512 only)."""
    from serving.kernels import library
    from serving.kernels.support import weights_unsupported

    if choice() == "off" or not kernels_run_here()[0]:
        return "xla"
    takes = weights_unsupported(quantization, "float32", library.status().isa) is None
    return "cpu-kernels" if takes else "xla"


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists (empty where it is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def describe() -> str:
    """One line for pytest's header: what this CPU offers the kernels and the suite's setting."""
    flags = cpu_flags()
    offered = [f for f in ("avx2", "fma", "avx512_vnni", "amx_int8", "amx_bf16") if f in flags]
    cpu = ", ".join(offered) if {"avx2", "fma"} <= flags else "no avx2 and fma (the CPU kernels cannot run here)"
    amx = os.environ.get("PATHSERVE_CPU_AMX", "").strip().lower()
    emulated = "; PATHSERVE_CPU_AMX=emulate (AMX tiles emulated)" if amx == "emulate" else ""
    return f"cpu kernels: {ENV}={choice()}; this CPU: {cpu}{emulated}"


def switch_in_process(setting: str):
    """Make engines built in this process take `setting` where their config says auto; returns a
    function that undoes it. serving.kernels.backend.select is the one place a backend is chosen."""
    from serving.kernels import backend

    select = backend.select

    def switched(cpu_kernels: str, *args, **kwargs):
        return select(setting if cpu_kernels == "auto" else cpu_kernels, *args, **kwargs)

    backend.select = switched

    def undo() -> None:
        backend.select = select

    return undo
