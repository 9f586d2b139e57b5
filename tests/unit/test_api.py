"""The HTTP API's translation and routes on the mock engine: a real uvicorn server on loopback and
the real openai client, with tokens computable by hand (AsciiTokenizer: "ab" continues "cdef...")."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import uvicorn

from loadtest.server import free_port
from serving.api.app import create_app
from serving.api.state import ServerState
from serving.config import ServingConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams

TOKENIZER = AsciiTokenizer()


class _Running:
    def __init__(self, state: ServerState):
        self.state = state
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(create_app(state), port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _state(queue: int = 16, start: bool = True) -> ServerState:
    cfg = ServingConfig(max_queued_requests=queue, max_prefill_predict_length=64, max_target_length=256)
    orchestrator = Orchestrator(MockEngine(slots=2), {}, TOKENIZER, cfg.orchestrator)
    state = ServerState(config=cfg.server)
    if start:
        state.set_ready(orchestrator.start(), "mock")
    else:
        state.set_ready(orchestrator, "mock")  # ready, but nothing drains its queue
    return state


@pytest.fixture(scope="module")
def server():
    running = _Running(_state())
    yield running
    running.stop()
    running.state.orchestrator.stop(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_probes_say_starting_until_the_engine_is_ready():
    state = ServerState(config=ServingConfig().server)
    running = _Running(state)
    try:
        assert httpx.get(f"{running.url}/healthcheck").status_code == 503
        assert httpx.post(f"{running.url}/v1/completions", json={"prompt": "a"}).status_code == 503
    finally:
        running.stop()


def test_completions_carry_the_engines_tokens_and_usage(client):
    out = client.completions.create(model="mock", prompt="ab", max_tokens=5, temperature=0)
    assert out.choices[0].text == "cdefg" and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2, 5)


def test_a_streamed_chat_equals_the_whole_answer(client):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model="mock", messages=messages, max_tokens=6, temperature=0)
    parts = client.chat.completions.create(
        model="mock", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    # the template ends "assistant: ", so the reply starts after a space: "!" then "\"#$%&"
    prompt = TOKENIZER.encode_chat(messages)
    expected = TOKENIZER.decode(MockEngine().expected(prompt, SamplingParams(max_tokens=6)))
    assert whole.choices[0].message.content == text == expected


def test_stop_strings_and_jetstream_generate(server):
    body = {"prompt": "ab", "max_tokens": 10, "stop": ["fg"], "temperature": 0}
    out = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "mock"}).json()
    assert out["choices"][0]["text"] == "cde" and out["choices"][0]["finish_reason"] == "stop"
    out = httpx.post(f"{server.url}/generate", json={"prompt": "ab", "max_tokens": 3}).json()
    assert out["response"] == "cde"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "ab", "max_tokens": 255}, "max_tokens"),
        ({"prompt": "a" * 255, "max_tokens": 2}, "max_tokens"),
        ({"prompt": "ab", "max_tokens": 2, "temperature": -1}, "temperature"),
    ],
)
def test_requests_the_engine_cannot_take_get_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server.url}/v1/completions", json={**body, "model": "mock"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "extra", [{}, {"repetition_penalty": 1.2}, {"logprobs": 2}], ids=["plain", "repetition_penalty", "logprobs"]
)
def test_a_prompt_longer_than_the_largest_prefill_is_served_in_chunks(server, extra):
    # a repetition penalty and logprobs too: the final chunk carries the whole prompt, and its call
    # gives the first token's logprobs
    body = {"model": "mock", "prompt": "a" * 200 + "b", "max_tokens": 3, "temperature": 0, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == "cde"
    if "logprobs" in extra:  # as the whole prefill (n = 2) gives them for the same tokens
        whole = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "ab", "n": 2}).json()["choices"][0]
        assert whole["text"] == "cde" and choice["logprobs"] == whole["logprobs"]
    assert response.json()["usage"]["prompt_tokens"] == 201


def test_the_prompts_logprobs_of_a_prompt_longer_than_the_largest_prefill_come_from_its_chunks(server):
    """echo with logprobs: each chunk scores its positions (the mock's logprob of each prompt
    token, the first none), the generated tokens' as without echo."""
    body = {"model": "mock", "prompt": "a" * 200 + "b", "max_tokens": 3, "temperature": 0, "logprobs": 2}
    plain = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]["logprobs"]
    response = httpx.post(f"{server.url}/v1/completions", json={**body, "echo": True})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] == "a" * 200 + "b" + "cde"
    lp = choice["logprobs"]
    assert lp["tokens"] == [*"a" * 200, "b", *plain["tokens"]] and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:201] == [0.0] * 199 + [-0.25]  # the mock's: a after a, then b
    assert lp["token_logprobs"][201:] == plain["token_logprobs"] and lp["top_logprobs"][201:] == plain["top_logprobs"]


def test_a_full_queue_answers_429_at_once():
    state = _state(queue=1, start=False)
    for _ in range(2 + 1):  # its two slots and its queue of one
        state.orchestrator.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=2))
    running = _Running(state)
    try:
        started = time.perf_counter()
        response = httpx.post(f"{running.url}/v1/completions", json={"model": "mock", "prompt": "a", "max_tokens": 2})
        assert response.status_code == 429 and time.perf_counter() - started < 2
        assert response.json()["error"]["type"] == "rate_limit_error"
        assert httpx.get(f"{running.url}/readyz").json() == {"status": "admission queue full"}
    finally:
        running.stop()


def test_metrics_use_jetstream_names(server, client):
    client.completions.create(model="mock", prompt="ab", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("jetstream_prefill_backlog_size", "jetstream_slots_used_percentage", "jetstream_time_to_first_token"):
        assert name in text


def test_a_generation_routes_requests_are_answered_when_its_response_is_sent():
    """The gate wraps the generation routes in the orchestrator's answer scope: their requests count
    as being answered (an idle loop gathering a burst waits for them) until the response is
    sent, then not at all, streamed or not."""
    cfg = ServingConfig(max_prefill_predict_length=64, max_target_length=256, admission_wait_ms=200, admission_gap_ms=5)
    orchestrator = Orchestrator(MockEngine(slots=2), {}, TOKENIZER, cfg.orchestrator)
    state = ServerState(config=cfg.server)
    state.set_ready(orchestrator.start(), "mock")
    submitted = []
    submit = orchestrator.submit_choices

    def spied(*args, **kwargs):
        submitted.extend(handles := submit(*args, **kwargs))
        return handles

    orchestrator.submit_choices = spied
    running = _Running(state)
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
        assert client.completions.create(model="mock", prompt="ab", max_tokens=3).choices[0].text
        chunks = client.chat.completions.create(
            model="mock", messages=[{"role": "user", "content": "ab"}], max_tokens=3, stream=True
        )
        assert [c for c in chunks]
        assert len(submitted) == 2 and all(h._request.answer is not None for h in submitted)
        # the route's last bytes reach the client before its handler returns and the gate's scope
        # ends: the scope's end is waited for, not raced
        deadline = time.monotonic() + 10
        while not all(h._request.answer.written for h in submitted) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(h._request.answer.written for h in submitted)
        assert not orchestrator._answers_pending(60.0)
    finally:
        running.stop()
        orchestrator.stop(timeout=10)
