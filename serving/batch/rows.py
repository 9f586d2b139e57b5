"""One input line -> one request, or the reason it cannot be one; and the output records.

Lines are OpenAI batch requests (`{"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}`) or plain `{"id"?, "prompt", "max_tokens"?, ...}` lines
(a completion, greedy unless a temperature is given). Output records have OpenAI's batch output shape.
"""

from __future__ import annotations

import json
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


class RowError(Exception):
    def __init__(self, custom_id: str | None, code: str, message: str):
        super().__init__(message)
        self.custom_id, self.code, self.message = custom_id, code, message


@dataclass(frozen=True)
class Row:
    custom_id: str
    body: OpenAIRequest


def parse(raw: bytes, record_id: str) -> Row:
    """The request on one line; raises RowError naming what is wrong with it."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RowError(None, "invalid_json", f"the line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RowError(None, "invalid_request", f"the line is a JSON {type(obj).__name__}, not an object")
    if "body" in obj or "custom_id" in obj:
        return _batch_request(obj)
    return _plain(obj, record_id)


def _batch_request(obj: dict[str, Any]) -> Row:
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise RowError(None, "invalid_request", "custom_id: a non-empty string is required")
    if obj.get("method", "POST") != "POST":
        raise RowError(
            custom_id, "invalid_request", f"method: only POST is supported, got {obj.get('method')!r}"
        )
    model = ROUTES.get(obj.get("url", ""))
    if model is None:
        raise RowError(
            custom_id, "invalid_request", f"url: one of {', '.join(ROUTES)}, got {obj.get('url')!r}"
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RowError(custom_id, "invalid_request", "body: a JSON object is required")
    return Row(custom_id, _validate(model, {**body, "stream": False}, custom_id))


def _plain(obj: dict[str, Any], record_id: str) -> Row:
    custom_id = obj.get("id", record_id)
    if not isinstance(custom_id, (str, int)) or isinstance(custom_id, bool):
        raise RowError(None, "invalid_request", "id: a string or an integer is required")
    custom_id = str(custom_id)
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


def error_record(record_id: str, custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    return {
        "id": record_id,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
