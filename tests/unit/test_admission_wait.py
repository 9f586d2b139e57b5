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


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_an_idle_loop_gathers_while_the_last_waves_answers_are_still_being_read():
    """A closed loop's clients send their next requests as their answers come: while the requests
    that just ended still have their last token unread (their answers not yet written), an idle
    loop keeps gathering past a gap with no arrival, so that the next wave prefills in one call
    (on a TPU VM, 64 answers written over 80 ms split the next wave into five prefill calls)."""
    orch = _orchestrator(wait_ms=20_000, gap_ms=50)
    try:
        wave = [orch.submit([5 + i, 6], SamplingParams(max_tokens=2)) for i in range(2)]
        _until(lambda: all(h._request.ended for h in wave))  # ended on the device, answers unread
        first = orch.submit([20, 21], SamplingParams(max_tokens=2))
        time.sleep(0.25)  # five gaps with no arrival: gathering still, for the unread answers
        assert _prefill_rows(orch.engine) == [2]
        wave[0].result()
        second = orch.submit([22, 23], SamplingParams(max_tokens=2))
        time.sleep(0.25)
        assert _prefill_rows(orch.engine) == [2]  # one answer is still unread
        wave[1].result()  # the last answer read: one gap later the two arrivals go together
        done = [first.result(), second.result()]
    finally:
        orch.stop(timeout=10)
    assert _prefill_rows(orch.engine) == [2, 2]
    assert [len(r.token_ids) for r in done] == [2, 2]


def test_an_answer_never_read_holds_an_idle_loop_no_longer_than_the_wait():
    """A reader that never comes for its last token (a stuck client) holds gathering for
    admission_wait_ms at most, and a cancelled request's not at all."""
    orch = _orchestrator(wait_ms=600, gap_ms=50, step_seconds=0.01)
    try:
        stuck = orch.submit([5, 6], SamplingParams(max_tokens=2))
        _until(lambda: stuck._request.ended)
        started = time.monotonic()
        late = orch.submit([7, 8], SamplingParams(max_tokens=2))
        assert len(late.result().token_ids) == 2
        assert time.monotonic() - started < 15  # the wait's 0.6 s bound, not forever
        gone = orch.submit([9, 10], SamplingParams(max_tokens=200))  # 2 s of decoding
        _until(lambda: _prefill_rows(orch.engine) == [1, 1, 1])
        gone.cancel()
        _until(lambda: gone._request.ended)
        assert gone._request.request_id not in orch._answering  # its reader left: no answer to wait for
    finally:
        orch.stop(timeout=10)
