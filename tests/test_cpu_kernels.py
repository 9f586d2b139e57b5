"""The CPU int8 kernel (serving/kernels/cpu_matmul.cc) against numpy, and where the engine uses it."""

from __future__ import annotations

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

from serving.config import ServingConfig
from serving.engine.engine import Engine
from serving.engine.offline import generate_all
from serving.generate import Generator
from serving.kernels import cpu_attention, cpu_matmul, library
from serving.kernels.cpu_matmul import PackedWeight
from serving.model_source import load_model
from serving.models import (
    KVCache,
    QuantizedWeight,
    decode_step,
    init_cache,
    init_params,
    prefill,
    quantize_params,
)
from serving.models.layers import attention_with_new_token
from serving.models.llama import quantize_kv
from serving.sampling import SamplingParams
from serving.weights import bf16_pair_weights, pack_for_cpu_kernels

CPU_FLAGS = set()
if Path("/proc/cpuinfo").exists():
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            CPU_FLAGS = set(line.split(":", 1)[1].split())
            break
CAN_RUN = (
    platform.machine() == "x86_64"
    and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= CPU_FLAGS
    and shutil.which("c++") is not None
)
needs_kernel = pytest.mark.skipif(not CAN_RUN, reason="needs x86-64 with AVX-512 VNNI and a C++ compiler")
HAS_AMX = CAN_RUN and {"amx_tile", "amx_int8"} <= CPU_FLAGS
# int8 weights in both layouts: the AVX-512 kernel's and (where the CPU has it) the AMX kernel's
INT8_LAYOUTS = [
    False,
    pytest.param(True, marks=pytest.mark.skipif(not HAS_AMX, reason="needs a CPU with AMX-INT8")),
]
HAS_AMX_BF16 = CAN_RUN and {"amx_tile", "amx_bf16"} <= CPU_FLAGS
needs_amx_bf16 = pytest.mark.skipif(not HAS_AMX_BF16, reason="needs a CPU with AMX-BF16")
# float32 weights in both layouts: the AVX-512 kernel's and the AMX kernel's (two bfloat16 each)
F32_LAYOUTS = [False, pytest.param(True, marks=needs_amx_bf16)]


def _two_bf16(values: np.ndarray) -> np.ndarray:
    """float32 values cut to 16 significant bits: each exactly the sum of two bfloat16."""
    return (values.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFFF00)).view(np.float32)


def test_status_says_whether_this_machine_runs_the_kernel():
    status = library.status()
    assert status.available == CAN_RUN, status.detail
    if status.available:
        assert Path(status.detail).is_file()  # the built library, in $PATHSERVE_HOME/kernels
    else:
        assert status.detail
    allowed = os.environ.get("PATHSERVE_CPU_AMX", "1") != "0"
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
]


@needs_kernel
# one row (decode), blocks of 4 rows and remainders, odd k, n off the 64-column tiles, long k;
# for AMX: one, two and three tiles of 16 rows, k off its 64-row steps, n off its 16-column tiles
@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
@pytest.mark.parametrize("amx", INT8_LAYOUTS)
def test_int8_kernel_is_int16_rows_times_int8_weights(rows, k, n, amx):
    rng = np.random.default_rng(rows * 1000 + k)
    values = rng.integers(-127, 128, (k, n), dtype=np.int8)
    scales = (rng.random(n) + 0.1).astype(np.float32)
    x = rng.standard_normal((rows, k)).astype(np.float32) * 3
    w = cpu_matmul.pack(jnp.asarray(values), jnp.asarray(scales), amx=amx)
    assert (w.in_features, w.out_features, w.amx) == (k, n, amx)
    got = np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x[None]), w))
    assert got.shape == (1, rows, n) and got.dtype == np.float32
    expected = _expected(x, values, scales)
    np.testing.assert_allclose(got[0], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    exact = x @ (values.astype(np.float32) * scales)
    assert np.abs(got[0] - exact).max() <= 1e-3 * np.abs(exact).max()


@needs_kernel
@pytest.mark.parametrize(("rows", "k", "n"), [*SHAPES, (16, 40, 17), (17, 576, 960)])
@pytest.mark.parametrize("amx", F32_LAYOUTS)
def test_float32_kernel_is_the_matmul(rows, k, n, amx):
    rng = np.random.default_rng(rows * 1000 + k + 1)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if amx:
        w = _two_bf16(w)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    packed = cpu_matmul.pack(jnp.asarray(w), amx=amx)
    assert packed.scales is None and (packed.in_features, packed.out_features, packed.amx) == (k, n, amx)
    got = np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), packed))
    expected = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
    # float32 accuracy: errors within a few roundings of the sum of the products' magnitudes
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64)
    assert (np.abs(got - expected) / magnitude).max() < 1e-6


@needs_amx_bf16
def test_float32_on_amx_gives_nan_for_a_row_with_nan_and_zeros_for_a_zero_row():
    w = _two_bf16(np.random.default_rng(0).standard_normal((80, 64)))
    x = np.ones((3, 80), np.float32)
    x[1, 5] = np.nan
    x[2] = 0
    got = np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), cpu_matmul.pack(jnp.asarray(w), amx=True)))
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
@pytest.mark.parametrize("amx", INT8_LAYOUTS)
def test_a_row_with_nan_gives_nan_and_a_zero_row_gives_zeros(amx):
    values = np.random.default_rng(0).integers(-127, 128, (80, 64), dtype=np.int8)
    x = np.ones((3, 80), np.float32)
    x[1, 5] = np.nan
    x[2] = 0
    packed = cpu_matmul.pack(values, np.ones(64), amx=amx)
    got = np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), packed))
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
        "float32",
        pytest.param("int8-amx", marks=INT8_LAYOUTS[1].marks),
        pytest.param("float32-amx", marks=needs_amx_bf16),
    ],
)
def test_stacked_layers_are_read_in_place_by_index(layout):
    rng = np.random.default_rng(1)
    if layout == "float32-amx":
        values = _two_bf16(rng.standard_normal((3, 96, 128)))
        per_layer = [cpu_matmul.pack(jnp.asarray(values[i]), amx=True) for i in range(3)]
        stacked = cpu_matmul.pack(jnp.asarray(values), amx=True)
    elif layout.startswith("int8"):
        amx = layout == "int8-amx"
        values = rng.integers(-127, 128, (3, 96, 128), dtype=np.int8)
        scales = (rng.random((3, 128)) + 0.5).astype(np.float32)
        per_layer = [
            cpu_matmul.pack(jnp.asarray(values[i]), jnp.asarray(scales[i]), amx=amx) for i in range(3)
        ]
        stacked = cpu_matmul.pack(jnp.asarray(values), jnp.asarray(scales), amx=amx)
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
@pytest.mark.parametrize("weights", ["int8", "float32", pytest.param("float32-bf16", marks=needs_amx_bf16)])
@pytest.mark.parametrize("tie", [False, True])
def test_packed_params_give_the_models_logits(tiny_cfg, tie, weights):
    cfg = tiny_cfg.model_copy(update={"tie_embeddings": tie})
    params = init_params(cfg, jax.random.PRNGKey(3))
    if weights == "int8":
        params = quantize_params(params)
    if weights == "float32-bf16":  # every weight exact in two bfloat16: all take AMX
        params = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)
    amx_f32 = bf16_pair_weights(params)
    assert bool(amx_f32) == (weights == "float32-bf16")
    packed = pack_for_cpu_kernels(params, amx_f32)
    layers = packed["layers"]
    assert all(isinstance(layers[n], PackedWeight) for n in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert isinstance(packed["lm_head"], PackedWeight)  # tied: a packed copy of the embedding
    assert type(packed["embed"]) is type(params["embed"])  # still there for the token lookup
    if weights == "float32-bf16":
        assert all(layers[n].amx for n in ("wqkv", "wo", "w_gate_up", "w_down")) and packed["lm_head"].amx
    tokens = jnp.asarray([[3, 17, 5, 99, 42, 7, 8, 1]])
    lengths = jnp.asarray([8])
    expected, _ = prefill(params, tokens, lengths, cfg)
    got, _ = jax.jit(prefill, static_argnums=3)(packed, tokens, lengths, cfg)
    tolerance = 1e-3 if weights == "int8" else 1e-5
    assert (
        np.abs(np.asarray(got) - np.asarray(expected)).max() <= tolerance * np.abs(np.asarray(expected)).max()
    )


@needs_amx_bf16
def test_only_float32_weights_exact_in_two_bfloat16_take_amx(tiny_cfg):
    params = init_params(tiny_cfg, jax.random.PRNGKey(4))
    assert bf16_pair_weights(params) == frozenset()  # random float32: 24 significant bits
    layers = dict(params["layers"])
    layers["wo"] = layers["wo"].astype(jnp.bfloat16).astype(jnp.float32)
    layers["wq"] = layers["wq"].astype(jnp.bfloat16).astype(jnp.float32)  # fused with k and v: not all exact
    params = {**params, "layers": layers}
    amx_f32 = bf16_pair_weights(params)
    assert amx_f32 == {("layers", "wo"), ("layers", "wq")}
    packed = pack_for_cpu_kernels(params, amx_f32)["layers"]
    assert packed["wo"].amx and not packed["wqkv"].amx and not packed["w_down"].amx


@needs_amx_bf16
def test_smollm2s_4_bit_layers_take_amx_and_its_8_bit_embedding_does_not(smollm2):
    amx_f32 = bf16_pair_weights(smollm2.params)
    assert {("layers", n) for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")} == amx_f32


@pytest.fixture(scope="module", params=["int8", ""])
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
    engine = Engine(model, cfg)
    assert engine.cpu_kernels
    layers = engine.load_params()["layers"]
    assert isinstance(layers["wqkv"], PackedWeight) and "wq" not in layers  # q, k, v: one matmul
    off = Engine(model, cfg.model_copy(update={"cpu_kernels": "off"}))
    assert not off.cpu_kernels
    assert not isinstance(off.load_params()["layers"]["wq"], PackedWeight)


@needs_kernel
def test_int8_activations_keep_xlas_int8_dot(tiny_model_dir):
    cfg = ServingConfig(max_prefill_predict_length=64, max_target_length=128, quantization="int8")
    cfg = cfg.model_copy(update={"quantize_activations": True})
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg)
    assert not engine.cpu_kernels
    assert isinstance(engine.load_params()["layers"]["wq"], QuantizedWeight)


@needs_kernel
@pytest.mark.parametrize("scan_layers", [True, False])
def test_engine_with_the_kernels_equals_the_plain_loop(served_model, scan_layers):
    """Batched engine = one-request generator (both through the kernels), scanned or unstacked."""
    cfg, model = served_model
    cfg = cfg.model_copy(update={"scan_layers": scan_layers})
    engine = Engine(model, cfg)
    params = engine.load_params()
    assert isinstance(params["layers"], dict if scan_layers else list)
    ids = model.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 3)
    requests = [(ids[i : i + 4 + 3 * i], SamplingParams(max_tokens=10 + i)) for i in range(6)]
    generator = Generator(model, cfg)
    for (prompt, sampling), completion in zip(requests, generate_all(engine, params, requests), strict=True):
        assert completion.token_ids == generator.generate(prompt, sampling).token_ids


@needs_kernel
@pytest.mark.parametrize("int8_cache", [False, True])
@pytest.mark.parametrize(("groups", "head_dim"), [(1, 16), (3, 64), (4, 128)])
def test_decode_attention_kernel_is_attention_over_each_rows_positions(int8_cache, groups, head_dim):
    rng = np.random.default_rng(groups * 100 + head_dim)
    layers, batch, capacity, kv = 3, 6, 40, 2
    q = rng.standard_normal((batch, kv, groups, head_dim)).astype(np.float32)
    k = rng.standard_normal((layers, batch, capacity, kv, head_dim)).astype(np.float32) * 2
    v = rng.standard_normal((layers, batch, capacity, kv, head_dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((batch, kv, head_dim)).astype(np.float32) for _ in range(2))
    lengths = np.array([0, 1, 7, 17, 39, 40], np.int32)  # none, some, and the whole cache
    if int8_cache:
        (kq, ks), (vq, vs) = quantize_kv(jnp.asarray(k)), quantize_kv(jnp.asarray(v))
        cache = (kq, vq, ks, vs)
        k = np.asarray(kq, np.float32) * np.asarray(ks)
        v = np.asarray(vq, np.float32) * np.asarray(vs)
    else:
        cache = (jnp.asarray(k), jnp.asarray(v), None, None)
    mask = jnp.asarray((np.arange(capacity)[None, :] < lengths[:, None])[:, None, :])
    for layer in range(layers):
        expected = attention_with_new_token(q[:, None], k[layer], v[layer], mask, k_new, v_new)[:, 0]
        got = jax.jit(cpu_attention.decode_attention)(q, *cache, layer, jnp.asarray(lengths), k_new, v_new)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="layer 3 of 3"):
        jax.block_until_ready(
            cpu_attention.decode_attention(q, *cache, 3, jnp.asarray(lengths), k_new, v_new)
        )


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
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg)
    assert engine.windows == [256]
    assert Engine(model, cfg.model_copy(update={"cpu_kernels": "off"})).windows == [128, 256]
    ids = model.tokenizer.encode("the quick brown fox jumps over the lazy dog " * 4)
    requests = [(ids[i : i + 3 + 9 * i], SamplingParams(max_tokens=20 + 30 * i)) for i in range(5)]
    generator = Generator(model, cfg)
    for (prompt, sampling), completion in zip(
        requests, generate_all(engine, engine.load_params(), requests), strict=True
    ):
        assert completion.token_ids == generator.generate(prompt, sampling).token_ids

    params = engine.load_params()
    tokens, positions = jnp.asarray([5, 9, 2, 7]), jnp.asarray([0, 3, 60, 200])
    shape = init_cache(model.config, 4, 256).k.shape
    k, v = (jax.random.uniform(jax.random.PRNGKey(i), shape, minval=-2, maxval=2) for i in (1, 2))
    cache = KVCache(k, v)
    if quantize_kvcache:
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        cache = KVCache(kq, vq, ks, vs)
    filled = cache
    ours, _ = decode_step(params, tokens, positions, filled, model.config, cpu_kernels=True)
    xla, _ = decode_step(params, tokens, positions, filled, model.config, cpu_kernels=False)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(xla), rtol=1e-4, atol=1e-4)
