"""int8 weights and the int8 KV cache against the float model, within stated tolerances."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.kernels import library
from serving.kernels.backend import CpuKernelOps
from serving.kernels.packing import pack_for_cpu_kernels
from serving.models import (
    QuantizedWeight,
    decode_step,
    init_params,
    prefill,
    quantize_params,
    store_prefix,
)
from serving.models.ops import XLA
from serving.models.quantization import int8_dot, quantize_int8, with_int8_activations
from tests.conftest import DATA
from tests.reference import row_cache


def test_int8_roundtrip_error_is_within_half_a_step():
    w = np.random.default_rng(0).normal(size=(3, 64, 32)).astype(np.float32)
    q = quantize_int8(w)
    assert q.values.dtype == jnp.int8 and q.scales.shape == (3, 1, 32)
    restored = np.asarray(q.values, np.float32) * np.asarray(q.scales)
    assert np.all(np.abs(restored - w) <= np.asarray(q.scales) / 2 + 1e-7)


@pytest.mark.parametrize("axis", [-2, -1])
def test_host_quantization_in_place_gives_the_plain_formulas_numbers_and_leaves_its_input(axis):
    """quantize_int8_numpy works on one float32 copy in place: its values and scales are exactly
    clip(rint(w / (max|w| / 127)), -127, 127) (all-zero channels, -0.0, bfloat16 input), and the
    caller's array is untouched."""
    import ml_dtypes

    from serving.models.quantization import quantize_int8_numpy

    rng = np.random.default_rng(3)
    w = rng.normal(size=(2, 64, 48)).astype(np.float32)
    w[0, :, 5], w[1, 7, :], w[1, 3, 4] = 0.0, -0.0, -3.5
    for given in (w, w.astype(ml_dtypes.bfloat16)):
        before = given.copy()
        values, scales = quantize_int8_numpy(given, axis)
        f = np.asarray(given, np.float32)
        absmax = np.max(np.abs(f), axis=axis, keepdims=True)
        want_scales = np.where(absmax > 0, absmax / 127.0, 1.0).astype(np.float32)
        want = np.clip(np.rint(f / want_scales), -127, 127).astype(np.int8)
        assert values.dtype == np.int8 and scales.dtype == np.float32
        np.testing.assert_array_equal(scales, want_scales)
        np.testing.assert_array_equal(values, want)
        np.testing.assert_array_equal(given, before)  # not written through


def test_quantize_params_replaces_matmul_weights_and_the_embedding(tiny_cfg):
    params = quantize_params(init_params(tiny_cfg, jax.random.PRNGKey(0)))
    layers = params["layers"]
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
        assert isinstance(layers[name], QuantizedWeight)
    assert isinstance(params["lm_head"], QuantizedWeight)
    assert isinstance(params["embed"], QuantizedWeight) and params["embed"].scales.shape == (
        tiny_cfg.vocab_size,
        1,
    )
    assert layers["attn_norm"].dtype == jnp.float32 and params["final_norm"].dtype == jnp.float32


@pytest.mark.parametrize(
    ("mode", "min_agreement", "max_perplexity_ratio"),
    # Measured: weights only 95.3% and +0.5%; through the CPU kernel (int16 activations) the same;
    # with int8 activations (w8a8) a draw that one-ulp changes redraw (tests/test_w8a8.py): 87%
    # and +5.5% on average, at worst 84% and +8.2% (on the AMD CI machine 85.2% and +8.0%).
    [("weights", 0.9, 1.02), ("kernel", 0.9, 1.02), ("activations", 0.8, 1.10)],
)
def test_int8_on_smollm2_agrees_with_float(smollm2, mode, min_agreement, max_perplexity_ratio):
    """Top-1 agreement over an English text and a bounded perplexity change."""
    if mode == "kernel" and not library.status().available:
        pytest.skip(f"the CPU kernels do not run here: {library.status().detail}")
    ids = smollm2.tokenizer.encode_prompt((DATA / "english.txt").read_text())[:256]
    tokens, lengths = jnp.asarray([ids]), jnp.array([len(ids)])
    float_logits, _ = prefill(smollm2.params, tokens, lengths, smollm2.config)
    params = quantize_params(smollm2.params)
    if mode == "activations":
        params = with_int8_activations(params)
    if mode == "kernel":
        params = pack_for_cpu_kernels(params)
    ops = CpuKernelOps() if mode == "kernel" else XLA
    int8_logits, _ = prefill(params, tokens, lengths, smollm2.config, ops=ops)
    agreement = np.mean(np.argmax(float_logits[0], -1) == np.argmax(int8_logits[0], -1))
    assert agreement >= min_agreement

    def nll(logits):
        logprobs = jax.nn.log_softmax(logits[0, :-1], axis=-1)
        return -float(jnp.mean(jnp.take_along_axis(logprobs, tokens[0, 1:, None], axis=-1)))

    assert np.exp(nll(int8_logits)) <= np.exp(nll(float_logits)) * max_perplexity_ratio


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("transposed", [False, True])
def test_int8_dot_is_the_per_row_quantized_product(rows, transposed):
    """Exactly what per-row int8 activations times int8 weights give, and close to the float product."""
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, 48)).astype(np.float32)
    w = quantize_int8(rng.normal(size=(48, 40)).astype(np.float32))
    values, scales = np.asarray(w.values), np.asarray(w.scales)[0]
    row_scales = np.maximum(np.abs(x).max(axis=1, keepdims=True), 1e-30) / 127
    xq = np.clip(np.rint(x / row_scales), -127, 127).astype(np.int64)
    expected = (xq @ values.astype(np.int64)).astype(np.float32) * row_scales * scales
    stored = jnp.asarray(values.T) if transposed else w.values
    got = np.asarray(
        jax.jit(int8_dot, static_argnums=3)(jnp.asarray(x[None]), stored, w.scales[0], transposed)
    )
    assert got.shape == (1, rows, 40)
    np.testing.assert_allclose(got[0], expected, rtol=1e-6, atol=1e-6)
    exact = x @ (values * np.asarray(w.scales))
    assert np.abs(got[0] - exact).max() <= 0.05 * np.abs(exact).max()


def test_with_int8_activations_marks_every_quantized_weight(tiny_cfg):
    params = with_int8_activations(quantize_params(init_params(tiny_cfg, jax.random.PRNGKey(0))))
    weights = jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, QuantizedWeight))
    quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
    assert len(quantized) == 9 and all(w.activations for w in quantized)


def test_int8_kv_cache_decode_close_to_float_cache(tiny_cfg):
    params = init_params(tiny_cfg, jax.random.PRNGKey(1))
    prompt = jnp.asarray(np.random.default_rng(2).integers(0, tiny_cfg.vocab_size, (1, 16)), jnp.int32)
    _, kv = prefill(params, prompt, jnp.array([16]), tiny_cfg)
    results = {}
    for quantized in (False, True):
        cache, pages = row_cache(tiny_cfg, 1, 32, quantized=quantized)
        cache = store_prefix(cache, kv, pages[0])
        assert cache.quantized == quantized
        logits = []
        for step in range(8):
            out, cache = decode_step(
                params, jnp.array([step + 3]), jnp.array([16 + step]), cache, tiny_cfg, pages=pages
            )
            logits.append(out)
        results[quantized] = np.stack(logits)
    scale = np.abs(results[False]).max()
    assert np.abs(results[True] - results[False]).max() <= 0.02 * scale
    assert cache.k.dtype == jnp.int8


def test_bfloat16_weights_stay_close_to_float32(tiny_model_dir):
    """weight_dtype=bfloat16 stores weights in bf16; compute stays float32 (dtype=float32)."""
    from serving.checkpoints.hf import load_hf_params, read_hf_config

    cfg = read_hf_config(tiny_model_dir)
    f32 = load_hf_params(tiny_model_dir, cfg, "float32")
    bf16 = load_hf_params(tiny_model_dir, cfg, "bfloat16")
    assert bf16["layers"]["wq"].dtype == jnp.bfloat16 and bf16["embed"].dtype == jnp.bfloat16
    tokens = jnp.asarray([[5, 17, 250, 3, 99, 42, 7, 1]])
    ref, _ = prefill(f32, tokens, jnp.array([8]), cfg)
    out, _ = prefill(bf16, tokens, jnp.array([8]), cfg)
    assert out.dtype == jnp.float32
    assert np.abs(np.asarray(out) - np.asarray(ref)).max() <= 0.02 * np.abs(np.asarray(ref)).max()
