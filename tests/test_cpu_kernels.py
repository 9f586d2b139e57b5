"""The CPU kernels (serving/kernels/*.cc) against numpy, and where the engine uses them: the
AVX-512 ones where the CPU has AVX-512 VNNI, the AVX2 ones (int8 and W8A8 weights) on any x86-64
CPU with AVX2 and FMA, AVX-512 CPUs included."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.checkpoints.model_source import load_model
from serving.config import ServingConfig
from serving.engine.engine import Engine
from serving.kernels import cpu_attention, cpu_matmul, library
from serving.kernels.backend import CpuKernelOps
from serving.kernels.cpu_matmul import PackedWeight
from serving.kernels.packing import AmxFloat32, amx_float32, pack_for_cpu_kernels
from serving.kernels.support import weights_unsupported
from serving.models import (
    KVCache,
    decode_step,
    init_params,
    init_pool,
    prefill,
    quantize_params,
)
from serving.models.cache import quantize_kv
from serving.models.layers import attention, attention_with_new_token
from serving.models.ops import XlaOps
from serving.models.params import MATMUL_WEIGHTS, int8_entries
from serving.models.quantization import int8_dot, with_int8_activations
from serving.orchestrator.offline import run_to_completion
from serving.request import SamplingParams
from tests.reference import ReferenceDecoder, row_cache

CPU_FLAGS = set()
if Path("/proc/cpuinfo").exists():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            CPU_FLAGS = set(line.split(":", 1)[1].split())
            break
HAS_CXX = platform.machine() == "x86_64" and shutil.which("c++") is not None
CAN_RUN_AVX512 = HAS_CXX and library.ISA_FLAGS["avx512"] <= CPU_FLAGS
CAN_RUN_AVX2 = HAS_CXX and library.ISA_FLAGS["avx2"] <= CPU_FLAGS
CAN_RUN = CAN_RUN_AVX512 or CAN_RUN_AVX2
# The instruction set library.status() picks here (the best, or PATHSERVE_CPU_ISA's).
ISA_HERE = library.choose_isa(CPU_FLAGS, os.environ.get(library.ISA_ENV, ""))[0] if HAS_CXX else None
needs_kernel = pytest.mark.skipif(not CAN_RUN, reason="needs x86-64 with AVX2 and FMA and a C++ compiler")
# AVX-512 kernels (float32 weights, decode attention, AMX), taken where the library chose AVX-512
needs_avx512 = pytest.mark.skipif(
    ISA_HERE != "avx512", reason=f"needs the kernels on AVX-512 VNNI (here: {ISA_HERE or 'none'})"
)
# int8 handlers: every instruction set this CPU runs (AVX2 also on an AVX-512 CPU)
ISAS = [
    pytest.param("avx2", marks=pytest.mark.skipif(not CAN_RUN_AVX2, reason="needs AVX2 and FMA")),
    pytest.param("avx512", marks=pytest.mark.skipif(not CAN_RUN_AVX512, reason="needs AVX-512 VNNI")),
]
# PATHSERVE_CPU_AMX=emulate: the AMX kernels with their tile instructions emulated in C++ (cpu_amx.h)
AMX_EMULATED = os.environ.get(library.AMX_ENV, "").strip().lower() == "emulate"
HAS_AMX = ISA_HERE == "avx512" and ({"amx_tile", "amx_int8"} <= CPU_FLAGS or AMX_EMULATED)
# int8 weights in every layout and handler: the AVX2 and AVX-512 loops' (one layout) and, where
# the CPU has it, the AMX kernel's
INT8_LAYOUTS = [
    *ISAS,
    pytest.param("amx", marks=[pytest.mark.amx, pytest.mark.skipif(not HAS_AMX, reason="needs a CPU with AMX-INT8")]),
]
HAS_AMX_BF16 = ISA_HERE == "avx512" and ({"amx_tile", "amx_bf16"} <= CPU_FLAGS or AMX_EMULATED)
needs_amx_bf16 = pytest.mark.skipif(not HAS_AMX_BF16, reason="needs a CPU with AMX-BF16")
# float32 weights in each layout: the AVX-512 kernel's and the AMX kernels' (two bfloat16 each;
# integers in 8-bit blocks; in 4-bit blocks with an offset)
F32_LAYOUTS = [
    "avx512",
    pytest.param("pairs", marks=[pytest.mark.amx, needs_amx_bf16]),
    pytest.param("blocks8", marks=[pytest.mark.amx, needs_amx_bf16]),
    pytest.param("blocks4", marks=[pytest.mark.amx, needs_amx_bf16]),
]


def _two_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values cut to 16 significant bits: each exactly the sum of two bfloat16."""
    return (values.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFFF00)).view(np.float32)


def _8bit_blocks(values: np.ndarray) -> np.ndarray:
    """values [..., in, out] as a Q8_0 GGUF tensor dequantizes them: per block of 32 inputs and
    column, integers in [-127, 127] (the largest magnitude 127) times a float16 scale."""
    *lead, k, n = values.shape
    depth = -(-k // 32) * 32
    v = np.pad(values.astype(np.float32), [(0, 0)] * len(lead) + [(0, depth - k), (0, 0)])
    v = v.reshape(*lead, depth // 32, 32, n)
    largest = np.abs(v).max(axis=-2, keepdims=True)
    scale = (largest / 127).astype(np.float16).astype(np.float32)
    q = np.clip(np.rint(v / np.where(scale > 0, scale, 1)), -127, 127)
    q = np.where(np.abs(v) == largest, np.sign(v) * 127, q)  # as the quantizer rounds the largest
    return (q * scale).reshape(*lead, depth, n)[..., :k, :]


def _4bit_blocks(values: np.ndarray) -> np.ndarray:
    """values [..., in, out] as a Q4_1 GGUF tensor dequantizes them: per block of 32 inputs and
    column, integers in [0, 15] (both ends taken) times a float16 scale plus a float16 offset."""
    *lead, k, n = values.shape
    depth = -(-k // 32) * 32
    v = np.pad(values.astype(np.float32), [(0, 0)] * len(lead) + [(0, depth - k), (0, 0)])
    v = v.reshape(*lead, depth // 32, 32, n)
    low = v.min(axis=-2, keepdims=True).astype(np.float16).astype(np.float32)
    scale = ((v.max(axis=-2, keepdims=True) - low) / 15).astype(np.float16).astype(np.float32)
    q = np.clip(np.rint((v - low) / np.where(scale > 0, scale, 1)), 0, 15)
    q[..., 0, :], q[..., 1, :] = 0, 15  # as the quantizer maps the smallest and the largest
    return (q * scale + low).reshape(*lead, depth, n)[..., :k, :]


def _pack_f32(w: np.ndarray, layout: str) -> PackedWeight:
    if layout.startswith("blocks"):
        return cpu_matmul.pack_blocks(jnp.asarray(w), layout)
    return cpu_matmul.pack(jnp.asarray(w), amx=layout == "pairs")


def _f32_weights(rng: np.random.Generator, shape: tuple[int, ...], layout: str) -> np.ndarray:
    """Random float32 weights the layout takes (exact in it)."""
    w = rng.standard_normal(shape).astype(np.float32)
    return {"avx512": w, "pairs": _two_bf16(w), "blocks8": _8bit_blocks(w), "blocks4": _4bit_blocks(w)}[
        layout
    ]


@pytest.mark.amx  # rerun emulated: status says AMX there
def test_status_says_whether_this_machine_runs_the_kernel():
    status = library.status()
    assert status.available == CAN_RUN, status.detail
    if status.available:
        assert Path(status.detail).is_file()  # the built library, in $PATHSERVE_HOME/kernels
    else:
        assert status.detail
    allowed = os.environ.get(library.AMX_ENV, "1") != "0"
    assert status.amx == (HAS_AMX and allowed)
    assert status.amx_bf16 == (HAS_AMX_BF16 and allowed)


@needs_kernel
def test_pathserve_cpu_amx_0_keeps_weights_off_amx():
    code = "from serving.kernels import library; s = library.status(); print(s.available, s.amx, s.amx_bf16)"
    env = {**os.environ, "PATHSERVE_CPU_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "False"]


def _expected(x: np.ndarray, values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Rows of x quantized to int16 (absmax / 32767), exact integer products, then both scales."""
    absmax = np.abs(x).max(axis=1, keepdims=True)
    row_scales = np.where(absmax > 0, absmax / 32767, 0).astype(np.float32)
    xq = np.rint(x * np.where(absmax > 0, 32767 / absmax, 0)).astype(np.int64)
    return (xq @ values.astype(np.int64)).astype(np.float64) * row_scales * scales


SHAPES = [
    (1, 576, 1536),
    (3, 7, 5),
    (4, 64, 64),
    (5, 100, 130),
    (9, 1536, 192),
    (37, 33, 70),
    (2, 2000, 64),
    (32, 576, 80),
    (70, 96, 200),  # a prompt's rows: each tile's rows in parts shared out between threads
    (261, 576, 576),  # 8 parts of 36 rows (the last 9), 9 tiles
]


@needs_kernel
# one row (decode), blocks of 4 rows and remainders, odd k, n off the 64-column tiles, long k;
# for AMX: one, two and three tiles of 16 rows, k off its 64-row steps, n off its 16-column tiles
@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
@pytest.mark.parametrize("layout", INT8_LAYOUTS)
def test_int8_kernel_is_int16_rows_times_int8_weights(rows, k, n, layout):
    rng = np.random.default_rng(rows * 1000 + k)
    values = rng.integers(-127, 128, (k, n), dtype=np.int8)
    scales = (rng.random(n) + 0.1).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32) * 3
    amx = layout == "amx"
    w = cpu_matmul.pack(jnp.asarray(values), jnp.asarray(scales), amx=amx)
    assert (w.in_features, w.out_features, w.amx) == (k, n, amx)
    matmul = functools.partial(cpu_matmul.matmul, isa=None if amx else layout)
    got = np.asarray(jax.jit(matmul)(jnp.asarray(x[None]), w))
    assert got.shape == (1, rows, n) and got.dtype == np.float32
    expected = _expected(x, values, scales)
    np.testing.assert_allclose(got[0], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    exact = x @ (values.astype(np.float32) * scales)
    assert np.abs(got[0] - exact).max() <= 1e-3 * np.abs(exact).max()


def _w8a8_expected(x: np.ndarray, values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """XLA's W8A8 in numpy: rows of x quantized to int8 (max(absmax, 1e-30) / 127, x / scale
    rounded half to even, clipped to +-127); the exact integer sums [M, N], and the float32 result
    float(sums) * row scale * column scale, in that order."""
    row_scales = (np.maximum(np.abs(x).max(axis=1, keepdims=True), np.float32(1e-30)) / np.float32(127)).astype(np.float32)
    xq = np.clip(np.rint(x / row_scales), -127, 127).astype(np.int64)
    sums = xq @ values.astype(np.int64)
    return sums, (sums.astype(np.float32) * row_scales) * scales


@needs_kernel
# the int16 test's shapes (k off the 4-row quads, n off the 64-column tiles, remainders of rows),
# a depth whose unsigned-offset sums pass 2^31 (VNNI: exact only as int32 wraps) and -128 weights
# (AMX: k off its 64-input tile steps and its 16 quads, rows past one and two tiles of 16)
@pytest.mark.parametrize(("rows", "k", "n"), [*SHAPES, (3, 70000, 9)])
@pytest.mark.parametrize("isa", INT8_LAYOUTS)
def test_w8a8_kernel_is_exact_integer_sums_of_int8_rows_and_weights(rows, k, n, isa):
    rng = np.random.default_rng(rows * 1000 + k + 7)
    values = rng.integers(-128, 128, (k, n), dtype=np.int8)
    values[0, :] = -128
    scales = (rng.random(n) + 0.1).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32) * 3
    x[0, 1 % k] = 100.0  # an outlier: the row's other values take few of the 127 steps
    w = cpu_matmul.pack_w8a8(jnp.asarray(values), jnp.asarray(scales), amx=isa == "amx")
    assert w.w8a8 and (w.in_features, w.out_features, w.amx) == (k, n, isa == "amx")
    assert w.values.shape == (-(-n // 64), -(-k // 4), 64, 4) and w.sums.shape == (-(-n // 64) * 64,)
    got = np.asarray(jax.jit(functools.partial(cpu_matmul.matmul, isa=None if isa == "amx" else isa))(jnp.asarray(x), w))
    sums, expected = _w8a8_expected(x, values, scales)
    assert got.shape == (rows, n) and got.dtype == np.float32
    row_scales = (np.maximum(np.abs(x).max(axis=1, keepdims=True), 1e-30) / 127).astype(np.float32)
    recovered = np.rint(got.astype(np.float64) / row_scales / scales)  # the integer sums back
    np.testing.assert_array_equal(recovered[np.abs(sums) < 2**22], sums[np.abs(sums) < 2**22])
    np.testing.assert_array_equal(got, expected)  # the same float32 operations on the same sums
    # and XLA's own W8A8 agrees up to its quantization's roundings
    xla = np.asarray(jax.jit(lambda a: int8_dot(a, jnp.asarray(values), jnp.asarray(scales)))(jnp.asarray(x)))
    assert np.abs(got - xla).max() <= 1e-3 * np.abs(xla).max()


@needs_kernel
@pytest.mark.parametrize(
    ("weights", "isa"),
    [
        *(pytest.param("int8", p.values[0], marks=p.marks) for p in ISAS),
        *(pytest.param("w8a8", p.values[0], marks=p.marks) for p in INT8_LAYOUTS),  # AMX's W8A8 too
        pytest.param("float32", "avx512", marks=needs_avx512),  # float32 weights: AVX-512 only
    ],
)
def test_only_the_counted_rows_are_computed_and_the_others_are_zeros(weights, isa):
    """A prompt chunk's padding and a decode call's inactive rows: x [groups, span, in] with
    counts [groups] computes each group's first counts[g] rows as the whole matmul does, exactly,
    and gives zeros for the rest without reading them (NaN there stays out)."""
    rng = np.random.default_rng(5)
    groups, span, k, n = 6, 9, 200, 150  # n off the 64-column tiles, spans off the 4-row blocks
    values = rng.integers(-127, 128, (k, n), dtype=np.int8)
    scales = (rng.random(n) + 0.5).astype(np.float32)
    amx, isa = isa == "amx", None if isa == "amx" else isa
    w = {
        "int8": lambda: cpu_matmul.pack(jnp.asarray(values), jnp.asarray(scales), amx=False),
        "w8a8": lambda: cpu_matmul.pack_w8a8(jnp.asarray(values), jnp.asarray(scales), amx=amx),
        "float32": lambda: cpu_matmul.pack(jnp.asarray(values.astype(np.float32) * scales)),
    }[weights]()
    counts = np.array([0, 9, 4, 1, 12, 5], np.int32)  # none, all, some, one, past the span (all)
    counted = np.arange(span)[None, :] < counts[:, None]
    x = rng.standard_normal((groups, span, k)).astype(np.float32)
    whole = np.asarray(jax.jit(functools.partial(cpu_matmul.matmul, isa=isa))(jnp.asarray(x), w))
    first = x[:, 0].copy()
    x[~counted] = np.nan
    part = jax.jit(functools.partial(cpu_matmul.matmul, w=w, isa=isa))
    got = np.asarray(part(jnp.asarray(x), counts=jnp.asarray(counts)))
    np.testing.assert_array_equal(got[counted], whole[counted])
    assert np.all(got[~counted] == 0)
    # decode rows: one per group, active or not
    active = np.array([1, 0, 0, 1, 1, 0], np.int32)
    rows = np.where(active[:, None] == 1, first, np.nan)  # [groups, k]
    got = np.asarray(part(jnp.asarray(rows), counts=jnp.asarray(active)))
    np.testing.assert_array_equal(got[active == 1], whole[active == 1, 0])
    assert np.all(got[active == 0] == 0)
    with pytest.raises(ValueError, match="4 row counts do not split 54 rows"):
        part(jnp.asarray(x), counts=jnp.zeros((4,), jnp.int32))
    # a prompt's rows: 64 or more counted rows split in parts between threads, depth past one
    # int32 pass (128 pairs), the map and the parts together
    x = rng.standard_normal((2, 64, 600)).astype(np.float32)
    values = rng.integers(-127, 128, (600, 150), dtype=np.int8)
    w = {
        "int8": lambda: cpu_matmul.pack(jnp.asarray(values), jnp.asarray(scales), amx=False),
        "w8a8": lambda: cpu_matmul.pack_w8a8(jnp.asarray(values), jnp.asarray(scales), amx=amx),
        "float32": lambda: cpu_matmul.pack(jnp.asarray(values.astype(np.float32) * scales)),
    }[weights]()
    whole = np.asarray(jax.jit(functools.partial(cpu_matmul.matmul, isa=isa))(jnp.asarray(x), w))
    counts = np.array([50, 40], np.int32)
    counted = np.arange(64)[None, :] < counts[:, None]
    x[~counted] = np.nan
    got = np.asarray(jax.jit(functools.partial(cpu_matmul.matmul, w=w, isa=isa))(jnp.asarray(x), counts=jnp.asarray(counts)))
    np.testing.assert_array_equal(got[counted], whole[counted])
    assert np.all(got[~counted] == 0)


def test_w8a8_layout_is_four_input_rows_per_column_with_column_sums():
    values = (np.arange(7 * 70, dtype=np.int32).reshape(7, 70) % 251 - 125).astype(np.int8)
    w = cpu_matmul.pack_w8a8(jnp.asarray(values), jnp.ones(70))
    v = np.asarray(w.values)
    assert v.shape == (2, 2, 64, 4) and w.scales.shape == (128,)
    assert v[1, 1, 3, 2] == values[4 + 2, 64 + 3] and v[0, 0, 5, 1] == values[1, 5]
    assert (v[:, 1, :, 3] == 0).all() and (v[1, :, 6:] == 0).all()  # padding: row 7, columns 70..
    np.testing.assert_array_equal(np.asarray(w.sums)[:70], values.astype(np.int64).sum(axis=0))
    assert (np.asarray(w.sums)[70:] == 0).all()


@pytest.mark.parametrize(
    ("flags", "asked", "isa"),
    [
        (set(), "", None),
        ({"avx2"}, "", None),  # AVX2 without FMA
        ({"avx2", "fma"}, "", "avx2"),
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}, "", "avx2"),  # AVX-512 without VNNI
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "", "avx512"),
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_int8"}, "", "avx512"),
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx2", "avx2"),
        ({"avx2", "fma"}, "avx512", None),  # asked for what the CPU lacks
        ({"avx2", "fma"}, "sse2", None),
    ],
)
def test_the_instruction_set_follows_the_cpu_flags(flags, asked, isa):
    chosen, why = library.choose_isa(frozenset(flags), asked)
    assert chosen == isa and why
    if isa is None:
        assert ("lacks" in why or "one of" in why) and (asked in why if asked else True)


@pytest.mark.parametrize(
    ("isa", "quantization", "weight_dtype", "takes"),
    [
        ("avx512", "", "float32", True),
        ("avx512", "int8w", "float32", True),
        ("avx512", "int8", "float32", True),
        ("avx512", "", "bfloat16", False),
        ("avx2", "int8w", "float32", True),
        ("avx2", "int8", "float32", True),
        ("avx2", "int8w", "bfloat16", True),
        ("avx2", "", "float32", False),
        ("avx2", "", "bfloat16", False),
    ],
)
def test_which_weights_each_instruction_set_takes(isa, quantization, weight_dtype, takes):
    reason = weights_unsupported(quantization, weight_dtype, isa)
    assert (reason is None) == takes
    if isa == "avx2" and not takes and weight_dtype == "float32":
        assert "AVX2" in reason and "int8" in reason


@needs_avx512
@pytest.mark.parametrize(("rows", "k", "n"), [*SHAPES, (16, 40, 17), (17, 576, 960)])
@pytest.mark.parametrize("layout", F32_LAYOUTS)
def test_float32_kernel_is_the_matmul(rows, k, n, layout):
    rng = np.random.default_rng(rows * 1000 + k + 1)
    w = _f32_weights(rng, (k, n), layout)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    packed = _pack_f32(w, layout)
    assert (packed.scales is not None) == layout.startswith("blocks")
    assert (packed.in_features, packed.out_features, packed.amx) == (k, n, layout != "avx512")
    got = np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), packed))
    expected = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    # float32 accuracy: errors within a few roundings of the sum of the products' magnitudes
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert (np.abs(got - expected) / magnitude).max() < 1e-6


@pytest.mark.amx
@needs_amx_bf16
@pytest.mark.parametrize("layout", ["pairs", "blocks8", "blocks4"])
def test_float32_on_amx_gives_nan_for_a_row_with_nan_and_zeros_for_a_zero_row(layout):
    w = _f32_weights(np.random.default_rng(0), (80, 64), layout)
    x = np.ones((3, 80), np.float32)
    x[1, 5] = np.nan
    x[2] = 0
    got = np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), _pack_f32(w, layout)))
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all() and (got[2] == 0).all()


def test_splits_exactly_is_true_of_values_with_16_significant_bits_and_finite():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 48)).astype(np.float32)
    assert not cpu_matmul.splits_exactly(jnp.asarray(w))  # float32's 24 bits
    for exact in (
        _two_bf16(w),
        w.astype(jnp.bfloat16).astype(np.float32),
        w.astype(np.float16).astype(np.float32),  # 11 bits
        (rng.integers(0, 16, w.shape) * np.float16(0.0123) + np.float16(-0.1)).astype(np.float32),  # Q4_1
    ):
        assert cpu_matmul.splits_exactly(jnp.asarray(exact))
    for bad in (np.inf, np.nan):
        assert not cpu_matmul.splits_exactly(jnp.asarray(_two_bf16(w)).at[3, 4].set(bad))


def test_in_blocks_exactly_is_true_of_integers_times_a_scale_plus_an_offset_per_block_of_32_inputs():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((70, 48)).astype(np.float32)  # 70 inputs: the last block padded
    for fmt, make, other in (("blocks8", _8bit_blocks, "blocks4"), ("blocks4", _4bit_blocks, "blocks8")):
        assert not cpu_matmul.in_blocks_exactly(jnp.asarray(w), fmt)
        blocks = make(w)
        assert cpu_matmul.in_blocks_exactly(jnp.asarray(blocks), fmt)
        assert not cpu_matmul.in_blocks_exactly(jnp.asarray(blocks), other)
        assert cpu_matmul.in_blocks_exactly(jnp.asarray(blocks).at[32:64, 5].set(0), fmt)  # a zero block
        # blocks run along the inputs: the same values blocked along the outputs are not
        assert not cpu_matmul.in_blocks_exactly(jnp.asarray(make(w.T).T), fmt)
        off = blocks.copy()
        off[40, 7] = np.nextafter(off[40, 7], np.float32(np.inf))
        for bad in (off, jnp.asarray(blocks).at[3, 4].set(np.inf), jnp.asarray(blocks).at[3, 4].set(np.nan)):
            assert not cpu_matmul.in_blocks_exactly(jnp.asarray(bad), fmt)
    # a scale of more than 16 significant bits: the integer times it would round
    fine = np.float32(1 + 2**-20) * np.arange(-127, 129, dtype=np.float32)[:, None].clip(-127, 127)
    assert not cpu_matmul.in_blocks_exactly(jnp.asarray(fine), "blocks8")
    # an offset the product cannot be added to exactly
    rounded = np.float32(2**-30) + np.float32(0.5) * np.arange(32, dtype=np.float32)[:, None].clip(0, 15)
    assert not cpu_matmul.in_blocks_exactly(jnp.asarray(rounded), "blocks4")


def test_blocks_layout_is_integers_of_row_pairs_per_block_of_32_with_scales_and_offsets_per_block():
    w = _4bit_blocks(np.random.default_rng(6).standard_normal((70, 20)))
    packed = cpu_matmul.pack_blocks(jnp.asarray(w), "blocks4")
    # 2 tiles of 16 columns, 70 rows padded to 3 blocks of 32: 16 row pairs each
    assert packed.amx and packed.values.shape == (2, 48, 16, 2) and packed.values.dtype == jnp.bfloat16
    assert packed.scales.shape == (2, 3, 2, 16) and packed.scales.dtype == jnp.float32
    v, scales = np.asarray(packed.values.astype(jnp.float32)), np.asarray(packed.scales)
    row, column = 32 + 2 * 5 + 1, 16 + 3  # block 1, pair 5, second row of the pair; tile 1, column 3
    scale, offset = scales[1, 1, :, 3]
    assert offset == w[32:64, column].min() and scale == (w[32:64, column].max() - offset) / 15
    assert v[1, 16 + 5, 3, 1] * scale + offset == w[row, column]
    assert (v[1, :, 4:] == 0).all() and (scales[1, :, :, 4:] == 0).all()
    # inputs 70-95 (pairs 3-15 of block 2) repeat input 69's integers: the block keeps its range
    assert (v[:, 32 + 3 :] == v[:, 32 + 2 : 32 + 3, :, 1:]).all()
    assert v.min() == 0 and v.max() == 15 and (v == np.rint(v)).all()


def test_float32_amx_layout_is_high_then_low_halves_of_row_pairs_per_block_of_32():
    rng = np.random.default_rng(3)
    w = _two_bf16(rng.standard_normal((70, 20)))
    packed = cpu_matmul.pack(jnp.asarray(w), amx=True)
    # 2 tiles of 16 columns, 70 rows padded to 3 blocks of 32
    assert packed.amx and packed.values.shape == (2, 96, 16, 2) and packed.values.dtype == jnp.bfloat16
    v = np.asarray(packed.values.astype(jnp.float32))
    high = (w.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    row, column = 32 + 2 * 5 + 1, 16 + 3  # block 1, pair 5, second row of the pair; tile 1, column 3
    assert v[1, 32 + 5, 3, 1] == high[row, column]
    assert v[1, 32 + 16 + 5, 3, 1] == w[row, column] - high[row, column]
    assert (
        (v[1, :, 4:] == 0).all() and (v[:, 64 + 3 : 64 + 16] == 0).all() and (v[:, 64 + 16 + 3 :] == 0).all()
    )
    assert (v[:, :, :, 0] + v[:, :, :, 1]).sum() != 0


@needs_kernel
@pytest.mark.parametrize(
    "layout", [*INT8_LAYOUTS, *(pytest.param(f"w8a8-{p.values[0]}", marks=p.marks) for p in INT8_LAYOUTS)]
)
def test_a_row_with_nan_gives_nan_and_a_zero_row_gives_zeros(layout):
    values = np.random.default_rng(0).integers(-127, 128, (80, 64), dtype=np.int8)
    x = np.ones((3, 80), np.float32)
    x[1, 5] = np.nan
    x[2] = 0
    if layout.startswith("w8a8"):
        isa = layout.split("-")[1]
        packed = cpu_matmul.pack_w8a8(jnp.asarray(values), jnp.ones(64), amx=isa == "amx")
        isa = None if isa == "amx" else isa
    else:
        packed, isa = cpu_matmul.pack(values, np.ones(64), amx=layout == "amx"), None if layout == "amx" else layout
    got = np.asarray(jax.jit(functools.partial(cpu_matmul.matmul, isa=isa))(jnp.asarray(x), packed))
    assert np.isfinite(got[0]).all() and np.isnan(got[1]).all() and (got[2] == 0).all()


def test_amx_layout_is_four_input_rows_per_column_and_only_where_int32_sums_cannot_overflow():
    values = np.arange(130 * 20, dtype=np.int32).reshape(130, 20).astype(np.int8)
    w = cpu_matmul.pack(jnp.asarray(values), jnp.ones(20), amx=True)
    assert w.amx and w.values.shape == (2, 192 // 4, 16, 4) and w.scales.shape == (32,)
    v = np.asarray(w.values)
    assert (
        v[1, 2, 3, 1] == values[2 * 4 + 1, 16 + 3]
        and (v[:, 130 // 4 + 1 :] == 0).all()
        and (v[1, :, 4:] == 0).all()
    )
    # longer inputs keep the AVX-512 layout, whose sums are flushed to float every 256 rows
    long = cpu_matmul.pack(jnp.zeros((cpu_matmul.AMX_MAX_DEPTH + 1, 1), jnp.int8), jnp.ones(1), amx=True)
    assert not long.amx and long.values.shape[-1] == 2


@needs_kernel
@pytest.mark.parametrize(
    "layout",
    [
        "int8",
        "w8a8",
        pytest.param("float32", marks=needs_avx512),
        pytest.param("int8-amx", marks=INT8_LAYOUTS[-1].marks),
        pytest.param("w8a8-amx", marks=INT8_LAYOUTS[-1].marks),
        pytest.param("float32-amx", marks=[pytest.mark.amx, needs_amx_bf16]),
        pytest.param("float32-blocks4", marks=[pytest.mark.amx, needs_amx_bf16]),
    ],
)
def test_stacked_layers_are_read_in_place_by_index(layout):
    rng = np.random.default_rng(1)
    if layout in ("float32-amx", "float32-blocks4"):
        f32 = "pairs" if layout == "float32-amx" else "blocks4"
        values = _f32_weights(rng, (3, 96, 128), f32)
        per_layer = [_pack_f32(values[i], f32) for i in range(3)]
        stacked = _pack_f32(values, f32)
    elif layout.startswith("int8"):
        amx = layout == "int8-amx"
        values = rng.integers(-127, 128, (3, 96, 128), dtype=np.int8)
        scales = (rng.random((3, 128)) + 0.5).astype(np.float32)
        per_layer = [
            cpu_matmul.pack(jnp.asarray(values[i]), jnp.asarray(scales[i]), amx=amx) for i in range(3)
        ]
        stacked = cpu_matmul.pack(jnp.asarray(values), jnp.asarray(scales), amx=amx)
        assert stacked.amx == amx
    elif layout.startswith("w8a8"):
        amx = layout == "w8a8-amx"
        values = rng.integers(-127, 128, (3, 96, 128), dtype=np.int8)
        scales = (rng.random((3, 128)) + 0.5).astype(np.float32)
        per_layer = [
            cpu_matmul.pack_w8a8(jnp.asarray(values[i]), jnp.asarray(scales[i]), amx=amx) for i in range(3)
        ]
        stacked = cpu_matmul.pack_w8a8(jnp.asarray(values), jnp.asarray(scales), amx=amx)
        assert stacked.amx == amx
    else:
        values = rng.standard_normal((3, 96, 128)).astype(np.float32)
        per_layer = [cpu_matmul.pack(jnp.asarray(values[i])) for i in range(3)]
        stacked = cpu_matmul.pack(jnp.asarray(values))
    x = jnp.asarray(rng.standard_normal((2, 96)).astype(np.float32))

    @jax.jit
    def scanned(x, w):
        return jax.lax.scan(lambda c, i: (c, cpu_matmul.matmul(x, w.at_layer(i))), None, jnp.arange(3))[1]

    got = np.asarray(scanned(x, stacked))
    for i in range(3):
        np.testing.assert_array_equal(got[i], np.asarray(jax.jit(cpu_matmul.matmul)(x, per_layer[i])))
    with pytest.raises(Exception, match="layer 3 of 3"):
        jax.block_until_ready(jax.jit(cpu_matmul.matmul)(x, stacked.at_layer(3)))


@needs_kernel
@pytest.mark.parametrize(
    "weights",
    [
        "int8",
        "w8a8",
        pytest.param("float32", marks=needs_avx512),
        pytest.param("float32-bf16", marks=[pytest.mark.amx, needs_amx_bf16]),
        pytest.param("float32-blocks", marks=[pytest.mark.amx, needs_amx_bf16]),
    ],
)
@pytest.mark.parametrize("tie", [False, True])
def test_packed_params_give_the_models_logits(tiny_cfg, tie, weights):
    cfg = tiny_cfg.model_copy(update={"tie_embeddings": tie})
    params = init_params(cfg, jax.random.PRNGKey(3))
    if weights == "int8":
        params = quantize_params(params)
    if weights == "w8a8":  # MaxText's int8: the layers' matmuls, the embedding and head float
        params = with_int8_activations(quantize_params(params, int8_entries("int8")))
    if weights == "float32-bf16":  # every weight exact in two bfloat16: all take AMX
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)
    if weights == "float32-blocks":  # as SmolLM2: 4-bit layer weights, an 8-bit embedding (and head)
        blocked = {
            n: jnp.asarray(_4bit_blocks(np.asarray(w)))
            for n, w in params["layers"].items()
            if n in MATMUL_WEIGHTS
        }
        params = {
            **params,
            "layers": {**params["layers"], **blocked},
            "embed": jnp.asarray(_8bit_blocks(np.asarray(params["embed"]).T).T),
        }
        if "lm_head" in params:
            params["lm_head"] = jnp.asarray(_8bit_blocks(np.asarray(params["lm_head"])))
    amx_f32 = amx_float32(params)
    layouts = {amx_f32.layout([p]) for p in amx_f32.layouts}
    assert (
        layouts
        == {
            "int8": set(),
            "w8a8": set(),
            "float32": set(),
            "float32-bf16": {"pairs"},
            "float32-blocks": {"blocks4", "blocks8"},
        }[weights]
    )
    packed = pack_for_cpu_kernels(params, amx_f32)
    layers = packed["layers"]
    assert all(isinstance(layers[n], PackedWeight) for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert all(layers[n].w8a8 == (weights == "w8a8") for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    # tied: a packed copy of the embedding (a float32 one where the kernels take float32)
    assert isinstance(packed.get("lm_head"), PackedWeight) == (weights == "int8" or ISA_HERE == "avx512")
    assert type(packed["embed"]) is type(params["embed"])  # still there for the token lookup
    if weights.startswith("float32-"):
        assert all(layers[n].amx for n in ("wqkv", "wo", "w_gate_up", "w_down")) and packed["lm_head"].amx
        assert (packed["lm_head"].scales is not None) == (weights == "float32-blocks")
    tokens = jnp.asarray([[3, 17, 5, 99, 42, 7, 8, 1]])
    lengths = jnp.asarray([8])
    expected, _ = prefill(params, tokens, lengths, cfg)
    got, _ = jax.jit(functools.partial(prefill, cfg=cfg, ops=CpuKernelOps()))(packed, tokens, lengths)
    # int8: int16 activations in the kernels, float in XLA's; W8A8: both quantize x to int8 alike
    tolerance = 1e-3 if weights in ("int8", "w8a8") else 1e-5
    assert (
        np.abs(np.asarray(got) - np.asarray(expected)).max() <= tolerance * np.abs(np.asarray(expected)).max()
    )


@pytest.mark.amx
@needs_amx_bf16
def test_only_float32_weights_exact_in_a_layout_take_amx(tiny_cfg):
    params = init_params(tiny_cfg, jax.random.PRNGKey(4))
    assert amx_float32(params) == AmxFloat32()  # random float32: 24 significant bits
    layers = dict(params["layers"])
    layers["wo"] = layers["wo"].astype(jnp.bfloat16).astype(jnp.float32)
    layers["wq"] = layers["wq"].astype(jnp.bfloat16).astype(jnp.float32)  # fused with k and v: not all exact
    layers["w_down"] = jnp.asarray(_8bit_blocks(np.asarray(layers["w_down"])))
    params = {**params, "layers": layers}
    amx_f32 = amx_float32(params)
    assert amx_f32.layouts == {
        ("layers", "wo"): {"pairs"},
        ("layers", "wq"): {"pairs"},
        ("layers", "w_down"): {"blocks8"},
    }
    packed = pack_for_cpu_kernels(params, amx_f32)["layers"]
    assert packed["wo"].amx and packed["wo"].scales is None
    assert packed["w_down"].amx and packed["w_down"].scales is not None
    assert not packed["wqkv"].amx and not packed["w_gate_up"].amx


def test_a_weight_exact_in_two_layouts_takes_the_one_of_fewer_bytes_and_fused_parts_a_shared_one():
    amx = AmxFloat32({("a",): frozenset({"blocks4", "pairs"}), ("b",): frozenset({"pairs"})})
    assert amx.layout([("a",)]) == "blocks4" and amx.layout([("b",)]) == "pairs"
    assert amx.layout([("a",), ("b",)]) == "pairs" and amx.layout([("c",)]) is None
    assert amx.describe() == "4-bit blocks with an offset: a; bfloat16 pairs: b"


@pytest.mark.amx
@needs_amx_bf16
def test_smollm2s_q4_1_layers_and_q8_0_embedding_take_amx_blocks(smollm2):
    amx_f32 = amx_float32(smollm2.params)
    layers = [("layers", n) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    assert set(amx_f32.layouts) == {*layers, ("embed",)}
    assert all(amx_f32.layouts[p] == {"blocks4", "pairs"} for p in layers)  # 4-bit: 16 bits or fewer
    assert amx_f32.layout(layers) == "blocks4"
    assert amx_f32.layout([("embed",)]) == "blocks8"  # the tied head, blocked along the embedding


@pytest.fixture(scope="module", params=["int8w", "int8", pytest.param("", marks=needs_avx512)])
def served_model(request, tiny_model_dir):
    cfg = ServingConfig(
        per_device_batch_size=4,
        max_prefill_predict_length=64,
        max_target_length=128,
        quantization=request.param,
    )
    return cfg, load_model(str(tiny_model_dir), cfg)


@needs_kernel
def test_engine_uses_the_kernels_by_default_and_keeps_xla_when_off(served_model):
    cfg, model = served_model
    engine = Engine(model, cfg.engine)
    assert engine.ops.name == "cpu-kernels"
    layers = engine.load_params()["layers"]
    assert isinstance(layers["wqkv"], PackedWeight) and "wq" not in layers  # q, k, v: one matmul
    off = Engine(model, cfg.model_copy(update={"cpu_kernels": "off"}).engine)
    assert off.ops.name == "xla"
    assert not isinstance(off.load_params()["layers"]["wq"], PackedWeight)


@needs_kernel
@pytest.mark.amx  # where AMX runs (or is emulated), the W8A8 layers take its kernel
@pytest.mark.parametrize("quantize_kvcache", [False, True])
def test_w8a8_on_the_kernels_gives_xlas_w8a8_tokens(tiny_model_dir, quantize_kvcache):
    """quantization=int8 (MaxText's W8A8) takes the kernels, which quantize x per row as XLA's
    int8 dot does: the same greedy tokens as the engine on XLA's ops."""
    cfg = ServingConfig(
        per_device_batch_size=4,
        max_prefill_predict_length=64,
        max_target_length=128,
        quantization="int8",
        quantize_kvcache=quantize_kvcache,
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    assert engine.ops.name == "cpu-kernels"
    params = engine.load_params()
    assert params["layers"]["wqkv"].w8a8 and params["layers"]["w_down"].w8a8
    assert params["layers"]["wqkv"].amx == params["layers"]["w_down"].amx == library.status().amx
    xla = Engine(model, cfg.model_copy(update={"cpu_kernels": "off"}).engine)
    assert xla.ops.name == "xla"
    ids = model.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    requests = [(ids[i : i + 4 + 3 * i], SamplingParams(max_tokens=12)) for i in range(5)]
    ours = run_to_completion(engine, params, requests)
    theirs = run_to_completion(xla, xla.load_params(), requests)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]


@needs_kernel
@pytest.mark.parametrize("scan_layers", [True, False])
def test_engine_with_the_kernels_equals_the_plain_loop(served_model, scan_layers):
    """Batched engine = one-request generator (both through the kernels), scanned or unstacked."""
    cfg, model = served_model
    cfg = cfg.model_copy(update={"scan_layers": scan_layers})
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    assert isinstance(params["layers"], dict if scan_layers else list)
    ids = model.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    requests = [(ids[i : i + 4 + 3 * i], SamplingParams(max_tokens=10 + i)) for i in range(6)]
    generator = ReferenceDecoder(model, cfg)
    for (prompt, sampling), completion in zip(requests, run_to_completion(engine, params, requests), strict=True):
        assert completion.token_ids == generator.generate(prompt, sampling).token_ids


def _block_table(rng: np.random.Generator, lengths: np.ndarray, page_size: int, max_pages: int) -> np.ndarray:
    """A block table [batch, max_pages] as a page allocator leaves it after interleaved requests:
    each row's pages drawn in turn from a shuffled pool (page 0, the scratch page, never), unused
    entries 0, and rows 5 and 6 reading row 4's first page (6 also row 5's second), as rows of
    one prompt share its prefix."""
    needed = -(-np.minimum(lengths, max_pages * page_size) // page_size)
    free = list(rng.permutation(np.arange(1, int(needed.sum()) + 1)))
    table = np.zeros((len(lengths), max_pages), np.int32)
    for slot in range(max_pages):
        for row in np.flatnonzero(needed > slot):
            table[row, slot] = free.pop()
    table[5, 0] = table[6, 0] = table[4, 0]
    table[6, 1] = table[5, 1]
    return table


def _pool(rng: np.random.Generator, cache_kind: str, shape: tuple[int, ...], pages: np.ndarray, lengths: np.ndarray):
    """A random page pool of `shape` [layers, num_pages, page_size, kv, head_dim] as the kernel takes
    it (float32, or int8 with scales in one of MaxText's layouts), with NaN in every token no row
    attends to (the scratch page among them: reading one shows); its float values (dequantized);
    the layer's token of each row's position [batch, full]; and whether the row attends to it."""
    num_pages, page_size = shape[1:3]
    full = pages.shape[1] * page_size
    k, v = rng.standard_normal(shape).astype(np.float32) * 2, rng.standard_normal(shape).astype(np.float32)
    positions = np.arange(full)
    tokens = pages[:, positions // page_size] * page_size + positions % page_size
    attended = positions[None, :] < np.minimum(lengths, full)[:, None]
    unread = np.ones(num_pages * page_size, bool)
    unread[tokens[attended]] = False
    unread = unread.reshape(num_pages, page_size)
    if cache_kind == "float32":
        k[:, unread], v[:, unread] = np.nan, np.nan
        return (jnp.asarray(k), jnp.asarray(v), None, None), (k, v), tokens, attended
    per_head = cache_kind == "int8 dkv"
    (kq, ks), (vq, vs) = quantize_kv(jnp.asarray(k), per_head), quantize_kv(jnp.asarray(v), per_head)
    ks, vs = np.array(ks), np.array(vs)
    ks[:, unread], vs[:, unread] = np.nan, np.nan
    dense = (np.asarray(kq, np.float32) * ks, np.asarray(vq, np.float32) * vs)
    return (kq, vq, jnp.asarray(ks), jnp.asarray(vs)), dense, tokens, attended


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cache_kind", ["float32", "int8 dkv", "int8 heads_and_dkv"])
# 24: a page holds one tile of 16 positions and part of the next
@pytest.mark.parametrize("page_size", [8, 16, 24])
@pytest.mark.parametrize(("groups", "head_dim"), [(1, 16), (3, 64), (4, 128), (8, 64)])  # 8 x 64: values in 3 + 1 vectors
def test_decode_attention_kernel_is_attention_over_each_rows_pages(cache_kind, page_size, groups, head_dim, isa):
    """int8 pools in both of MaxText's scale layouts: per token and kv head (dkv), per token
    (heads_and_dkv)."""
    rng = np.random.default_rng(groups * 100 + head_dim + page_size)
    layers, kv, max_pages = 3, 2, 48 // page_size
    full = max_pages * page_size
    # none, one, within the first page, across pages, one short of the table, all of it, and past it
    # (clamped to the table)
    lengths = np.array([0, 1, 7, 17, full - 1, full, full + 9], np.int32)
    batch = len(lengths)
    pages = _block_table(rng, lengths, page_size, max_pages)
    num_pages = int(pages.max()) + 3  # and two pages no row reads
    cache, (k, v), tokens, attended = _pool(rng, cache_kind, (layers, num_pages, page_size, kv, head_dim), pages, lengths)
    q = rng.standard_normal((batch, kv, groups, head_dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((batch, kv, head_dim)).astype(np.float32) for _ in range(2))
    attend = jax.jit(functools.partial(cpu_attention.paged_attention, isa=isa))
    for layer in range(layers):
        # the reference reads each row's positions gathered out of the pool (zeros where it does not attend)
        keys, values = (
            np.where(attended[..., None, None], x[layer].reshape(-1, kv, head_dim)[tokens], 0) for x in (k, v)
        )
        expected = attention_with_new_token(q[:, None], keys, values, attended[:, None], k_new, v_new)[:, 0]
        got = attend(q, *cache, layer, jnp.asarray(lengths), k_new, v_new, jnp.asarray(pages))
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
        # rows enough for every thread (the rows repeated): an item per row, its kv heads together;
        # one row: an item per kv head
        reps = -(-2 * (os.cpu_count() or 1) // batch)
        got = attend(np.tile(q, (reps, 1, 1, 1)), *cache, layer, jnp.asarray(np.tile(lengths, reps)),
                     np.tile(k_new, (reps, 1, 1)), np.tile(v_new, (reps, 1, 1)), jnp.asarray(np.tile(pages, (reps, 1))))
        np.testing.assert_allclose(np.asarray(got), np.tile(np.asarray(expected), (reps, 1, 1, 1)), rtol=1e-5, atol=1e-5)
        for row in range(batch):
            alone = slice(row, row + 1)
            got = attend(q[alone], *cache, layer, jnp.asarray(lengths[alone]), k_new[alone], v_new[alone],
                         jnp.asarray(pages[alone]))
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected)[alone], rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="layer 3 of 3"):
        jax.block_until_ready(attend(q, *cache, 3, jnp.asarray(lengths), k_new, v_new, jnp.asarray(pages)))


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cache_kind", ["float32", "int8 dkv", "int8 heads_and_dkv"])
# the kernel takes up to 64 queries (positions x groups) per block: 40 x 3 is two blocks, 11 x 12 three
@pytest.mark.parametrize(
    ("chunk", "page_size", "groups", "head_dim"),
    [(5, 8, 3, 64), (2, 16, 1, 16), (9, 8, 4, 32), (40, 16, 3, 64), (11, 8, 12, 16), (5, 24, 3, 64)],
)
def test_chunk_attention_kernel_is_causal_attention_after_each_rows_pages(cache_kind, chunk, page_size, groups,
                                                                           head_dim, isa):
    """Several query positions per row (a prompt's chunk after its cached positions, verify's k + 1):
    position s of row b attends to the row's cached positions [0, starts[b]) where its table puts
    them, then to the call's own keys 0..s; against XLA's attention over the gathered positions."""
    rng = np.random.default_rng(chunk * 1000 + groups * 100 + head_dim + page_size)
    layers, kv, max_pages = 2, 2, 48 // page_size
    full = max_pages * page_size
    starts = np.array([0, 1, 7, 17, full - 1, full, full + 9], np.int32)  # the last clamped to the table
    batch = len(starts)
    pages = _block_table(rng, starts, page_size, max_pages)
    num_pages = int(pages.max()) + 3
    cache, (k, v), tokens, attended = _pool(rng, cache_kind, (layers, num_pages, page_size, kv, head_dim), pages, starts)
    q = rng.standard_normal((batch, chunk, kv, groups, head_dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((batch, chunk, kv, head_dim)).astype(np.float32) for _ in range(2))
    causal = np.tril(np.ones((chunk, chunk), bool))
    mask = np.concatenate([np.broadcast_to(attended[:, None, :], (batch, chunk, full)),
                           np.broadcast_to(causal, (batch, chunk, chunk))], axis=-1)
    attend = jax.jit(functools.partial(cpu_attention.paged_attention, isa=isa))
    for layer in range(layers):
        keys, values = (
            np.where(attended[..., None, None], x[layer].reshape(-1, kv, head_dim)[tokens], 0) for x in (k, v)
        )
        expected = attention(q, np.concatenate([keys, k_new], 1), np.concatenate([values, v_new], 1), mask)
        got = attend(q, *cache, layer, jnp.asarray(starts), k_new, v_new, jnp.asarray(pages))
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
        # a chunk's padding: the positions past each row's count (clamped to the chunk) are skipped,
        # their outputs zeros; none on a row with no cached position and on one with all of them
        counts = np.array([0, 1, chunk // 2, chunk, chunk + 3, 0, chunk - 1], np.int32)
        got = attend(q, *cache, layer, jnp.asarray(starts), k_new, v_new, jnp.asarray(pages), jnp.asarray(counts))
        counted = (np.arange(chunk)[None, :] < counts[:, None])[..., None, None, None]
        padded = np.where(counted, expected, 0)
        np.testing.assert_allclose(np.asarray(got), padded, rtol=1e-5, atol=1e-5)
        # one row at a time: too few blocks of queries to share among threads, so the kernel takes
        # one item per query position (unless the row's chunk is more than one block)
        for row in range(batch):
            alone = slice(row, row + 1)
            got = attend(q[alone], *cache, layer, jnp.asarray(starts[alone]), k_new[alone], v_new[alone],
                         jnp.asarray(pages[alone]), jnp.asarray(counts[alone]))
            np.testing.assert_allclose(np.asarray(got), padded[alone], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("entry", [-1, 9])
def test_decode_attention_kernel_refuses_a_table_entry_outside_the_pool(isa, entry):
    """Every entry is checked, read or not: an entry outside the pool is never read."""
    batch, kv, groups, head_dim, page_size = 3, 2, 2, 16, 4
    q = jnp.ones((batch, kv, groups, head_dim))
    k = v = jnp.zeros((2, 9, page_size, kv, head_dim))
    new = jnp.ones((batch, kv, head_dim))
    pages = np.array([[1, 2, 0], [3, 0, 0], [4, 5, 6]], np.int32)
    pages[1, 2] = entry  # past row 1's length
    attend = functools.partial(cpu_attention.paged_attention, isa=isa)
    with pytest.raises(Exception, match=rf"pages\[1, 2\] = {entry} is not a page of the pool's 9"):
        jax.block_until_ready(attend(q, k, v, None, None, 0, jnp.array([5, 2, 9]), new, new, jnp.asarray(pages)))


def test_decode_attention_kernel_says_what_it_does_not_handle():
    assert cpu_attention.supports(jnp.float32, 64, 3) and cpu_attention.supports(jnp.int8, 128, 4)
    assert not cpu_attention.supports(jnp.bfloat16, 64, 3)
    assert not cpu_attention.supports(jnp.float32, 72, 3)  # head_dim not a multiple of 16
    assert not cpu_attention.supports(jnp.float32, 64, 9)


@needs_kernel
@pytest.mark.parametrize("quantize_kvcache", [False, True])
def test_engine_attends_in_place_and_equals_the_plain_loop(tiny_model_dir, quantize_kvcache):
    """With the attention kernel one generate variant serves every length; tokens = the plain loop
    (which goes through the kernels too) and the logits = XLA's attention's."""
    cfg = ServingConfig(
        per_device_batch_size=4,
        max_prefill_predict_length=64,
        max_target_length=256,
        quantize_kvcache=quantize_kvcache,
        quantization="int8w",  # weights the kernels take with AVX2 too
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    assert engine.windows == [256]
    assert Engine(model, cfg.model_copy(update={"cpu_kernels": "off"}).engine).windows == [128, 256]
    ids = model.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)
    requests = [(ids[i : i + 3 + 9 * i], SamplingParams(max_tokens=20 + 30 * i)) for i in range(5)]
    generator = ReferenceDecoder(model, cfg)
    for (prompt, sampling), completion in zip(
        requests, run_to_completion(engine, engine.load_params(), requests), strict=True
    ):
        assert completion.token_ids == generator.generate(prompt, sampling).token_ids

    params = engine.load_params()
    tokens, positions = jnp.asarray([5, 9, 2, 7]), jnp.asarray([0, 3, 60, 200])
    # 4 rows of 256 positions in pages of 16, scattered over the pool
    pages = jnp.asarray(1 + np.random.default_rng(0).permutation(64).reshape(4, 16), jnp.int32)
    shape = init_pool(model.config, 65, 16).k.shape
    k, v = (jax.random.uniform(jax.random.PRNGKey(i), shape, minval=-2, maxval=2) for i in (1, 2))
    cache = KVCache(k, v)
    if quantize_kvcache:
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        cache = KVCache(kq, vq, ks, vs)
    filled = cache
    ours, _ = decode_step(params, tokens, positions, filled, model.config, ops=CpuKernelOps(), pages=pages)
    xla, _ = decode_step(params, tokens, positions, filled, model.config, ops=_KernelMatmulsOnly(), pages=pages)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), rtol=1e-4, atol=1e-4)


class _KernelMatmulsOnly(CpuKernelOps):
    """The kernels' matmuls (the params are packed) with XLA's decode attention."""

    decode_attention = XlaOps.decode_attention
    reads_cache_in_place = XlaOps.reads_cache_in_place


@pytest.mark.parametrize(
    ("isa", "weights"),
    [
        ("avx512", "float32"),
        ("avx512", "int8"),
        ("avx2", "int8"),
        ("avx512", "w8a8"),
        ("avx2", "w8a8"),
        ("amx", "w8a8"),  # AMX-INT8: the W8A8 layers on its kernel
    ],
)
def test_the_kernel_backend_traces_where_the_kernels_cannot_run(tiny_cfg, monkeypatch, isa, weights):
    """The backend's Python side (fused splits, weights read in place by layer, the attention
    kernel's call, the handler each instruction set takes) is checked on every machine: traced to a
    jaxpr, which needs no kernel library."""
    monkeypatch.setattr(library, "require", lambda: None)
    amx, isa = isa == "amx", "avx512" if isa == "amx" else isa
    monkeypatch.setattr(library, "status", lambda: library.KernelStatus(True, "traced", amx=amx, isa=isa))
    params = init_params(tiny_cfg, jax.random.PRNGKey(0))
    if weights == "int8":
        params = quantize_params(params)
    elif weights == "w8a8":
        params = with_int8_activations(quantize_params(params, int8_entries("int8")))
    params = pack_for_cpu_kernels(params)
    ops = CpuKernelOps()
    tokens, lengths = jnp.zeros((2, 16), jnp.int32), jnp.array([16, 5])
    logits = jax.eval_shape(functools.partial(prefill, cfg=tiny_cfg, ops=ops), params, tokens, lengths)[0]
    assert logits.shape == (2, 16, tiny_cfg.vocab_size)
    quantized = weights != "float32"
    cache, pages = row_cache(tiny_cfg, 2, 64, quantized=quantized)
    step = functools.partial(decode_step, cfg=tiny_cfg, ops=ops, pages=pages)
    jaxpr = str(jax.make_jaxpr(step)(params, tokens[:, 0], jnp.array([3, 9]), cache))
    attention = {
        ("avx512", True): cpu_attention.INT8_TARGET,
        ("avx512", False): cpu_attention.F32_TARGET,
        ("avx2", True): cpu_attention.INT8_AVX2_TARGET,
        ("avx2", False): cpu_attention.F32_AVX2_TARGET,
    }[(isa, quantized)]
    assert jaxpr.count(attention) == 1
    target = {
        ("avx512", "float32"): cpu_matmul.F32_TARGET,
        ("avx512", "int8"): cpu_matmul.INT8_TARGET,
        ("avx2", "int8"): cpu_matmul.INT8_AVX2_TARGET,
        ("avx512", "w8a8"): cpu_matmul.W8A8_AMX_TARGET if amx else cpu_matmul.W8A8_TARGET,
        ("avx2", "w8a8"): cpu_matmul.W8A8_AVX2_TARGET,
    }[(isa, weights)]
    # the layer scan's body once: q, k and v as one weight, gate and up as one, wo, w_down; the
    # head (W8A8: float32, which AVX2 leaves to XLA and AVX-512 takes on its float32 kernel)
    assert jaxpr.count(target) == (4 if weights == "w8a8" else 5)
    head = int(weights == "w8a8" and isa == "avx512")
    assert jaxpr.count(cpu_matmul.F32_TARGET) == head or weights == "float32"
    assert jaxpr.count("_matmul") == jaxpr.count(target) + head and jaxpr.count("decode_attention") == 1
    out = jax.eval_shape(step, params, tokens[:, 0], jnp.array([3, 9]), cache)[0]
    assert out.shape == (2, tiny_cfg.vocab_size)
    # a chunk after cached positions (and verify, the same call) attends through the same kernel
    chunk = functools.partial(prefill, cfg=tiny_cfg, ops=ops, starts=jnp.array([3, 9]), cache=cache, pages=pages,
                              window=64, quantized_kv=quantized)
    jaxpr = str(jax.make_jaxpr(chunk)(params, tokens, lengths))
    assert jaxpr.count(attention) == 1
