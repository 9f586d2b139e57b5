"""The HTTP server as a real process on loopback with the tiny model: the official openai client,
JetStream's routes, errors, backpressure, metrics and the OpenAPI schema under fuzzing.
(Disconnects, auth and the SIGTERM drain: test_make_serve.py, on the real model.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serving.checkpoints.model_source import load_model
from serving.config import ServingConfig
from serving.request import SamplingParams
from tests.backends import expected_backend
from tests.cli import call_cli
from tests.conftest import TINY_MAX_PREFILL, TINY_MAX_TARGET, TINY_QUEUE, TINY_SLOTS
from tests.reference import ReferenceDecoder
from tests.server_process import free_port, metric, wait_for, with_free_grpc_port

SLOTS, QUEUE = TINY_SLOTS, TINY_QUEUE
PROMPT = "The history of the lighthouse is closely tied to"


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the session's shared server (tests/conftest.py)


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    cfg = ServingConfig(max_prefill_predict_length=TINY_MAX_PREFILL, max_target_length=TINY_MAX_TARGET)
    return load_model(str(tiny_model_dir), cfg), cfg



def test_healthcheck_is_503_until_ready_then_200(server):
    assert 503 in server.healthchecks and server.healthchecks[-1] == 200
    assert server.healthchecks.index(503) < server.healthchecks.index(200)
    assert httpx.get(f"{server.url}/healthcheck").json() == {"response": {"is_live": True}}
    for probe in ("/startupz", "/readyz", "/livez"):
        assert httpx.get(server.url + probe).status_code == 200, probe
    assert "listening on" in server.output() and "ready:" in server.output()
    # Which backend served: float32 weights take the CPU kernels on AVX-512 VNNI (unless PATHSERVE_CPU_KERNELS=off).
    ready = next(line for line in server.output().splitlines() if "ready:" in line)
    assert f"{expected_backend(quantization='')} backend" in ready, ready  # float32: the tiny model unquantized


def test_completions_greedy_equal_the_engine_and_count_usage(client, model_name, tiny):
    model, cfg = tiny
    prompt_ids = model.tokenizer.encode_prompt(PROMPT)
    expected = ReferenceDecoder(model, cfg).generate(
        prompt_ids, SamplingParams(max_tokens=24, stop_ids=model.tokenizer.eos_ids)
    )
    response = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0)
    assert response.choices[0].text == expected.text
    assert response.choices[0].finish_reason == ("stop" if expected.finish_reason == "stop" else "length")
    assert response.usage.prompt_tokens == len(prompt_ids)
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == len(prompt_ids) + len(expected.token_ids)


def test_completions_stream_equals_non_stream_for_a_seed(client, model_name):
    args = dict(model=model_name, prompt=PROMPT, max_tokens=40, temperature=0.9, top_p=0.95, seed=1234)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    other = client.completions.create(**{**args, "seed": 99})
    assert other.choices[0].text != whole.choices[0].text  # the seed matters


def test_completions_accept_token_ids(client, model_name, tiny):
    model, _ = tiny
    ids = model.tokenizer.encode_prompt(PROMPT)
    by_text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_stream_equals_non_stream_and_counts_tokens(client, model_name, tiny):
    model, _ = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me of ships."}]
    args = dict(model=model_name, messages=messages, max_completion_tokens=30, temperature=0.7, seed=5)
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(model.tokenizer.encode_chat(messages))
    assert 1 <= whole.usage.completion_tokens <= 30
    stream = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content
    assert stream[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" for c in stream)


def test_stop_strings_cut_the_text(client, model_name):
    full = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=40, temperature=0)
    text = full.choices[0].text
    stop = text[12:15]
    cut = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_models_lists_the_served_model(client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]


def test_jetstream_generate_both_modes(server):
    body = {"prompt": PROMPT, "max_tokens": 20}
    whole = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert whole.status_code == 200
    response = whole.json()
    assert set(response) >= {"response"} and response["usage"]["completion_tokens"] == 20
    with httpx.stream("POST", f"{server.url}/generate", json=body | {"stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    deltas, final = lines[:-1], lines[-1]
    # how many deltas depends on the pace (tokens queued meanwhile go out as one): not asserted
    assert deltas and all(set(d) == {"text"} for d in deltas)
    assert "".join(d["text"] for d in deltas) == final["response"] == response["response"]
    assert final["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, "max_tokens", ["greater than"]),
        ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, "temperature", ["number"]),
        ("/v1/completions", {"prompt": PROMPT, "n": SLOTS + 1}, "n", ["decode slots"]),
        ("/v1/completions", {"prompt": [PROMPT, PROMPT]}, "prompt", ["one prompt"]),
        ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt", ["vocabulary"]),
        # past max_prefill_predict_length a prompt is served in chunks; past the context it is refused
        ("/v1/completions", {"prompt": "word " * 2100}, "prompt", ["max_target_length=2048"]),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 5000}, "max_tokens", ["max_target_length=2048"]),
        ("/v1/completions", {"max_tokens": 5}, "prompt", ["required"]),
        ("/v1/chat/completions", {"messages": []}, "messages", ["at least 1"]),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.[0].role", []),
        ("/generate", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens", []),
        ("/generate", {"prompt": 3}, "prompt", ["string"]),
    ],
)
def test_bad_requests_get_400_with_an_openai_error_body(server, path, body, param, words):
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]


def test_an_unknown_field_is_a_400_naming_it(server):
    """OpenAI's answer to a field it does not know; a typo does not run with the default instead.
    (unknown_request_fields=warn: tests/api/test_admission_and_fields.py.)"""
    body = {"messages": [{"role": "user", "content": "Tell me of ships."}], "temprature": 0.5}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "temprature"
    assert reply.json()["error"]["message"] == "Unrecognized request argument supplied: temprature"
    del body["temprature"]
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=120)
    assert ok.status_code == 200, ok.text


def test_malformed_json_nan_and_size_limit(server):
    url = f"{server.url}/v1/completions"
    headers = {"content-type": "application/json"}
    broken = httpx.post(url, content=b'{"prompt": ', headers=headers)
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    nan = httpx.post(url, content=b'{"prompt": "a", "temperature": NaN}', headers=headers)
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
    huge = httpx.post(url, json={"prompt": "x" * 70000})
    assert huge.status_code == 413 and "65536" in huge.json()["error"]["message"]
    missing = httpx.get(f"{server.url}/v2/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.post(url, json={"model": "gpt-4", "prompt": "a"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    form = httpx.post(
        f"{server.url}/generate", content=b'{"prompt": "a", "max_tokens": 2}'
    )  # no content-type
    assert form.status_code == 200, form.text


def test_burst_beyond_capacity_gets_429s_and_every_admitted_request_completes(server, model_name):
    """A burst of 4x capacity at an idle server: the first `capacity` are admitted whatever the pace,
    each later one is admitted or told to retry (how many of each depends on how fast this machine
    drains the slots, so not asserted: test_admission_and_fields.py holds the slots to see a 429 for
    certain), every admitted one completes and every 429 is counted."""
    capacity = SLOTS + QUEUE
    assert wait_for(lambda: metric(server, "pathserve_active_slots") == 0, 60)
    rejected_before = metric(server, "pathserve_requests_rejected_total")

    def one(i: int) -> httpx.Response:
        body = {"model": model_name, "prompt": PROMPT, "max_tokens": 300, "seed": i, "ignore_eos": True}
        return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    with ThreadPoolExecutor(4 * capacity) as pool:
        responses = list(pool.map(one, range(4 * capacity)))
    statuses = [r.status_code for r in responses]
    assert all(s in (200, 429) for s in statuses), statuses
    assert statuses.count(200) >= capacity, statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 300
    assert metric(server, "pathserve_requests_rejected_total") - rejected_before == statuses.count(429)
    if 429 in statuses:
        assert metric(server, "pathserve_http_requests_total", '{route="/v1/completions",status="429"}') >= 1


def test_metrics_use_jetstream_names(server, client, model_name):
    client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "jetstream_time_to_first_token_bucket",
        "jetstream_time_per_output_token_count",
        "jetstream_prefill_backlog_size",
        "jetstream_slots_used_percentage",
        "jetstream_request_success_count_total",
        "pathserve_kv_cache_usage_ratio",
        'pathserve_http_requests_total{route="/v1/completions",status="200"}',
    ):
        assert name in text, name
    assert metric(server, "pathserve_total_slots") == SLOTS


def test_schemathesis_finds_no_server_errors(server, tmp_path):
    st = shutil.which("schemathesis", path=str(sys.prefix) + "/bin") or "schemathesis"
    run = subprocess.run(
        [
            st,
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "25",
            "--seed",
            "1",
            "--workers",
            "1",
            "--request-timeout",
            "120",
            "--phases",
            "examples,coverage,fuzzing",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,  # its cache directory
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    counts = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert counts and counts[1] == counts[2] and int(counts[1]) > 100, run.stdout[-3000:]


def _serve_cli(*args: str) -> subprocess.CompletedProcess:
    """`pathserve serve ARGS` to its end, on a free gRPC port (never the default 9000 another
    server on the machine may hold)."""
    return subprocess.run(
        [sys.executable, "-m", "serving.cli", "serve", *with_free_grpc_port(args)],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (["max_target_lenght=64"], ["max_target_lenght", "did you mean"]),
        (["drain_timeout_s=-1"], ["drain_timeout_s"]),
        (["/no/such/model"], ["SOURCE not found", "/no/such/model"]),
        (["--port", "70000"], ["--port"]),
    ],
)
def test_serve_refuses_bad_arguments_before_listening(args, mentions):
    """In-process: each is refused while parsing or validating, before a socket or a model."""
    args = with_free_grpc_port(args)
    run = call_cli("serve", *args, "--port", "1") if "--port" not in args else call_cli("serve", *args)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "listening" not in run.stderr
    for text in mentions:
        assert text in run.stderr


def test_serve_exits_2_when_the_model_cannot_be_loaded(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # exists, but is no model
    run = _serve_cli(str(tmp_path), "--port", str(free_port()))
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and str(tmp_path) in run.stderr


def test_usage_reports_the_prompt_tokens_read_from_the_prefix_cache(client, model_name):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: 0 the first time a prompt is seen, its
    full pages' tokens (32 a page, one token always computed) when it comes again, in a stream's
    usage too, for n > 1 choices, under a repetition penalty, logprobs and a grammar too; a request
    for the prompt's logprobs (echo) scores every position, reads none and says 0, with tokens to
    generate or none (max_tokens 0)."""
    prompt = [20 + (i * 37) % 230 for i in range(70)]  # no other test sends it
    args = dict(model=model_name, prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    assert again.choices[0].text == first.choices[0].text
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
    # n = 2: two sequences sharing the prompt's pages through the cache
    choices = client.completions.create(**args, n=2)
    assert choices.usage.prompt_tokens_details.cached_tokens == 64
    assert [c.text for c in choices.choices] == [first.choices[0].text] * 2
    # a repetition penalty reads the cached pages too (its prompt tokens are carried to the final
    # chunk), and logprobs and a grammar come from the final chunk: the tokens and logprobs of a
    # request that computes every position, echo's (reading no cached page)
    alone = client.completions.create(**{**args, "max_tokens": 0}, logprobs=2, echo=True)  # the prompt scored alone
    scored = client.completions.create(**args, logprobs=2, echo=True)  # and with tokens to generate
    assert scored.usage.prompt_tokens_details.cached_tokens == alone.usage.prompt_tokens_details.cached_tokens == 0
    assert scored.choices[0].logprobs.tokens[:70] == alone.choices[0].logprobs.tokens
    assert scored.choices[0].logprobs.token_logprobs[0] is alone.choices[0].logprobs.token_logprobs[0] is None
    assert scored.choices[0].logprobs.token_logprobs[1:70] == pytest.approx(alone.choices[0].logprobs.token_logprobs[1:], abs=1e-4)
    for extra in ({"repetition_penalty": 0.2}, {"response_format": {"type": "json_object"}}):
        chunked = client.completions.create(**args, logprobs=2, extra_body=extra)
        whole = client.completions.create(**args, logprobs=2, echo=True, extra_body=extra)
        assert chunked.usage.prompt_tokens_details.cached_tokens == 64
        assert whole.usage.prompt_tokens_details.cached_tokens == 0
        generated = whole.choices[0].logprobs.tokens[-4:], whole.choices[0].logprobs.token_logprobs[-4:]
        assert chunked.choices[0].logprobs.tokens == generated[0]
        assert chunked.choices[0].logprobs.token_logprobs == pytest.approx(generated[1], abs=1e-4)
