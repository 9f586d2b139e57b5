"""float32 and int8 weight matmuls on x86 CPUs through XLA FFI kernels (cpu_matmul.cc says why).

The C++ source is compiled on first use with the machine's C++ compiler into $PATHSERVE_HOME/kernels
(one file per source, compiler and jax version; the AVX-512 code is chosen by function attributes,
not -march, so the library loads anywhere and checks the CPU itself), then registered as XLA custom
call targets for the CPU platform. `status()` says whether that worked and, if not, why; the model
then keeps XLA's dot.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path

import jax
import jax.numpy as jnp

from serving.home import pathserve_home

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
F32_TARGET = "pathserve_f32_matmul"
INT8_TARGET = "pathserve_int8_matmul"
TILE = 64  # output columns per packed tile (kTile in the C++ source)


@dataclass(frozen=True)
class KernelStatus:
    """Whether the kernels can run in this process, and why not (or where their library is)."""

    available: bool
    detail: str


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedWeight:
    """A [..., in, out] matmul weight in the kernels' layout, 64 output columns per tile.

    float32: values [..., tiles, in, 64] and no scales. int8: values [..., tiles, pairs, 64, 2]
    (input rows paired) with per-output scales [..., tiles * 64]. `in_features` and `out_features`
    are the sizes before padding.

    Stacked layers stay stacked inside a scan: `at_layer(i)` names the layer the kernel reads, where
    a slice would make XLA copy the weight out of the stack before every call.
    """

    values: jax.Array
    scales: jax.Array | None
    in_features: int = field(metadata={"static": True})
    out_features: int = field(metadata={"static": True})
    layer: jax.Array | None = None

    def at_layer(self, index: jax.Array | int) -> PackedWeight:
        return replace(self, layer=jnp.asarray(index, jnp.int32))


def pack(values: jax.Array, scales: jax.Array | None = None) -> PackedWeight:
    """Pack a [..., in, out] weight (any leading axes, e.g. stacked layers): float32 values, or int8
    values with per-output `scales` [..., out]. Columns are padded to a multiple of 64 and, for
    int8, input rows to an even count."""
    *lead, k, n = values.shape
    tiles, nd = -(-n // TILE), len(lead)
    pad = [(0, 0)] * nd
    if scales is None:
        v = jnp.pad(values.astype(jnp.float32), [*pad, (0, 0), (0, tiles * TILE - n)])
        v = v.reshape(*lead, k, tiles, TILE).transpose(*range(nd), nd + 1, nd, nd + 2)
        return PackedWeight(values=v, scales=None, in_features=k, out_features=n)
    pairs = -(-k // 2)
    v = jnp.pad(values, [*pad, (0, 2 * pairs - k), (0, tiles * TILE - n)])
    v = v.reshape(*lead, pairs, 2, tiles, TILE).transpose(*range(nd), nd + 2, nd, nd + 3, nd + 1)
    s = jnp.pad(scales.reshape(*lead, n).astype(jnp.float32), [*pad, (0, tiles * TILE - n)])
    return PackedWeight(values=v, scales=s, in_features=k, out_features=n)


def matmul(x: jax.Array, w: PackedWeight) -> jax.Array:
    """x[..., in] @ w as float32 [..., out]. With int8 weights x is quantized per row to int16."""
    kernels = status()  # registers the targets on first use
    if not kernels.available:
        raise RuntimeError(f"the CPU matmul kernels cannot run here: {kernels.detail}")
    lead = x.shape[:-1]
    rows = x.reshape(-1, w.in_features).astype(jnp.float32)
    layer = jnp.zeros((), jnp.int32) if w.layer is None else w.layer
    result = jax.ShapeDtypeStruct((rows.shape[0], w.out_features), jnp.float32)
    if w.scales is None:
        out = jax.ffi.ffi_call(F32_TARGET, result)(rows, w.values, layer)
    else:
        out = jax.ffi.ffi_call(INT8_TARGET, result)(rows, w.values, w.scales, layer)
    return out.reshape(*lead, w.out_features)


@functools.cache
def status() -> KernelStatus:
    """Build (once per machine), load and register the kernels; never raises."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return KernelStatus(False, f"the kernels are for x86-64 CPUs, not {platform.machine()}")
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return KernelStatus(False, "no C++ compiler found (set CXX or install g++)")
    try:
        library = _build(compiler)
        lib = ctypes.cdll.LoadLibrary(str(library))
    except (OSError, subprocess.SubprocessError) as e:
        return KernelStatus(False, f"building {SOURCE.name} failed: {e}")
    if not lib.pathserve_cpu_matmul_supported():
        return KernelStatus(False, "this CPU lacks AVX-512 VNNI")
    jax.ffi.register_ffi_target(F32_TARGET, jax.ffi.pycapsule(lib.PathserveF32Matmul), platform="cpu")
    jax.ffi.register_ffi_target(INT8_TARGET, jax.ffi.pycapsule(lib.PathserveInt8Matmul), platform="cpu")
    return KernelStatus(True, str(library))


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + jax.__version__.encode()).hexdigest()[:16]
    library = pathserve_home() / "kernels" / f"cpu_matmul-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_name(f"{library.name}.{os.getpid()}.tmp")
    command = [compiler, "-O3", "-std=c++17", "-shared", "-fPIC", "-I", jax.ffi.include_dir()]
    log.info("compiling %s into %s", SOURCE.name, library)
    result = subprocess.run([*command, str(SOURCE), "-o", str(partial)], capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        errors = [line for line in result.stderr.splitlines() if "error" in line] or [result.stderr.strip()]
        raise subprocess.SubprocessError(errors[0])
    os.replace(partial, library)  # atomic: concurrent builders each write a whole file
    return library
