"""LoRA adapters read from PEFT directories, applied per row by the model: logits equal
transformers + peft (unmerged), each adapter alone and mixed in one batch with the base model."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from serving.checkpoints.hf import load_hf_params, read_hf_config
from serving.lora.errors import AdapterError
from serving.lora.peft import read_adapter
from serving.lora.stack import init_stack, lora_batch, write_slot
from serving.models import prefill, store_prefix
from serving.models.llama import decode_step
from tests.conftest import make_hf_llama
from tests.lora.adapters import ADAPTERS, make_adapters, peft_model, reference_logits
from tests.reference import row_cache

RTOL = 1e-4
PROMPTS = [[5, 17, 250, 3, 99, 42, 7, 1, 300, 11, 64], [8, 2, 199, 45, 71, 6], [9, 9, 31, 4], [100, 7, 12, 13, 14]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = make_hf_llama(tmp_path_factory.mktemp("base"), num_kv_heads=2, rope_scaling=True)
    adapters = make_adapters(base, tmp_path_factory.mktemp("adapters"))
    cfg = read_hf_config(base)
    return base, adapters, cfg, load_hf_params(base, cfg)


def _close(actual, expected):
    scale = np.abs(expected).max()
    np.testing.assert_allclose(actual, expected, atol=RTOL * scale, rtol=RTOL)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_mixed_batch_prefill_and_decode_equal_peft_unmerged(setup, scan_layers):
    """Rows 0-2 under the three adapters, row 3 the base model, in one prefill and decode steps."""
    base, adapters, cfg, params = setup
    params = dict(params)
    params["lora"] = init_stack(cfg, max_loras=3, max_rank=16, dtype=jnp.float32, sharding=None)
    for slot, (name, *_rest) in enumerate(ADAPTERS, start=1):
        write_slot(params, slot, read_adapter(str(adapters[name]), cfg, max_rank=16))
    slots = jnp.array([1, 2, 3, 0], jnp.int32)
    names = [a[0] for a in ADAPTERS] + [None]
    refs = [peft_model(base, adapters[n] if n else None) for n in names]
    tokens = np.zeros((len(PROMPTS), 16), np.int32)
    for row, ids in enumerate(PROMPTS):
        tokens[row, : len(ids)] = ids
    lengths = jnp.array([len(p) for p in PROMPTS], jnp.int32)
    if not scan_layers:
        from serving.models.llama import unstack_layers

        params = unstack_layers(params)
    logits, kv = prefill(params, jnp.asarray(tokens), lengths, cfg, scan_layers=scan_layers, lora=lora_batch(params, slots))
    for row, ids in enumerate(PROMPTS):
        expected = reference_logits(refs[row], ids)
        _close(np.asarray(logits[row, : len(ids)]), expected)
        if names[row] is not None:  # the adapter moves the logits far past the tolerance
            assert np.abs(expected - reference_logits(refs[-1], ids)).max() > 100 * RTOL * np.abs(expected).max()

    cache, pages = row_cache(cfg, batch=len(PROMPTS), length=64)
    for row in range(len(PROMPTS)):
        cache = store_prefix(cache, type(kv)(kv.k[:, row : row + 1], kv.v[:, row : row + 1]), pages[row])
    rng = np.random.default_rng(3)
    extra = [rng.integers(0, cfg.vocab_size, 4).tolist() for _ in PROMPTS]
    positions = np.array([len(p) for p in PROMPTS])
    for step in range(4):
        step_tokens = jnp.array([e[step] for e in extra], jnp.int32)
        out, cache = decode_step(
            params, step_tokens, jnp.asarray(positions + step, jnp.int32), cache, cfg, scan_layers=scan_layers,
            lora=lora_batch(params, slots), pages=pages,
        )
        for row, ids in enumerate(PROMPTS):
            expected = reference_logits(refs[row], ids + extra[row][: step + 1])[-1]
            _close(np.asarray(out[row]), expected)


def test_adapter_shapes_and_ranks_that_do_not_fit_are_refused_naming_the_tensor(setup, tmp_path):
    _, adapters, cfg, _ = setup
    with pytest.raises(AdapterError, match="max_lora_rank=8"):
        read_adapter(str(adapters["mlp-r16-rs"]), cfg, max_rank=8)
    other = make_hf_llama(tmp_path / "wide", num_kv_heads=4)  # k_proj / v_proj: 64 outputs, not 32
    wrong = read_hf_config(other)
    with pytest.raises(AdapterError, match=r"self_attn\.k_proj\.lora_B\.weight.*has shape \[32, 8\]"):
        read_adapter(str(adapters["all-r8"]), wrong, max_rank=16)
    config = json.loads((adapters["attn-r4"] / "adapter_config.json").read_text())
    (tmp_path / "dora").mkdir()
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (tmp_path / "dora" / "adapter_model.safetensors").write_bytes(
        (adapters["attn-r4"] / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match="use_dora"):
        read_adapter(str(tmp_path / "dora"), cfg, max_rank=16)
    with pytest.raises(AdapterError, match="not found"):
        read_adapter(str(tmp_path / "missing"), cfg, max_rank=16)


def test_int8_kv_cache_with_adapters_stays_within_the_int8_cache_bound(setup):
    """Prefill and decode through an int8 KV cache, three adapters and the base model in one batch:
    within tests/test_quantization.py's bound for the int8 cache (2% of the largest logit) of
    transformers + peft (float, unmerged)."""
    base, adapters, cfg, params = setup
    params = dict(params)
    params["lora"] = init_stack(cfg, max_loras=3, max_rank=16, dtype=jnp.float32, sharding=None)
    for slot, (name, *_rest) in enumerate(ADAPTERS, start=1):
        write_slot(params, slot, read_adapter(str(adapters[name]), cfg, max_rank=16))
    slots = jnp.array([1, 2, 3, 0], jnp.int32)
    refs = [peft_model(base, adapters[a[0]]) for a in ADAPTERS] + [peft_model(base, None)]
    prompt = PROMPTS[1]
    tokens = jnp.asarray([prompt] * 4)
    lengths = jnp.full((4,), len(prompt), jnp.int32)
    _, kv = prefill(params, tokens, lengths, cfg, quantized_kv=True, lora=lora_batch(params, slots))
    cache, pages = row_cache(cfg, batch=4, length=64, quantized=True)
    for row in range(4):
        cache = store_prefix(cache, type(kv)(kv.k[:, row : row + 1], kv.v[:, row : row + 1]), pages[row])
    extra = [3, 250, 17, 99]
    for step, token in enumerate(extra):
        out, cache = decode_step(
            params, jnp.full((4,), token, jnp.int32), jnp.full((4,), len(prompt) + step, jnp.int32), cache, cfg,
            lora=lora_batch(params, slots), pages=pages,
        )
        base_expected = reference_logits(refs[3], prompt + extra[: step + 1])[-1]
        for row in range(4):
            expected = reference_logits(refs[row], prompt + extra[: step + 1])[-1]
            scale = np.abs(expected).max()
            assert np.abs(np.asarray(out[row]) - expected).max() <= 0.02 * scale
            if row < 3:  # the bound tells the adapters apart
                assert np.abs(expected - base_expected).max() > 0.1 * scale
    assert cache.k.dtype == jnp.int8
