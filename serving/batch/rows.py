"""One input line -> one request, or the reason it cannot be one; and the output records.

Lines are OpenAI batch requests (`{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`) or plain `{"id"?, "prompt", "max_tokens"?, ...}` lines
(a completion, greedy unless a temperature is given). Output records have OpenAI's batch output shape;
a row that failed has `error` set and `response` holding the HTTP status the same request would get.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from serving.openai.convert import OpenAIRequest
from serving.openai.errors import describe_validation
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest

ROUTES: dict[str, type[CompletionRequest] | type[ChatCompletionRequest]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


# JSON's \uXXXX escapes can name half a UTF-16 pair alone: Python keeps it as a lone surrogate,
# which no UTF-8 writer (the results, a tokenizer) accepts. Raw UTF-8 cannot carry one.
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class RowError(Exception):
    """A line that is no request; `status` is what `serve` answers the same request."""

    def __init__(self, custom_id: str | None, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.custom_id, self.code, self.message, self.status = custom_id, code, message, status


@dataclass(frozen=True)
class Row:
    custom_id: str
    body: OpenAIRequest


def parse(raw: bytes, record_id: str) -> Row:
    """The request on one line; raises RowError naming what is wrong with it."""
    obj = _load(raw)
    custom_id = _custom_id(obj, record_id)
    if _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate(obj)) is not None:
        raise RowError(custom_id, "invalid_request", f"{where}: {_NOT_TEXT}")
    if _is_batch_request(obj):
        return _batch_request(obj, custom_id)
    return _plain(obj, custom_id)


_NOT_TEXT = "holds a lone surrogate (a \\ud800-\\udfff escape not part of a pair), which is not text"


def custom_id_of(raw: bytes) -> str | None:
    """The custom_id the line's record will carry; None when it has none of its own (a plain line
    without an id: its record id stands in) or cannot be read (its record says why)."""
    try:
        obj = _load(raw)
        return _custom_id(obj, "") if _is_batch_request(obj) or "id" in obj else None
    except RowError:
        return None


def _load(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise RowError(None, "invalid_json", f"the line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RowError(None, "invalid_request", f"the line is a JSON {type(obj).__name__}, not an object")
    return obj


def _is_batch_request(obj: dict[str, Any]) -> bool:
    return "body" in obj or "custom_id" in obj


def _custom_id(obj: dict[str, Any], record_id: str) -> str:
    """The line's custom_id (a plain line's id, else its record id); RowError without one when it
    cannot be read."""
    if _is_batch_request(obj):
        custom_id = obj.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise RowError(None, "invalid_request", "custom_id: a non-empty string is required")
        key = "custom_id"
    else:
        custom_id = obj.get("id", record_id)
        if not isinstance(custom_id, (str, int)) or isinstance(custom_id, bool):
            raise RowError(None, "invalid_request", "id: a string or an integer is required")
        custom_id, key = str(custom_id), "id"
    if _SURROGATE.search(custom_id):
        raise RowError(None, "invalid_request", f"{key}: {_NOT_TEXT}")
    return custom_id


def _lone_surrogate(obj: dict[str, Any]) -> str | None:
    """Where in the line (`body.messages[0].content`) the first string holding a lone surrogate
    is, if any (a key holding one is named escaped). Walked without recursion: json.loads takes
    nesting as deep as the recursion limit allows."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return where
        elif isinstance(value, list):
            stack += reversed([(f"{where}[{i}]", item) for i, item in enumerate(value)])
        elif isinstance(value, dict):
            for key in value:
                if _SURROGATE.search(key):
                    return f"{where}.{key!a}" if where else ascii(key)
            stack += reversed([(f"{where}.{key}" if where else key, item) for key, item in value.items()])
    return None


def _batch_request(obj: dict[str, Any], custom_id: str) -> Row:
    if obj.get("method", "POST") != "POST":
        raise RowError(
            custom_id, "invalid_request", f"method: only POST is supported, got {obj.get('method')!r}", 405
        )
    model = ROUTES.get(obj.get("url", ""))
    if model is None:
        raise RowError(
            custom_id, "invalid_request", f"url: one of {', '.join(ROUTES)}, got {obj.get('url')!r}", 404
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RowError(custom_id, "invalid_request", "body: a JSON object is required")
    return Row(custom_id, _validate(model, {**body, "stream": False}, custom_id))


def _plain(obj: dict[str, Any], custom_id: str) -> Row:
    if "prompt" not in obj:
        raise RowError(custom_id, "invalid_request", "prompt: required")
    fields = {k: v for k, v in obj.items() if k != "id"}
    fields.setdefault("temperature", 0.0)
    return Row(custom_id, _validate(CompletionRequest, {**fields, "stream": False}, custom_id))


def _validate(model: type[CompletionRequest] | type[ChatCompletionRequest], body: dict, custom_id: str):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        message, _ = describe_validation(exc.errors())
        raise RowError(custom_id, "invalid_request", message) from None


def ok_record(record_id: str, custom_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": record_id,
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": record_id, "body": body},
        "error": None,
    }


def error_record(record_id: str, custom_id: str | None, status: int, code: str, message: str) -> dict[str, Any]:
    """A row that failed: `status` is the HTTP status the same request would get from `serve` (400
    a bad request, 404 a model that is not there); `error` set is what marks the row failed."""
    return {
        "id": record_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": record_id, "body": None},
        "error": {"code": code, "message": message},
    }
