"""The gate every request passes before a route: body size, bearer token, startup and drain state.

A pure ASGI middleware (no buffering of responses, so streams stay streams). It also counts
requests by route and status for /metrics and the API requests in flight, which the drain waits for.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.api.state import ServerState
from serving.openai.errors import error_body

GENERATION_ROUTES = frozenset({"/generate", "/v1/generate", "/v1/completions", "/v1/chat/completions"})
API_ROUTES = GENERATION_ROUTES | {"/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
OPEN_ROUTES = frozenset(
    {"/healthcheck", "/v1/health", "/startupz", "/readyz", "/livez", "/metrics", "/openapi.json", "/docs"}
)


class Gate:
    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        route = path if path in API_ROUTES or path in OPEN_ROUTES else "other"
        status_seen = 0

        async def counting_send(message: Message) -> None:
            nonlocal status_seen
            if message["type"] == "http.response.start":
                status_seen = message["status"]
            await send(message)

        state = self.state
        try:
            if path in API_ROUTES:
                refusal = self._refusal(scope, path)
                if refusal is not None:
                    await _send_error(counting_send, *refusal)
                    return
                bounded = await self._bounded_body(scope, receive, counting_send)
                if bounded is None:
                    return
                receive = bounded
                if scope["method"] == "POST":
                    scope = _as_json(scope)
            if path in GENERATION_ROUTES:
                with state.lock:
                    state.in_flight += 1
                try:
                    if state.orchestrator is not None:  # its requests are answered once the response is sent
                        with state.orchestrator.answer_scope():
                            await self.app(scope, receive, counting_send)
                    else:
                        await self.app(scope, receive, counting_send)
                finally:
                    with state.lock:
                        state.in_flight -= 1
            else:
                await self.app(scope, receive, counting_send)
        finally:
            state.count(route, status_seen or 500)

    def _refusal(self, scope: Scope, path: str) -> tuple[int, str, str, dict[str, str]] | None:
        state = self.state
        if state.api_key and not _authorized(scope, state.api_key):
            return (
                401,
                "a valid API key is required (Authorization: Bearer KEY)",
                "invalid_api_key",
                {"www-authenticate": "Bearer"},
            )
        if not state.started:
            return (
                503,
                "the model is still loading; retry when /readyz answers 200",
                "not_ready",
                {"retry-after": "5"},
            )
        if state.phase == "draining" and path in GENERATION_ROUTES:
            return 503, "the server is shutting down", "shutting_down", {}
        return None

    async def _bounded_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """Read the body up to max_request_body_bytes (413 beyond), then replay it to the route."""
        limit = self.state.config.max_request_body_bytes
        declared = dict(scope.get("headers", [])).get(b"content-length")
        too_large = (413, f"the request body exceeds {limit} bytes", "request_too_large", {})
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_error(send, *too_large)
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending everything
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await _send_error(send, *too_large)
                return None
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: waits for http.disconnect

        return replay


def _as_json(scope: Scope) -> Scope:
    """Bodies are JSON whatever the client declared (`curl -d` says form-urlencoded, some say nothing)."""
    headers = [(k, v) for k, v in scope.get("headers", []) if k != b"content-type"]
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


def _authorized(scope: Scope, api_key: str) -> bool:
    header = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


async def _send_error(send: Send, status: int, message: str, code: str, headers: dict[str, str]) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
