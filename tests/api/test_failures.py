"""What a client sees when the engine cannot finish its request, and JetStream's HTTP shapes, on
the mock engine over a real uvicorn server (AsciiTokenizer: "ab" continues "cdef...").

A request the device loop failed under, or whose LoRA adapter was unloaded while it waited, is an
error on every surface (HTTP 500 / 404, an error record ending a stream, no batch record), never a
short completion with status 200. JetStream's sidecar `/generate` and `/healthcheck`, and its own
server's `/v1/generate` and `/v1/health`, answer in their shapes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from serving.api.state import ServerState
from serving.config import ServingConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.errors import ADAPTER_UNLOADED, ENGINE_FAILED, RequestFailed, failure
from serving.lora.peft import LoraWeights
from serving.lora.registry import AdapterRegistry
from serving.orchestrator import Orchestrator
from tests.failing_engine import FailsAfter
from tests.server_process import wait_for
from tests.unit.test_api import _Running

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = AsciiTokenizer()
CFG = ServingConfig(max_queued_requests=8, max_prefill_predict_length=64, max_target_length=256)


def _serving(engine: MockEngine, adapters: AdapterRegistry | None = None, start: bool = True) -> _Running:
    orchestrator = Orchestrator(engine, {}, TOKENIZER, CFG.orchestrator, adapters=adapters)
    state = ServerState(config=CFG.server)
    state.set_ready(orchestrator.start() if start else orchestrator, "mock")
    return _Running(state)


@pytest.fixture
def failing():
    running = _serving(FailsAfter(2, slots=2, step_seconds=0.02))
    yield running
    running.stop()
    running.state.orchestrator.stop(timeout=10)


@pytest.fixture(scope="module")
def healthy():
    running = _serving(MockEngine(slots=2))
    yield running
    running.stop()
    running.state.orchestrator.stop(timeout=10)


def test_failure_names_what_the_front_ends_answer():
    assert failure(["stop", "length", "cancelled"]) is None
    engine, adapter = failure(["stop", ENGINE_FAILED]), failure([ADAPTER_UNLOADED])
    assert isinstance(engine, RequestFailed) and engine.kind == "engine"
    assert isinstance(adapter, RequestFailed) and adapter.kind == "adapter"
    assert failure([ADAPTER_UNLOADED, ENGINE_FAILED]).kind == "engine"


def test_a_failed_engine_is_a_500_not_a_short_completion(failing):
    reply = httpx.post(f"{failing.url}/v1/completions", json={"prompt": "ab", "max_tokens": 50}, timeout=30)
    assert reply.status_code == 500, reply.text
    error = reply.json()["error"]
    assert error["code"] == "engine_error" and "engine failed" in error["message"]
    # the loop is dead: the sidecar's /healthcheck says so as gRPC HealthCheck and /livez do
    health = httpx.get(f"{failing.url}/healthcheck")
    assert health.status_code == 503 and health.json() == {"response": {"is_live": False}}
    assert httpx.get(f"{failing.url}/v1/health").json() == {"is_live": "False"}
    assert httpx.get(f"{failing.url}/livez").status_code == 503


def test_a_stream_the_engine_failed_under_ends_with_an_error_record(failing):
    body = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 50, "stream": True, "n": 2,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{failing.url}/v1/chat/completions", json=body, timeout=30) as reply:
        assert reply.status_code == 200  # the answer had begun
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "engine_error"
    records = [json.loads(e) for e in events[:-2]]
    assert all("error" not in r and r["choices"] for r in records)  # no finish chunk, no usage chunk
    assert not any(c["finish_reason"] for r in records for c in r["choices"])


def test_generate_the_sidecars_way_fails_as_an_error_too(failing):
    reply = httpx.post(f"{failing.url}/generate", json={"prompt": "ab", "max_tokens": 50}, timeout=30)
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "engine_error"


def test_a_streamed_generate_ends_with_an_error_line():
    running = _serving(FailsAfter(2, slots=2, step_seconds=0.02))
    try:
        body = {"prompt": "ab", "max_tokens": 50, "stream": True}
        with httpx.stream("POST", f"{running.url}/generate", json=body, timeout=30) as reply:
            lines = [json.loads(line) for line in reply.iter_lines() if line]
        assert lines[-1]["error"]["code"] == "engine_error"
        assert all(set(line) == {"text"} for line in lines[:-1])
    finally:
        running.stop()
        running.state.orchestrator.stop(timeout=10)


def test_an_adapter_unloaded_while_its_request_waited_is_a_404():
    registry = AdapterRegistry(lambda path: LoraWeights(1, {"wq": (np.zeros((1, 2, 1)), np.zeros((1, 1, 2)))}, 1.0), max_loras=1, max_cpu_loras=1)
    registry.load("sql", "/store/sql")
    running = _serving(MockEngine(slots=2), registry, start=False)  # nothing drains the queue yet
    try:
        replies = []
        body = {"model": "sql", "prompt": "ab", "max_tokens": 3}
        thread = threading.Thread(
            target=lambda: replies.append(httpx.post(f"{running.url}/v1/completions", json=body, timeout=30))
        )
        thread.start()
        orchestrator = running.state.orchestrator
        assert wait_for(lambda: not orchestrator._queue_empty(), 30)  # submitted: it waits in the queue
        registry.unload("sql")
        orchestrator.start()
        thread.join(30)
        (reply,) = replies
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found", reply.text
    finally:
        running.stop()
        running.state.orchestrator.stop(timeout=10)


def test_the_sidecars_generate_shape(healthy):
    url = healthy.url
    # its defaults: 100 tokens; session_cache and priority at their neutral values; server and port
    # (where the sidecar forwards) accepted and said to have no effect
    neutral = {"prompt": "ab", "session_cache": "", "priority": 0, "server": "127.0.0.1", "port": "9000"}
    reply = httpx.post(f"{url}/generate", json=neutral, timeout=30)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 100
    assert "server:" in reply.headers["pathserve-ignored-fields"] and "port:" in reply.headers["pathserve-ignored-fields"]
    for field, value in [("session_cache", "gs://cache"), ("priority", 3)]:
        refused = httpx.post(f"{url}/generate", json={"prompt": "ab", field: value}, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    # streamed: every line has "text" (the last one's is empty)
    with httpx.stream("POST", f"{url}/generate", json={"prompt": "ab", "max_tokens": 3, "stream": True}) as reply:
        lines = [json.loads(line) for line in reply.iter_lines() if line]
    assert "".join(line["text"] for line in lines) == "cde"
    assert lines[-1]["text"] == "" and lines[-1]["response"] == "cde" and lines[-1]["finish_reason"] == "length"

