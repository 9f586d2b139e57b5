"""Build, load and register the CPU kernels (the *.cc files beside this module) once per machine.

They are compiled on first use with the machine's C++ compiler into one library in
$PATHSERVE_HOME/kernels (named by a hash of the sources, the compiler and jax, whose FFI headers
they use). The AVX-512 code is chosen by function attributes, not -march, so the library loads on
any x86-64 CPU and checks the CPU itself. `status()` says whether that worked and, if not, why;
the model then keeps XLA's own ops.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import jax

from serving.home import pathserve_home

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
COMPILE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC")
# XLA custom call target -> the handler symbol the library exports.
TARGETS = {
    "pathserve_f32_matmul": "PathserveF32Matmul",
    "pathserve_int8_matmul": "PathserveInt8Matmul",
    "pathserve_int8_amx_matmul": "PathserveInt8AmxMatmul",
    "pathserve_f32_amx_matmul": "PathserveF32AmxMatmul",
    "pathserve_f32_blocks_amx_matmul": "PathserveF32BlocksAmxMatmul",
    "pathserve_f32_decode_attention": "PathserveF32DecodeAttention",
    "pathserve_int8_decode_attention": "PathserveInt8DecodeAttention",
    "pathserve_int8_avx2_matmul": "PathserveInt8Avx2Matmul",
    "pathserve_w8a8_avx2_matmul": "PathserveW8a8Avx2Matmul",
    "pathserve_w8a8_matmul": "PathserveW8a8Matmul",
    "pathserve_w8a8_amx_matmul": "PathserveW8a8AmxMatmul",
    "pathserve_f32_decode_attention_avx2": "PathserveF32DecodeAttentionAvx2",
    "pathserve_int8_decode_attention_avx2": "PathserveInt8DecodeAttentionAvx2",
}
# The instruction sets the kernels are written for, best first, with the CPU flags (as Linux's
# /proc/cpuinfo names them) each needs.
ISA_FLAGS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "avx2": frozenset({"avx2", "fma"}),
}
ISA_ENV = "PATHSERVE_CPU_ISA"  # avx2: take the AVX2 kernels on a CPU that has AVX-512 too
# 0: keep every weight off AMX on a CPU that has it; emulate: build the library with the tile
# instructions in plain C++ (cpu_amx.h) and take the AMX kernels on any AVX-512 CPU, slowly: for tests
AMX_ENV = "PATHSERVE_CPU_AMX"


def choose_isa(flags: set[str] | frozenset[str], asked: str = "") -> tuple[str | None, str]:
    """The instruction set the kernels run with on a CPU with these `flags` (best first, or `asked`,
    one of ISA_FLAGS, where the CPU has it) and why; None where the CPU has none of them."""
    if asked and asked not in ISA_FLAGS:
        return None, f"{ISA_ENV}={asked!r}: one of {', '.join(ISA_FLAGS)}"
    for isa, needed in ISA_FLAGS.items():
        if asked and isa != asked:
            continue
        if needed <= flags:
            return isa, f"{isa} ({', '.join(sorted(needed))})"
    wanted = f"{ISA_ENV}={asked}: " if asked else ""
    return None, f"{wanted}this CPU lacks {' and '.join(sorted(ISA_FLAGS[asked or 'avx2'] - flags))}"


@dataclass(frozen=True)
class KernelStatus:
    """Whether the kernels can run in this process, and why not (or where their library is);
    `amx`: whether int8 weights take the AMX kernel (the CPU has AMX-INT8, Linux allows it, and
    PATHSERVE_CPU_AMX is not 0); `amx_bf16`: the same for float32 weights that are exactly two
    bfloat16 each (AMX-BF16); `isa`: the instruction set the kernels take (ISA_FLAGS), which decides
    the weights they take (`takes`) and the handlers the matmuls call."""

    available: bool
    detail: str
    amx: bool = False
    amx_bf16: bool = False
    isa: str | None = None

    @property
    def avx512(self) -> bool:
        return self.isa == "avx512"


def find_compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else `c++` or `g++` on the PATH."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@functools.cache
def status() -> KernelStatus:
    """Build (once per machine), load and register the kernels; never raises."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return KernelStatus(False, f"the kernels are for x86-64 CPUs, not {platform.machine()}")
    compiler = find_compiler()
    if not compiler:
        return KernelStatus(False, "no C++ compiler found (set CXX or install g++)")
    amx_setting = os.environ.get(AMX_ENV, "1").strip().lower()
    emulate = amx_setting == "emulate"
    try:
        library = _build(compiler, ("-DPATHSERVE_AMX_EMULATE", "-ffp-contract=off") if emulate else ())
        lib = ctypes.cdll.LoadLibrary(str(library))
    except (OSError, subprocess.SubprocessError) as e:
        return KernelStatus(False, f"building the CPU kernels failed: {e}")
    flags: set[str] = set()
    if lib.pathserve_cpu_kernels_supported():
        flags |= ISA_FLAGS["avx512"]
    if lib.pathserve_cpu_avx2_supported():
        flags |= ISA_FLAGS["avx2"]
    isa, why = choose_isa(flags, os.environ.get(ISA_ENV, "").strip().lower())
    if isa is None:
        return KernelStatus(False, why)
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    allowed = amx_setting != "0" and isa == "avx512"
    amx = allowed and bool(lib.pathserve_cpu_amx_supported())
    amx_bf16 = allowed and bool(lib.pathserve_cpu_amx_bf16_supported())
    if emulate:
        log.warning("%s=emulate: AMX tiles emulated in plain C++ (for tests; slow)", AMX_ENV)
    return KernelStatus(True, str(library), amx, amx_bf16, isa)


def require() -> None:
    """Raise unless the kernels run here (called where a computation uses them)."""
    kernels = status()
    if not kernels.available:
        raise RuntimeError(f"the CPU kernels cannot run here: {kernels.detail}")


def _build(compiler: str, defines: tuple[str, ...] = ()) -> Path:
    sources = sorted(HERE.glob("*.cc"))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    command = [compiler, *COMPILE_FLAGS, *defines, "-I", jax.ffi.include_dir()]
    # Keyed by everything the library is made of: sources, compiler, flags, jax's FFI headers.
    digest = hashlib.sha256(version.encode() + jax.__version__.encode() + " ".join(command).encode())
    for path in sorted([*sources, *HERE.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    library = pathserve_home() / "kernels" / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    # One build per machine at a time (~20 CPU-seconds): on a cold cache a server, its test process
    # and pytest's other worker all ask at once; the others wait here and then find the library.
    with open(library.with_name(f"{library.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():
            return library
        partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
        log.info("compiling the CPU kernels into %s", library)
        result = subprocess.run(
            [*command, *map(str, sources), "-o", str(partial)], capture_output=True, text=True
        )
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            errors = [line for line in result.stderr.splitlines() if "error" in line] or [result.stderr.strip()]
            raise subprocess.SubprocessError(errors[0])
        os.replace(partial, library)  # atomic: a reader never sees a partial file
    return library
