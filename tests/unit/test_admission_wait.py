"""An idle device loop admits a burst of arrivals together (`admission_wait_ms`): with nothing
running, it waits while requests keep coming, each within `admission_gap_ms` of the last, so that
their prompts prefill in one call and they decode in step. The orchestrator's calls to the mock
engine are read, not the clock: each wait below is far longer than the machine's scheduling."""

from __future__ import annotations

import time

from serving.config import OrchestratorConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams


def _orchestrator(wait_ms: float, gap_ms: float, step_seconds: float = 0.0) -> Orchestrator:
    engine = MockEngine(
        slots=4, max_prefill_length=64, max_target_length=256, max_prefill_batch=4, step_seconds=step_seconds
    )
    config = OrchestratorConfig(max_queued_requests=16, admission_wait_ms=wait_ms, admission_gap_ms=gap_ms)
    return Orchestrator(engine, {}, AsciiTokenizer(), config).start()


def _prefill_rows(engine: MockEngine) -> list[int]:
    return [len(call[1]) for call in engine.calls if call[0] == "prefill_slots"]


def test_a_burst_reaching_an_idle_loop_prefills_in_one_call():
    orch = _orchestrator(wait_ms=20_000, gap_ms=2_000)
    try:
        first = orch.submit([5, 6, 7], SamplingParams(max_tokens=4))
        time.sleep(0.3)  # the loop has taken it up and waits for the burst's next arrival
        assert _prefill_rows(orch.engine) == []
        rest = [orch.submit([8 + i, 9], SamplingParams(max_tokens=4)) for i in range(3)]
        done = [h.result() for h in (first, *rest)]
    finally:
        orch.stop(timeout=10)
    assert _prefill_rows(orch.engine)[0] == 4  # the four together
    assert [len(r.token_ids) for r in done] == [4, 4, 4, 4]


def test_a_lone_request_waits_one_gap_and_a_loop_with_work_running_never_waits():
    orch = _orchestrator(wait_ms=20_000, gap_ms=300, step_seconds=0.02)  # 50 calls: 1 s of decoding
    try:
        started = time.monotonic()
        long = orch.submit([5, 6], SamplingParams(max_tokens=100))
        while not _prefill_rows(orch.engine):
            time.sleep(0.005)
        assert time.monotonic() - started >= 0.3  # one gap with no arrival, not the whole wait
        # while it decodes, an arrival is scheduled at the loop's next turn: no gathering
        late = orch.submit([7], SamplingParams(max_tokens=2))
        assert len(late.result().token_ids) == 2
        assert not long._request.ended  # the late one came, prefilled and ended while the first decoded
        assert len(long.result().token_ids) == 100
    finally:
        orch.stop(timeout=10)
    assert _prefill_rows(orch.engine) == [1, 1]


def test_a_burst_that_takes_every_free_slot_is_scheduled_without_waiting_for_more():
    """Gathering stops once the waiting requests take every free slot (no later arrival could join
    their turn): four arrivals on four slots are scheduled at once, not a 20 s gap after the last."""
    orch = _orchestrator(wait_ms=20_000, gap_ms=20_000)
    try:
        first = orch.submit([5, 6, 7], SamplingParams(max_tokens=4))
        time.sleep(0.3)  # the loop has taken it up and waits for the burst's next arrival
        started = time.monotonic()
        rest = [orch.submit([8 + i, 9], SamplingParams(max_tokens=4)) for i in range(3)]
        done = [h.result() for h in (first, *rest)]
        assert time.monotonic() - started < 10  # not the gap's 20 s
    finally:
        orch.stop(timeout=10)
    assert _prefill_rows(orch.engine)[0] == 4 and [len(r.token_ids) for r in done] == [4, 4, 4, 4]
