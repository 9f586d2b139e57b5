"""Request fields through batch lines (the same parsing as HTTP) on the mock engine, and the
conversions that need no model: vLLM's bad_words tokenization, logit_bias and stop_token_ids
checks, the ignored fields' log."""

from __future__ import annotations

import json
import logging

import pytest

from serving.config import ServingConfig
from serving.engine.mock import AsciiTokenizer
from serving.openai import convert, ignored
from serving.openai.errors import APIError
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest

TOKENIZER = AsciiTokenizer()


def _id(char: str) -> int:
    return TOKENIZER.encode(char)[0]


def test_batch_lines_take_truncation_prompt_logprobs_and_penalties_and_log_ignored_fields(tmp_path, caplog, monkeypatch):
    from serving.batch.runner import run_batch
    from tests import batch_mock

    body = {
        "prompt": "abcdef", "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": 4, "prompt_logprobs": 1,
        "presence_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 1, "user": "u1",
    }
    rows = [{"custom_id": "a", "url": "/v1/completions", "body": body}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ServingConfig(max_target_length=128, max_prefill_predict_length=64)
    monkeypatch.setattr(ignored, "_logged", set())  # logged once per process: from now on
    with caplog.at_level(logging.INFO, logger="serving.openai.ignored"):
        summary = run_batch(str(source), str(tmp_path / "out"), "mock", cfg, progress=False, start=batch_mock.start_mock([]))
    assert (summary.rows_ok, summary.rows_failed) == (1, 0)
    response = batch_mock.records(tmp_path / "out")["a"]["response"]["body"]
    assert response["usage"]["prompt_tokens"] == 4
    entries = response["choices"][0]["prompt_logprobs"]
    assert len(entries) == 4 and entries[0] is None and str(_id("d")) in entries[1]
    assert any("'user'" in r.getMessage() for r in caplog.records)


def test_bad_words_are_tokenized_alone_and_after_a_space():
    # the ASCII tokenizer: one token per character, so " ab" differs from "ab" in its first token
    # and in length: only the word alone is kept (vLLM's rule keeps the spaced form when the lengths match)
    assert convert.bad_words(["ab"], TOKENIZER) == ((_id("a"), _id("b")),)
    with pytest.raises(APIError) as too_long:
        convert.bad_words(["abcdefghij"], TOKENIZER)
    assert too_long.value.param == "bad_words"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_values_are_400s_naming_the_field(fields, param):
    body = CompletionRequest(prompt="ab", **{"max_tokens": 4, **fields})
    with pytest.raises(APIError) as refused:
        convert.openai_sampling(body, TOKENIZER, 2, 64, default_seed=0)
    assert refused.value.param == param


def test_the_sampling_fields_reach_the_request():
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}], max_tokens=4, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.3, min_p=0.2, min_tokens=2, logit_bias={str(_id("a")): -100}, stop_token_ids=[_id("b")],
        bad_words=["c"], include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    s = convert.openai_sampling(body, TOKENIZER, 2, 64, default_seed=0)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p, s.min_tokens) == (
        0.5, -0.5, 1.3, 0.2, 2)
    assert s.logit_bias == ((_id("a"), -100.0),) and _id("b") in s.stop_ids and s.bad_words == ((_id("c"),),)
    assert s.include_stop_str_in_output and not s.skip_special_tokens and not s.spaces_between_special_tokens
    assert ignored.ignored_fields(body) == []
