"""The scheduler's decisions for serving under load, as plain data: lowest free slot first, decode
slot buckets, rows of one prefill_slots call within their budgets, chunks; the mock's chunked
contract. (Pages, sharing and preemption: test_pages.py.)"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from serving.engine.api import PrefillRow
from serving.engine.limits import Limits
from serving.engine.mock import MockEngine
from serving.orchestrator.prefix_cache import block_keys
from serving.orchestrator.scheduler import Scheduler, Waiting
from serving.request import SamplingParams


def _waiting(request_id: int, prompt, max_tokens: int = 4) -> Waiting:
    return Waiting(request_id, tuple(prompt), SamplingParams(max_tokens=max_tokens))


def _rows(plan) -> list[tuple[int, int, int, bool]]:
    return [(r.slot, r.start, len(r.tokens), r.final) for r in plan.rows]


def test_the_lowest_free_slot_is_taken_first_and_decode_computes_the_running_slots_in_the_smallest_bucket():
    scheduler = Scheduler(Limits(8, 32, 256, prefill_batch_tokens=128), decode_steps_per_call=2)
    plan = scheduler.schedule([_waiting(i, [i + 1]) for i in range(4)])
    assert [r.slot for r in plan.rows] == [0, 1, 2, 3] and (plan.num_slots, plan.slots) == (4, (0, 1, 2, 3))
    plan = scheduler.schedule([], cancelled={2, 0})
    assert plan.frees == (0, 2) and (plan.num_slots, plan.slots) == (2, (1, 3))  # not the first 4 slots
    plan = scheduler.schedule([], cancelled={3})
    assert (plan.num_slots, plan.slots) == (1, (1,))  # slot 1 alone: one row, not the bucket of 2
    plan = scheduler.schedule([_waiting(10, [5]), _waiting(11, [6]), _waiting(12, [7])])
    assert [r.slot for r in plan.rows] == [0, 2, 3] and plan.slots == (0, 1, 2, 3)  # a final row decodes at once
    plan = scheduler.schedule([], cancelled={10, 11})
    assert plan.slots == (1, 3)
    assert Limits(8, 32, 256, decode_buckets=(3,)).decode_rows({6, 3}) == (0, 3, 6)  # padded with the lowest other
    assert Limits(8, 32, 256).decode_buckets == (1, 2, 4, 8)
    assert Limits(8, 32, 256, decode_buckets=(3, 6)).decode_buckets == (3, 6, 8)


def test_rows_fill_one_call_up_to_max_prefill_batch_oldest_first():
    limits = Limits(8, 64, 512, prefill_chunk_size=16, max_prefill_batch=3, prefill_batch_tokens=256)
    scheduler = Scheduler(limits, decode_steps_per_call=2)
    plan = scheduler.schedule([_waiting(i, range(1, 11)) for i in range(5)])
    assert _rows(plan) == [(0, 0, 10, True), (1, 0, 10, True), (2, 0, 10, True)]
    plan = scheduler.schedule([])
    assert _rows(plan) == [(3, 0, 10, True), (4, 0, 10, True)]


def test_short_chunks_fill_the_call_before_one_that_would_widen_its_bucket():
    """A shared system prompt's questions after its cached blocks: 33-66 tokens each. The one of
    66 tokens (bucket 128) would cut the call to 4 rows x 128; it waits a turn instead and the six
    short ones go as 6 x 64 (the same padded budget). A longer chunk still joins when it fits."""
    limits = Limits(8, 512, 1024, prefill_chunk_size=256, max_prefill_batch=8, prefill_batch_tokens=512)
    scheduler = Scheduler(limits, decode_steps_per_call=2)
    lengths = [50, 66, 40, 60, 33, 64, 45]
    plan = scheduler.schedule([_waiting(i, range(1, n + 1)) for i, n in enumerate(lengths)])
    assert _rows(plan) == [(i, 0, n, True) for i, n in enumerate(lengths) if n <= 64]
    plan = scheduler.schedule([])
    assert _rows(plan) == [(1, 0, 66, True)]
    scheduler = Scheduler(limits, decode_steps_per_call=2)  # the oldest widens nothing: 3 x 128 fits
    plan = scheduler.schedule([_waiting(0, range(1, 20)), _waiting(1, range(1, 100)), _waiting(2, range(1, 30))])
    assert _rows(plan) == [(0, 0, 19, True), (1, 0, 99, True), (2, 0, 29, True)]


def test_a_row_that_would_overflow_the_padded_token_budget_waits_and_a_shorter_one_joins():
    limits = Limits(8, 64, 512, prefill_chunk_size=32, max_prefill_batch=8, prefill_batch_tokens=32)
    scheduler = Scheduler(limits, decode_steps_per_call=2)
    plan = scheduler.schedule([_waiting(0, range(1, 6)), _waiting(1, range(1, 41)), _waiting(2, range(1, 6))])
    assert _rows(plan) == [(0, 0, 5, True), (2, 0, 5, True)]  # 2 rows x bucket 16; with slot 1's chunk 3 x 32
    plan = scheduler.schedule([])
    assert _rows(plan) == [(1, 0, 32, False)]  # alone: the oldest always goes
    plan = scheduler.schedule([])
    assert _rows(plan) == [(1, 32, 8, True)]


def test_a_long_prompt_enters_in_chunks_between_decode_calls():
    limits = Limits(2, 32, 256, prefill_chunk_size=16)
    scheduler = Scheduler(limits, decode_steps_per_call=2)
    scheduler.schedule([_waiting(0, [3], max_tokens=50)])
    turns = [scheduler.schedule([_waiting(1, range(40))])] + [scheduler.schedule([]) for _ in range(2)]
    assert [_rows(p) for p in turns] == [[(1, 0, 16, False)], [(1, 16, 16, False)], [(1, 32, 8, True)]]
    assert [p.decode_steps for p in turns] == [2, 2, 2]  # slot 0's stream keeps flowing
    assert [p.max_position for p in turns] == [1, 1, 40]  # the prefilling slot counts once it decodes
    assert scheduler.kv_tokens_used() == 41


def test_prefilling_slots_are_freed_when_cancelled():
    scheduler = Scheduler(Limits(1, 32, 256, prefill_chunk_size=16), decode_steps_per_call=2)
    plan = scheduler.schedule([_waiting(0, range(100))])
    assert _rows(plan) == [(0, 0, 16, False)] and plan.decode_steps == 0 and scheduler.room() == 0
    assert scheduler.room(cancelled={0}) == 1 and scheduler.slot_of(0) == 0
    plan = scheduler.schedule([_waiting(1, [4])], cancelled={0})
    assert plan.frees == (0,) and _rows(plan) == [(0, 0, 1, True)]


def test_the_mock_checks_the_chunked_contract():
    engine = MockEngine(slots=2, max_prefill_length=16, prefill_chunk_size=8, max_prefill_batch=2, prefix_block=4)
    sampling = SamplingParams(max_tokens=2)
    tables = np.zeros((2, engine.limits.max_pages), np.int32)
    tables[0, :2], tables[1, 0] = (1, 2), 3
    state = engine.set_pages(engine.init_decode_state(), tables)
    with pytest.raises(AssertionError, match="holds no page"):  # slot 1 holds one page of 4 positions
        engine.prefill_slots({}, state, [PrefillRow(1, (1, 2, 3, 4, 5), 0, False, sampling)])
    state = engine.set_pages(engine.init_decode_state(), tables)
    state, firsts, _ = engine.prefill_slots({}, state, [PrefillRow(0, (1, 2, 3, 4, 5), 0, False, sampling)])
    assert firsts == (None,) and engine.pages_of(state, 0) == (1, 2) and state.pool[1] == {0: 1, 1: 2, 2: 3, 3: 4}
    with pytest.raises(AssertionError, match="reads position 0, which no write reached"):
        engine.prefill_slots({}, state, [PrefillRow(1, (6,), 2, True, sampling)])
    with pytest.raises(AssertionError, match="a chunk of 9 tokens"):
        engine.prefill_slots({}, state, [PrefillRow(1, tuple(range(9)), 0, True, sampling)])
    with pytest.raises(AssertionError, match="mixes first chunks"):
        engine.prefill_slots({}, state, [PrefillRow(0, (6,), 5, True, sampling), PrefillRow(1, (6,), 0, True, sampling)])
    state, firsts, _ = engine.prefill_slots({}, state, [PrefillRow(1, (6,), 0, True, sampling)])
    assert firsts == (7,)
    with pytest.raises(AssertionError, match="3 slots is not one of"):
        engine.generate({}, state, num_slots=3)
    with pytest.raises(AssertionError, match="num_slots=1 but slot 1 is active"):
        engine.generate({}, state, num_slots=1)
    with pytest.raises(AssertionError, match=r"leave out active slots \[1\]"):
        engine.generate({}, state, slots=(0,))
    with pytest.raises(AssertionError, match="are not distinct"):
        engine.generate({}, state, slots=(1, 1))
    with pytest.raises(AssertionError, match="a chunk prefilled into slot 1, which is decoding"):
        engine.prefill_slots({}, state, [PrefillRow(1, (6,), 0, True, sampling)])


def test_block_keys_chain_the_whole_prefix_and_are_the_same_in_every_process():
    keys = block_keys(list(range(10)), 4)
    assert len(keys) == 2 and keys[0] == block_keys([0, 1, 2, 3, 9], 4)[0]
    assert block_keys([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != keys[1]  # same block, another prefix
    code = "from serving.orchestrator.prefix_cache import block_keys; print(block_keys(list(range(10)), 4)[1].hex())"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert run.stdout.strip() == keys[1].hex()


def test_a_call_after_cached_positions_takes_the_history_budget():
    """Fresh prompts' first chunks share a call of up to prefill_batch_tokens padded tokens; later
    chunks (rows after cached positions, whose attention reads a window of history too) take at
    most history_batch_tokens. The mock checks each call's padded tokens against its own budget."""
    limits = Limits(8, 64, 256, prefill_chunk_size=16, max_prefill_batch=8, prefill_batch_tokens=128,
                    history_batch_tokens=32)
    assert (limits.batch_tokens(0), limits.batch_tokens(16)) == (128, 32)
    scheduler = Scheduler(limits, decode_steps_per_call=2)
    plan = scheduler.schedule([_waiting(i, range(1, 41)) for i in range(6)])  # 40 tokens: 3 chunks each
    assert _rows(plan) == [(i, 0, 16, False) for i in range(6)]  # 6 x 16 = 96 padded tokens, <= 128
    plan = scheduler.schedule([])
    assert _rows(plan) == [(0, 16, 16, False), (1, 16, 16, False)]  # 2 x 16 = 32: the history budget
    assert Limits(8, 64, 256, prefill_batch_tokens=128).history_batch_tokens == 128  # 0: the same budget
    from serving.orchestrator.offline import run_to_completion

    engine = MockEngine(slots=8, max_prefill_length=64, max_target_length=256, prefill_chunk_size=16,
                        max_prefill_batch=8, prefill_batch_tokens=128, history_batch_tokens=32)
    requests = [(list(range(1, 41)), SamplingParams(max_tokens=3)) for _ in range(6)]
    done = run_to_completion(engine, None, requests)
    assert all(len(r.token_ids) == 3 for r in done)
    later = [call for call in engine.calls if call[0] == "prefill_slots" and call[1][0][1] > 0]
    assert later and all(len(call[1]) * 16 <= 32 for call in later)


def test_a_call_padded_to_its_row_bucket_stays_within_the_budget():
    """A call's rows are padded to the row ladder (1, 2, 4, 8 here): with 96 padded tokens a call
    of three 32-token rows would run as four (128), a shape warmup never compiles for that budget;
    so two go, then the rest."""
    limits = Limits(8, 32, 256, max_prefill_batch=8, prefill_batch_tokens=96)
    assert limits.row_buckets == (1, 2, 4, 8) and limits.padded_rows(3) == 4
    assert Limits(64, 32, 256, max_prefill_batch=64, bucket_growth=4, min_bucket=16).row_buckets == (1, 4, 16, 64)
    scheduler = Scheduler(limits, decode_steps_per_call=2)
    plan = scheduler.schedule([_waiting(i, range(1, 21)) for i in range(5)])  # 20 tokens: bucket 32
    assert [r.slot for r in plan.rows] == [0, 1]
    for _ in range(2):
        plan = scheduler.schedule([])
        assert limits.padded_rows(len(plan.rows)) * 32 <= 96


@pytest.mark.parametrize("burst_first", [False, True])
def test_a_bursts_prompts_prefill_before_any_of_it_decodes_with_burst_first(burst_first):
    """Eight prompts whose rows take four prefill calls (2 rows a call): with burst_first no turn
    decodes until the last of them is prefilled (then all decode from the same call, in step);
    without it, each turn decodes what is in, the groups a call apart. At most BURST_DEFERRALS
    turns in a row are held back, and once a sequence has decoded nothing is."""
    from serving.orchestrator.executor import Executor
    from serving.orchestrator.scheduler import BURST_DEFERRALS

    engine = MockEngine(slots=8, max_prefill_length=64, max_target_length=256, prefill_chunk_size=64,
                        max_prefill_batch=8, prefill_batch_tokens=32)
    scheduler = Scheduler(engine.limits, 2, burst_first=burst_first)
    executor = Executor(engine, {})
    plan = scheduler.schedule([_waiting(i, range(1, 11), max_tokens=6) for i in range(8)])  # 10 tokens: bucket 16
    decodes = []
    while scheduler.num_used:
        decodes.append((len(plan.rows), plan.decode_steps))
        scheduler.update(plan, executor.run(plan))
        plan = scheduler.schedule([])
    if burst_first:
        assert decodes[:4] == [(2, 0), (2, 0), (2, 0), (2, 2)]  # the last group's call decodes all 8
        assert all(rows == 0 for rows, _ in decodes[4:])
        assert BURST_DEFERRALS >= 3
    else:
        assert decodes[:4] == [(2, 2), (2, 2), (2, 2), (2, 2)]


def test_burst_first_holds_back_at_most_burst_deferrals_turns():
    """Twelve prompts, one row a prefill call: BURST_DEFERRALS turns run no generate call, then one
    does; while the burst's rest (young sequences and prompts still to prefill) is at least as
    many as the sequences that decoded, it is held back again, each time BURST_DEFERRALS turns at most."""
    from serving.orchestrator.executor import Executor
    from serving.orchestrator.scheduler import BURST_DEFERRALS

    engine = MockEngine(slots=16, max_prefill_length=64, max_target_length=256, prefill_chunk_size=64,
                        max_prefill_batch=16, prefill_batch_tokens=16)  # one row a call
    scheduler, executor = Scheduler(engine.limits, 2, burst_first=True), Executor(engine, {})
    plan = scheduler.schedule([_waiting(i, range(1, 11), max_tokens=6) for i in range(12)])
    steps = []
    for _ in range(12):
        steps.append(plan.decode_steps)
        scheduler.update(plan, executor.run(plan))
        plan = scheduler.schedule([])
    held = [0] * BURST_DEFERRALS + [2]
    # 5 decoded, 7 to come (2 young, 5 to prefill): held again; then 10 against 2: decoding every turn
    assert steps == [*held, *held, 2, 2] and BURST_DEFERRALS == 4
    assert not scheduler.young


def test_burst_first_does_not_hold_back_a_batch_for_fewer_newcomers():
    """Eight sequences decoding when three prompts arrive (one row a prefill call): the newcomers
    are fewer than the sequences they would hold back, so every turn decodes."""
    from serving.orchestrator.executor import Executor

    engine = MockEngine(slots=16, max_prefill_length=64, max_target_length=256, prefill_chunk_size=64,
                        max_prefill_batch=16, prefill_batch_tokens=16)  # one row a call
    scheduler, executor = Scheduler(engine.limits, 2), Executor(engine, {})
    plan = scheduler.schedule([_waiting(i, range(1, 11), max_tokens=40) for i in range(8)])
    for _ in range(9):  # all eight in and decoding
        scheduler.update(plan, executor.run(plan))
        plan = scheduler.schedule([])
    assert len(scheduler.running) == 8 and not scheduler.prefilling and not scheduler.young
    scheduler.burst_first = True
    scheduler.update(plan, executor.run(plan))
    plan = scheduler.schedule([_waiting(i, range(1, 11), max_tokens=40) for i in range(8, 11)])
    steps = []
    for _ in range(3):
        steps.append((len(plan.rows), plan.decode_steps))
        scheduler.update(plan, executor.run(plan))
        plan = scheduler.schedule([])
    assert steps == [(1, 2), (1, 2), (1, 2)]


def test_burst_first_does_not_hold_decoding_back_for_a_long_prompts_chunks():
    """One sequence decoding when a 1,000-token prompt arrives (chunks of 64): the prompt is no
    burst, so every turn decodes while it goes through its chunks (a rule that counted every
    prompt still to prefill held the decode back 4 turns of every 5)."""
    from serving.orchestrator.executor import Executor

    engine = MockEngine(slots=4, max_prefill_length=1024, max_target_length=2048, prefill_chunk_size=64,
                        max_prefill_batch=4, prefill_batch_tokens=64)
    scheduler, executor = Scheduler(engine.limits, 2, burst_first=True), Executor(engine, {})
    plan = scheduler.schedule([_waiting(0, range(1, 11), max_tokens=200)])
    for _ in range(3):  # decoding, several tokens in
        scheduler.update(plan, executor.run(plan))
        plan = scheduler.schedule([])
    scheduler.update(plan, executor.run(plan))
    plan = scheduler.schedule([_waiting(1, [5 + i % 200 for i in range(1000)], max_tokens=4)])
    steps = []
    for _ in range(10):
        steps.append(plan.decode_steps)
        scheduler.update(plan, executor.run(plan))
        plan = scheduler.schedule([])
    assert steps == [2] * 10


def test_a_cancelled_prompt_scoring_request_leaves_no_scores_behind_in_the_executor():
    """The prompt's logprobs its earlier chunks scored are held per slot until its final chunk;
    a request cancelled between its chunks takes them along when its slot is freed."""
    from serving.orchestrator.executor import Executor

    engine = MockEngine(slots=2, max_prefill_length=16, prefill_chunk_size=16)
    scheduler, executor = Scheduler(engine.limits, 2), Executor(engine, {})
    scoring = Waiting(0, tuple(range(1, 40)), SamplingParams(max_tokens=2, prompt_logprobs=1))
    plan = scheduler.schedule([scoring])
    assert _rows(plan) == [(0, 0, 16, False)] and plan.rows[0].score
    scheduler.update(plan, executor.run(plan))
    assert set(executor._scores) == {0}  # the first chunk's scores, waiting for the rest
    plan = scheduler.schedule([_waiting(1, [4, 5])], cancelled={0})
    assert plan.frees == (0,)
    scheduler.update(plan, executor.run(plan))
    assert executor._scores == {}
