"""logprobs, echo, n > 1, grammar masks in the plan and tool-call text, on the mock engine (its
logprob rule: token t has -(t % 5) / 4, alternatives t + 1, t + 2, ... one less each) and through
the real HTTP app with the openai client. No grammar library here (it imports torch): the real
matchers run in tests/test_structured.py."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from serving.config import ServingConfig
from serving.engine.limits import Limits
from serving.engine.mock import AsciiTokenizer, MockEngine, mock_logprob
from serving.errors import GenerationError, QueueFullError
from serving.orchestrator import Orchestrator
from serving.orchestrator.scheduler import Scheduler, StepOutcome, Waiting
from serving.orchestrator.streams import Request
from serving.request import Grammar, SamplingParams
from serving.text.tools import CHATML, LLAMA3, call_schema, parse_calls, render_messages
from tests.unit.test_api import _Running

TOKENIZER = AsciiTokenizer()


def _orchestrator(slots: int = 4, queue: int = 64, prefix_cache: str = "on") -> Orchestrator:
    cfg = ServingConfig(
        max_queued_requests=queue, max_prefill_predict_length=64, max_target_length=256, prefix_cache=prefix_cache
    )
    return Orchestrator(MockEngine(slots=slots), {}, TOKENIZER, cfg.orchestrator)


@pytest.fixture(scope="module")
def server():
    cfg = ServingConfig(max_queued_requests=16, max_prefill_predict_length=64, max_target_length=256)
    from serving.api.state import ServerState

    state = ServerState(config=cfg.server)
    state.set_ready(Orchestrator(MockEngine(slots=4), {}, TOKENIZER, cfg.orchestrator).start(), "mock")
    running = _Running(state)
    yield running
    running.stop()
    state.orchestrator.stop(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=30)


def _lp(char: str) -> float:
    return mock_logprob(ord(char) - 32).logprob


# -- the scheduler ------------------------------------------------------------------------------


class _Matcher:
    """A grammar matcher's contract (serving.structured): its mask is the tokens it has seen."""

    def __init__(self):
        self.seen: list[int] = []

    def mask(self) -> np.ndarray:
        return np.full((3,), 7 + len(self.seen), np.int32)

    def advance(self, token: int) -> bool:
        self.seen.append(token)
        return True


def test_n_choices_take_n_slots_and_grammar_plans_carry_masks():
    """The scheduler holds a grammar request's matcher: the first token's mask in its final prompt
    row (in chunks, as any request), then each one-step call's mask from the matcher as the tokens
    advance it."""
    scheduler = Scheduler(Limits(4, 64, 256), decode_steps_per_call=2)
    grammar = SamplingParams(max_tokens=5, grammar=Grammar("json"))
    plan = scheduler.schedule([Waiting(0, (1, 2), SamplingParams(max_tokens=5, n=3), (1, 2))])
    assert [r.slot for r in plan.rows] == [0, 1, 2] and plan.decode_steps == 2 and plan.masks is None
    assert scheduler.room() == 1
    with pytest.raises(ValueError, match="2 slots asked for, 1 free"):
        scheduler.schedule([Waiting(3, (1,), SamplingParams(n=2), (4,))])
    # a grammar request's final row: no generate call this turn (its mask needs the first token)
    matcher = _Matcher()
    plan = scheduler.schedule([Waiting(5, (1,), grammar, (), (matcher,))])
    assert [(r.slot, r.final) for r in plan.rows] == [(3, True)]
    assert (plan.rows[0].mask == 7).all() and plan.decode_steps == 0
    scheduler.update(plan, StepOutcome(first_tokens=(11,)))
    assert matcher.seen == [11]
    # then one-step calls with every slot's mask (all tokens allowed for the others)
    plan = scheduler.schedule([])
    assert plan.decode_steps == 1 and plan.masks.shape == (4, 3)
    assert (plan.masks[3] == 8).all() and (plan.masks[:3] == -1).all()


# -- the orchestrator ---------------------------------------------------------------------------


def test_logprobs_follow_every_token_and_echo_scores_the_prompt():
    orchestrator = _orchestrator().start()
    try:
        sampling = SamplingParams(max_tokens=6, logprobs=2, prompt_logprobs=2)
        c = orchestrator.submit(TOKENIZER.encode("ab"), sampling).result()
        assert c.text == "cdefgh"
        assert [e.token for e in c.logprobs] == c.token_ids
        assert [e.logprob for e in c.logprobs] == [_lp(ch) for ch in "cdefgh"]
        assert c.logprobs[0].top[:2] == mock_logprob(c.token_ids[0]).top[:2]
        assert c.prompt_logprobs[0] is None and c.prompt_logprobs[1].token == TOKENIZER.encode("b")[0]
        scored = orchestrator.submit(TOKENIZER.encode("abc"), SamplingParams(max_tokens=0, prompt_logprobs=0)).result()
        assert scored.token_ids == [] and scored.finish_reason == "length" and len(scored.prompt_logprobs) == 3
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=0)
    finally:
        orchestrator.stop(timeout=10)


@pytest.mark.parametrize("prefix_cache", ["on", "off"])
def test_n_choices_share_a_prefill_seed_apart_and_count_as_n_in_the_queue(prefix_cache):
    """n choices are n chunked sequences, each its choice's seed: with the prefix cache sharing the
    prompt's pages through it, without it each computing them (no whole prefill either way), at
    any prompt length."""
    engine_orchestrator = _orchestrator(slots=4, prefix_cache=prefix_cache)
    orchestrator = engine_orchestrator.start()
    try:
        sampling = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3)
        handles = orchestrator.submit_choices(TOKENIZER.encode("ab"), sampling)
        results = [h.result() for h in handles]
        engine = orchestrator.engine
        assert [r.choice for r in results] == [0, 1, 2]
        for i, r in enumerate(results):
            assert r.token_ids == engine.expected(TOKENIZER.encode("ab"), sampling, i)
        assert len({tuple(r.token_ids) for r in results}) == 3
        assert not [call for call in engine.calls if call[0] in ("prefill", "insert")]
        with pytest.raises(GenerationError, match="decode slots"):
            orchestrator.submit_choices([1], SamplingParams(n=5))
        long = [(i * 7) % 90 + 3 for i in range(100)]  # past max_prefill_predict_length (64): chunks
        got = [h.result().token_ids for h in orchestrator.submit_choices(long, sampling)]
        assert got == [engine.expected(long, sampling, i) for i in range(3)]
        with pytest.raises(ValueError, match="submit_choices"):
            orchestrator.submit([1], sampling)
    finally:
        orchestrator.stop(timeout=10)
    idle = _orchestrator(slots=4, queue=4)  # not started: nothing drains the queue
    idle.submit_choices([1], SamplingParams(n=3))
    idle.submit_choices([1], SamplingParams(n=4))  # 7 of 4 slots + 4 queued
    with pytest.raises(QueueFullError):
        idle.submit_choices([1], SamplingParams(n=2))  # whole or not at all


def test_n_above_the_queue_bound_but_within_the_slots_is_admitted_at_an_idle_server():
    idle = _orchestrator(slots=4, queue=2)
    assert len(idle.submit_choices([1], SamplingParams(n=3))) == 3
    with pytest.raises(GenerationError, match="decode slots") as raised:
        idle.submit_choices([1], SamplingParams(n=5))  # never fits: a 400, not a 429 forever
    assert raised.value.field == "n"


def test_a_head_held_back_for_want_of_slots_still_counts_against_the_bound():
    idle = _orchestrator(slots=1, queue=2)  # not started: the test plays the device loop's turns
    idle.submit([1], SamplingParams(max_tokens=2))
    assert len(idle._take(room=1)) == 1  # into the one slot
    idle.submit([2], SamplingParams(max_tokens=2))
    idle.submit([3], SamplingParams(max_tokens=2))
    assert idle._take(room=0) == []  # no free slot: the head leaves the queue, held for the next turn
    with pytest.raises(QueueFullError):
        idle.submit([4], SamplingParams(max_tokens=2))
    assert idle._waiting() == 2 and idle.full()


def test_the_device_loop_waits_for_a_request_s_last_choice_being_put():
    """submit_choices puts a request's choices one by one under its lock; the device loop may take
    the first before the last is there, and must wait for it instead of failing on an empty queue."""
    import threading

    orchestrator = _orchestrator(slots=4)
    sampling = SamplingParams(max_tokens=2, n=2)
    first, second = (Request([1], sampling, (), choice=i) for i in range(2))
    taken: list = []
    with orchestrator._submit_lock:
        orchestrator._queue.put_nowait(first)
        taker = threading.Thread(target=lambda: taken.append(orchestrator._take(room=4)))
        taker.start()
        taker.join(0.2)
        assert taker.is_alive()  # waiting for the submitter, not raising queue.Empty
        orchestrator._queue.put_nowait(second)
    taker.join(5)
    assert taken == [[([first, second], None)]]  # its group, with no adapter load


def test_a_request_that_does_not_fit_waits_without_being_passed():
    orchestrator = _orchestrator(slots=4).start()
    try:
        first = orchestrator.submit([1], SamplingParams(max_tokens=30))
        second = orchestrator.submit_choices([2], SamplingParams(max_tokens=3, n=4))
        third = orchestrator.submit([3], SamplingParams(max_tokens=3))
        assert [h.result().finish_reason for h in [first, *second, third]] == ["length"] * 6
        calls = orchestrator.engine.calls
        # [1], then the 4 choices of [2] once 4 slots were free (chunks of one call), then [3]
        rows = [c[1] for c in calls if c[0] == "prefill_slots"]
        assert [[r[0] for r in call] for call in rows] == [[0], [0, 1, 2, 3], [0]]
    finally:
        orchestrator.stop(timeout=10)


# -- the HTTP API -------------------------------------------------------------------------------


def test_completions_logprobs_and_echo_in_openais_shape(client):
    r = client.completions.create(model="mock", prompt="ab", max_tokens=3, logprobs=2, echo=True, temperature=0)
    choice = r.choices[0]
    assert choice.text == "abcde"
    lp = choice.logprobs
    assert lp.tokens == list("abcde") and lp.text_offset == [0, 1, 2, 3, 4]
    assert lp.token_logprobs == [None, _lp("b"), _lp("c"), _lp("d"), _lp("e")]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[2] == {"c": _lp("c"), "d": _lp("c") - 1}
    scored = client.completions.create(model="mock", prompt="abc", max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == "abc" and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == [None, _lp("b"), _lp("c")]
    streamed = list(client.completions.create(model="mock", prompt="ab", max_tokens=3, logprobs=2, echo=True,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "abcde"
    offsets = [o for c in streamed if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == [0, 1, 2, 3, 4]


def test_chat_logprobs_in_openais_shape(client):
    r = client.chat.completions.create(
        model="mock", messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == list(r.choices[0].message.content)
    assert content[0].bytes == list(content[0].token.encode())
    assert [t.logprob for t in content[0].top_logprobs] == [content[0].logprob, content[0].logprob - 1]


def test_n_choices_over_http_streamed_interleave_by_index(client, server):
    args = dict(model="mock", prompt="ab", max_tokens=6, temperature=1.0, seed=2, n=3)
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in whole.choices]
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 18
    chat = list(client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=2, n=2, stream=True))
    roles = [c.choices[0].index for c in chat if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1]
    too_many = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "n": 5})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}}, "response_format"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "stop": ["}"]},
         "stop"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "ignore_eos": True},
         "ignore_eos"),
    ],
)
def test_bad_feature_fields_get_400_naming_them(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_completions_echo_needs_max_tokens_above_0_without_it(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ab", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# -- tool-call text -----------------------------------------------------------------------------

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def test_tools_render_in_each_format_with_the_follow_up_turns():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"c": 3}', "tool_call_id": "call_1"},
    ]
    chatml = render_messages(CHATML, messages, [WEATHER])
    assert chatml[0]["role"] == "system" and "<tools>" in chatml[0]["content"] and "get_weather" in chatml[0]["content"]
    assert chatml[2] == {"role": "assistant",
                         "content": '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'}
    # the call a result answers goes to the template too (a template may read it, as vLLM passes it)
    assert chatml[3] == {"role": "tool", "content": '<tool_response>{"c": 3}</tool_response>', "tool_call_id": "call_1"}
    llama = render_messages(LLAMA3, messages, [WEATHER])
    assert llama[0] == {"role": "system", "content": "Environment: ipython"}
    assert llama[1]["content"].endswith("Weather in Oslo?") and '"parameters"' in llama[1]["content"]
    assert llama[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert llama[3] == {"role": "ipython", "content": '{"c": 3}', "tool_call_id": "call_1"}
    rendered = TOKENIZER.apply_chat_template([m for m in render_messages(CHATML, messages[:1], None)])
    assert rendered == "user: Weather in Oslo? | assistant: "


def test_replies_parse_into_calls_or_stay_content():
    assert parse_calls(CHATML, '<tool_call>[{"name": "f", "arguments": {"a": 1}}]</tool_call>')[0].arguments == '{"a": 1}'
    assert parse_calls(CHATML, '{"name": "f", "arguments": {}}')[0].name == "f"
    two = parse_calls(LLAMA3, '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}')
    assert [c.name for c in two] == ["f", "g"]
    assert parse_calls(LLAMA3, "The weather is fine.") is None
    assert parse_calls(CHATML, "<tool_call>not json</tool_call>") is None
    schema = call_schema(LLAMA3, [WEATHER])
    assert schema["properties"]["name"] == {"const": "get_weather"} and schema["required"] == ["name", "parameters"]
    assert set(call_schema(CHATML, [WEATHER, {"name": "t"}])) == {"anyOf"}
    assert json.loads(parse_calls(LLAMA3, '{"name": "f", "parameters": {"x": "é"}}')[0].arguments) == {"x": "é"}


def test_a_strict_functions_call_that_breaks_its_schema_stays_content():
    """OpenAI's `strict: true`: a call follows the schema. A forced tool_choice's grammar makes the
    model follow it; under "auto" a reply whose call breaks it is content, not a call."""
    from serving.openai.protocol import ChatCompletionRequest
    from serving.openai.tool_calls import parse

    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
    messages = [{"role": "user", "content": "x"}]

    def calls(strict: bool, arguments: str):
        tools = [{"type": "function", "function": {"name": "f", "parameters": parameters, "strict": strict}}]
        reply = f'<tool_call>[{{"name": "f", "arguments": {arguments}}}]</tool_call>'
        return parse(ChatCompletionRequest(messages=messages, tools=tools), TOKENIZER, reply)

    assert [c.name for c in calls(True, '{"city": "Oslo"}')] == ["f"]
    assert calls(True, '{"town": "Oslo"}') is None and calls(True, '{"city": 3}') is None
    assert [c.name for c in calls(False, '{"town": "Oslo"}')] == ["f"]  # not strict: the call as made


def test_message_names_go_to_the_template_and_are_said_unread_where_it_reads_none(server, client):
    from serving.text import chat_templates

    assert not chat_templates.reads(TOKENIZER.chat_template, "name")
    reads_names = "{% for m in messages %}{{ m.get('name', m['role']) }}: {{ m['content'] }}\n{% endfor %}"
    assert chat_templates.reads(reads_names, "name") and not chat_templates.reads(reads_names, "tool_call_id")
    named = [{"role": "user", "content": "ab", "name": "bob"}]
    assert chat_templates.render(reads_names, [{"role": "user", "content": "ab", "name": "bob"}], False, "", "") == "bob: ab\n"
    # the mock's template reads no name: the answer says so, and the prompt is the same
    body = {"model": "mock", "messages": named, "max_tokens": 2}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    assert "messages[].name: this model's chat template does not read it" in reply.headers["pathserve-ignored-fields"]
    plain = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "ab"}], max_tokens=2)
    assert reply.json()["usage"]["prompt_tokens"] == plain.usage.prompt_tokens
    # (through the translation alone: a grammar's first compile here would import its library)
    from serving.openai.convert import unread_fields
    from serving.openai.protocol import ChatCompletionRequest

    described = ChatCompletionRequest(
        messages=[{"role": "user", "content": "ab"}],
        response_format={"type": "json_schema", "json_schema": {"name": "s", "description": "a thing", "schema": {}}},
    )
    assert "response_format.json_schema.description" in unread_fields(described, TOKENIZER)


def test_an_assistant_turn_replayed_from_openai_is_taken(server):
    """OpenAI's answers carry `refusal: null` (and may carry the deprecated `function_call`): a
    conversation replayed from them continues here. A refusal's text is the turn's text; a
    function_call is the turn's one call; audio, which this server has none of, is null only."""

    from serving.openai.protocol import ChatCompletionRequest
    from serving.openai.tool_calls import render

    def prompt_tokens(assistant: dict) -> int:
        body = {"model": "mock", "max_tokens": 1,
                "messages": [{"role": "user", "content": "ab"}, {"role": "assistant", **assistant},
                             {"role": "user", "content": "cd"}]}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    assert prompt_tokens({"content": "x", "refusal": None, "function_call": None, "audio": None}) == prompt_tokens({"content": "x"})
    assert prompt_tokens({"content": None, "refusal": "I can't."}) == prompt_tokens({"content": "I can't."})
    call, tools = {"name": "f", "arguments": "{}"}, [{"type": "function", "function": {"name": "f"}}]

    def turns(assistant: dict) -> list[dict]:
        messages = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": None, **assistant}]
        return render(ChatCompletionRequest(messages=messages, tools=tools), TOKENIZER)

    assert turns({"function_call": call}) == turns({"tool_calls": [{"id": "c", "type": "function", "function": call}]})
    assert "<tool_call>" in turns({"function_call": call})[-1]["content"]
    refused = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": "mock", "messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "x",
                                                                          "audio": {"id": "a1"}}]})
    assert refused.status_code == 400 and "audio" in refused.json()["error"]["message"], refused.text


def test_parallel_tool_calls_false_keeps_one_call():
    from serving.openai.protocol import ChatCompletionRequest
    from serving.openai.tool_calls import parse

    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    reply = '<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]</tool_call>'
    messages = [{"role": "user", "content": "x"}]
    both = parse(ChatCompletionRequest(messages=messages, tools=tools), TOKENIZER, reply)
    one = parse(ChatCompletionRequest(messages=messages, tools=tools, parallel_tool_calls=False), TOKENIZER, reply)
    assert [c.name for c in both] == ["f", "g"] and [c.name for c in one] == ["f"]


def test_batch_rows_take_n_logprobs_and_refuse_a_bad_schema(tmp_path):
    from serving.batch.runner import run_batch
    from tests import batch_mock

    rows = [
        {"custom_id": "n", "url": "/v1/completions",
         "body": {"prompt": "ab", "max_tokens": 3, "n": 2, "temperature": 1, "seed": 4, "logprobs": 1}},
        {"custom_id": "bad", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "x"}],
                  "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ServingConfig(max_target_length=128, max_prefill_predict_length=64)
    summary = run_batch(str(source), str(tmp_path / "out"), "mock", cfg, progress=False, start=batch_mock.start_mock([]))
    assert (summary.rows_ok, summary.rows_failed) == (1, 1)
    records = batch_mock.records(tmp_path / "out")
    choices = records["n"]["response"]["body"]["choices"]
    sampling = SamplingParams(max_tokens=3, temperature=1.0, seed=4, n=2)
    expected = [TOKENIZER.decode(MockEngine().expected(TOKENIZER.encode("ab"), sampling, i)) for i in range(2)]
    assert [c["text"] for c in choices] == expected
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [3, 3]
    assert "response_format" in records["bad"]["error"]["message"]
