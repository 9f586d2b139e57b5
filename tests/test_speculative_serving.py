"""Speculative decoding through the orchestrator on the tiny random model: 16 mixed greedy requests
(short, long, stop strings, logprobs, a JSON grammar, n=2), across chunked prefill and the prefix
cache, give the same tokens with speculation off and on, and the speculation really ran."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serving.checkpoints.model_source import load_model
from serving.config import OrchestratorConfig, ServingConfig, SpeculativeConfig
from serving.engine.engine import Engine
from serving.orchestrator import Orchestrator
from serving.orchestrator.proposers import Speculator, ngram_proposal
from serving.request import Grammar, SamplingParams
from tests.conftest import DATA

TEXT = (DATA / "english.txt").read_text()


def test_ngram_proposal_is_the_continuation_of_the_longest_latest_match():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert ngram_proposal(tokens, 3, 1, 3) == (4, 9, 2)  # "1 2 3" matched at the start
    assert ngram_proposal(tokens, 3, 1, 2) == (5, 6, 1)  # "2 3": its latest earlier occurrence
    assert ngram_proposal(tokens, 2, 4, 5) == ()
    assert ngram_proposal([7, 7, 7], 4, 1, 2) == (7,)  # the continuation stops at the end


def test_speculator_policy():
    config = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=1,
                               speculative_max_slots=2, speculative_min_acceptance=0.5,
                               speculative_cost_ratio=0.0)
    spec = Speculator(config)
    for rid in range(3):
        spec.start(rid, [1, 2, 1], SamplingParams(speculative=rid != 2))
        spec.emitted(rid, [2])
    proposals = spec.propose({0: 0, 2: 2}, 4)
    assert proposals.tokens[0].tolist() == [1, 2] and proposals.num_proposed.tolist() == [2, 0, 0, 0]  # 2 opted out
    assert spec.propose({0: 0, 1: 1, 2: 2}, 4) is None  # more slots than the crossover
    spec.verified(0, 2, 1)  # nothing accepted: acceptance falls below 0.5, the request rests
    rests = 0
    while spec.propose({0: 0}, 4) is None:
        rests += 1
    assert rests == 8
    spec.verified(0, 2, 1)
    rests = 0
    while spec.propose({0: 0}, 4) is None:
        rests += 1
    assert rests == 16  # failing again: a longer rest
    assert spec.stats.proposed == 4 and spec.stats.accepted == 0 and spec.stats.rounds == 2


def test_a_verify_call_runs_only_when_its_expected_tokens_pay_for_it():
    config = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                               speculative_max_slots=8, speculative_cost_ratio=2.0)
    spec = Speculator(config)
    for rid in range(4):
        spec.start(rid, [1, 2, 3, 4, 5, 1] if rid == 0 else [9], SamplingParams(max_tokens=64))
        spec.emitted(rid, [2])
    # alone: 1 + 0.5 x 4 expected tokens against 2 x 1 for a decode step
    assert spec.propose({0: 0}, 4) is not None
    # with three slots that do not propose: 3 + 3 = 6 < 2 x 4
    assert spec.propose({0: 0, 1: 1, 2: 2, 3: 3}, 4) is None
    spec.verified(0, 4, 5)  # all accepted: acceptance 0.75, 1 + 3 + 3 = 7 < 8 still
    assert spec.propose({0: 0, 1: 1, 2: 2, 3: 3}, 4) is None
    spec.verified(0, 4, 5)
    spec.verified(0, 4, 5)  # 0.94: 1 + 3.75 + 3 = 7.75
    spec.verified(0, 4, 5)  # 0.97: 1 + 3.88 + 3 = 7.88 ... never 8 with one slot of four
    assert spec.propose({0: 0, 1: 1}, 4) is not None  # two slots: 1 + 3.9 + 1 >= 4


def test_a_draft_models_proposals_count_in_the_gate():
    """The draft's k forward passes cost steps too: a verify call that pays for itself alone
    (3 expected tokens against 2 steps) does not once the draft adds 1.5 (3 < 3.5)."""
    config = SpeculativeConfig(speculative_method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                               speculative_max_slots=8, speculative_cost_ratio=2.0)
    for draft_cost, pays in ((0.0, True), (1.0, True), (1.5, False)):
        spec = Speculator(config, draft_cost=draft_cost)
        spec.start(0, [1, 2, 3, 4, 5, 1], SamplingParams(max_tokens=64))
        spec.emitted(0, [2])
        assert (spec.propose({0: 0}, 4) is not None) is pays, draft_cost


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    cfg = ServingConfig(
        per_device_batch_size=8, max_prefill_predict_length=64, max_target_length=256, decode_steps_per_call=2,
        prefill_chunk_size=16, prefix_block_size=16, cpu_kernels="off",
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    return model, engine, engine.load_params()


def _requests(tokenizer):
    ids = tokenizer.encode(TEXT)
    sentence = ids[:12]
    looping = sentence * 4  # a prompt that repeats itself: the lookup finds it
    shared = ids[100:140]  # a shared prefix of more than two blocks (the prefix cache)
    out = []
    for i in range(16):
        kind = i % 8
        prompt = {0: ids[i : i + 5], 1: looping, 2: ids[200 : 200 + 90], 3: shared + ids[i : i + 3]}.get(
            kind, looping[i % 5 :] + ids[i : i + 4]
        )
        sampling = SamplingParams(max_tokens=10 + i)
        stops: tuple[str, ...] = ()
        if kind == 4:
            stops = ("e ", "th")
        if kind == 5:
            sampling = SamplingParams(max_tokens=12, logprobs=3)
        if kind == 6:
            sampling = SamplingParams(max_tokens=8, grammar=Grammar("json"))
        if kind == 7:
            sampling = SamplingParams(max_tokens=14, n=2)
        out.append((prompt, sampling, stops))
    return out


def _serve(model, engine, params, requests, method):
    speculative = SpeculativeConfig(speculative_method=method, num_speculative_tokens=3, prompt_lookup_min=1,
                                    speculative_max_slots=8, speculative_min_acceptance=0.0,
                                    speculative_cost_ratio=0.0)
    config = OrchestratorConfig(max_queued_requests=64, speculative=speculative)
    orchestrator = Orchestrator(engine, params, model.tokenizer, config).start()
    results: list = [None] * len(requests)

    def client(i, prompt, sampling, stops):
        handles = orchestrator.submit_choices(prompt, sampling, stops)
        results[i] = [h.result() for h in handles]

    try:
        # the shared-prefix requests (kind 3) a little apart, so a later one finds the blocks cached
        threads = [threading.Thread(target=client, args=(i, *r)) for i, r in enumerate(requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        orchestrator.stop(timeout=60)
    return results, orchestrator.metrics


def test_greedy_tokens_identical_with_ngram_speculation(setup):
    model, engine, params = setup
    requests = _requests(model.tokenizer)
    plain, _ = _serve(model, engine, params, requests, "none")
    spec, metrics = _serve(model, engine, params, requests, "ngram")
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert [c.token_ids for c in a] == [c.token_ids for c in b], i
        assert [c.text for c in a] == [c.text for c in b], i
        assert [c.finish_reason for c in a] == [c.finish_reason for c in b], i
        if a[0].logprobs is not None:
            np.testing.assert_allclose([lp.logprob for lp in a[0].logprobs], [lp.logprob for lp in b[0].logprobs],
                                       atol=1e-4)
    assert metrics.spec_proposed > 0 and metrics.spec_accepted > 0
    assert metrics.prefix_cache_hits > 0


# -- the draft model --------------------------------------------------------------------------


def _with_draft(engine, directory, k=3):
    """An engine like `engine` (its model and config: the same params fit) built with the draft of
    the model at `directory`."""
    from serving.engine.draft import DraftModel

    cfg = ServingConfig(max_prefill_predict_length=64, max_target_length=256, cpu_kernels="off")
    draft_model = load_model(str(directory), cfg)
    draft_engine = Engine(draft_model, DraftModel.engine_config(engine.config, k))
    draft = DraftModel(draft_engine, draft_engine.load_params(), engine.model.tokenizer, k)
    return Engine(engine.model, engine.config, draft=draft)


@pytest.mark.parametrize("draft", ["same", "random"])
def test_greedy_tokens_identical_with_a_draft_model(setup, tiny_model_dir, tmp_path_factory, draft):
    from tests.conftest import make_hf_llama, make_hf_tokenizer

    model, engine, params = setup
    directory = tiny_model_dir
    if draft == "random":
        directory = tmp_path_factory.mktemp("tiny-draft")
        make_hf_llama(directory, vocab=320, rope_scaling=True, seed=1)
        make_hf_tokenizer(directory, vocab=300)
    requests = _requests(model.tokenizer)
    plain, _ = _serve(model, engine, params, requests, "none")
    spec, metrics = _serve(model, _with_draft(engine, directory), params, requests, "draft")
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert [c.token_ids for c in a] == [c.token_ids for c in b], i
    rate = metrics.spec_accepted / metrics.spec_proposed
    if draft == "same":  # the target drafting for itself: every proposal accepted
        assert metrics.spec_proposed > 50 and rate > 0.97, rate
    else:  # a random model of the same tokenizer: almost nothing
        assert metrics.spec_proposed > 20 and rate < 0.15, rate


def test_a_draft_with_another_tokenizer_is_refused(setup, tmp_path_factory):
    from tests.conftest import make_hf_llama, make_hf_tokenizer

    _, engine, _ = setup
    directory = tmp_path_factory.mktemp("tiny-other-tokenizer")
    make_hf_llama(directory, vocab=320)
    make_hf_tokenizer(directory, vocab=280)
    with pytest.raises(ValueError, match="tokenizer is not the target's: vocabulary of 280"):
        _with_draft(engine, directory)


def test_load_draft_reads_speculative_model_beside_the_target(setup, tiny_model_dir):
    from serving.engine.draft import load_draft

    _, engine, _ = setup
    cfg = ServingConfig(max_prefill_predict_length=64, max_target_length=256, cpu_kernels="off",
                        speculative_method="draft", speculative_model=str(tiny_model_dir), num_speculative_tokens=5)
    draft = load_draft(cfg, engine.config, engine.mesh, engine.model.tokenizer, 10 * engine.model.config.num_params)
    assert draft.k == 5 and draft.engine.decode_steps_per_call == 4
    assert draft.engine.max_concurrent_decodes == engine.max_concurrent_decodes
    assert draft.engine.mesh is engine.mesh
    # its 5 forward passes, each a tenth of the (here ten times larger) target's weights
    assert draft.cost_in_steps == pytest.approx(0.5)
