"""Speculative decoding through the real orchestrator, scheduler and executor on the mock engine
(tokens by hand: each the previous plus one): the n-gram lookup's proposals are verified, the
streams get the same text as without, and the policy keeps it off where it should."""

from __future__ import annotations

from serving.config import OrchestratorConfig, SpeculativeConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams

TOKENIZER = AsciiTokenizer()
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def _run(requests, method="ngram", max_slots=4, slots=4):
    engine = MockEngine(slots=slots)
    spec = SpeculativeConfig(speculative_method=method, num_speculative_tokens=3, speculative_max_slots=max_slots,
                             speculative_cost_ratio=0.0)
    orchestrator = Orchestrator(engine, {}, TOKENIZER, OrchestratorConfig(speculative=spec)).start()
    try:
        handles = [orchestrator.submit_choices(TOKENIZER.encode(p), s, stops) for p, s, stops in requests]
        results = [[h.result().text for h in group] for group in handles]
    finally:
        orchestrator.stop(timeout=10)
    return results, engine.calls, orchestrator.metrics


REQUESTS = [
    (ALPHABET + "abc", SamplingParams(max_tokens=12), ()),  # "defg..." is in the prompt: the lookup finds it
    (ALPHABET + "ab", SamplingParams(max_tokens=20), ("op",)),  # a stop string
    ("xyz", SamplingParams(max_tokens=5), ()),  # nothing to look up
    (ALPHABET + "abc", SamplingParams(max_tokens=6, temperature=1.0, n=2, seed=3), ()),
]


def test_speculation_gives_the_same_text_and_verifies_proposals():
    plain, plain_calls, _ = _run(REQUESTS, method="none")
    spec, calls, metrics = _run(REQUESTS)
    assert spec == plain
    assert spec[0] == ["defghijklmno"] and spec[1] == ["cdefghijklmn"]
    assert not any(c[0] == "verify" for c in plain_calls)
    assert any(c[0] == "verify" for c in calls)
    assert metrics.spec_accepted > 0 and metrics.spec_accepted <= metrics.spec_proposed
    assert metrics.speculative_method == "ngram"


def test_speculation_stays_off_for_an_opted_out_request_and_at_zero_slots():
    _, calls, metrics = _run(REQUESTS[:2], max_slots=0)
    assert not any(c[0] == "verify" for c in calls) and metrics.spec_proposed == 0
    opted_out = [(ALPHABET + "abc", SamplingParams(max_tokens=12, speculative=False), ())]
    _, calls, _ = _run(opted_out)
    assert not any(c[0] == "verify" for c in calls)


def test_a_speculative_plan_reaches_a_follower_whole(monkeypatch):
    """The multi-host leader's plan carries the proposals (n-gram) and the draft's rows: a follower
    receives the same ones (the plan channel's wire, as tests/unit/test_lockstep.py fakes it)."""
    import numpy as np

    from serving.engine.api import PrefillRow
    from serving.orchestrator.plan import StepPlan
    from tests.unit.test_lockstep import Wire, channel

    wire = Wire(monkeypatch)
    rows = (PrefillRow(1, (5, 6, 7), 40, True, SamplingParams(max_tokens=3)),)
    plan = StepPlan(decode_steps=4, running=2, max_position=43, slots=(0, 1),
                    proposals=np.arange(12, dtype=np.int32).reshape(4, 3),
                    num_proposed=np.array([3, 0, 0, 0], np.int32), draft_rows=rows)
    channel(True).send(plan)
    wire.sending = False
    got = channel(False).receive()
    assert isinstance(got, StepPlan) and got.draft_rows == rows and got.decode_steps == 4
    np.testing.assert_array_equal(got.proposals, plan.proposals)
    np.testing.assert_array_equal(got.num_proposed, plan.num_proposed)
