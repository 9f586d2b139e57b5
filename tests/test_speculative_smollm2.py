"""Speculative decoding on the real SmolLM2-135M-Instruct (float32): greedy tokens identical with
and without it, for the n-gram lookup and for the model drafting for itself (which accepts
everything), over short and long (chunked) prompts, one of them a copy-the-input request."""

from __future__ import annotations

import pytest

from serving.config import ServingConfig, SpeculativeConfig
from serving.engine.draft import DraftModel
from serving.engine.engine import Engine
from serving.orchestrator.offline import run_to_completion
from serving.orchestrator.proposers import Speculator
from serving.request import SamplingParams
from tests.conftest import DATA

PARAGRAPH = (
    "The lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
    "climbed the narrow stairs and polished the great lens."
)


@pytest.fixture(scope="module")
def served(smollm2):
    """The engine, built with SmolLM2 as its own draft (k = 4) on the same params: the draft runs
    only for a plan of draft rows (speculative_method=draft)."""
    cfg = ServingConfig(per_device_batch_size=4, max_prefill_predict_length=256, max_target_length=512,
                        prefill_chunk_size=64, decode_steps_per_call=2)
    draft_engine = Engine(smollm2, DraftModel.engine_config(cfg.engine, 4))
    params = draft_engine.load_params()  # placed as the target's: the same model, mesh and layout
    engine = Engine(smollm2, cfg.engine, draft=DraftModel(draft_engine, params, smollm2.tokenizer, 4))
    return smollm2, engine, params


def _requests(tokenizer):
    def chat(text):
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))

    stops = tokenizer.eos_ids
    return [
        (chat(f"Repeat this paragraph exactly:\n\n{PARAGRAPH}"), SamplingParams(max_tokens=48, stop_ids=stops)),
        (chat("What is the capital of France?"), SamplingParams(max_tokens=20, stop_ids=stops)),
        (tokenizer.encode_prompt((DATA / "english.txt").read_text()[:700]), SamplingParams(max_tokens=24)),
        (tokenizer.encode_prompt("One, two, three, four, five, six,"), SamplingParams(max_tokens=24)),
    ]


def _speculator(method, engine):
    config = SpeculativeConfig(speculative_method=method, num_speculative_tokens=4, speculative_max_slots=4,
                               speculative_cost_ratio=0.0)
    return Speculator(config, chunk=engine.limits.prefill_chunk_size)


def test_smollm2_greedy_identical_with_ngram_and_with_itself_as_draft(served):
    model, engine, params = served
    requests = _requests(model.tokenizer)
    plain = [r.token_ids for r in run_to_completion(engine, params, requests)]
    ngram = _speculator("ngram", engine)
    assert [r.token_ids for r in run_to_completion(engine, params, requests, speculator=ngram)] == plain
    assert ngram.stats.accepted / ngram.stats.proposed > 0.3

    draft = _speculator("draft", engine)
    assert [r.token_ids for r in run_to_completion(engine, params, requests, speculator=draft)] == plain
    assert draft.stats.proposed > 40 and draft.stats.accepted / draft.stats.proposed > 0.95
