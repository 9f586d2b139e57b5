"""JetStream's gRPC API on a real `pathserve serve` process (the tiny model, 4 slots, queue of 4),
through stubs generated in the test from the shipped .proto: the same greedy text as HTTP
/generate, old clients' fields refused, errors, backpressure, cancellation, a seed-style HTTP sidecar, the
gRPC benchmark, and the SIGTERM drain that ends the server (the session's shared one: that test runs
last of all, tests/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest

from serving.text.tokenizer import load_tokenizer
from tests.conftest import TINY_MAX_PREFILL, TINY_MAX_TARGET, TINY_QUEUE, TINY_SLOTS
from tests.server_process import ServerProcess, free_port, metric, wait_for

SLOTS, MAX_PREFILL, MAX_TARGET = TINY_SLOTS, TINY_MAX_PREFILL, TINY_MAX_TARGET
PROMPTS = ["The history of the lighthouse is closely tied to", "Le café du coin — naïve, 東京 ☕"]
# Prompts whose greedy completion on the tiny model runs past 1,000 tokens (no end-of-sequence).
LONG = ["Story number 1:", "Story number 3:", "Story number 5:"]
LENGTH = 'pathserve_requests_finished_total{reason="length"}'


class GrpcServer:
    """The server process, its gRPC address, and what HealthCheck said while it started."""

    def __init__(self, process: ServerProcess, address: str, health_while_starting: list[tuple[bool, int]]):
        self.process, self.address = process, address
        self.url = process.url
        self.health_while_starting = health_while_starting


@pytest.fixture(scope="module")
def server(tiny_server):
    """The session's shared server (tests/conftest.py), which recorded HealthCheck while it started."""
    return GrpcServer(tiny_server, tiny_server.grpc_address, tiny_server.health_while_starting)


@pytest.fixture(scope="module")
def stub(server, stubs):
    with grpc.insecure_channel(server.address) as channel:
        yield stubs.pb_grpc.OrchestratorStub(channel)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def text_request(pb, text: str, max_tokens: int, **fields):
    return pb.DecodeRequest(
        text_content=pb.DecodeRequest.TextContent(text=text), max_tokens=max_tokens, **fields
    )


def token_request(pb, ids: list[int], max_tokens: int, **fields):
    return pb.DecodeRequest(
        token_content=pb.DecodeRequest.TokenContent(token_ids=ids), max_tokens=max_tokens, **fields
    )


def samples(responses) -> list[tuple[str, list[int]]]:
    out = []
    for response in responses:
        assert response.WhichOneof("content") == "stream_content"
        (sample,) = response.stream_content.samples
        out.append((sample.text, list(sample.token_ids)))
    return out


def http_generate(server, prompt: str, max_tokens: int) -> dict:
    reply = httpx.post(
        f"{server.url}/generate", json={"prompt": prompt, "max_tokens": max_tokens}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    return reply.json()




def test_health_check_is_false_until_ready_then_true(server, stub, stubs):
    seen = server.health_while_starting
    assert (False, 503) in seen, seen  # gRPC answers while the model loads, like HTTP's probes
    assert seen[-1][0] is True and stub.HealthCheck(stubs.pb.HealthCheckRequest()).is_live
    assert f"gRPC (jetstream_proto.Orchestrator) on {server.address}" in server.process.output()


@pytest.mark.parametrize("prompt", PROMPTS, ids=["ascii", "multibyte"])
def test_text_content_streams_the_text_of_http_generate(server, stub, stubs, tokenizer, prompt):
    expected = http_generate(server, prompt, 24)
    got = samples(stub.Decode(text_request(stubs.pb, prompt, 24)))
    text = "".join(t for t, _ in got)
    ids = [i for _, chunk in got for i in chunk]
    assert text == expected["response"]
    assert len(ids) == expected["usage"]["completion_tokens"] and 0 < len(ids) <= 24
    for k in range(1, len(got) + 1):  # each message ends on a whole character: prefixes decode alike
        prefix = [i for _, chunk in got[:k] for i in chunk]
        assert "".join(t for t, _ in got[:k]) == tokenizer.decode(prefix)
    # the client tokenizes (as JetStream's benchmark does): the same token ids come back, no text
    by_tokens = samples(stub.Decode(token_request(stubs.pb, tokenizer.encode_prompt(prompt), 24)))
    assert [i for _, chunk in by_tokens for i in chunk] == ids
    assert all(t == "" and chunk for t, chunk in by_tokens)


def test_a_jetstream_v022_clients_fields_are_refused_when_set_and_absent_otherwise(server, stubs):
    """v0.2.x's DecodeRequest had `string session_cache = 1; string additional_text = 2; int32
    priority = 3;` (JetStream reserves the numbers now). Left at their defaults they are not on the
    wire, so such a client is served; set, they arrive as unknown fields and are refused by name,
    not dropped."""
    pb = stubs.pb
    with grpc.insecure_channel(server.address) as channel:
        decode = channel.unary_stream(
            "/jetstream_proto.Orchestrator/Decode",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.DecodeResponse.FromString,
        )
        request = text_request(pb, PROMPTS[0], 8).SerializeToString()
        assert "".join(t for t, _ in samples(decode(request))) == http_generate(server, PROMPTS[0], 8)["response"]
        for old_fields, named in [(b"\x0a\x05cache", "session_cache"), (b"\x18\x07", "priority"),
                                  (b"\x0a\x05cache\x18\x07", "session_cache, priority")]:
            with pytest.raises(grpc.RpcError) as info:
                list(decode(old_fields + request))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(named.split(",")[0] + ":") and named in info.value.details()


@pytest.mark.parametrize(
    ("fields", "code", "mentions"),
    [
        ({"max_tokens": 0}, "INVALID_ARGUMENT", "max_tokens"),
        ({"max_tokens": MAX_TARGET}, "INVALID_ARGUMENT", "max_tokens"),
        ({"text": ""}, "INVALID_ARGUMENT", "text_content.text"),
        ({"no_content": True}, "INVALID_ARGUMENT", "content"),
        ({"token_ids": []}, "INVALID_ARGUMENT", "token_content.token_ids"),
        ({"token_ids": [1, 10**6]}, "INVALID_ARGUMENT", "token_content.token_ids"),
        ({"token_ids": [5] * MAX_TARGET}, "INVALID_ARGUMENT", "token_content.token_ids"),
        ({"text": "word " * (MAX_TARGET + 8)}, "INVALID_ARGUMENT", "text_content.text"),
        ({"lora_adapter_id": "sql-adapter"}, "NOT_FOUND", "lora_adapter_id"),  # no such adapter here
        ({"num_samples": 2}, "UNIMPLEMENTED", "num_samples"),
        ({"num_samples": -1}, "INVALID_ARGUMENT", "num_samples"),
    ],
)
def test_bad_requests_get_a_status_naming_the_field(stub, stubs, fields, code, mentions):
    pb = stubs.pb
    fields = dict(fields)
    max_tokens = fields.pop("max_tokens", 8)
    if fields.pop("no_content", False):
        request = pb.DecodeRequest(max_tokens=max_tokens)
    elif "token_ids" in fields:
        request = token_request(pb, fields.pop("token_ids"), max_tokens, **fields)
    else:
        request = text_request(pb, fields.pop("text", PROMPTS[0]), max_tokens, **fields)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Decode(request))
    assert info.value.code().name == code, info.value.details()
    assert info.value.details().startswith(f"{mentions}:"), info.value.details()


def test_num_samples_one_is_one_sample(server, stub, stubs):
    got = samples(stub.Decode(text_request(stubs.pb, PROMPTS[0], 8, num_samples=1, has_bos=False)))
    assert "".join(t for t, _ in got) == http_generate(server, PROMPTS[0], 8)["response"]


def test_64_concurrent_streams_on_4_slots_complete_or_are_told_to_retry(server, stubs):
    """At an idle server the first slots + queue streams are admitted whatever the pace; each later
    one completes or hears RESOURCE_EXHAUSTED (how many of each depends on how fast this machine
    drains the slots, so not asserted: tests/grpc/test_grpc_on_mock.py fills the queue to see the code
    for certain), and every rejection is counted."""
    pb, n, max_tokens = stubs.pb, 64, 12
    assert wait_for(lambda: metric(server, "pathserve_active_slots") == 0, 60)

    async def one(orchestrator, i: int) -> str:
        request = text_request(pb, f"Story number {i}:", max_tokens)
        try:
            count = 0
            async for response in orchestrator.Decode(request, timeout=120):
                count += sum(len(s.token_ids) for s in response.stream_content.samples)
            assert 0 < count <= max_tokens
            return "OK"
        except grpc.aio.AioRpcError as exc:
            return exc.code().name

    async def burst() -> list[str]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            orchestrator = stubs.pb_grpc.OrchestratorStub(channel)
            return await asyncio.gather(*(one(orchestrator, i) for i in range(n)))

    rejected_before = metric(server, "pathserve_requests_rejected_total")
    outcomes = asyncio.run(burst())
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes.count("OK") >= SLOTS + TINY_QUEUE, outcomes
    assert metric(server, "pathserve_requests_rejected_total") - rejected_before == outcomes.count(
        "RESOURCE_EXHAUSTED"
    )
    assert wait_for(lambda: metric(server, "pathserve_active_slots") == 0, 10)


def test_a_cancelled_stream_frees_its_slot_within_a_step(server, stub, stubs):
    cancelled = 'pathserve_requests_finished_total{reason="cancelled"}'
    before, finished = metric(server, cancelled), metric(server, LENGTH)
    call = stub.Decode(text_request(stubs.pb, LONG[0], MAX_TARGET - MAX_PREFILL))
    next(call), next(call)  # in a slot (no look at the slot count: a fast machine may be past it)
    call.cancel()
    left = time.monotonic()  # ~2,000 tokens would take far longer; the slot must free in a step or two
    assert wait_for(lambda: metric(server, "pathserve_active_slots") == 0, 5)
    assert time.monotonic() - left < 5
    assert wait_for(lambda: metric(server, cancelled) == before + 1, 5)
    assert metric(server, LENGTH) == finished  # it did not run to its length


def sidecar_app(address: str, stubs):
    """The seed's `jetstream-http` shape: /generate -> Decode(text_content), /healthcheck -> HealthCheck."""
    from fastapi import FastAPI

    pb = stubs.pb
    app = FastAPI()
    channel = grpc.insecure_channel(address)
    orchestrator = stubs.pb_grpc.OrchestratorStub(channel)

    @app.post("/generate")
    def generate(body: dict) -> dict:
        request = text_request(pb, body["prompt"], body["max_tokens"])
        texts = [s.text for r in orchestrator.Decode(request) for s in r.stream_content.samples]
        return {"response": "".join(texts)}

    @app.get("/healthcheck")
    def healthcheck() -> dict:
        return {"response": {"is_live": orchestrator.HealthCheck(pb.HealthCheckRequest()).is_live}}

    return app, channel


def test_a_seed_style_http_sidecar_over_grpc_returns_our_generate_text(server, stubs):
    import uvicorn

    app, channel = sidecar_app(server.address, stubs)
    port = free_port()
    sidecar = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=sidecar.run, daemon=True)
    thread.start()
    try:
        assert wait_for(lambda: sidecar.started, 30)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/healthcheck").json() == {"response": {"is_live": True}}
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 16}
            via_sidecar = httpx.post(f"{url}/generate", json=body, timeout=120).json()["response"]
            assert via_sidecar == http_generate(server, prompt, 16)["response"]
    finally:
        sidecar.should_exit = True
        thread.join(timeout=10)
        channel.close()


def test_bench_serve_over_grpc_writes_the_same_report(server, tiny_model_dir, tmp_path):
    before = metric(server, "pathserve_generation_tokens_total")
    run = subprocess.run(
        [
            sys.executable, "-m", "serving.cli", "bench", "serve", "--grpc", server.address,
            "--tokenizer", str(tiny_model_dir), "--concurrency", "1,4", "--requests", "8",
            "--max-prompt-words", "8", "--max-output-tokens", "16", "--out", str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "serve-bench.json").read_text())
    assert report["api"] == "grpc" and report["url"] == f"grpc://{server.address}"
    for level in report["levels"]:
        assert level["completed"] == level["requests"] == 8 and level["errors"] == 0
        assert level["output_tokens_per_s"] == pytest.approx(level["output_tokens"] / level["wall_s"])
        assert 0 < level["ttft_ms"]["median"] <= level["e2e_ms"]["median"]
        assert level["tpot_ms"]["count"] > 0 and level["prompt_tokens"] > 0
    streamed = sum(level["output_tokens"] for level in report["levels"])
    assert streamed == metric(server, "pathserve_generation_tokens_total") - before
    assert (tmp_path / "serve-bench-throughput.png").is_file() and (
        tmp_path / "serve-bench-latency.png"
    ).is_file()


def test_bench_serve_over_http_sends_temperature_and_top_p(server, tmp_path):
    run = subprocess.run(
        [
            sys.executable, "-m", "serving.cli", "bench", "serve", "--url", server.url,
            "--concurrency", "2", "--requests", "2", "--temperature", "0.8", "--top-p", "0.9",
            "--max-prompt-words", "8", "--max-output-tokens", "8", "--out", str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "serve-bench.json").read_text())
    assert report["sampling"] == {"temperature": 0.8, "top_p": 0.9}
    assert report["levels"][0]["completed"] == 2
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving.cli",
            "bench",
            "serve",
            "--grpc",
            server.address,
            "--temperature",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "no sampling fields" in refused.stderr


def test_a_second_server_on_the_same_grpc_port_exits_2_naming_grpc_port(server, tiny_model_dir):
    port = server.address.rsplit(":", 1)[1]
    run = subprocess.run(
        [sys.executable, "-m", "serving.cli", "serve", str(tiny_model_dir), f"grpc_port={port}",
         "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "grpc_port" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.drains_tiny_server  # ends the shared server: runs after every other test (conftest.py)
def test_sigterm_drains_grpc_streams_and_refuses_new_calls(server, stub, stubs):
    # the longest streams this server takes (its max_target_length), so that the drain outlasts the
    # checks below by as much as it can on a fast machine (a drain that ended would leave no server)
    pb, n, max_tokens = stubs.pb, len(LONG), MAX_TARGET - MAX_PREFILL
    prompts = LONG
    expected = [http_generate(server, p, max_tokens)["response"] for p in prompts]
    results: list = [None] * n
    streaming = threading.Barrier(n + 1)

    def stream(i: int) -> None:
        got = []
        for response in stub.Decode(text_request(pb, prompts[i], max_tokens)):
            if not got:
                streaming.wait()
            got.append(response.stream_content.samples[0].text)
        results[i] = "".join(got)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    streaming.wait(timeout=60)
    server.process.signal()
    assert wait_for(lambda: httpx.get(f"{server.url}/readyz").status_code == 503, 2)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Decode(text_request(pb, prompts[0], 4)))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()
    assert stub.HealthCheck(pb.HealthCheckRequest()).is_live  # still live: streams are being served
    for t in threads:
        t.join(timeout=120)
    assert results == expected
    assert server.process.proc.wait(timeout=60) == 0, server.process.output()
