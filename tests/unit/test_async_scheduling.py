"""Async scheduling (serving.orchestrator.scheduler.runs_ahead / project): the device loop makes and
starts the next plan while the last one's generate call is in flight, then reads that call's tokens.
On the mock engine, whose tokens are hand-computable: the same tokens and finish reasons as each
plan waiting for the last, when requests stop in the middle of a call, finish at their first
token, arrive while others decode, are cancelled, or run short of pages (then it waits); and it
does run ahead."""

from __future__ import annotations

import time

import pytest

from serving.config import OrchestratorConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.orchestrator import Orchestrator
from serving.orchestrator.executor import Executor
from serving.orchestrator.offline import run_to_completion
from serving.orchestrator.scheduler import Scheduler
from serving.request import SamplingParams

TOKENIZER = AsciiTokenizer()


class _Whole(Executor):
    """Each plan run whole (its tokens read before the next plan is made)."""

    pipelines = False


def _engine(**keys) -> MockEngine:
    settings = dict(slots=8, max_prefill_length=64, max_target_length=128, decode_steps_per_call=4,
                    prefill_chunk_size=16, max_prefill_batch=4, prefill_batch_tokens=64)
    return MockEngine(**{**settings, **keys})


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 2 to 40 tokens; max_tokens 1 (finished by the first token), 3 and 30 (finished
    mid-call), stop ids that come in the middle of a call, a seed's own continuation."""
    out = []
    for i in range(20):
        prompt = TOKENIZER.encode(chr(ord("a") + i % 20) * (2 + (i * 7) % 39))
        stop = TOKENIZER.encode(chr(ord("a") + (i + 5) % 26)) if i % 3 == 0 else []
        out.append((prompt, SamplingParams(max_tokens=(1, 3, 30, 17)[i % 4], stop_ids=tuple(stop),
                                           temperature=0.8 if i % 5 == 0 else 0.0, seed=i)))
    return out


@pytest.fixture
def projections(monkeypatch) -> list[int]:
    """How many plans ran ahead (Scheduler.project calls)."""
    calls: list[int] = []
    real = Scheduler.project

    def counted(self, plan):
        calls.append(1)
        return real(self, plan)

    monkeypatch.setattr(Scheduler, "project", counted)
    return calls


@pytest.mark.parametrize("pages, page", [(0, 64), (24, 8)], ids=["pages-enough", "pages-short"])
def test_offline_driver_running_ahead_gives_the_same_tokens(pages, page, projections, monkeypatch):
    requests = _requests()
    engine = _engine(num_pages=pages, prefix_block=page)
    want = run_to_completion(engine, None, requests, executor=_Whole(engine, None))
    assert not projections
    waited, preempted = [], []
    runs_ahead, preempt = Scheduler.runs_ahead, Scheduler._preempt
    monkeypatch.setattr(Scheduler, "runs_ahead", lambda self: runs_ahead(self) or waited.append(1))
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, *a: preempt(self, *a) or preempted.append(1))
    engine = _engine(num_pages=pages, prefix_block=page)
    got = run_to_completion(engine, None, requests)
    assert [(r.token_ids, r.finish_reason) for r in got] == [(r.token_ids, r.finish_reason) for r in want]
    for (prompt, sampling), result in zip(requests, got, strict=True):
        assert result.token_ids == engine.expected(prompt, sampling)[: len(result.token_ids)]
    assert len(projections) > 10  # most decode calls ran ahead
    if pages:  # short of pages: some turns read the call in flight first (a preemption may come)
        assert waited and preempted


def _served(async_scheduling: bool, requests, cancel: int | None = None):
    """The requests' completions on the served loop; with `cancel`, that request is cancelled from
    inside the third generate call on (a call in flight, at any machine's pace)."""
    engine = _engine(step_seconds=0.002)
    handles: list = []
    if cancel is not None:
        generate, calls = engine.generate, [0]

        def cancelling(*args, **kwargs):
            calls[0] += 1
            if calls[0] >= 3 and len(handles) > cancel:
                handles[cancel].cancel()
            return generate(*args, **kwargs)

        engine.generate = cancelling
    config = OrchestratorConfig(max_queued_requests=64, async_scheduling=async_scheduling)
    orchestrator = Orchestrator(engine, {}, TOKENIZER, config).start()
    try:
        for i, (prompt, sampling) in enumerate(requests):
            handles.append(orchestrator.submit(prompt, sampling))
            if i % 5 == 4:
                time.sleep(0.01)  # some arrive while others decode
        return [h.result() for h in handles]
    finally:
        orchestrator.stop(timeout=30)


def test_the_served_loop_running_ahead_streams_the_same_tokens(projections):
    requests = _requests()
    want = _served(False, requests)
    assert not projections
    got = _served(True, requests)
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.token_ids, c.finish_reason) for c in want]
    assert len(projections) > 10


def test_a_request_cancelled_while_its_call_is_in_flight_gets_nothing_after_its_end(projections):
    long = (TOKENIZER.encode("abc"), SamplingParams(max_tokens=120))
    requests = [long, *_requests()[:6]]
    done = _served(True, requests, cancel=0)
    cancelled = done[0]
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 120
    engine = _engine()
    assert cancelled.token_ids == engine.expected(*long)[: len(cancelled.token_ids)]
    for (prompt, sampling), completion in zip(requests[1:], done[1:], strict=True):
        assert completion.token_ids == engine.expected(prompt, sampling)


def test_no_generate_call_runs_for_sequences_the_call_in_flight_ends(projections):
    """Running ahead, the next plan is made before the tokens are read; sequences whose call in
    flight reaches their max_tokens are not decoded again (the device stopped them), so a batch
    that ends together takes no extra generate call: as many as plans run whole."""

    def generates(executor_class) -> tuple[int, list]:
        engine = _engine()
        requests = [(TOKENIZER.encode("ab" * (i + 1)), SamplingParams(max_tokens=10)) for i in range(8)]
        executor = executor_class(engine, None)
        done = run_to_completion(engine, None, requests, executor=executor)
        return sum(1 for call in engine.calls if call[0] == "generate"), [r.token_ids for r in done]

    whole, want = generates(_Whole)
    ahead, got = generates(Executor)
    assert got == want and ahead == whole == 4  # 1 + 9 tokens: 3 calls of 4 steps; the second 4 prompts a call later
    assert projections


def test_the_offline_driver_refuses_a_request_of_several_choices_naming_n():
    """One result a request: n > 1 is refused up front (it crashed in the executor, a zip of one slot
    with two first tokens), naming the field."""
    from serving.errors import GenerationError

    with pytest.raises(GenerationError, match="n=2") as refused:
        run_to_completion(MockEngine(slots=4), None, [([5, 6, 7], SamplingParams(max_tokens=3, n=2, temperature=1.0))])
    assert refused.value.field == "n"


def test_the_offline_driver_gives_no_token_to_a_request_that_only_scores_its_prompt():
    """max_tokens 0 (the prompt's logprobs alone, echo): its prefill samples a token the request
    never asked for; the driver records none (as the server streams none), beside a plain one."""
    engine = MockEngine(slots=4)
    requests = [([5, 6, 7], SamplingParams(max_tokens=0, prompt_logprobs=1)), ([5, 6, 7], SamplingParams(max_tokens=3))]
    done = run_to_completion(engine, None, requests)
    assert [r.token_ids for r in done] == [engine.expected(p, s) for p, s in requests] and done[0].token_ids == []
