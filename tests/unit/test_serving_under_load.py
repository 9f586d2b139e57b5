"""Serving under load on the mock engine, through the orchestrator's threads: batched and chunked
prefill, the prefix cache, decode slot buckets switching as requests come and go. The tokens are
the mock's hand-computable ones whatever the plans."""

from __future__ import annotations

import itertools
import time

import pytest

from serving.api.prometheus import Scrape, registry, render
from serving.config import OrchestratorConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams

TOKENIZER = AsciiTokenizer()
SYSTEM = [(7 * i) % 90 for i in range(40)]  # a shared "system prompt": 2 whole blocks of 16 and a half


def _orchestrator(cache: str = "on", **engine) -> Orchestrator:
    engine = {"slots": 4, "max_prefill_length": 64, "max_target_length": 512, "prefix_block": 16, **engine}
    config = OrchestratorConfig(max_queued_requests=64, prefix_cache=cache)
    return Orchestrator(MockEngine(**engine), {}, TOKENIZER, config)


def _mixed_requests() -> list[tuple[list[int], SamplingParams]]:
    """16 prompts of 1..200 tokens, half of them behind the shared system prompt."""
    lengths = [1, 5, 17, 33, 64, 65, 90, 130, 200, 3, 48, 100, 12, 70, 16, 150]
    prompts = [[(i * 11 + j) % 95 for j in range(n)] for i, n in enumerate(lengths)]
    prompts = [SYSTEM + p if i % 2 else p for i, p in enumerate(prompts)]
    return [(p, SamplingParams(max_tokens=3 + i % 5)) for i, p in enumerate(prompts)]


def _serve_together(orchestrator: Orchestrator, requests) -> list[list[int]]:
    handles = [orchestrator.submit(p, s) for p, s in requests]
    return [h.result().token_ids for h in handles]


def _rows(engine: MockEngine) -> list[tuple]:
    return [call[1] for call in engine.calls if call[0] == "prefill_slots"]


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("cache", ["on", "off"])
def test_sixteen_mixed_requests_together_get_the_same_tokens_whatever_the_prefill_plan(chunk, batch, cache):
    orch = _orchestrator(cache, prefill_chunk_size=chunk, max_prefill_batch=batch, prefill_batch_tokens=256)
    requests = _mixed_requests()
    handles = [orch.submit(p, s) for p, s in requests]  # all queued before the device loop starts
    orch.start()
    try:
        got = [h.result().token_ids for h in handles]
    finally:
        orch.stop(timeout=10)
    engine = orch.engine
    assert got == [engine.expected(p, s) for p, s in requests]
    calls = _rows(engine)
    # batched: every free slot in a call (cache on: a slot may wait for another's shared blocks)
    assert max(len(rows) for rows in calls) in ({1} if batch == 1 else {4} if cache == "off" else {3, 4})
    chunks_of_200 = [row for rows in calls for row in rows if row[3] and row[1] + row[2] == 200]
    assert chunks_of_200 and chunks_of_200[0][1] > 0  # the 200-token prompt (> 64) came in several chunks
    assert all(row[2] <= chunk for rows in calls for row in rows)
    assert (orch.metrics.prefix_cache_hits > 0) == (cache == "on")


def _generate_slots(engine: MockEngine) -> list[int]:
    return [call[2] for call in engine.calls if call[0] == "generate"]


def _await_generate(engine: MockEngine, num_slots: int, timeout: float = 20.0) -> None:
    """Until the engine has run a generate call of `num_slots` rows (the device loop's progress,
    not the clock, decides when the test goes on)."""
    deadline = time.monotonic() + timeout
    while num_slots not in _generate_slots(engine):
        if time.monotonic() > deadline:
            raise AssertionError(f"no generate call of {num_slots} rows: {_generate_slots(engine)}")
        time.sleep(0.002)


def test_decode_buckets_switch_as_requests_come_and_go_without_losing_or_reordering_a_token():
    """Arrivals in three waves, each sent once the device loop decodes the one before (1 slot, then
    3 in the bucket of 4, then 7 in the bucket of 8), the last wave short: the buckets grow 1, 4, 8
    and shrink again as requests finish. Each wave waits on the engine's calls, never on a clock
    (the clock's version saw buckets {1, 2} once on a loaded 2-core machine)."""
    orch = _orchestrator("off", slots=8, step_seconds=0.002, prefill_chunk_size=16).start()
    engine = orch.engine
    assert engine.limits.decode_slots(3) == 4 and engine.limits.decode_slots(7) == 8
    prompts = [[(5 * i + j) % 95 for j in range(1 + 9 * i)] for i in range(7)]
    # the first three outlast the last wave by ~400 mock calls, however the machine's load delays it
    samplings = [SamplingParams(max_tokens=n) for n in (440, 420, 420, 6, 9, 12, 15)]
    waves = [((0,), 1), ((1, 2), 4), ((3, 4, 5, 6), 8)]  # (requests, the bucket their wave decodes in)
    handles = {}
    try:
        for wave, bucket in waves:
            handles.update({i: orch.submit(prompts[i], samplings[i]) for i in wave})
            _await_generate(engine, bucket)
        streamed = {i: h.result().token_ids for i, h in handles.items()}
    finally:
        orch.stop(timeout=10)
    for i, tokens in streamed.items():
        assert tokens == engine.expected(prompts[i], samplings[i])
    num_slots = _generate_slots(engine)
    assert {1, 4, 8} <= set(num_slots) <= set(engine.limits.decode_buckets)
    after = num_slots[num_slots.index(8) :]
    assert any(a > b for a, b in itertools.pairwise(after))  # it shrank again once the short ones ended


def test_a_shared_prefix_is_loaded_from_the_cache_and_counted_in_metrics():
    orch = _orchestrator(prefill_chunk_size=32).start()
    try:
        requests = [([*SYSTEM, i, i + 1], SamplingParams(max_tokens=4)) for i in range(5)]
        first = _serve_together(orch, requests[:1])
        rest = _serve_together(orch, requests[1:])
        text = render(registry(lambda: Scrape(orch.metrics)))
    finally:
        orch.stop(timeout=10)
    engine = orch.engine
    assert first + rest == [engine.expected(p, s) for p, s in requests]
    # the later four read the first one's 2 pages of 16 tokens in place and compute from 32 on
    later = [row for rows in _rows(engine) for row in rows][2:]  # after the first prompt's two chunks
    assert [row[1] for row in later] == [32] * 4
    metrics = orch.metrics
    assert (metrics.prefix_cache_hits, metrics.prefix_cache_misses) == (8, 2)
    assert metrics.prefix_cache_bytes == 2 * engine.page_bytes
    for line in ("pathserve_prefix_cache_hits_total 8.0", "pathserve_prefix_cache_misses_total 2.0",
                 "pathserve_prefix_cache_bytes 2000.0"):
        assert line in text


class _Warmup:
    """A stand-in for serving.engine.warmup.BackgroundWarmup: what is pending, what it was told."""

    def __init__(self):
        self.pending, self.told = 3, []

    def idle(self) -> None:
        if not self.told or self.told[-1] != "idle":
            self.told.append("idle")

    def busy(self) -> None:
        self.told.append("busy")

    def stop(self) -> None:
        self.told.append("stop")


def test_the_background_warmup_is_a_gauge_compiles_only_while_idle_and_stops_with_the_loop():
    warmup = _Warmup()
    engine = MockEngine(slots=4, max_prefill_length=64, max_target_length=512, prefix_block=16, background_warmup=warmup)
    orch = Orchestrator(engine, {}, TOKENIZER, OrchestratorConfig(max_queued_requests=8))
    assert "pathserve_warmup_shapes_pending 3.0" in render(registry(lambda: Scrape(orch.metrics)))  # before start
    orch.start()
    try:
        deadline = time.monotonic() + 10
        while not warmup.told and time.monotonic() < deadline:
            time.sleep(0.01)
        orch.submit([1, 2, 3], SamplingParams(max_tokens=4)).result()
        warmup.pending = 0  # the last shape compiled: the next turn says so
        deadline = time.monotonic() + 10
        while (orch.metrics.warmup_shapes_pending or warmup.told[-1] != "idle") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "pathserve_warmup_shapes_pending 0.0" in render(registry(lambda: Scrape(orch.metrics)))
    finally:
        orch.stop(timeout=10)
    told = [t for i, t in enumerate(warmup.told) if i == 0 or t != warmup.told[i - 1]]
    assert told[0] == "idle" and "busy" in told and told[-2:] == ["idle", "stop"]


def test_a_pool_too_small_for_its_sequences_preempts_and_every_stream_keeps_its_tokens():
    """17 pages of 16 positions (one sequence of max_target_length and the scratch page) for four
    slots of mixed requests: sequences wait for pages and the newest are preempted and recomputed;
    every stream still gets exactly the tokens it would alone, none repeated, none lost."""
    results, orchs = {}, {}
    for cache, pages in (("off", 0), ("on", 17)):
        orch = _orchestrator(cache, prefill_chunk_size=16, max_target_length=256, num_pages=pages)
        try:
            requests = _mixed_requests()
            # the first eight queued before the loop starts: they contend for the pages at once,
            # however fast this machine would have served them one by one
            first = [orch.submit(p, s) for p, s in requests[:8]]
            orch.start()
            results[cache] = [h.result().token_ids for h in first] + _serve_together(orch, requests[8:])
        finally:
            orch.stop(timeout=10)
        orchs[cache] = orch
    small = orchs["on"]
    assert results["on"] == results["off"] == [small.engine.expected(p, s) for p, s in _mixed_requests()]
    assert small.metrics.preemptions > 0 and orchs["off"].metrics.preemptions == 0
    # a preempted sequence's prefill gives its next token: the first token's time is observed once
    assert small.metrics.time_to_first_token.count == len(_mixed_requests())


def test_a_request_cancelled_while_its_prompt_is_prefilling_frees_its_slot():
    orch = _orchestrator("off", slots=2, step_seconds=0.01, prefill_chunk_size=16).start()
    try:
        running = orch.submit([1], SamplingParams(max_tokens=400))
        long = orch.submit([3] * 480, SamplingParams(max_tokens=2))  # 30 chunks, one per turn
        while orch.metrics.kv_tokens_used < 1 + 32:  # two chunks in, the running slot at 1+
            time.sleep(0.005)
        assert orch.metrics.active_slots == 2  # a prefilling slot is in use
        long.cancel()
        assert long.result().finish_reason == "cancelled" and long.completion.completion_tokens == 0
        after = orch.submit([5], SamplingParams(max_tokens=2))
        assert after.result().token_ids == [6, 7]
        running.cancel()
    finally:
        orch.stop(timeout=10)
    calls = orch.engine.calls
    assert ("free_resource", 1) in calls
    assert sum(rows[0][0] == 1 and rows[0][1] > 0 for rows in _rows(orch.engine)) < 29  # it stopped part-way


def test_a_running_sequence_preempted_mid_stream_neither_repeats_nor_loses_a_token():
    """Two long generations in a pool that holds one: the newer, already streaming, gives up its
    pages and later prefills its prompt and its streamed tokens again; its stream goes on with the
    next token, and its first token's time is observed once."""
    orch = _orchestrator(slots=2, max_prefill_length=16, max_target_length=64, prefix_block=4, num_pages=17)
    try:
        requests = [([5 + i] * 8, SamplingParams(max_tokens=50)) for i in range(2)]
        handles = [orch.submit(p, s) for p, s in requests]  # both queued before the loop starts
        orch.start()
        streams = [[delta.token_ids for delta in h.stream()] for h in handles]
    finally:
        orch.stop(timeout=10)
    for stream, (prompt, sampling) in zip(streams, requests, strict=True):
        assert [t for delta in stream for t in delta] == orch.engine.expected(prompt, sampling)
    resumed = [c for c in orch.engine.calls if c[0] == "prefill_slots" and any(r[1] > 8 for r in c[1])]
    assert orch.metrics.preemptions > 0 and resumed  # a prefill past the 8-token prompt: a resumed one
    assert orch.metrics.time_to_first_token.count == 2
