"""JetStream's own HTTP server's routes (jetstream/entrypoints/http/api_server.py), beside the
sidecar's `/generate` and `/healthcheck` (serving.api.app):

- `POST /v1/generate`: a DecodeRequest as proto JSON (`{"max_tokens": 8, "text_content": {"text":
  "..."}}`, or `token_content`, `has_bos`, `lora_adapter_id`), answered as JetStream answers it: the
  DecodeResponse messages, each as protobuf's JSON, one after another as they are decoded. The
  request passes the gRPC call's checks (serving.grpc.service.submit): a bad or unknown field is a
  400 naming it, an unknown adapter 404, a full queue 429. A stream the engine could not finish
  ends with an OpenAI-style error object instead of its last message.
- `GET /v1/health`: `{"is_live": "True"}` (JetStream's string) with 200 while live, 503 not.

The proto's modules load at the first /v1/generate, not with the app: a process that imports the
app (a test's) may hold the same proto from a file of its own, and protobuf's one descriptor pool
takes each message once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.api.state import ServerState
from serving.openai.errors import APIError, error_body

if TYPE_CHECKING:
    from serving.grpc.decode import RequestError
    from serving.grpc.jetstream_pb2 import DecodeRequest

# gRPC's status codes (by name) as the HTTP statuses the other routes answer for the same refusals
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNIMPLEMENTED": 400,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "INTERNAL": 500,
}


def api_error(exc: RequestError) -> APIError:
    """A DecodeRequest's refusal (a gRPC status and a message naming the field) as an HTTP error."""
    status = HTTP_STATUS.get(exc.code.name, 500)
    field = exc.message.split(":", 1)[0] if status in (400, 404) and ":" in exc.message else None
    return APIError(status, exc.message, param=field, code=exc.code.name.lower())


def parse(body: bytes) -> DecodeRequest:
    """A DecodeRequest from proto JSON; a field the message does not define is a 400 naming it."""
    from google.protobuf import json_format

    from serving.grpc import jetstream_pb2 as pb

    try:
        return json_format.Parse(body or b"{}", pb.DecodeRequest())
    except json_format.ParseError as exc:
        raise APIError(400, f"not a JetStream DecodeRequest: {exc}") from None


def mount(app: FastAPI, state: ServerState, stream_headers: dict[str, str]) -> None:
    """Add JetStream's `/v1/generate` and `/v1/health` to `app`."""

    @app.post("/v1/generate", tags=["jetstream"])
    async def jetstream_decode(request: Request) -> Response:
        """JetStream's HTTP Decode: its DecodeResponse messages as protobuf JSON, streamed."""
        from google.protobuf import json_format

        from serving.grpc import decode, service

        try:
            handle, prompt = service.submit(state, parse(await request.body()))
        except decode.RequestError as exc:
            raise api_error(exc) from None

        async def messages() -> AsyncIterator[str]:
            try:
                async for response in service.responses(handle, prompt):
                    yield json_format.MessageToJson(response)
            except decode.RequestError as exc:  # the engine could not finish it
                error = api_error(exc)
                yield json.dumps(error_body(error.status, error.message, error.param, error.code))

        return StreamingResponse(messages(), media_type="text/event-stream", headers=stream_headers)

    @app.get("/v1/health", tags=["jetstream"])
    def jetstream_health() -> JSONResponse:
        """JetStream's HTTP health check: is_live as the string JetStream writes."""
        live = state.live
        return JSONResponse({"is_live": str(live)}, status_code=200 if live else 503)
