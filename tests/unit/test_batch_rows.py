"""Batch lines that are no request: each gets an error record naming why and the job goes on
(serving.batch.rows, and the runner on the mock engine; no model, no JAX)."""

from __future__ import annotations

import json

import pytest

from serving.batch import rows
from serving.batch.runner import run_batch
from serving.config import ServingConfig
from tests.batch_mock import start_mock

CFG = ServingConfig(max_target_length=128, max_prefill_predict_length=64)


def _request(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "ab", "max_tokens": 2, **body},
    }


def _line(obj: dict) -> bytes:
    return json.dumps(obj).encode()  # ensure_ascii: a lone surrogate is written as its \u escape


@pytest.mark.parametrize(
    ("obj", "custom_id", "where"),
    [
        (_request("\ud800"), None, "custom_id"),
        ({"id": "\udc80", "prompt": "ab"}, None, "id"),
        (_request("m", model="x\udc80"), "m", "body.model"),
        (_request("p", prompt="a\ud800"), "p", "body.prompt"),
        (_request("s", stop=["ok", "\udfff"]), "s", "body.stop[1]"),
        (
            {
                "custom_id": "c",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "\ud83d"}]},
            },
            "c",
            "body.messages[0].content",
        ),
        (_request("k", logit_bias={"\ud800": 1}), "k", "body.logit_bias.'\\ud800'"),
    ],
)
def test_a_lone_surrogate_is_refused_where_it_is(obj, custom_id, where):
    with pytest.raises(rows.RowError) as refused:
        rows.parse(_line(obj), "batch_req_0_1")
    assert (refused.value.custom_id, refused.value.code) == (custom_id, "invalid_request")
    assert refused.value.message.startswith(f"{where}: holds a lone surrogate")
    refused.value.message.encode()  # the message itself is writable


def test_a_surrogate_pair_and_an_escaped_backslash_are_text():
    emoji = rows.parse(_line(_request("e", prompt="\U0001f600")), "r")  # \ud83d\ude00: one character
    assert emoji.body.prompt == "\U0001f600"
    escaped = rows.parse(rb'{"id": "b", "prompt": "\\ud800"}', "r")  # a backslash, then "ud800"
    assert escaped.body.prompt == "\\ud800"


def test_a_line_nested_past_the_recursion_limit_is_invalid_json():
    with pytest.raises(rows.RowError) as refused:
        rows.parse(b'{"id": "deep", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "r")
    assert (refused.value.custom_id, refused.value.code) == (None, "invalid_json")


def test_lines_with_lone_surrogates_get_error_records_and_the_job_goes_on(tmp_path):
    """Such a line used to raise UnicodeEncodeError in the runner (the default seed, the results'
    encoding), failing every rerun of the job at the same line."""
    lines = [
        _request("ok-0"),
        _request("\ud800"),
        _request("m", model="x\udc80"),
        {"id": "\udc80", "prompt": "ab", "max_tokens": 2},
        _request("ok-1"),
    ]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(_line(obj) + b"\n" for obj in lines))
    out = tmp_path / "out"
    for _ in range(2):  # the rerun finds the job done
        summary = run_batch(
            str(source), str(out), "mock", CFG, shard_size=2, progress=False, start=start_mock([])
        )
        assert (summary.rows_ok, summary.rows_failed) == (2, 3)
    got = {r["id"]: r for r in _records(out)}
    assert [got[f"batch_req_0_{n}"]["custom_id"] for n in range(1, 6)] == ["ok-0", None, "m", None, "ok-1"]
    assert got["batch_req_0_2"]["error"]["message"].startswith("custom_id: holds a lone surrogate")
    assert got["batch_req_0_3"]["error"]["message"].startswith("body.model: holds a lone surrogate")
    assert got["batch_req_0_4"]["error"]["message"].startswith("id: holds a lone surrogate")


def test_an_error_record_carries_the_status_serve_would_answer_and_counts_as_failed(tmp_path):
    """vLLM's run_batch shape: `response` holds the status and request id (no body) beside `error`,
    so a reader of r["response"]["status_code"] works on every record."""
    lines = [
        b"{not json",  # batch_req_0_1
        _line(_request("no-model", model="gpt-4o")),
        _line({**_request("embed"), "url": "/v1/embeddings"}),
        _line({**_request("get"), "method": "GET"}),
        _line(_request("zero", max_tokens=0)),
        _line(_request("unknown", frobnicate=1)),
        _line(_request("ok")),  # batch_req_0_7
    ]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(line + b"\n" for line in lines))
    summary = run_batch(str(source), str(tmp_path / "out"), "mock", CFG, progress=False, start=start_mock([]))
    assert (summary.rows_ok, summary.rows_failed, summary.tokens_in, summary.tokens_out) == (1, 6, 2, 2)
    got = {r["id"]: r for r in _records(tmp_path / "out")}
    expected = {
        1: (400, "invalid_json"),
        2: (404, "model_not_found"),
        3: (404, "invalid_request"),
        4: (405, "invalid_request"),
        5: (400, "invalid_request"),
        6: (400, "unknown_field"),
    }
    for n, (status, code) in expected.items():
        record = got[f"batch_req_0_{n}"]
        assert record["response"] == {"status_code": status, "request_id": f"batch_req_0_{n}", "body": None}
        assert record["error"]["code"] == code and record["error"]["message"], record
    assert got["batch_req_0_7"]["response"]["status_code"] == 200 and got["batch_req_0_7"]["error"] is None


def _records(out) -> list[dict]:
    return [
        json.loads(text)
        for path in sorted(out.glob("results-*.jsonl"))
        for text in path.read_text().splitlines()
    ]
