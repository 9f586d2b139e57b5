"""Chat tool calls: the request's tools into the prompt (serving.text.tools, in the model's own
format), `tool_choice` "required" or a named function as a grammar over one call, and the reply's
calls as OpenAI's `tool_calls` (each with an id)."""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from serving.errors import GenerationError
from serving.openai.errors import APIError
from serving.openai.protocol import ChatCompletionRequest, NamedToolChoice
from serving.request import Grammar
from serving.text import chat_templates
from serving.text.tools import (
    PASSED_KEYS,
    ToolCallText,
    call_schema,
    parse_calls,
    render_messages,
    tool_format,
)

if TYPE_CHECKING:
    from serving.text.tokenizer import Tokenizer


def calling(body: ChatCompletionRequest) -> bool:
    """The model sees the tools and may (or must) call them."""
    return bool(body.tools) and body.effective_tool_choice() != "none"


def _functions(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [t.function.model_dump(exclude_none=True) for t in body.tools or []]


def render(body: ChatCompletionRequest, tokenizer: Tokenizer) -> list[dict[str, str]]:
    """The messages as plain {"role", "content"} turns for the chat template (with each message's
    `name` and `tool_call_id`, for a template that reads them)."""
    messages = [
        {
            "role": m.role,
            "content": m.text(),
            "tool_calls": [c.model_dump() for c in calls] if (calls := m.calls()) else None,
            "name": m.name,
            "tool_call_id": m.tool_call_id,
        }
        for m in body.messages
    ]
    return render_messages(tool_format(tokenizer), messages, _functions(body) if calling(body) else None)


def forced_grammar(body: ChatCompletionRequest, tokenizer: Tokenizer) -> Grammar | None:
    """For tool_choice "required" (any tool) or a named function: a JSON Schema of one call."""
    choice = body.effective_tool_choice()
    if not body.tools or choice in ("none", "auto"):
        return None
    functions = _functions(body)
    if isinstance(choice, NamedToolChoice):
        functions = [f for f in functions if f["name"] == choice.function.name]
    from serving.structured.grammar import schema_grammar

    for f in functions:
        try:
            schema_grammar(f.get("parameters") or {"type": "object"})
        except GenerationError as exc:
            message = str(exc).replace("response_format: ", "")
            raise APIError(400, f"tools: function {f['name']!r}: {message}", param="tools") from None
    return Grammar("json_schema", json.dumps(call_schema(tool_format(tokenizer), functions), sort_keys=True))


def parse(body: ChatCompletionRequest, tokenizer: Tokenizer | None, text: str) -> list[ToolCallText] | None:
    """The calls in a reply (None: the reply is content), only for the request's own tools, and
    for a function with `strict: true` only arguments its `parameters` schema accepts: OpenAI's
    promise that a strict call follows its schema (a forced tool_choice's grammar makes the model
    follow it; under "auto" a call that breaks it is returned as content, not as a call)."""
    if not calling(body) or tokenizer is None:
        return None
    calls = parse_calls(tool_format(tokenizer), text)
    names = {t.function.name for t in body.tools or []}
    if calls is None or any(c.name not in names for c in calls) or not _strict_calls_conform(body, calls):
        return None
    return calls[:1] if body.parallel_tool_calls is False else calls


def _strict_calls_conform(body: ChatCompletionRequest, calls: list[ToolCallText]) -> bool:
    import jsonschema

    strict = {t.function.name: t.function.parameters for t in body.tools or [] if t.function.strict}
    for call in calls:
        if call.name not in strict:
            continue
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            return False
        schema = strict[call.name]
        if not jsonschema.validators.validator_for(schema)(schema).is_valid(arguments):
            return False
    return True


def wire(calls: list[ToolCallText]) -> list[dict[str, Any]]:
    """OpenAI's `tool_calls`: ids, type function, arguments as JSON text."""
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def unread_message_keys(body: ChatCompletionRequest, tokenizer: Tokenizer) -> dict[str, str]:
    """The messages' `name` / `tool_call_id` that this model's chat template leaves out of the
    prompt, with why (for the ignored-fields header: sent, passed on, and without effect here)."""
    out = {}
    for key in PASSED_KEYS:
        if any(getattr(m, key) is not None for m in body.messages) and not chat_templates.reads(tokenizer.chat_template, key):
            out[f"messages[].{key}"] = "this model's chat template does not read it (it is passed to the template, as vLLM passes it)"
    return out
