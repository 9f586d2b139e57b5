"""A real server (tiny model) with 4 slots, a queue of 2 and unknown_request_fields=warn: a burst of
slots + queue simultaneous requests at an idle server is admitted whole and the next one is not; an
unknown field is ignored, logged once by name and counted in /metrics. (The default, reject, is in
tests/api/test_server.py.)"""

from __future__ import annotations

import contextlib
import threading

import httpx
import pytest

from tests.server_process import ServerProcess, metric, wait_for

SLOTS, QUEUE = 4, 2
LONG = 30_000  # tokens (ignore_eos): seconds on the fastest machine, so they are still running when looked at
OVERRIDES = [
    f"per_device_batch_size={SLOTS}",
    f"max_queued_requests={QUEUE}",
    "max_prefill_predict_length=64",
    f"max_target_length={LONG + 2048}",
    "enable_model_warmup=false",  # the serving profile's warmup would compile every window up to LONG
    "unknown_request_fields=warn",
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    process = ServerProcess.pathserve(str(tiny_model_dir), *OVERRIDES).wait_ready()
    yield process
    assert process.stop() == 0, process.output()


def clients(server: ServerProcess, count: int, stack: contextlib.ExitStack) -> list[httpx.Client]:
    """`count` clients, each with its connection open (closed with `stack`)."""
    opened = [stack.enter_context(httpx.Client(base_url=server.url, timeout=300)) for _ in range(count)]
    for client in opened:
        client.get("/healthcheck")
    return opened


def simultaneously(connected: list[httpx.Client], send) -> list:
    """`send(client)` on every client from a thread of its own, all released at once."""
    results: list = [None] * len(connected)
    go = threading.Barrier(len(connected))

    def one(i: int) -> None:
        go.wait()
        results[i] = send(connected[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(connected))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def open_stream(client: httpx.Client, body: dict):
    """(the stream's context manager, its response): headers read, the body left unread."""
    stream = client.stream("POST", "/v1/completions", json=body)
    return stream, stream.__enter__()


def idle(server: ServerProcess) -> bool:
    return all(metric(server, name) == 0 for name in ("pathserve_active_slots", "jetstream_prefill_backlog_size"))


def test_a_burst_of_slots_plus_queue_at_an_idle_server_all_get_200(server):
    assert wait_for(lambda: idle(server), 60)
    body = {"prompt": "The lighthouse", "max_tokens": 48, "ignore_eos": True}
    with contextlib.ExitStack() as stack:
        burst = clients(server, SLOTS + QUEUE, stack)
        responses = simultaneously(burst, lambda c: c.post("/v1/completions", json=body))
    assert [r.status_code for r in responses] == [200] * (SLOTS + QUEUE), [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 48 for r in responses)
    assert metric(server, "pathserve_requests_rejected_total") == 0


def test_one_more_than_slots_plus_queue_gets_429(server):
    assert wait_for(lambda: idle(server), 60)
    body = {"prompt": "The lighthouse", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as streams:
        burst = clients(server, SLOTS + QUEUE, streams)
        # A stream's status comes as soon as the request is admitted (or refused).
        opened = simultaneously(burst, lambda c: open_stream(c, body))
        for stream, _ in opened:
            streams.push(stream)  # closed (the server cancels them) on leaving
        assert [r.status_code for _, r in opened] == [200] * (SLOTS + QUEUE)
        late = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=60)
        assert late.status_code == 429 and late.json()["error"]["code"] == "queue_full", late.text
        assert httpx.get(f"{server.url}/readyz").json() == {"status": "admission queue full"}
    assert wait_for(lambda: idle(server), 60)  # closed streams are cancelled, queued ones too
    assert httpx.get(f"{server.url}/readyz").status_code == 200


def test_with_warn_an_unknown_field_answers_200_and_the_log_names_it(server):
    body = {"messages": [{"role": "user", "content": "Tell me of ships."}], "max_tokens": 8, "temperature": 0}
    expected = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
    for _ in range(2):
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "temprature": 0.5}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"] == expected["choices"]  # ignored: it changed nothing
    logged = [line for line in server.output().splitlines() if "ignoring unknown request field" in line]
    assert len(logged) == 1 and "'temprature'" in logged[0], logged  # once per name
    assert metric(server, "pathserve_ignored_request_fields_total", '{field="temprature"}') == 2
