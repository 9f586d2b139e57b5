"""The request fields real clients send (OpenAI's and vLLM's), on the shared tiny server with the
official openai client: vLLM's sampling fields, the output options, vLLM's prompt_logprobs,
OpenAI's hosted-service chat fields, and a walk of docs/request-fields.md's table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.server_process import REPO

TABLE = REPO / "docs" / "request-fields.md"
PROMPT = "The history of the lighthouse is closely tied to"
HEADER = "pathserve-ignored-fields"
BASE = {  # the smallest request of each endpoint, greedy and short
    "completions": {"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
    "chat": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0},
}
ROW = re.compile(r"^\| `(\w+)` \| (\w+) \| (honoured|ignored|refused) \| `(\{.*?\})`[^|]* \| (.*) \|$")


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(Path(tiny_model_dir) / "tokenizer.json"))


@pytest.fixture(scope="module")
def word(tokenizer) -> tuple[int, str]:
    """A token that is a word of its own: its text tokenizes back to it alone, with no space."""
    for token in range(60, 300):
        text = tokenizer.decode([token])
        if text.isalpha() and len(text) > 2 and tokenizer.encode(text).ids == [token]:
            return token, text
    raise AssertionError("no single-token word in the tiny tokenizer")


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def complete(client, model):
    """A completion of PROMPT by the openai client: OpenAI's fields as arguments, vLLM's in extra_body."""
    native = ("max_tokens", "logit_bias", "seed", "temperature", "logprobs", "echo", "stop", "n")

    def create(**fields):
        extra = {k: fields.pop(k) for k in list(fields) if k not in native}
        return client.completions.create(model=model, prompt=PROMPT, extra_body=extra or None, **fields)

    return create


def test_vllm_sampling_fields_through_the_openai_client(complete, word, tokenizer):
    token, text = word
    greedy = complete(max_tokens=6, temperature=0).choices[0]
    # vLLM's benchmark client sends these at their neutral values: the same greedy text
    neutral = complete(
        max_tokens=6, temperature=0, repetition_penalty=1.0, min_p=0.0, min_tokens=0,
        logit_bias={}, stop_token_ids=[], bad_words=[], top_k=-1,
    ).choices[0]
    assert neutral.text == greedy.text
    biased = complete(max_tokens=4, temperature=0, logit_bias={str(token): 100}, ignore_eos=True)
    assert biased.choices[0].text == text * 4
    banned = complete(max_tokens=4, temperature=0, logit_bias={str(token): 100}, bad_words=[text],
                       logprobs=0, ignore_eos=True)
    assert text not in banned.choices[0].logprobs.tokens and banned.usage.completion_tokens == 4
    # min_tokens holds the stop token back; then it ends the request, its text left out
    stopped = complete(max_tokens=8, temperature=0, logit_bias={str(token): 100}, stop_token_ids=[token],
                        min_tokens=3, ignore_eos=True).choices[0]
    assert stopped.finish_reason == "stop" and text not in stopped.text
    assert complete(max_tokens=8, temperature=0, logit_bias={str(token): 100}, stop_token_ids=[token],
                     min_tokens=3, ignore_eos=True).usage.completion_tokens == 4
    eos = {"logit_bias": {str(tokenizer.token_to_id("<|endoftext|>")): 100}, "max_tokens": 4, "temperature": 0}
    assert complete(**eos).usage.completion_tokens == 1
    assert complete(**eos, ignore_eos=True).choices[0].finish_reason == "length"
    # penalties make the biased token give way; min_p=1 keeps only the best token: greedy at any seed
    penalized = complete(max_tokens=8, temperature=0, logit_bias={str(token): 4}, frequency_penalty=2,
                          presence_penalty=2, repetition_penalty=2, ignore_eos=True).choices[0]
    assert penalized.text != text * 8
    for seed in (1, 2):
        assert complete(max_tokens=6, temperature=1.0, min_p=1.0, seed=seed).choices[0].text == greedy.text


def test_output_options(client, model, complete, word, tokenizer):
    token, text = word
    base = dict(max_tokens=8, temperature=0, logit_bias={str(token): 100}, stop_token_ids=[token], min_tokens=3,
                ignore_eos=True)
    cut = complete(**base).choices[0].text
    kept = complete(**base, include_stop_str_in_output=True).choices[0].text
    assert kept == cut + text
    stop = complete(max_tokens=6, temperature=0, logit_bias={str(token): 100}, ignore_eos=True,
                     stop=[text * 2]).choices[0].text
    with_stop = complete(max_tokens=6, temperature=0, logit_bias={str(token): 100}, ignore_eos=True,
                          stop=[text * 2], include_stop_str_in_output=True).choices[0].text
    assert (stop, with_stop) == ("", text * 2)
    # a special token (<|im_start|>, not an end of sequence) shown or not, spaced or not
    special = tokenizer.token_to_id("<|im_start|>")
    shown = dict(max_tokens=2, temperature=0, logit_bias={str(special): 100}, ignore_eos=True)
    assert complete(**shown).choices[0].text == ""
    assert complete(**shown, skip_special_tokens=False).choices[0].text == "<|im_start|> <|im_start|>"
    assert complete(**shown, skip_special_tokens=False, spaces_between_special_tokens=False).choices[
        0].text == "<|im_start|><|im_start|>"
    # left truncation, in completions and chat
    ids = tokenizer.encode(PROMPT).ids
    short = client.completions.create(model=model, prompt=ids, max_tokens=1, echo=True, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 3})
    assert short.usage.prompt_tokens == 3 and short.choices[0].text.startswith(tokenizer.decode(ids[-3:]))
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4


def test_prompt_logprobs_in_vllms_shape(client, model, server, tokenizer):
    ids = tokenizer.encode(PROMPT).ids
    r = client.completions.create(model=model, prompt=ids, max_tokens=1, echo=True, logprobs=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    choice = r.choices[0]
    entries = choice.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for i, (token, entry) in enumerate(zip(ids[1:], entries[1:], strict=True), start=1):
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(choice.logprobs.token_logprobs[i], abs=1e-6)
        assert mine["decoded_token"] == tokenizer.decode([token])
        ranked = sorted(entry.values(), key=lambda e: -e["logprob"])
        assert {e["rank"] for e in ranked if e is not mine} <= {1, 2} and len(entry) <= 3
        likelier = [e for e in ranked if e["logprob"] > mine["logprob"]]
        assert mine["rank"] >= 1 + len(likelier) and (mine["rank"] > 2 or mine["rank"] == 1 + len(likelier))
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={**BASE["chat"], "prompt_logprobs": 1}, timeout=60)
    top = chat.json()["prompt_logprobs"]
    assert chat.status_code == 200 and top[0] is None and all(len(e) in (1, 2) for e in top[1:])
    streamed = httpx.post(f"{server.url}/v1/completions", json={**BASE["completions"], "prompt_logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_openai_chat_fields(client, model):
    messages = [{"role": "user", "content": "Hi"}]
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_completion_tokens=3, temperature=0, store=False,
        metadata={"team": "a"}, service_tier="auto", prediction={"type": "content", "content": "Hello"},
        modalities=["text"], user="u1",
    )
    said = raw.headers[HEADER]
    assert all(f"{name}:" in said for name in ("metadata", "service_tier", "prediction", "user"))
    assert "store:" not in said and "modalities:" not in said
    assert raw.parse().usage.completion_tokens <= 3
    plain = client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=1)
    assert HEADER not in plain.headers
    for fields, param in [
        ({"store": True}, "store"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=model, messages=messages, max_tokens=1, extra_body=fields)
        assert refused.value.body["param"] == param and "supported" in refused.value.body["message"]


def _rows() -> list[tuple[str, str, str, dict, str]]:
    rows = [m.groups() for line in TABLE.read_text().splitlines() if (m := ROW.match(line))]
    return [(field, where, we, json.loads(example), note) for field, where, we, example, note in rows]


def test_the_field_table_is_whole_and_each_row_holds(server):
    rows = _rows()
    names = {field for field, *_ in rows}
    openai_fields = {  # OpenAI's completions and chat references, vLLM's extra parameters
        "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "seed",
        "stop", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "best_of", "suffix",
        "frequency_penalty", "presence_penalty", "logit_bias", "user", "response_format", "tools", "tool_choice",
        "parallel_tool_calls", "store", "metadata", "service_tier", "prediction", "modalities", "audio",
        "web_search_options", "reasoning_effort", "verbosity", "functions", "function_call", "prompt_cache_key",
        "safety_identifier", "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "bad_words",
        "ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
        "truncate_prompt_tokens", "prompt_logprobs", "use_beam_search", "length_penalty", "allowed_token_ids",
    }
    assert openai_fields <= names, openai_fields - names
    for field, where, we, example, note in rows:
        for endpoint in ("completions", "chat") if where == "both" else (where,):
            if endpoint == "chat" and field == "logprobs":
                example = {"logprobs": True}
            path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
            r = httpx.post(server.url + path, json={**BASE[endpoint], **example}, timeout=60)
            said = r.headers.get(HEADER, "")
            if we == "refused":
                assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, endpoint, r.text)
                continue
            assert r.status_code == 200, (field, endpoint, r.text)
            assert (f"{field}:" in said) == (we == "ignored"), (field, said)
            if we == "honoured" and note.startswith("`tests/"):
                path, name = note.strip("`").split("::")
                assert f"def {name}(" in (REPO / path).read_text(), note
