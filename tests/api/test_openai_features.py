"""OpenAI features as clients use them, on a real server (the tiny random model, float32) with the
official openai client: logprobs and echo (against our model's own logits and the perplexity
command), n > 1, response_format (JSON Schema, validated with jsonschema) and tool calls."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import openai
import pytest

from serving.checkpoints.model_source import load_model
from serving.cli import main as cli_main
from serving.config import ServingConfig
from serving.models import prefill
from serving.text.tools import render_messages, tool_format
from tests.server_process import ServerProcess

SLOTS = 20
OVERRIDES = [
    f"per_device_batch_size={SLOTS}",
    "max_prefill_predict_length=1024",
    "max_target_length=1536",
    "decode_steps_per_call=4",
    "cpu_kernels=off",  # XLA's ops: the logits the test computes itself, and no kernel build
    "enable_model_warmup=false",  # the serving profile's warmup: minutes for 20 slots up to 1536
]
TEXT = "The history of the lighthouse is closely tied to the history of ships and of the sea."
PROMPT = "The history of the lighthouse is closely tied to"
# Bounded, so that a random model's samples end within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    process = ServerProcess.pathserve(str(tiny_model_dir), *OVERRIDES).wait_ready()
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), ServingConfig(max_prefill_predict_length=1024))


def test_echo_logprobs_score_the_prompt_as_the_model_and_the_perplexity_command(
    client, tiny, tiny_model_dir, tmp_path, capsys
):
    response = client.completions.create(model="", prompt=TEXT, max_tokens=0, echo=True, logprobs=5)
    choice = response.choices[0]
    ids = tiny.tokenizer.encode_prompt(TEXT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == response.usage.prompt_tokens
    assert response.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.text == tiny.tokenizer.decode(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # our model's logits at each position, float32
    logits, _ = prefill(tiny.params, jnp.asarray([ids]), jnp.asarray([len(ids)]), tiny.config)
    expected = np.asarray(jax.nn.log_softmax(logits[0, :-1], axis=-1))
    chosen = expected[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(lp.token_logprobs[1:], chosen, atol=1e-4)
    for position, top in enumerate(lp.top_logprobs[1:]):
        assert 5 <= len(top) <= 6  # the best 5 and the chosen token
        best = np.sort(expected[position])[::-1][:5]
        np.testing.assert_allclose(sorted(top.values(), reverse=True)[:5], best, atol=1e-4)
    (tmp_path / "text.txt").write_text(TEXT)
    # the perplexity command, in this process (its own code path; no second JAX start-up)
    capsys.readouterr()
    argv = ["perplexity", str(tiny_model_dir), "--text-file", str(tmp_path / "text.txt"), "cpu_kernels=off", "--json"]
    assert cli_main(argv) == 0
    perplexity = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert perplexity["tokens"] == len(ids) - 1
    assert math.exp(-sum(lp.token_logprobs[1:]) / (len(ids) - 1)) == pytest.approx(perplexity["perplexity"], rel=1e-4)


def test_echo_with_new_tokens_streamed_equals_whole(client):
    args = dict(model="", prompt=PROMPT, max_tokens=6, echo=True, logprobs=2, temperature=0)
    whole = client.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**args, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text and whole.text.startswith(PROMPT)
    streamed = [x for c in chunks if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    assert [x for c in chunks if c.logprobs for x in c.logprobs.text_offset] == whole.logprobs.text_offset
    # the generated tokens: greedy, so each is its position's best
    generated = whole.logprobs.top_logprobs[-6:]
    for top, value in zip(generated, whole.logprobs.token_logprobs[-6:], strict=True):
        assert value == pytest.approx(max(top.values()), abs=1e-6)


def test_greedy_chat_logprobs_are_top_1_and_streaming_equals_whole(client):
    args = dict(
        model="",
        messages=[{"role": "user", "content": "Tell me about lighthouses."}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    whole = client.chat.completions.create(**args).choices[0]
    content = whole.logprobs.content
    assert len(content) == 12 == len(whole.logprobs.content)
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or entry.token.startswith("bytes:")
    assert "".join(bytes(e.bytes).decode("utf-8", "replace") for e in content) == whole.message.content
    chunks = [c.choices[0] for c in client.chat.completions.create(**args, stream=True) if c.choices]
    streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    # the same tokens and alternatives; the stream reads the first request's prompt pages from the
    # prefix cache, whose attention sums in another order: logprobs within float32 rounding
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in content
    ]
    for got, want in zip(streamed, content, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([t.logprob for t in want.top_logprobs], abs=1e-4)


def test_n_choices_are_reproducible_for_a_seed_and_differ(client, tiny):
    args = dict(model="", prompt=PROMPT, max_tokens=12, temperature=1.0, n=4, seed=1234)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    # the prompt counted once, every choice's tokens (each ends by max_tokens or end-of-sequence)
    assert first.usage.prompt_tokens == len(tiny.tokenizer.encode_prompt(PROMPT))
    assert 4 <= first.usage.completion_tokens <= 4 * 12
    alone = client.completions.create(**{**args, "n": 1})
    assert alone.choices[0].text == texts[0]  # choice 0 samples with the request's own seed
    # streamed: the choices interleave, each chunk names its index, the texts are the same
    chunks = list(client.completions.create(**args, stream=True))
    by_index = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(4)}
    assert [by_index[i] for i in range(4)] == texts
    order = [c.choices[0].index for c in chunks]
    assert order != sorted(order)  # not one choice after another
    chat = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=1, n=3, seed=5
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_json_schema_samples_all_validate(client):
    def one(seed: int) -> list[str]:
        response = client.chat.completions.create(
            model="",
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            max_tokens=200,
            temperature=1.0,
            n=10,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
        )
        assert all(c.finish_reason == "stop" for c in response.choices), response
        return [c.message.content for c in response.choices]

    with ThreadPoolExecutor(2) as pool:
        contents = [text for texts in pool.map(one, range(2)) for text in texts]
    assert len(contents) == 20
    for text in contents:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(contents)) > 1


def test_json_object_and_bad_schemas(client, server):
    response = client.completions.create(
        model="", prompt=PROMPT, max_tokens=120, temperature=0.7, seed=3,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if response.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(response.choices[0].text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert response.choices[0].text.startswith("{")
    bad = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text


def test_named_tool_call_parses_and_validates_and_none_gives_text(client, tiny):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    common = dict(model="", messages=messages, max_tokens=120, temperature=1.0)

    def stream():
        chunks = client.chat.completions.create(**common, tools=[WEATHER], seed=11, tool_choice=named, stream=True)
        return [c.choices[0] for c in chunks if c.choices]

    with ThreadPoolExecutor(3) as pool:  # together, in one batch of slots
        jobs = [
            pool.submit(client.chat.completions.create, **common, tools=[WEATHER, TIME], seed=11, tool_choice=named),
            pool.submit(client.chat.completions.create, **common, tools=[WEATHER, TIME], seed=12,
                        tool_choice="required"),
            pool.submit(stream),
        ]
        response, required, chunks = (job.result() for job in jobs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.tool_calls[0].function.name in {"get_weather", "get_time"}
    # streamed: one tool_calls delta, then finish_reason tool_calls
    deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].function.name == "get_weather"
    assert chunks[-1].finish_reason == "tool_calls"
    none = client.chat.completions.create(
        model="", messages=messages, tools=[WEATHER], max_tokens=8, temperature=0, tool_choice="none"
    )
    assert none.choices[0].finish_reason in ("stop", "length") and none.choices[0].message.tool_calls is None
    assert isinstance(none.choices[0].message.content, str)
    # the follow-up turn: the call and its result go back in; the reply is text or another call
    follow = client.chat.completions.create(
        model="",
        messages=[
            *messages,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ],
        tools=[WEATHER], max_tokens=8, temperature=0,
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # what the model read: the call as the text it would have written, the result in the format's turn
    fmt = tool_format(tiny.tokenizer)
    turns = render_messages(fmt, [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": '{"temperature": 21}'},
    ], [WEATHER["function"]])
    assert '{"temperature": 21}' in turns[-1]["content"] and "get_weather" in turns[-2]["content"]
    assert follow.usage.prompt_tokens == len(tiny.tokenizer.encode_chat(turns))
