"""`make serve` as the README runs it: the default SmolLM2-135M-Instruct (int8) answering the official
openai client; then, on that real model, bearer-token auth, client disconnects freeing their slots, and
the SIGTERM drain that loses no in-flight request. The tests run in file order; the drain ends it."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

from tests.backends import expected_backend
from tests.server_process import REPO, ServerProcess, free_port, metric, wait_for

pytestmark = pytest.mark.slow  # the real model's server, its 64 slots warmed up (docs/development.md)

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served():
    port = free_port()
    process = ServerProcess(
        ["make", "--no-print-directory", "serve", f"PORT={port}", f"GRPC_PORT={free_port()}"],
        port,
        env={"PATHSERVE_API_KEY": KEY, "MAKEFLAGS": ""},
        cwd=REPO,
    ).wait_ready(timeout=900)
    yield process
    process.stop()


def serve_pid(process: ServerProcess) -> int:
    """The `pathserve serve` process that make started."""
    out = subprocess.run(
        ["pgrep", "-s", str(process.proc.pid), "-f", "pathserve serve"], capture_output=True, text=True
    )
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, (out.stdout, process.output())
    return pids[0]




def test_make_serve_answers_a_chat_request(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        max_tokens=32,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens <= 32
    assert "quantization=int8" in served.output() and "64 slots" in served.output()
    ready = next(line for line in served.output().splitlines() if "ready:" in line)
    assert f"{expected_backend()} backend" in ready, ready  # the CPU kernels where this CPU runs them


def test_api_key_guards_the_api_not_the_probes(served):
    assert httpx.post(f"{served.url}/v1/completions", json={"prompt": "a"}).status_code == 401
    wrong = httpx.post(f"{served.url}/generate", json={"prompt": "a"}, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert wrong.headers["www-authenticate"] == "Bearer"
    for probe in ("/healthcheck", "/startupz", "/readyz", "/livez", "/metrics"):
        assert httpx.get(served.url + probe).status_code == 200, probe


LENGTH = 'pathserve_requests_finished_total{reason="length"}'
GENERATE_CALLS = "pathserve_generate_step_seconds_count"


def _cancelled(process: ServerProcess) -> float:
    return metric(process, 'pathserve_requests_finished_total{reason="cancelled"}')


def test_disconnect_mid_stream_frees_the_slot_within_a_step(served):
    """A client that leaves mid-stream cancels its request. The test waits for the events that say
    so (the request ends as cancelled, not at its length; its slot is free again) rather than for
    a state in between, which a fast machine may have left before the first look."""
    cancelled, finished = _cancelled(served), metric(served, LENGTH)
    calls = metric(served, GENERATE_CALLS)
    max_tokens = 1000  # ignore_eos: 500 generate calls of 2 steps (default.yml) if it ran to its end
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: {"))  # in a slot, decoding
        assert json.loads(first.removeprefix("data: "))["choices"][0]["finish_reason"] is None
        r.close()  # the client goes away mid-stream
        left = time.monotonic()
    assert wait_for(lambda: _cancelled(served) == cancelled + 1, 30)
    assert time.monotonic() - left < 5  # a step or two on any machine, not the rest of the request
    assert wait_for(lambda: metric(served, "pathserve_active_slots") == 0, 5)
    assert metric(served, LENGTH) == finished  # it did not run to its length
    # The device loop's own count: the slot was freed after a few calls, not after the request's
    # 500 (the reader counts a cancelled stream as soon as its client leaves, slot freed or not).
    assert metric(served, GENERATE_CALLS) - calls < max_tokens / 2 / 4


def test_disconnect_while_waiting_for_a_whole_completion_frees_the_slot(served):
    """A client that leaves while its (non-streamed) completion runs cancels it. The client leaves
    once the request holds a slot (no client timeout that a fast machine could outrun: 900 tokens
    are seconds here), and the request ends as cancelled, not at its length."""
    before, finished = _cancelled(served), metric(served, LENGTH)
    assert wait_for(lambda: metric(served, "pathserve_active_slots") == 0, 30)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True}).encode()
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: {AUTH['Authorization']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        assert wait_for(lambda: metric(served, "pathserve_active_slots") == 1, 30)
    assert wait_for(lambda: _cancelled(served) == before + 1, 5)
    assert wait_for(lambda: metric(served, "pathserve_active_slots") == 0, 5)
    assert metric(served, LENGTH) == finished  # it did not run to its length


def test_sigterm_drains_in_flight_requests_then_exits_zero(served):
    # long enough that the drain outlasts the checks below by far on any CPU: with 48 tokens a fast
    # machine (async scheduling) finished the drain and exited before /readyz was asked
    n, tokens = 4, 320
    results: list = [None] * n
    streaming = threading.Barrier(n + 1)

    def stream(i: int) -> None:
        body = {"prompt": f"Story number {i}:", "max_tokens": tokens, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.stream("POST", f"{served.url}/generate", json=body, headers=AUTH, timeout=300) as r:
            for line in r.iter_lines():
                if not lines:
                    streaming.wait()
                if line:
                    lines.append(json.loads(line))
        results[i] = lines

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    streaming.wait(timeout=120)
    subprocess.run(["kill", "-TERM", str(serve_pid(served))], check=True)
    assert wait_for(lambda: httpx.get(f"{served.url}/readyz").status_code == 503, 2)
    assert httpx.get(f"{served.url}/readyz").json() == {"status": "draining"}
    late = httpx.post(f"{served.url}/generate", json={"prompt": "a"}, headers=AUTH)
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
    for t in threads:
        t.join(timeout=300)
    assert served.proc.wait(timeout=120) == 0, served.output()  # make exits with pathserve's status
    for lines in results:
        final = lines[-1]
        assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == tokens
        assert "".join(line.get("text", "") for line in lines[:-1]) == final["response"]
    assert "draining" in served.output() and "stopped" in served.output()
