"""The scheduler's decisions as plain data, and the executor running them on the mock engine."""

from __future__ import annotations

import pytest

from serving.engine.limits import Limits
from serving.engine.mock import MockEngine
from serving.orchestrator.executor import Executor
from serving.orchestrator.scheduler import Scheduler, StepOutcome, Waiting
from serving.request import SamplingParams


def _waiting(request_id: int, length: int = 3, max_tokens: int = 4, **kw) -> Waiting:
    return Waiting(request_id, tuple(range(1, length + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def test_choices_and_a_scored_prompt_take_chunked_slots_in_order():
    """n > 1 without the prefix cache: a prefilling slot a choice, each computing the prompt; the
    prompt's logprobs alone (max_tokens 0): a scored chunk, alone in its call."""
    scheduler = Scheduler(Limits(4, 32, 64, prefill_batch_tokens=64), decode_steps_per_call=2)
    choices = SamplingParams(max_tokens=4, n=2, temperature=1.0)
    plan = scheduler.schedule([Waiting(7, (1, 2, 3), choices, (9,)), _waiting(8, length=20, max_tokens=0, prompt_logprobs=0)])
    assert [(r.slot, r.tokens, r.start, r.final, r.score) for r in plan.rows] == [
        (0, (1, 2, 3), 0, True, False), (1, (1, 2, 3), 0, True, False),
    ]
    assert [r.sampling.seed for r in plan.rows] == [choices.choice_seed(0), choices.choice_seed(1)]
    assert scheduler.room() == 1 and set(scheduler.prefilling) == {2}
    scheduler.update(plan, StepOutcome((5, 6)))
    plan = scheduler.schedule([])
    assert [(r.slot, r.final, r.score) for r in plan.rows] == [(2, True, True)]  # alone, scored
    with pytest.raises(ValueError, match="2 slots asked for, 1 free"):
        scheduler.schedule([Waiting(9, (1,), SamplingParams(n=2, temperature=1.0), (10,))])


def test_plain_requests_enter_their_slots_as_rows_of_one_prefill_call():
    scheduler = Scheduler(Limits(2, 32, 64, prefill_batch_tokens=64), decode_steps_per_call=2)
    plan = scheduler.schedule([_waiting(7, length=3), _waiting(8, length=20)])
    assert [(r.slot, r.tokens, r.start, r.final) for r in plan.rows] == [
        (0, (1, 2, 3), 0, True),
        (1, tuple(range(1, 21)), 0, True),
    ]
    assert (plan.decode_steps, plan.running, plan.max_position, plan.num_slots) == (2, 0, 20, 2)
    assert plan.first_token_slots == (0, 1) and scheduler.room() == 0


def test_positions_are_mirrored_on_the_host_and_finished_slots_come_back():
    scheduler = Scheduler(Limits(2, 32, 64), decode_steps_per_call=2)
    plan = scheduler.schedule([_waiting(1, length=5), _waiting(2, length=9)])
    # slot 0 produced two tokens; slot 1 one, which finished it
    outcome = StepOutcome((10, 11), [[3, 4], [5, 0]], [[True, True], [True, False]], [[False, True], [False, False]])
    assert scheduler.update(plan, outcome) == [(2, 1)]
    assert scheduler.running[0].position == 7 and scheduler.kv_tokens_used() == 7
    assert scheduler.room() == 1


def test_a_first_token_that_finishes_frees_the_slot_at_once():
    scheduler = Scheduler(Limits(1, 32, 64), decode_steps_per_call=1)
    plan = scheduler.schedule([_waiting(1, max_tokens=1)])
    assert scheduler.update(plan, StepOutcome((5,))) == [(1, 0)]
    assert scheduler.room() == 1 and scheduler.schedule([]).empty


def test_cancelled_requests_free_their_slot_before_admissions_take_it():
    scheduler = Scheduler(Limits(1, 32, 64), decode_steps_per_call=1)
    scheduler.schedule([_waiting(1)])
    assert scheduler.room(cancelled={1}) == 1
    plan = scheduler.schedule([_waiting(2)], cancelled={1})
    assert plan.frees == (0,) and [r.slot for r in plan.rows] == [0] and plan.running == 0


def test_the_executor_runs_plans_and_skips_a_generate_call_nothing_needs():
    engine = MockEngine(slots=2, decode_steps_per_call=2)
    scheduler, executor = Scheduler(engine.limits, 2), Executor(engine, {})
    only_one_token = Waiting(1, (4,), SamplingParams(max_tokens=1))
    plan = scheduler.schedule([only_one_token])
    outcome = executor.run(plan)
    assert outcome.first_tokens == (5,) and outcome.tokens == ()
    assert [c[0] for c in engine.calls] == ["init_decode_state", "set_pages", "prefill_slots"]
    assert scheduler.update(plan, outcome) == [(1, 0)]
    plan = scheduler.schedule([Waiting(2, (4,), SamplingParams(max_tokens=3))])
    outcome = executor.run(plan)
    assert outcome.first_tokens == (5,) and [row[0] for row in outcome.tokens] == [6, 7]
    assert engine.calls[-1] == ("generate", 1, 1)  # the host mirror: position 1, nothing read back; 1 slot
    assert scheduler.update(plan, outcome) == [(2, 0)]
    plan = scheduler.schedule([Waiting(3, (4,), SamplingParams(max_tokens=1, prompt_logprobs=0))])  # scored, in chunks
    outcome = executor.run(plan)
    assert outcome.first_tokens == (5,) and engine.calls[-1][0] == "prefill_slots_scored"
    assert scheduler.update(plan, outcome) == [(3, 0)]
    plan = scheduler.schedule([Waiting(4, (4,), SamplingParams(max_tokens=0, prompt_logprobs=0))])  # scored alone
    executor.run(plan)
    assert engine.calls[-1][0] == "prefill_slots_scored" and not [c for c in engine.calls if c[0] in ("prefill", "insert")]


def test_a_request_for_the_prompts_logprobs_goes_in_scored_chunks_alone_reading_no_cached_page():
    """Its prompt's every position is scored (each chunk's last one against the next chunk's
    first token), so no cached page is read for it (vLLM's rule too), and its chunks go alone."""
    engine = MockEngine(slots=4, prefill_chunk_size=16, prefill_batch_tokens=64, prefix_block=8)
    scheduler, executor = Scheduler(engine.limits, 2, prefix_caching=True), Executor(engine, {})
    prompt = tuple(range(1, 41))  # 40 tokens: chunks of 16, 16, 8

    def run(waiting) -> list:
        plan, rows = scheduler.schedule(waiting), []
        while not plan.empty:
            rows += plan.rows
            assert all(not r.score for r in plan.rows) or len(plan.rows) == 1  # a scored chunk goes alone
            scheduler.update(plan, executor.run(plan))
            plan = scheduler.schedule([])
        return rows

    run([Waiting(0, prompt, SamplingParams(max_tokens=2))])
    assert scheduler.take_cached() == {0: 0}
    rows = run([Waiting(1, prompt, SamplingParams(max_tokens=2, prompt_logprobs=1)), Waiting(2, prompt, SamplingParams(max_tokens=2))])
    assert scheduler.take_cached() == {2: 32}  # the plain repeat read 4 cached pages; the scored one none
    mine = [(r.start, len(r.tokens), r.final, r.score_next) for r in rows if r.score]
    assert mine == [(0, 16, False, 17), (16, 16, False, 33), (32, 8, True, -1)]
    assert [c for c in engine.calls if c[0] == "prefill_slots_scored"][-1][1] == (0, 32, 8, True)


def test_a_waiting_requests_adapter_load_goes_into_its_turns_plan():
    from serving.lora.registry import AdapterLoad

    scheduler = Scheduler(Limits(2, 32, 64), decode_steps_per_call=2)
    load = AdapterLoad(1, "sql", 3, "/adapters/sql")
    loading = Waiting(1, (1, 2, 3), SamplingParams(max_tokens=4), adapter_load=load)
    plan = scheduler.schedule([_waiting(0), loading])
    assert plan.adapter_loads == (load,) and {row.slot for row in plan.rows} == {0, 1}
    assert scheduler.schedule([]).adapter_loads == ()  # written once, in the turn it was scheduled
