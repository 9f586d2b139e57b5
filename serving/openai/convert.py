"""From OpenAI-shaped request bodies to what the orchestrator takes, and from its completions back
to OpenAI's response bodies. Shared by the HTTP routes and the batch runner, so that a batch line
and an HTTP request with the same body give the same answer.

A request with n choices comes back as n completions (one per choice, in order); echo, logprobs
(serving.openai.logprobs), response_format and tool calls (serving.openai.tool_calls) are decided
here from the body alone.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from serving.errors import GenerationError
from serving.openai import tool_calls
from serving.openai.errors import APIError
from serving.openai.logprobs import CompletionLogprobs, chat_logprobs, prompt_logprobs
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from serving.request import MAX_BAD_WORD_TOKENS, Grammar, SamplingParams
from serving.text.chat_templates import ChatTemplateError

if TYPE_CHECKING:
    from serving.orchestrator import Completion
    from serving.text.tokenizer import Tokenizer

OpenAIRequest = CompletionRequest | ChatCompletionRequest


def unread_fields(body: OpenAIRequest, tokenizer: Tokenizer) -> dict[str, str]:
    """Fields below the top level that `body` sent and that have no effect here, with why (the
    ignored-fields header names them beside serving.openai.ignored's top-level ones)."""
    out = tool_calls.unread_message_keys(body, tokenizer) if isinstance(body, ChatCompletionRequest) else {}
    schema = body.response_format.json_schema if body.response_format is not None else None
    if schema is not None and schema.description:
        out["response_format.json_schema.description"] = (
            "guidance for OpenAI's models; here the schema alone constrains the output (the model is not shown it)"
        )
    return out


def prompt_ids(body: OpenAIRequest, tokenizer: Tokenizer, max_target_length: int) -> list[int]:
    """The prompt's token ids: text, token ids, or chat messages through the chat template (with
    the tools, in the model's format, unless tool_choice is "none"); with truncate_prompt_tokens=k
    only the last k of them (vLLM's left truncation; -1: k = max_target_length)."""
    ids = _whole_prompt_ids(body, tokenizer)
    keep = body.truncate_prompt_tokens
    if keep is not None:
        keep = max_target_length if keep == -1 else keep
        ids = ids[-keep:]
    return ids


def _whole_prompt_ids(body: OpenAIRequest, tokenizer: Tokenizer) -> list[int]:
    if isinstance(body, ChatCompletionRequest):
        messages = tool_calls.render(body, tokenizer)
        try:
            return tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        return tokenizer.encode_prompt(prompt)
    bad = next((i for i in prompt if not 0 <= i < tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(
            400,
            f"prompt: token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})",
            param="prompt",
        )
    return list(prompt)


def prompt_param(body: OpenAIRequest) -> str:
    return "messages" if isinstance(body, ChatCompletionRequest) else "prompt"


def sampling(
    tokenizer: Tokenizer, ignore_eos: bool, stop_token_ids: Sequence[int] = (), **values: Any
) -> SamplingParams:
    """SamplingParams from request values (None = the default); a bad value is a 400 naming it.
    The stop ids are the model's end-of-sequence ids (unless `ignore_eos`) and `stop_token_ids`."""
    top_k = values.pop("top_k") or 0
    top_p = values.pop("top_p")
    seed = values.pop("seed") % (1 << 32)  # any int64 is a valid OpenAI seed; keys take 32 bits
    _check_token_ids(tokenizer, "stop_token_ids", stop_token_ids)
    eos = () if ignore_eos else tokenizer.eos_ids
    try:
        return SamplingParams(
            **values,
            seed=seed,
            top_k=max(0, top_k),
            top_p=1.0 if top_p is None else top_p,
            stop_ids=tuple(dict.fromkeys((*eos, *stop_token_ids))),
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split()[0]) from None


def _check_token_ids(tokenizer: Tokenizer, name: str, ids: Sequence[int]) -> None:
    bad = next((i for i in ids if not 0 <= i < tokenizer.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{name}: token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", param=name)


def logit_bias(body: OpenAIRequest, tokenizer: Tokenizer) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token id text -> bias) as (id, bias) pairs; a key that is not a token
    id of the vocabulary is a 400 naming it."""
    pairs = []
    for key, bias in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias: {key!r} is not a token id", param="logit_bias") from None
        _check_token_ids(tokenizer, "logit_bias", [token])
        pairs.append((token, bias))
    return tuple(pairs)


def bad_words(words: Sequence[str], tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word tokenized alone and after a space (the same
    word at the start of the text and inside it), the second only where it makes another first
    token; a word of more than MAX_BAD_WORD_TOKENS tokens is a 400 naming it."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip()))
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        for ids in (alone, spaced) if spaced[:1] != alone[:1] and len(spaced) == len(alone) else (alone,):
            if not 0 < len(ids) <= MAX_BAD_WORD_TOKENS:
                raise APIError(
                    400, f"bad_words: {word!r} is {len(ids)} tokens, at most {MAX_BAD_WORD_TOKENS}", param="bad_words"
                )
            sequences.append(ids)
    return tuple(sequences)


def grammar(body: OpenAIRequest, tokenizer: Tokenizer) -> Grammar | None:
    """The constraint the body asks for: response_format, or a tool_choice that must call a tool."""
    forced = tool_calls.forced_grammar(body, tokenizer) if isinstance(body, ChatCompletionRequest) else None
    if forced is not None:
        return forced
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar("json")
    from serving.structured.grammar import schema_grammar

    try:
        return schema_grammar(fmt.json_schema.schema_)
    except GenerationError as exc:
        raise APIError(400, str(exc), param="response_format") from None


def openai_sampling(
    body: OpenAIRequest,
    tokenizer: Tokenizer,
    prompt_length: int,
    max_target_length: int,
    default_seed: int | None = None,
) -> SamplingParams:
    """OpenAI's defaults: temperature 1; max_tokens 16 for completions, the rest of the context for
    chat; no seed means `default_seed`, or a fresh one per request."""
    max_tokens = body.limit() if isinstance(body, ChatCompletionRequest) else body.max_tokens
    if max_tokens is None:
        max_tokens = max(1, max_target_length - prompt_length)
    seed = body.seed if body.seed is not None else default_seed
    if isinstance(body, ChatCompletionRequest):
        logprobs, prompt_logprobs = (body.top_logprobs or 0) if body.logprobs else None, None
    else:
        logprobs = body.logprobs
        prompt_logprobs = None
        if body.echo and (logprobs is not None or max_tokens == 0):
            prompt_logprobs = logprobs or 0
    if body.prompt_logprobs is not None:  # vLLM's: as many alternatives as the larger ask
        prompt_logprobs = max(prompt_logprobs or 0, body.prompt_logprobs)
    return sampling(
        tokenizer,
        body.ignore_eos,
        body.stop_token_ids or (),
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=seed if seed is not None else secrets.randbits(31),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        n=body.n,
        grammar=grammar(body, tokenizer),
        speculative=body.speculative,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens,
        logit_bias=logit_bias(body, tokenizer),
        bad_words=bad_words(body.bad_words or (), tokenizer),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
    )


def usage(c: Completion | Sequence[Completion]) -> dict[str, Any]:
    """Usage of one completion, or of a request's choices (the prompt counted once), with OpenAI's
    prompt_tokens_details.cached_tokens: the prompt tokens read from the prefix cache."""
    choices = [c] if not isinstance(c, Sequence) else list(c)
    prompt = choices[0].prompt_tokens
    completion = sum(x.completion_tokens for x in choices)
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": choices[0].cached_tokens},
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def echo_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The prompt as echoed: its tokens decoded (what text_offset counts in)."""
    return tokenizer.decode(ids)


def completion_choice(
    body: CompletionRequest, c: Completion, ids: Sequence[int], tokenizer: Tokenizer
) -> dict[str, Any]:
    """One choice of a text completion: echo and logprobs as asked."""
    text, logprobs = c.text, None
    if body.echo:
        text = echo_text(tokenizer, ids) + text
    if body.logprobs is not None:
        builder = CompletionLogprobs(tokenizer, body.logprobs)
        entries, tokens = list(c.logprobs or []), list(c.token_ids)
        if body.echo:
            entries = [*(c.prompt_logprobs or [None] * len(ids)), *entries]
            tokens = [*ids, *tokens]
        logprobs = builder.chunk(entries, tokens)
    choice = {"index": c.choice, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(body, c, ids, tokenizer)
    return choice


def vllm_prompt_logprobs(
    body: OpenAIRequest, c: Completion, ids: Sequence[int], tokenizer: Tokenizer
) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs of one completion (the request asked for them)."""
    entries = c.prompt_logprobs or (None,) * len(ids)
    return prompt_logprobs(tokenizer, entries, ids, body.prompt_logprobs)


def chat_choice(
    body: ChatCompletionRequest, c: Completion, tokenizer: Tokenizer, call_id: str | None = None
) -> dict[str, Any]:
    """One choice of a chat completion: content, or tool_calls with finish_reason tool_calls."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    finish_reason = c.finish_reason
    calls = tool_calls.parse(body, tokenizer, c.text)
    if calls is not None:
        message = {"role": "assistant", "content": None, "tool_calls": tool_calls.wire(calls)}
        finish_reason = "tool_calls"
    logprobs = None
    if body.logprobs:
        logprobs = chat_logprobs(tokenizer, c.logprobs or [], body.top_logprobs or 0)
    return {"index": c.choice, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def response_body(
    body: OpenAIRequest,
    rid: str,
    created: int,
    model: str,
    completions: Completion | Sequence[Completion],
    ids: Sequence[int] = (),
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """The whole (non-streamed) response: a text completion or a chat completion, one choice per
    completion. `ids` (the prompt) and `tokenizer` are needed for echo, logprobs and tool calls."""
    choices = [completions] if not isinstance(completions, Sequence) else list(completions)
    needs_tokenizer = getattr(body, "echo", False) or body.logprobs is not None or body.prompt_logprobs is not None
    if tokenizer is None and (needs_tokenizer or _has_tools(body)):
        raise ValueError("echo, logprobs and tools need the tokenizer")
    if isinstance(body, CompletionRequest):
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [completion_choice(body, c, ids, tokenizer) for c in choices]
            if tokenizer is not None
            else [{"index": c.choice, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                  for c in choices],
            "usage": usage(choices),
        }
    chat = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [chat_choice(body, c, tokenizer) for c in choices],
        "usage": usage(choices),
    }
    if body.prompt_logprobs is not None:  # vLLM puts a chat request's at the top level
        chat["prompt_logprobs"] = vllm_prompt_logprobs(body, choices[0], ids, tokenizer)
    return chat


def _has_tools(body: OpenAIRequest) -> bool:
    return isinstance(body, ChatCompletionRequest) and bool(body.tools)


def adapter_of(model: str | None, base_model: str, adapters) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model, named or left out);
    404 naming it when it is neither. `adapters`: the server's registry (None: no adapters)."""
    if not model or model == base_model:
        return None
    if adapters is not None and any(a.name == model for a in adapters.list()):
        return model
    raise APIError(
        404,
        f"The model `{model}` does not exist; this server serves {base_model!r}"
        + (" and its LoRA adapters (GET /v1/models)" if adapters is not None else ""),
        param="model",
        code="model_not_found",
    )
