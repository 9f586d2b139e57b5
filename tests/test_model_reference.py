"""Our Llama forward pass against transformers.LlamaForCausalLM on random small configs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from serving.checkpoints.hf import load_hf_params, read_hf_config
from serving.models import prefill, store_prefix
from serving.models.llama import decode_step
from tests.conftest import make_hf_llama
from tests.reference import row_cache

TOL = 1e-4

# (kv heads for 4 query heads -> groups of 4, 2 and 1), llama3 rope scaling, tied embeddings.
CASES = [
    pytest.param(dict(num_kv_heads=1, rope_scaling=False, tie=False), id="groups4-plain-untied"),
    pytest.param(dict(num_kv_heads=2, rope_scaling=True, tie=False), id="groups2-llama3-untied"),
    pytest.param(dict(num_kv_heads=4, rope_scaling=False, tie=True), id="groups1-plain-tied"),
    pytest.param(dict(num_kv_heads=1, rope_scaling=True, tie=True), id="groups4-llama3-tied"),
]

PROMPTS = [[5, 17, 250, 3, 99, 42, 7, 1, 300, 11, 64], [8, 2, 199, 45, 71, 6]]  # true lengths 11, 6
PADDED = 16
DECODE_STEPS = 12


@pytest.fixture(scope="module", params=CASES)
def reference(request, tmp_path_factory):
    directory = make_hf_llama(tmp_path_factory.mktemp("hf"), **request.param)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    cfg = read_hf_config(directory)
    return model, cfg, load_hf_params(directory, cfg)


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _padded_batch() -> tuple[jnp.ndarray, jnp.ndarray]:
    tokens = np.zeros((len(PROMPTS), PADDED), np.int32)
    for row, ids in enumerate(PROMPTS):
        tokens[row, : len(ids)] = ids
    return jnp.asarray(tokens), jnp.array([len(p) for p in PROMPTS], jnp.int32)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_prefill_logits_match_transformers(reference, scan_layers):
    model, cfg, params = reference
    tokens, lengths = _padded_batch()
    logits, _ = prefill(params, tokens, lengths, cfg, scan_layers=scan_layers)
    for row, ids in enumerate(PROMPTS):
        expected = _hf_logits(model, ids)
        np.testing.assert_allclose(np.asarray(logits[row, : len(ids)]), expected, atol=TOL, rtol=0)
    # `last`: only each row's logits at its last token (the LM head on those positions alone)
    last, _ = prefill(params, tokens, lengths, cfg, scan_layers=scan_layers, last=lengths - 1)
    assert last.shape == (len(PROMPTS), logits.shape[-1])
    np.testing.assert_allclose(np.asarray(last), np.asarray(logits[jnp.arange(len(PROMPTS)), lengths - 1]),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scan", "unrolled"])
def test_decode_steps_through_cache_match_transformers(reference, scan_layers):
    """Prefill two prompts of different lengths, then decode both rows at their own positions."""
    model, cfg, params = reference
    rng = np.random.default_rng(1)
    continuations = [rng.integers(0, cfg.vocab_size, DECODE_STEPS).tolist() for _ in PROMPTS]
    expected = [_hf_logits(model, p + c) for p, c in zip(PROMPTS, continuations, strict=True)]

    tokens, lengths = _padded_batch()
    _, prompt_kv = prefill(params, tokens, lengths, cfg, scan_layers=scan_layers)
    cache, pages = row_cache(cfg, batch=len(PROMPTS), length=64)
    for row in range(len(PROMPTS)):
        row_kv = type(prompt_kv)(prompt_kv.k[:, row : row + 1], prompt_kv.v[:, row : row + 1])
        cache = store_prefix(cache, row_kv, pages[row])

    positions = np.array([len(p) for p in PROMPTS])
    for step in range(DECODE_STEPS):
        step_tokens = jnp.array([c[step] for c in continuations], jnp.int32)
        logits, cache = decode_step(
            params, step_tokens, jnp.asarray(positions), cache, cfg, scan_layers=scan_layers, pages=pages
        )
        for row in range(len(PROMPTS)):
            np.testing.assert_allclose(
                np.asarray(logits[row]),
                expected[row][positions[row]],
                atol=TOL,
                rtol=0,
                err_msg=f"step {step}",
            )
        positions += 1


def test_scan_and_unrolled_give_the_same_numbers(reference):
    _, cfg, params = reference
    tokens, lengths = _padded_batch()
    scanned, kv_scanned = prefill(params, tokens, lengths, cfg, scan_layers=True)
    unrolled, kv_unrolled = prefill(params, tokens, lengths, cfg, scan_layers=False)
    np.testing.assert_allclose(np.asarray(scanned), np.asarray(unrolled), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(kv_scanned.k), np.asarray(kv_unrolled.k), atol=1e-5, rtol=0)
