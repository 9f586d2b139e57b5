"""The scheduler's decisions for serving under load, as plain data: lowest free slot first, decode
slot buckets, rows of one prefill_slots call within their budgets, chunks, prefix-cache loads,
stores and evictions; and the executor keeping the same blocks as the index, on the mock engine."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from serving.engine.api import PrefillRow
from serving.engine.limits import Limits
from serving.engine.mock import MockEngine
from serving.orchestrator.executor import Executor
from serving.orchestrator.offline import run_to_completion
from serving.orchestrator.plan import PrefixLoad, PrefixStore
from serving.orchestrator.prefix_cache import PrefixCache, block_keys
from serving.orchestrator.scheduler import Scheduler, Waiting
from serving.request import SamplingParams


def _waiting(request_id: int, prompt, max_tokens: int = 4) -> Waiting:
    return Waiting(request_id, tuple(prompt), SamplingParams(max_tokens=max_tokens))


def _rows(plan) -> list[tuple[int, int, int, bool]]:
    return [(r.slot, r.start, len(r.tokens), r.final) for r in plan.rows]


def test_the_lowest_free_slot_is_taken_first_and_decode_runs_the_smallest_bucket_holding_it():
    scheduler = Scheduler(Limits(8, 32, 256, prefill_batch_tokens=128), decode_steps_per_call=2)
    plan = scheduler.schedule([_waiting(i, [i + 1]) for i in range(4)])
    assert [r.slot for r in plan.rows] == [0, 1, 2, 3] and plan.num_slots == 4
    plan = scheduler.schedule([], cancelled={2, 0})
    assert plan.frees == (0, 2) and plan.num_slots == 4  # slot 3 still decodes
    plan = scheduler.schedule([], cancelled={3})
    assert plan.num_slots == 2  # slot 1 alone: the bucket of 2 slots
    plan = scheduler.schedule([_waiting(10, [5]), _waiting(11, [6]), _waiting(12, [7])])
    assert [r.slot for r in plan.rows] == [0, 2, 3] and plan.num_slots == 4  # a final row decodes at once
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


def _cached(block: int = 4, blocks: int = 2, **limits) -> Scheduler:
    cache = PrefixCache(block, block_bytes=1000, budget_bytes=blocks * 1000 + 500)
    return Scheduler(Limits(4, 16, 256, prefix_block=block, prefill_batch_tokens=64, **limits), 2, cache)


def test_computed_blocks_are_stored_and_a_shared_prefix_is_loaded_leaving_one_token_to_compute():
    scheduler = _cached(blocks=8, prefill_chunk_size=8)
    prompt = tuple(range(1, 14))  # 13 tokens: 3 whole blocks of 4
    keys = block_keys(prompt, 4)
    plan = scheduler.schedule([_waiting(0, prompt)])
    assert plan.stores == (PrefixStore(keys[0], 0, 0), PrefixStore(keys[1], 0, 4)) and plan.loads == ()
    plan = scheduler.schedule([])
    assert plan.stores == (PrefixStore(keys[2], 0, 8),)
    plan = scheduler.schedule([_waiting(1, prompt[:12]), _waiting(2, prompt)])
    # 12 tokens: blocks 0-1 reused (block 2 ends the prompt: its last token is computed again)
    assert plan.loads == (PrefixLoad(1, keys[:2]), PrefixLoad(2, keys))
    assert _rows(plan) == [(1, 8, 4, True), (2, 12, 1, True)] and plan.stores == ()
    assert (scheduler.prefix_cache.hits, scheduler.prefix_cache.misses) == (5, 3)  # the first: 3 misses
    pickle.loads(pickle.dumps(plan))  # a plan is broadcast to the followers of a slice


def test_requests_sharing_a_prefix_admitted_together_wait_for_its_blocks_and_compute_it_once():
    scheduler = _cached(blocks=16, prefill_chunk_size=8)
    system = tuple(range(1, 13))  # 3 whole blocks of 4
    prompts = [(*system, 50 + i, 60 + i) for i in range(4)]
    keys = block_keys(prompts[0], 4)
    plan = scheduler.schedule([_waiting(i, p) for i, p in enumerate(prompts)])
    assert _rows(plan) == [(0, 0, 8, False)] and plan.loads == ()  # slots 1-3 wait for slot 0's blocks
    plan = scheduler.schedule([])
    assert _rows(plan) == [(0, 8, 6, True)] and plan.loads == ()  # blocks 0-1 stored, block 2 still coming
    plan = scheduler.schedule([])
    assert plan.loads == tuple(PrefixLoad(slot, keys) for slot in (1, 2, 3))
    assert _rows(plan) == [(1, 12, 2, True), (2, 12, 2, True), (3, 12, 2, True)]
    assert (scheduler.prefix_cache.hits, scheduler.prefix_cache.misses) == (9, 3)  # counted once, at the load


def test_a_waiting_slot_goes_on_when_the_slot_computing_its_blocks_is_cancelled():
    scheduler = _cached(blocks=16, prefill_chunk_size=8)
    system = tuple(range(1, 13))
    prompts = [(*system, 50 + i, 60 + i) for i in range(3)]
    keys = block_keys(prompts[0], 4)
    scheduler.schedule([_waiting(i, p) for i, p in enumerate(prompts)])  # slot 0 stores blocks 0-1
    plan = scheduler.schedule([], cancelled={0})
    # slot 1 loads what is cached and computes block 2 itself; slot 2 now waits for slot 1's
    assert plan.frees == (0,) and plan.loads == (PrefixLoad(1, keys[:2]),)
    assert _rows(plan) == [(1, 8, 6, True)] and [s.key for s in plan.stores] == [keys[2]]
    plan = scheduler.schedule([])
    assert plan.loads == (PrefixLoad(2, keys),) and _rows(plan) == [(2, 12, 2, True)]


def test_a_slot_does_not_wait_for_a_block_past_the_budget_s_capacity():
    scheduler = _cached(blocks=2, prefill_chunk_size=8)  # room for 2 blocks of 4
    prompt = tuple(range(1, 14))  # 3 reusable blocks: the third can never be kept
    keys = block_keys(prompt, 4)
    scheduler.schedule([_waiting(0, prompt), _waiting(1, prompt)])  # slot 0 stores blocks 0-1
    plan = scheduler.schedule([])
    assert plan.loads == (PrefixLoad(1, keys[:2]),)  # not waiting for block 2
    assert _rows(plan) == [(0, 8, 5, True), (1, 8, 5, True)]  # it computes block 2's tokens itself


def test_rows_of_one_call_start_all_at_zero_or_all_after_it():
    scheduler = _cached(blocks=8)
    prompt = tuple(range(1, 10))
    scheduler.schedule([_waiting(0, prompt)])
    plan = scheduler.schedule([_waiting(1, prompt), _waiting(2, [7, 7]), _waiting(3, prompt)])
    assert _rows(plan) == [(1, 8, 1, True), (3, 8, 1, True)]  # the first row started after 0
    assert _rows(scheduler.schedule([])) == [(2, 0, 2, True)]


def test_eviction_takes_the_least_recently_used_deepest_block_first_and_never_cuts_a_chain():
    scheduler = _cached(blocks=2, prefill_chunk_size=16)
    a, b = tuple(range(1, 14)), tuple(range(50, 59))
    ka, kb = block_keys(a, 4), block_keys(b, 4)
    plan = scheduler.schedule([_waiting(0, a)])
    assert [s.key for s in plan.stores] == [ka[0], ka[1]]  # a third block would not fit with its chain
    assert list(scheduler.prefix_cache) == [ka[1], ka[0]]
    plan = scheduler.schedule([_waiting(1, b)])
    assert plan.evictions == (ka[1], ka[0]) and [s.key for s in plan.stores] == [kb[0], kb[1]]
    assert scheduler.prefix_cache.bytes_used == 2000


def test_a_block_stored_and_evicted_in_one_turn_is_not_stored():
    scheduler = _cached(blocks=1)
    plan = scheduler.schedule([_waiting(0, range(1, 6)), _waiting(1, range(20, 25))])
    assert plan.stores == (PrefixStore(block_keys(range(20, 25), 4)[0], 1, 0),) and plan.evictions == ()


def test_prefix_cache_off_plans_no_loads_nor_stores():
    scheduler = Scheduler(Limits(4, 16, 256, prefix_block=4), 2)
    plans = [scheduler.schedule([_waiting(i, range(1, 14))]) for i in range(3)]
    assert all(p.loads == () and p.stores == () and p.evictions == () for p in plans)


def test_the_executor_keeps_the_same_blocks_as_the_index_and_the_tokens_stay_the_same():
    engine = MockEngine(slots=3, max_prefill_length=16, prefill_chunk_size=8, prefix_block=4, decode_steps_per_call=2)
    cache = PrefixCache(4, engine.prefix_block_bytes, 3 * engine.prefix_block_bytes)
    scheduler, executor = Scheduler(engine.limits, 2, cache), Executor(engine, {})
    system = tuple(range(10, 22))
    prompts = [system + (i,) * (1 + i % 3) for i in range(6)] + [tuple(range(30, 60))]
    waiting = [_waiting(i, p, max_tokens=3) for i, p in enumerate(prompts)]
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while waiting or scheduler.num_used:
        admit, waiting = waiting[: scheduler.room()], waiting[scheduler.room() :]
        plan = scheduler.schedule(admit)
        slots = {slot: r.request_id for slot, r in scheduler.running.items()}
        outcome = executor.run(plan)
        assert set(executor.blocks) == set(cache) and cache.bytes_used <= 3 * engine.prefix_block_bytes
        for slot, first in zip(plan.first_token_slots, outcome.first_tokens, strict=True):
            tokens[slots[slot]].append(first)
        for step_tokens, step_valid in zip(outcome.tokens, outcome.valid, strict=True):
            for slot, rid in slots.items():
                if step_valid[slot]:
                    tokens[rid].append(step_tokens[slot])
        scheduler.update(plan, outcome)
    for i, prompt in enumerate(prompts):
        assert tokens[i] == engine.expected(prompt, SamplingParams(max_tokens=3))
    assert cache.hits > 0 and any(c[0] == "load_blocks" for c in engine.calls)


def test_the_offline_driver_gives_the_same_tokens_with_and_without_the_prefix_cache():
    requests = [([*range(5, 25), i], SamplingParams(max_tokens=4)) for i in range(6)]
    runs = []
    for cache in (None, PrefixCache(4, 1000, 10_000)):
        engine = MockEngine(slots=2, max_prefill_length=16, prefill_chunk_size=8, prefix_block=4)
        runs.append([r.token_ids for r in run_to_completion(engine, {}, requests, cache)])
    assert runs[0] == runs[1] == [MockEngine().expected(p, s) for p, s in requests]


def test_the_mock_checks_the_chunked_contract():
    engine = MockEngine(slots=2, max_prefill_length=16, prefill_chunk_size=8, max_prefill_batch=2, prefix_block=4)
    sampling = SamplingParams(max_tokens=2)
    state = engine.init_decode_state()
    state, firsts = engine.prefill_slots({}, state, [PrefillRow(0, (1, 2, 3, 4, 5), 0, False, sampling)])
    assert firsts == (None,) and engine.save_block(state, 0, 0) == (1, 2, 3, 4)
    with pytest.raises(AssertionError, match="holds 5 tokens of the prompt"):
        engine.prefill_slots({}, state, [PrefillRow(0, (6,), 0, True, sampling)])
    with pytest.raises(AssertionError, match="a chunk of 9 tokens"):
        engine.prefill_slots({}, state, [PrefillRow(1, tuple(range(9)), 0, True, sampling)])
    with pytest.raises(AssertionError, match="mixes first chunks"):
        engine.prefill_slots({}, state, [PrefillRow(0, (6,), 5, True, sampling), PrefillRow(1, (6,), 0, True, sampling)])
    state, firsts = engine.prefill_slots({}, state, [PrefillRow(1, (6,), 0, True, sampling)])
    assert firsts == (7,)
    with pytest.raises(AssertionError, match="num_slots=3 is not one of"):
        engine.generate({}, state, num_slots=3)
    with pytest.raises(AssertionError, match="num_slots=1 but slot 1 is active"):
        engine.generate({}, state, num_slots=1)
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


def test_the_index_evicts_another_chain_s_deepest_block_before_an_ancestor_of_the_new_one():
    cache = PrefixCache(4, block_bytes=10, budget_bytes=30)
    a0, a1, b0, b1 = (bytes([i]) * 16 for i in range(4))
    assert cache.add(a0, ()) == () and cache.add(b0, ()) == () and cache.add(b1, (b0,)) == ()
    assert list(cache) == [a0, b1, b0]
    assert cache.add(a1, (a0,)) == (b1,)  # a0 was the oldest, but a1 needs it
    assert list(cache) == [b0, a1, a0]
    assert cache.lookup([b0, b1]) == 1 and list(cache) == [a1, a0, b0]
    assert cache.add(b1, (b0, a1, a0)) is None  # a chain longer than the budget is not kept
    assert cache.add(b1, (b"\xff" * 16,)) is None  # nor a block whose ancestor is gone
    assert PrefixCache(4, 10, 9).add(a0, ()) is None and (cache.hits, cache.misses) == (1, 1)
