"""Tool calling in the model's own chat format: tools and tool turns rendered into messages any
chat template can show, and the model's reply parsed back into calls.

Two formats, chosen by the vocabulary as the chat template is:
- Llama 3.1 / 3.2 (JSON tool calling): the tools as JSON in the first user turn with the
  instruction to answer `{"name": ..., "parameters": {...}}`; results come back as `ipython` turns.
- SmolLM2 (ChatML): the tools as JSON inside `<tools></tools>` in the system prompt, calls answered
  as `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`; results come back as `tool`
  turns wrapped in `<tool_response></tool_response>`.
Either way the result is plain {"role", "content"} turns, so the tokenizer's own template (or the
built-in one) renders them.
`call_schema` is the JSON Schema of one call in that format, which `tool_choice` "required" or a
named function enforces as a grammar, so that the arguments always parse and match.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LLAMA3, CHATML = "llama3", "chatml"


@dataclass(frozen=True)
class ToolCallText:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def tool_format(tokenizer) -> str:
    return LLAMA3 if tokenizer.token_id("<|start_header_id|>") is not None else CHATML


def arguments_key(fmt: str) -> str:
    return "parameters" if fmt == LLAMA3 else "arguments"


def call_schema(fmt: str, functions: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A JSON Schema for one call of one of `functions` ({"name", "parameters"}), in `fmt`'s shape."""
    key = arguments_key(fmt)
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: f.get("parameters") or {"type": "object"}},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def render_messages(
    fmt: str, messages: Sequence[Mapping[str, Any]], functions: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, str]]:
    """{"role", "content"} messages for a template without tool support: the tools (if any) in the
    format's place, assistant calls as the text the model would have written, tool results as the
    format's result turns."""
    out = [_render_turn(fmt, m) for m in messages]
    if not functions:
        return out
    tools = json.dumps([{"type": "function", "function": dict(f)} for f in functions], ensure_ascii=False)
    if fmt == LLAMA3:
        first_user = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
        instruction = (
            "Given the following functions, please respond with a JSON for a function call with its "
            'proper arguments that best answers the given prompt.\n\nRespond in the format {"name": '
            'function name, "parameters": dictionary of argument name and its value}. Do not use '
            f"variables.\n\n{tools}\n\n"
        )
        system = {"role": "system", "content": "Environment: ipython"}
        if first_user is None:
            return [system, *out, {"role": "user", "content": instruction}]
        out[first_user] = {"role": "user", "content": instruction + out[first_user]["content"]}
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": "Environment: ipython\n\n" + out[0]["content"]}
            return out
        return [system, *out]
    instruction = (
        "You can call functions to answer the question. You have access to the following tools:\n"
        f"<tools>{tools}</tools>\n\n"
        "To call one or more of them, answer with nothing but\n"
        '<tool_call>[{"name": "func_name", "arguments": {"argument1": "value1"}}]</tool_call>\n'
        "with arguments of the right types. If no call is needed, answer normally."
    )
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + instruction}
        return out
    return [{"role": "system", "content": instruction}, *out]


# A message's keys that go to the chat template as they came (OpenAI's participant name, the call a
# tool result answers): a template that reads them uses them, as vLLM passes them.
PASSED_KEYS = ("name", "tool_call_id")


def _render_turn(fmt: str, m: Mapping[str, Any]) -> dict[str, str]:
    turn = _render_content(fmt, m)
    return turn | {key: m[key] for key in PASSED_KEYS if m.get(key) is not None}


def _render_content(fmt: str, m: Mapping[str, Any]) -> dict[str, str]:
    role, content = m["role"], m.get("content") or ""
    if role == "assistant" and m.get("tool_calls"):
        calls = [
            {"name": c["function"]["name"], arguments_key(fmt): _loads(c["function"]["arguments"])}
            for c in m["tool_calls"]
        ]
        if fmt == LLAMA3:
            text = "; ".join(json.dumps(c, ensure_ascii=False) for c in calls)
        else:
            text = f"<tool_call>{json.dumps(calls, ensure_ascii=False)}</tool_call>"
        return {"role": "assistant", "content": (content + "\n" if content else "") + text}
    if role == "tool":
        if fmt == LLAMA3:
            return {"role": "ipython", "content": content}
        return {"role": "tool", "content": f"<tool_response>{content}</tool_response>"}
    return {"role": role, "content": content}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


_CHATML_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)


def parse_calls(fmt: str, text: str) -> list[ToolCallText] | None:
    """The calls in a reply, or None when it makes none (then it is plain content). A bare JSON
    call (what the grammar of a forced tool_choice produces) counts in both formats."""
    stripped = text.strip()
    candidates: list[Any] = []
    if fmt == CHATML and "<tool_call>" in stripped:
        for body in _CHATML_CALL.findall(stripped):
            value = _loads(body.strip())
            candidates.extend(value if isinstance(value, list) else [value])
    elif stripped.startswith(("{", "[")):
        whole = _loads(stripped)
        parts = [whole] if not isinstance(whole, str) or fmt == CHATML else [
            _loads(p.strip()) for p in stripped.split(";")  # Llama 3: calls separated by ";"
        ]
        for value in parts:
            candidates.extend(value if isinstance(value, list) else [value])
    calls = []
    for c in candidates:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        args = c.get("arguments", c.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        calls.append(ToolCallText(c["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None
