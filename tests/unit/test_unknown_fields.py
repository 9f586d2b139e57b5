"""Request fields no wire type defines: a 400 naming each of them by default (as OpenAI answers),
or with unknown_request_fields=warn ignored, logged once per name and counted in /metrics; the same
for batch lines. On the mock engine through the real HTTP app (no model, no JAX)."""

from __future__ import annotations

import json
import logging
import re

import httpx
import pytest

from serving.api.state import ServerState
from serving.batch.runner import run_batch
from serving.config import ConfigError, ServingConfig, load_config
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.openai import fields
from serving.openai.fields import UnknownFieldPolicy, unknown_fields
from serving.openai.protocol import ChatCompletionRequest
from serving.orchestrator import Orchestrator
from tests import batch_mock
from tests.unit.test_api import _Running

TOKENIZER = AsciiTokenizer()
CHAT = {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}


def _server(mode: str) -> _Running:
    cfg = load_config(
        None, [f"unknown_request_fields={mode}", "max_prefill_predict_length=64", "max_target_length=256"]
    )
    state = ServerState(config=cfg.server)
    state.set_ready(Orchestrator(MockEngine(slots=2), {}, TOKENIZER, cfg.orchestrator).start(), "mock")
    return _Running(state)


@pytest.fixture(scope="module")
def rejecting():
    running = _server("reject")
    yield running
    running.stop()
    running.state.orchestrator.stop(timeout=10)


@pytest.fixture(scope="module")
def warning():
    running = _server("warn")
    yield running
    running.stop()
    running.state.orchestrator.stop(timeout=10)


def _ignored(running: _Running) -> dict[str, float]:
    text = httpx.get(f"{running.url}/metrics").text
    return {
        m[1]: float(m[2])
        for m in re.finditer(r'^pathserve_ignored_request_fields_total\{field="(.*)"\} (\S+)$', text, re.M)
    }


def test_unknown_fields_are_named_by_their_path_nested_ones_too():
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "yo", "nmae": "x"}],
            "temprature": 0.5,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"extra": "is the schema's"}, "strictt": 1},
            },
        }
    )
    assert unknown_fields(body) == ["temprature", "response_format.json_schema.strictt", "messages[1].nmae"]
    assert unknown_fields(ChatCompletionRequest.model_validate(CHAT)) == []
    assert ChatCompletionRequest.model_json_schema()["additionalProperties"] is False  # what reject does


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {**CHAT, "temprature": 0.5}),
        ("/v1/completions", {"prompt": "ab", "max_tokens": 2, "temprature": 0.5}),
        ("/generate", {"prompt": "ab", "max_tokens": 2, "temprature": 0.5}),
    ],
)
def test_an_unknown_field_is_a_400_naming_it(rejecting, path, body):
    response = httpx.post(f"{rejecting.url}{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error == {
        "message": "Unrecognized request argument supplied: temprature",
        "type": "invalid_request_error",
        "param": "temprature",
        "code": "unknown_field",
    }


def test_every_unknown_field_is_named(rejecting):
    body = {"messages": [{"role": "user", "content": "ab", "nmae": "x"}], "temprature": 0.5, "max_tokns": 3}
    error = httpx.post(f"{rejecting.url}/v1/chat/completions", json=body).json()["error"]
    assert (
        error["message"] == "Unrecognized request arguments supplied: temprature, max_tokns, messages[0].nmae"
    )
    assert httpx.post(f"{rejecting.url}/v1/chat/completions", json=CHAT).status_code == 200


def test_with_warn_the_field_is_ignored_logged_once_and_counted(warning, caplog):
    chat = {**CHAT, "temperature": 0}
    expected = httpx.post(f"{warning.url}/v1/chat/completions", json=chat).json()["choices"][0]["message"]
    with caplog.at_level(logging.WARNING, logger="serving.openai.fields"):
        for _ in range(2):
            response = httpx.post(f"{warning.url}/v1/chat/completions", json={**chat, "temprature": 0.5})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"] == expected  # the field did nothing
        jet = httpx.post(f"{warning.url}/generate", json={"prompt": "ab", "max_tokens": 2, "vendor_x": 1})
        assert jet.status_code == 200 and jet.json()["response"] == "cd"
    logged = [r.getMessage() for r in caplog.records if "ignoring unknown request field" in r.getMessage()]
    assert logged == [
        "ignoring unknown request field 'temprature' (unknown_request_fields=warn; logged once)",
        "ignoring unknown request field 'vendor_x' (unknown_request_fields=warn; logged once)",
    ]
    counted = _ignored(warning)
    assert counted["temprature"] == 2 and counted["vendor_x"] == 1


def test_the_counted_names_are_bounded(caplog):
    policy = UnknownFieldPolicy("warn")
    with caplog.at_level(logging.WARNING, logger="serving.openai.fields"):
        for i in range(fields.MAX_NAMES + 10):
            policy.check(ChatCompletionRequest.model_validate({**CHAT, f"x{i}" * 40: 1}))
    counts = policy.counts()
    assert len(counts) == fields.MAX_NAMES + 1 and counts[fields.OTHER] == 10
    assert all(len(name) <= fields.MAX_NAME_LENGTH for name in counts)
    assert len(caplog.records) == fields.MAX_NAMES + 1  # one line per name, one for the rest


def test_the_setting_is_validated_naming_the_key():
    assert ServingConfig().unknown_request_fields == "reject"
    with pytest.raises(ConfigError, match="unknown_request_fields"):
        load_config(None, ["unknown_request_fields=ignore"])
    with pytest.raises(ValueError, match="unknown_request_fields"):
        UnknownFieldPolicy("loud")


@pytest.mark.parametrize("mode", ["reject", "warn"])
def test_batch_lines_with_an_unknown_field(tmp_path, mode):
    lines = [
        {"id": "plain", "prompt": "ab", "max_tokens": 2, "temprature": 0.5},
        {
            "custom_id": "openai",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**CHAT, "vendor": 1},
        },
        {"id": "fine", "prompt": "ab", "max_tokens": 2},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = ServingConfig(max_target_length=128, max_prefill_predict_length=64, unknown_request_fields=mode)
    summary = run_batch(str(source), str(tmp_path / "out"), "mock", cfg, progress=False, start=batch_mock.start_mock([]))
    records = batch_mock.records(tmp_path / "out")
    if mode == "reject":
        assert (summary.rows_ok, summary.rows_failed) == (1, 2)
        assert records["plain"]["error"] == {
            "code": "unknown_field",
            "message": "Unrecognized request argument supplied: temprature",
        }
        assert records["openai"]["error"]["message"] == "Unrecognized request argument supplied: vendor"
    else:
        assert (summary.rows_ok, summary.rows_failed) == (3, 0)
        assert records["plain"]["response"]["body"]["choices"][0]["text"] == "cd"
