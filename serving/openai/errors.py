"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, as plain data (no
HTTP framework): raised by the translation layer, answered by the HTTP routes, written by batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with `status` and an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param, "code": code}}


def describe_validation(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """(message, param) for pydantic errors: the first bad field by name, and how many more."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [_name(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None
    param = ".".join(loc) or None
    if param is None and ":" in message:  # model validators name their field first: "n: only n=1 ..."
        param = message.split(":", 1)[0].split()[0]
    text = f"{param}: {message}" if param and not message.startswith(f"{param}:") else message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problems)"
    return text, param


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member that failed ('str', 'list[int]', ...): not a field."""
    return isinstance(part, str) and (
        not part.isidentifier() or part in {"str", "int", "float", "bool", "list"}
    )


def _name(part: object) -> str:
    return f"[{part}]" if isinstance(part, int) else str(part)
