"""From OpenAI-shaped request bodies to what the orchestrator takes, and from its completions back
to OpenAI's response bodies. Shared by the HTTP routes and the batch runner, so that a batch line
and an HTTP request with the same body give the same answer."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from serving.openai.errors import APIError
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from serving.request import SamplingParams
from serving.text.chat_templates import ChatTemplateError

if TYPE_CHECKING:
    from serving.orchestrator import Completion
    from serving.text.tokenizer import Tokenizer

OpenAIRequest = CompletionRequest | ChatCompletionRequest


def prompt_ids(body: OpenAIRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: text, token ids, or chat messages through the chat template."""
    if isinstance(body, ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
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


def sampling(tokenizer: Tokenizer, ignore_eos: bool, **values: Any) -> SamplingParams:
    """SamplingParams from request values (None = the default); a bad value is a 400 naming it."""
    top_k = values.pop("top_k") or 0
    top_p = values.pop("top_p")
    seed = values.pop("seed") % (1 << 32)  # any int64 is a valid OpenAI seed; keys take 32 bits
    try:
        return SamplingParams(
            **values,
            seed=seed,
            top_k=max(0, top_k),
            top_p=1.0 if top_p is None else top_p,
            stop_ids=() if ignore_eos else tokenizer.eos_ids,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split()[0]) from None


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
    return sampling(
        tokenizer,
        body.ignore_eos,
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=seed if seed is not None else secrets.randbits(31),
    )


def usage(c: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    }


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, str], finish_reason: str | None
) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def response_body(body: OpenAIRequest, rid: str, created: int, model: str, c: Completion) -> dict[str, Any]:
    """The whole (non-streamed) response: a text completion or a chat completion."""
    if isinstance(body, CompletionRequest):
        return completion_chunk(rid, created, model, c.text, c.finish_reason) | {"usage": usage(c)}
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": None,
        "finish_reason": c.finish_reason,
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(c),
    }
