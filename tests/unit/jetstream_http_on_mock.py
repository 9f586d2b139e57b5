"""Run by tests/api/test_jetstream_http.py in a process of its own (the route loads
the server's proto modules; the stubs tests/grpc generates cannot share a process with them):
JetStream's own HTTP server's /v1/generate and /v1/health over the mock engine, with answers
computable by hand (AsciiTokenizer: "ab" continues "cdef..."). Prints "ok" or fails."""

from __future__ import annotations

import json

import httpx
from google.protobuf import json_format

from serving.api.state import ServerState
from serving.config import ServingConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.grpc import jetstream_pb2 as pb
from serving.orchestrator import Orchestrator
from tests.unit.test_api import _Running

TOKENIZER = AsciiTokenizer()


def main() -> None:
    cfg = ServingConfig(max_queued_requests=8, max_prefill_predict_length=64, max_target_length=256)
    state = ServerState(config=cfg.server)
    state.set_ready(Orchestrator(MockEngine(slots=2), {}, TOKENIZER, cfg.orchestrator).start(), "mock")
    running = _Running(state)
    try:
        check(running.url)
    finally:
        running.stop()
        state.orchestrator.stop(timeout=10)
    print("ok")


def check(url: str) -> None:
    assert httpx.get(f"{url}/v1/health").json() == {"is_live": "True"}
    reply = httpx.post(f"{url}/v1/generate", json={"max_tokens": 4, "text_content": {"text": "ab"}}, timeout=30)
    assert reply.status_code == 200, reply.text
    parsed = [json_format.ParseDict(m, pb.DecodeResponse()) for m in json_objects(reply.text)]
    samples = [s for m in parsed for s in m.stream_content.samples]
    assert "".join(s.text for s in samples) == "cdef", samples
    assert [i for s in samples for i in s.token_ids] == TOKENIZER.encode("cdef")
    # token content in, token ids out (JetStream's benchmark tokenizes itself)
    tokens = httpx.post(f"{url}/v1/generate", json={"max_tokens": 3, "token_content": {"token_ids": [10, 11]}})
    ids = [i for m in json_objects(tokens.text) for s in m["streamContent"]["samples"] for i in s.get("tokenIds", [])]
    assert ids == [12, 13, 14], tokens.text
    for bad, status, param in [
        ({"max_tokens": 4, "text_content": {"text": "ab"}, "priority": 1}, 400, None),  # no such DecodeRequest field
        ({"text_content": {"text": "ab"}}, 400, "max_tokens"),
        ({"max_tokens": 4}, 400, "content"),
        ({"max_tokens": 4, "text_content": {"text": "ab"}, "lora_adapter_id": "nope"}, 404, "lora_adapter_id"),
    ]:
        refused = httpx.post(f"{url}/v1/generate", json=bad, timeout=30)
        assert refused.status_code == status, (bad, refused.text)
        assert refused.json()["error"]["param"] == param, (bad, refused.text)


def json_objects(text: str) -> list[dict]:
    """JSON objects written one after another (protobuf's JSON of each message, unseparated)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return out
        value, at = decoder.raw_decode(text, at)
        out.append(value)


if __name__ == "__main__":
    main()
