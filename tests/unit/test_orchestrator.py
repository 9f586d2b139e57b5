"""The orchestrator's threads on the mock engine: hand-computable tokens, no model, no JAX."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import threading
import time

import pytest

from serving.config import OrchestratorConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.errors import GenerationError, QueueFullError, ShuttingDownError
from serving.orchestrator import Orchestrator
from serving.orchestrator.streams import Delta
from serving.request import SamplingParams

TOKENIZER = AsciiTokenizer()


def _orchestrator(slots: int = 2, queue: int = 64, **engine) -> Orchestrator:
    return Orchestrator(MockEngine(slots=slots, **engine), {}, TOKENIZER, OrchestratorConfig(max_queued_requests=queue))


@pytest.fixture
def orchestrator():
    orch = _orchestrator().start()
    yield orch
    orch.stop(timeout=10)


def test_more_concurrent_requests_than_slots_all_get_their_own_tokens(orchestrator):
    prompts = [TOKENIZER.encode(chr(ord("a") + i) * (1 + i % 3)) for i in range(9)]
    samplings = [SamplingParams(max_tokens=2 + i) for i in range(9)]
    results: list = [None] * 9

    def client(i):
        results[i] = orchestrator.submit(prompts[i], samplings[i]).result()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    engine = orchestrator.engine
    for prompt, sampling, result in zip(prompts, samplings, results, strict=True):
        assert result.token_ids == engine.expected(prompt, sampling)
        assert result.finish_reason == "length" and result.prompt_tokens == len(prompt)
    assert TOKENIZER.decode(results[0].token_ids) == "bc"  # "a" continues "bc..."


def test_a_stop_id_ends_with_stop_and_a_stop_string_cuts_the_text(orchestrator):
    stop_at_e = SamplingParams(max_tokens=10, stop_ids=tuple(TOKENIZER.encode("e")))
    done = orchestrator.submit(TOKENIZER.encode("ab"), stop_at_e).result()
    # the stop token's text is left out, as vLLM does, unless include_stop_str_in_output
    assert (done.text, done.finish_reason, len(done.token_ids)) == ("cd", "stop", 3)
    kept = dataclasses.replace(stop_at_e, include_stop_str_in_output=True)
    assert orchestrator.submit(TOKENIZER.encode("ab"), kept).result().text == "cde"
    cut = orchestrator.submit(TOKENIZER.encode("ab"), SamplingParams(max_tokens=10), stop_strings=("fg",))
    completion = cut.result()
    assert (completion.text, completion.finish_reason) == ("cde", "stop")


def test_stream_deltas_add_up_to_the_text(orchestrator):
    handle = orchestrator.submit(TOKENIZER.encode("k"), SamplingParams(max_tokens=7))
    deltas = list(handle.stream())
    assert "".join(d.text for d in deltas) == handle.completion.text == "lmnopqr"
    assert [i for d in deltas for i in d.token_ids] == handle.completion.token_ids


def test_asyncio_readers_get_the_same_stream():
    orch = _orchestrator().start()

    async def read():
        handle = orch.submit(TOKENIZER.encode("k"), SamplingParams(max_tokens=3), loop=asyncio.get_running_loop())
        return "".join([d.text async for d in handle.astream()])

    try:
        assert asyncio.run(read()) == "lmn"
    finally:
        orch.stop(timeout=10)


def test_tokens_already_queued_come_out_as_one_delta_and_a_stop_string_drops_the_rest():
    """A generate call's tokens reach a stream together: one delta (one SSE event, one wake-up of
    the reader) for all of them, threads and asyncio alike; a stop string among them still cuts."""
    from serving.orchestrator.streams import END, LoopQueue, Request, RequestHandle

    orch = _orchestrator()

    def queued(tokens=None) -> Request:
        request = Request(TOKENIZER.encode("a"), SamplingParams(max_tokens=8), ("de",))
        if tokens is not None:
            request.tokens = tokens
        for token in TOKENIZER.encode("bcdefg"):
            request.put(token)
        request.tokens.put((END, "length"))
        return request

    handle = RequestHandle(queued(), TOKENIZER, orch)
    assert [(d.text, d.token_ids) for d in handle.stream()] == [("bc", TOKENIZER.encode("bcd"))]  # as one by one
    assert handle.completion.finish_reason == "stop"

    async def read():
        handle = RequestHandle(queued(LoopQueue(asyncio.get_running_loop())), TOKENIZER, orch)
        return [d.text async for d in handle.astream()], handle.completion

    texts, completion = asyncio.run(read())
    assert texts == ["bc"] and (completion.text, completion.finish_reason) == ("bc", "stop")


def test_a_joined_delta_still_ends_on_a_whole_character_its_ids_decoding_to_its_text():
    from serving.orchestrator.streams import END, Request, RequestHandle

    class Bytes(AsciiTokenizer):  # token i <-> the byte i: a character may take several tokens
        @property
        def vocab_size(self) -> int:
            return 256

        def token_bytes(self, token_id: int) -> bytes:
            return bytes([token_id])

    tokenizer, orch = Bytes(), _orchestrator()
    request = Request([1], SamplingParams(max_tokens=8), ())
    handle = RequestHandle(request, tokenizer, orch)
    a, e1, e2, b = b"a\xc3\xa9b"
    for token in (a, e1):  # "a" and the first byte of "é" arrive together
        request.put(token)
    deltas = handle.stream()
    assert next(deltas) == Delta("a", [a])  # the partial character's token waits for the next delta
    for item in (e2, b, (END, "length")):
        request.tokens.put(item)
    assert list(deltas) == [Delta("éb", [e1, e2, b])]


def test_cancellation_frees_the_slot_for_the_next_request():
    orch = _orchestrator(slots=1, step_seconds=0.01, max_target_length=4096).start()
    try:
        long = orch.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=4000))
        waiting_sampling = SamplingParams(max_tokens=2)
        waiting = orch.submit(TOKENIZER.encode("a"), waiting_sampling)
        stream = long.stream()
        next(stream)
        long.cancel()
        list(stream)
        assert long.completion.finish_reason == "cancelled" and long.completion.completion_tokens < 100
        assert waiting.result().token_ids == orch.engine.expected(TOKENIZER.encode("a"), waiting_sampling)
        assert ("free_resource", 0) in orch.engine.calls
    finally:
        orch.stop(timeout=10)


def test_a_full_server_fails_fast_and_is_counted():
    orch = _orchestrator(slots=2, queue=2)  # not started: nothing drains
    prompt = TOKENIZER.encode("a")
    for _ in range(2 + 2):  # the free slots are room too, before the device loop takes anyone
        orch.submit(prompt, SamplingParams(max_tokens=2))
    assert orch.full()
    started = time.perf_counter()
    with pytest.raises(QueueFullError):
        orch.submit(prompt, SamplingParams(max_tokens=2))
    assert time.perf_counter() - started < 0.5 and orch.metrics.requests_rejected == 1


def test_a_burst_of_slots_plus_queue_at_an_idle_server_is_admitted_whole_and_one_more_is_not():
    slots, queue = 4, 2
    gate = threading.Event()  # no request can finish (and give its room back) before the refused submit

    class Gated(MockEngine):
        def generate(self, *args, **kwargs):
            gate.wait(10)
            return super().generate(*args, **kwargs)

    engine = Gated(slots=slots, max_target_length=4096)
    orch = Orchestrator(engine, {}, TOKENIZER, OrchestratorConfig(max_queued_requests=queue)).start()
    try:
        go = threading.Barrier(slots + queue)
        handles: list = [None] * (slots + queue)

        def client(i: int) -> None:
            go.wait()
            # 150 tokens need generate calls: each request stays until the gate opens
            handles[i] = orch.submit(TOKENIZER.encode("ab"), SamplingParams(max_tokens=150))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(slots + queue)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert all(h is not None for h in handles) and orch.metrics.requests_rejected == 0
        with pytest.raises(QueueFullError):  # four in slots (or about to be) and two waiting
            orch.submit(TOKENIZER.encode("ab"), SamplingParams(max_tokens=2))
        gate.set()
        assert [h.result().completion_tokens for h in handles] == [150] * (slots + queue)
        # Finished requests give their room back: the server takes a whole burst again.
        again = [orch.submit(TOKENIZER.encode("ab"), SamplingParams(max_tokens=2)) for _ in range(slots + queue)]
        assert [h.result().finish_reason for h in again] == ["length"] * (slots + queue)
    finally:
        gate.set()
        orch.stop(timeout=10)


def test_cancelled_requests_give_their_room_back():
    orch = _orchestrator(slots=1, queue=1, step_seconds=0.01, max_target_length=4096).start()
    try:
        for _ in range(3):  # more rounds than the capacity: a leaked count would refuse one
            first = orch.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=4000))
            second = orch.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=4000))
            next(first.stream())
            first.cancel()
            second.cancel()
            assert first.result().finish_reason == second.result().finish_reason == "cancelled"
        assert orch.metrics.requests_rejected == 0
    finally:
        orch.stop(timeout=10)


def test_requests_the_engine_cannot_take_fail_at_submit_naming_the_field(orchestrator):
    with pytest.raises(GenerationError) as err:
        orchestrator.submit([1, 2], SamplingParams(max_tokens=255))
    assert err.value.field == "max_tokens"
    with pytest.raises(GenerationError) as err:
        orchestrator.submit([1] * 255, SamplingParams(max_tokens=2))
    assert err.value.field == "max_tokens" and err.value.code == "context_length_exceeded"


def test_a_prompt_longer_than_the_largest_prefill_enters_its_slot_in_chunks(orchestrator):
    prompt, sampling = list(range(90)) * 2, SamplingParams(max_tokens=3)  # 180 tokens, buckets up to 64
    assert orchestrator.submit(prompt, sampling).result().token_ids == orchestrator.engine.expected(prompt, sampling)
    chunks = [call[1] for call in orchestrator.engine.calls if call[0] == "prefill_slots"]
    assert [row[1:] for rows in chunks for row in rows] == [(0, 64, False), (64, 64, False), (128, 52, True)]


def test_stop_finishes_what_is_running_and_refuses_new_requests():
    orch = _orchestrator(step_seconds=0.005).start()
    handle = orch.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=20))
    orch.stop(timeout=10)
    assert handle.result().completion_tokens == 20 and not orch.alive
    with pytest.raises(ShuttingDownError):
        orch.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=2))


def test_metrics_count_steps_tokens_and_slots(orchestrator):
    orchestrator.submit(TOKENIZER.encode("ab"), SamplingParams(max_tokens=6)).result()
    deadline = time.monotonic() + 5
    while orchestrator.metrics.requests_finished.get("length") != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    metrics = orchestrator.metrics
    assert metrics.generate_step.count >= 3 and metrics.prefill_step.count == 1
    assert (metrics.prompt_tokens, metrics.generation_tokens) == (2, 6)
    assert metrics.active_slots == 0 and metrics.kv_tokens_used == 0


def test_the_orchestrator_on_the_mock_engine_loads_no_jax_torch_or_transformers():
    code = (
        "import sys, serving.orchestrator.orchestrator, serving.engine.mock;"
        "print(sorted(m for m in ('jax', 'torch', 'transformers') if m in sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"


def test_the_first_token_is_streamed_before_the_turns_generate_call():
    """The turn's generate call waits at a gate until the first token has been read (no race
    with the pace of the machine): the token and its time to first token come before the call."""
    gate = threading.Event()

    class Gated(MockEngine):
        def generate(self, *args, **kwargs):
            if not gate.wait(10):  # the first token was not streamed before this call
                raise RuntimeError("generate ran before the first token was read")
            return super().generate(*args, **kwargs)

    orch = Orchestrator(Gated(slots=2), {}, TOKENIZER, OrchestratorConfig(max_queued_requests=64)).start()
    try:
        submitted = time.perf_counter()
        stream = orch.submit(TOKENIZER.encode("ab"), SamplingParams(max_tokens=3)).stream()
        assert next(stream).text == "c"  # the generate call is still held at the gate
        released = time.perf_counter()
        gate.set()
        list(stream)
        ttft = orch.metrics.time_to_first_token
        assert ttft.count == 1 and ttft.total <= released - submitted  # observed before the call
    finally:
        gate.set()
        orch.stop(timeout=10)


def test_an_engine_failure_ends_every_stream_with_error_and_the_loop_reports_dead():
    class Failing(MockEngine):
        def generate(self, params, decode_state, max_position=None, masks=None, num_slots=None):
            raise RuntimeError("device lost")

    orch = Orchestrator(Failing(slots=1), {}, TOKENIZER, OrchestratorConfig()).start()
    running = orch.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=5))
    queued = orch.submit(TOKENIZER.encode("b"), SamplingParams(max_tokens=5))
    assert running.result().finish_reason == "error" and queued.result().finish_reason == "error"
    orch._thread.join(5)
    assert not orch.alive
    with pytest.raises(ShuttingDownError):
        orch.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=2))


def test_requests_whose_clients_left_while_queued_behind_a_waiting_head_stop_counting():
    """One slot, busy; B waits for it at the head of the queue, C and D behind it are cancelled
    (their clients left). They end at the next turn and leave the queue: the picker's queue size
    counts B alone, and their room goes to new requests (it was a 429 until the slot freed)."""
    config = OrchestratorConfig(max_queued_requests=3)
    orch = Orchestrator(MockEngine(slots=1, step_seconds=0.01), {}, TOKENIZER, config).start()
    try:
        busy = orch.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=240))
        assert next(busy.stream()).text  # in the slot
        waiting = orch.submit(TOKENIZER.encode("b"), SamplingParams(max_tokens=2))
        gone = [orch.submit(TOKENIZER.encode(c), SamplingParams(max_tokens=2)) for c in "cd"]
        for handle in gone:
            handle.cancel()
        assert all(h.result().finish_reason == "cancelled" for h in gone)
        deadline = time.monotonic() + 10
        while orch._waiting() != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert orch._waiting() == 1 and not orch.full()
        more = [orch.submit(TOKENIZER.encode(c), SamplingParams(max_tokens=2)) for c in "ef"]  # no QueueFullError
        busy.cancel()
        assert waiting.result().finish_reason == "length" and all(h.result().finish_reason == "length" for h in more)
    finally:
        orch.stop(timeout=10)
