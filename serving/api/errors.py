"""OpenAI-style error responses for every route (serving.openai.errors has the body's shape)."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from serving.openai.errors import APIError, describe_validation, error_body


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


async def api_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)


async def validation_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    """pydantic's complaints as one 400 naming the first bad field (OpenAI answers 400, not 422)."""
    assert isinstance(exc, RequestValidationError)
    message, param = describe_validation(exc.errors())
    return error_response(400, message, param=param)
