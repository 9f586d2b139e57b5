"""The KV cache's pages in plain Python: the pool's free list, references and cached keys; the
scheduler taking pages as sequences grow, sharing a cached prefix by reference, and preempting the
newest sequence when none are free (on the mock engine, whose pool holds token ids, so a page read
after it was reused for something else would give other tokens)."""

from __future__ import annotations

import pickle

import pytest

from serving.engine.limits import Limits
from serving.engine.mock import MockEngine
from serving.orchestrator import scheduler as scheduler_module
from serving.orchestrator.executor import Executor
from serving.orchestrator.offline import run_to_completion
from serving.orchestrator.pages import PagePool
from serving.orchestrator.scheduler import Scheduler, Waiting
from serving.request import SamplingParams


def test_the_pool_hands_out_the_oldest_free_page_and_a_freed_cached_page_stays_findable_until_then():
    pool = PagePool(5)  # pages 1-4; 0 is scratch
    a = pool.take(2)
    assert a == [1, 2] and pool.num_free == 2 and pool.take(3) is None and pool.num_free == 2
    pool.register(1, b"k1")
    pool.register(2, b"k2")
    pool.release(a)  # freed in reverse: page 2 (the deeper one) goes before page 1
    assert pool.num_free == 4 and pool.num_cached == 2
    assert pool.lookup([b"k1", b"k2", b"k3"]) == [1, 2] and (pool.hits, pool.misses) == (2, 1)
    assert pool.refs(1) == pool.refs(2) == 1 and pool.num_free == 2
    pool.release([1, 2])
    assert pool.take(3) == [3, 4, 2]  # the never-used ones, then the deepest cached page
    assert pool.lookup([b"k1", b"k2"]) == [1]  # k2's page was reused: the chain stops before it
    with pytest.raises(ValueError, match="released more often"):
        pool.release([3, 3])


def _scheduler(num_pages: int = 0, caching: bool = True, slots: int = 4, steps: int = 2) -> Scheduler:
    limits = Limits(slots, 16, 64, prefill_chunk_size=16, prefix_block=4, prefill_batch_tokens=64, num_pages=num_pages)
    return Scheduler(limits, steps, caching)


def test_two_requests_with_one_prefix_hold_its_pages_once():
    scheduler = _scheduler()
    system = tuple(range(1, 13))  # three full pages of 4
    scheduler.schedule([Waiting(0, (*system, 50), SamplingParams(max_tokens=4))])
    plan = scheduler.schedule([Waiting(1, (*system, 60), SamplingParams(max_tokens=4))])
    shared = scheduler.tables[0][:3]
    assert scheduler.tables[1][:3] == shared and [scheduler.pool.refs(p) for p in shared] == [2, 2, 2]
    assert [(r.slot, r.start) for r in plan.rows] == [(1, 12)]  # only its own token is computed
    assert len(set(scheduler.tables[0]) | set(scheduler.tables[1])) == len(scheduler.tables[0]) + len(scheduler.tables[1]) - 3
    assert dict(plan.page_tables)[1][:3] == tuple(shared)
    pickle.loads(pickle.dumps(plan))  # a plan is broadcast to the followers of a slice


def test_pages_grow_with_the_sequence_and_are_all_freed_when_it_ends():
    engine = MockEngine(slots=2, max_prefill_length=16, max_target_length=64, prefix_block=4, decode_steps_per_call=2)
    scheduler, executor = Scheduler(engine.limits, 2), Executor(engine, {})
    plan = scheduler.schedule([Waiting(0, (1, 2, 3, 4, 5), SamplingParams(max_tokens=9))])
    assert len(scheduler.tables[0]) == 2  # 5 prompt positions and the next call's 2: 7 positions
    seen = []
    while scheduler.num_used:
        seen.append(len(scheduler.tables.get(0, ())))  # what the call about to run may write
        outcome = executor.run(plan)
        finished = scheduler.update(plan, outcome)
        plan = scheduler.schedule([])
    # the 9th token's call writes position 12 (prompt 0-4, fed tokens 5-12): 4 pages of 4
    assert finished == [(0, 0)] and seen == [2, 3, 3, 4] and scheduler.pool.num_used == 0
    assert scheduler.pool.num_free == engine.limits.num_pages - 1


def test_a_pool_too_small_preempts_the_newest_and_the_tokens_are_those_of_a_large_pool():
    requests = [(list(range(1 + i, 14 + i)), SamplingParams(max_tokens=40 + i)) for i in range(4)]
    runs = {}
    for pages in (0, 17):  # 17: one sequence of max_target_length (16 pages) and the scratch page
        engine = MockEngine(slots=4, max_prefill_length=16, max_target_length=64, prefix_block=4, num_pages=pages)
        runs[pages] = [r.token_ids for r in run_to_completion(engine, {}, requests, prefix_caching=True)]
    assert runs[0] == runs[17] == [MockEngine().expected(p, s) for p, s in requests]


def test_preemption_counts_and_a_preempted_sequence_resumes_with_its_generated_tokens():
    engine = MockEngine(slots=2, max_prefill_length=16, max_target_length=64, prefix_block=4, num_pages=17)
    scheduler, executor = Scheduler(engine.limits, 2), Executor(engine, {})
    requests = [Waiting(i, tuple(range(10 * i + 1, 10 * i + 9)), SamplingParams(max_tokens=50)) for i in range(2)]
    plan, resumed, tokens = scheduler.schedule(requests), [], {0: [], 1: []}
    while scheduler.num_used:
        slots = {slot: r.request_id for slot, r in scheduler.running.items()}
        outcome = executor.run(plan)
        for slot, first in zip(plan.first_token_slots, outcome.first_tokens, strict=True):
            tokens[slots[slot]].append(first)
        for step, valid in zip(outcome.tokens, outcome.valid, strict=True):
            for slot, rid in slots.items():
                if valid[slot]:
                    tokens[rid].append(step[slot])
        scheduler.update(plan, outcome)
        plan = scheduler.schedule([])
        resumed += [row for row in plan.rows if row.generated]
    assert scheduler.preemptions >= 1 and resumed
    assert all(row.start + len(row.tokens) <= 8 + row.generated for row in resumed)
    for i, r in enumerate(requests):
        assert tokens[i] == engine.expected(r.prompt_ids, r.sampling)


@pytest.mark.parametrize(("prompt", "max_tokens", "room"), [(10, 60, 1), (60, 60, 0), (58, 5, 1)])
def test_new_prompts_take_the_pages_running_sequences_will_not_grow_into_soon(prompt, max_tokens, room):
    # one running sequence in a pool of 2 pages of 64 positions, one of them free: at position 12
    # (its prompt, then the turn's decode call of 2 steps) its next GROWTH_HORIZON positions stay in
    # its page, so a new request may take the free one; at 62 they cross into a second page, so
    # the free page stays its own (before, every running sequence kept a page free); at 60 with 5
    # tokens to generate, its last position (62) is in its page: nothing to keep
    engine = MockEngine(slots=2, max_prefill_length=64, max_target_length=128, prefix_block=64, num_pages=3)
    scheduler, executor = Scheduler(engine.limits, 2), Executor(engine, {})
    plan = scheduler.schedule([Waiting(0, tuple(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens))])
    scheduler.update(plan, executor.run(plan))
    assert scheduler.running[0].position == prompt + 2 and len(scheduler.tables[0]) == 1
    assert scheduler.pool.num_free == 1 and scheduler.room() == room
    if room:
        plan = scheduler.schedule([Waiting(1, (7, 8, 9), SamplingParams(max_tokens=4))])
        assert [r.slot for r in plan.rows] == [1] and len(scheduler.tables[1]) == 1


def _pages_of_16(slots: int) -> Limits:
    """Prompts of up to 128 positions in chunks of 32, pages of 16 positions, 8 of them free."""
    return Limits(slots, 128, 128, prefill_chunk_size=32, prefix_block=16, prefill_batch_tokens=256, num_pages=9)


@pytest.mark.parametrize("starved_turns", [64, 1])
def test_a_prompt_takes_its_whole_prompts_pages_when_it_starts_and_newer_ones_pass_it_for_a_while(
    monkeypatch, starved_turns
):
    # pages of 16 positions, 8 free; R runs (2 pages, one more kept free for its growth), so the
    # 100-token prompt A (7 pages with its first decode call) waits while the 20-token B (2 pages)
    # starts: before, A took its first chunk's 2 pages and then waited half computed, holding them,
    # for pages only a finishing sequence frees. Once A has waited `STARVED_TURNS`, C (whose pages
    # are free) does not start before it.
    monkeypatch.setattr(scheduler_module, "STARVED_TURNS", starved_turns)
    limits = _pages_of_16(slots=4)
    scheduler = Scheduler(limits, 2)
    scheduler.schedule([Waiting(0, tuple(range(1, 21)), SamplingParams(max_tokens=50))])
    assert list(scheduler.running) == [0] and len(scheduler.tables[0]) == 2
    plan = scheduler.schedule([
        Waiting(1, tuple(range(1, 101)), SamplingParams(max_tokens=4)),
        Waiting(2, tuple(range(201, 221)), SamplingParams(max_tokens=4)),
    ])
    assert [r.slot for r in plan.rows] == [2] and len(scheduler.tables[2]) == 2 and not scheduler.tables.get(1)
    plan = scheduler.schedule([Waiting(3, tuple(range(301, 321)), SamplingParams(max_tokens=4))])
    assert [r.slot for r in plan.rows] == ([3] if starved_turns > 1 else []) and not scheduler.tables.get(1)


def test_a_started_prompt_holds_every_page_of_its_prompt_while_its_chunks_are_computed():
    limits = _pages_of_16(slots=2)
    scheduler = Scheduler(limits, 2)
    plan = scheduler.schedule([Waiting(0, tuple(range(1, 101)), SamplingParams(max_tokens=4))])
    assert [(r.slot, r.start, len(r.tokens)) for r in plan.rows] == [(0, 0, 32)]
    assert len(scheduler.tables[0]) == 7  # 100 prompt positions and the first decode call's 2
    for start in (32, 64, 96):
        plan = scheduler.schedule([])
        assert [r.start for r in plan.rows] == [start] and len(scheduler.tables[0]) == 7


def test_a_starved_prompt_starts_when_nothing_runs_though_a_newer_one_holds_cached_prefix_pages():
    # pages of 16, 8 free. A (100 tokens: 7 pages) waits past STARVED_TURNS behind the running R;
    # then B arrives and its 2 cached prefix pages go into its table, but B may not start before
    # A. When R ends nothing runs, A needs 7 of the 6 free pages: B is preempted (its pages go back,
    # still cached) and A starts; before, no prompt ever ran again.
    limits = _pages_of_16(slots=4)
    scheduler = Scheduler(limits, 2, prefix_caching=True)
    prefix = tuple(range(500, 532))
    scheduler.schedule([Waiting(0, (*prefix, 1, 2, 3, 4), SamplingParams(max_tokens=4))])
    scheduler.schedule([], cancelled=[0])
    assert scheduler.pool.num_cached == 2 and scheduler.pool.num_free == 8
    scheduler.schedule([Waiting(1, tuple(range(1, 21)), SamplingParams(max_tokens=100))])  # R, slot 0
    scheduler.schedule([Waiting(2, tuple(range(600, 700)), SamplingParams(max_tokens=4))])  # A, slot 1
    for _ in range(scheduler_module.STARVED_TURNS + 1):
        assert not scheduler.schedule([]).rows
    scheduler.take_cached()
    scheduler.schedule([Waiting(3, (*prefix, 9, 9, 9, 9), SamplingParams(max_tokens=4))])  # B, slot 2
    assert len(scheduler.tables[2]) == 2 and 2 in scheduler.prefilling
    assert scheduler.take_cached() == {3: 32}  # usage's cached_tokens, so far
    scheduler.schedule([], cancelled=[1])  # R ends
    rows = next(plan.rows for plan in (scheduler.schedule([]) for _ in range(3)) if plan.rows)
    assert [r.slot for r in rows] == [1] and len(scheduler.tables[1]) == 7
    assert scheduler.take_cached() == {3: 0}  # B gave its cached pages back: it computes its whole prompt


def test_a_preempted_sequence_starts_again_before_newer_prompts(monkeypatch):
    # R1 and R2 run in the 4 pages of 16 (no growth headroom kept) until both need a third: R2,
    # the newer, is preempted and cannot start again yet; the 3-token C, whose page is free, does
    # not start before it (before, C did: R2 had waited one turn, not STARVED_TURNS)
    monkeypatch.setattr(scheduler_module, "GROWTH_HORIZON", 0)
    limits = Limits(3, 64, 64, prefill_chunk_size=32, prefix_block=16, prefill_batch_tokens=256, num_pages=5)
    scheduler = Scheduler(limits, 2)
    scheduler.schedule([Waiting(0, tuple(range(1, 21)), SamplingParams(max_tokens=40))])
    scheduler.schedule([Waiting(1, tuple(range(101, 121)), SamplingParams(max_tokens=40))])
    assert set(scheduler.running) == {0, 1} and scheduler.pool.num_free == 0
    for _ in range(8):  # the decode calls' positions (no engine runs them)
        for entry in scheduler.running.values():
            entry.position += 2
        plan = scheduler.schedule([])
        if plan.preempted:
            break
    assert plan.preempted == (1,) and 1 in scheduler.prefilling and scheduler.pool.num_free == 1
    plan = scheduler.schedule([Waiting(2, (7, 8, 9), SamplingParams(max_tokens=2))])
    assert not plan.rows and not scheduler.tables.get(2) and not scheduler.tables.get(1)
