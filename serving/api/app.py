"""The FastAPI application: JetStream's and OpenAI's routes, probes and metrics over one orchestrator.

Every API request passes the gate first (body size, bearer token, startup and drain state), then is
validated (`protocol`), tokenized and submitted; tokens come back on the event loop (no thread per
request) and go out as one JSON body, server-sent events (OpenAI) or JSON lines (JetStream). A client
that goes away cancels its request, which frees its decode slot at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.api import prometheus
from serving.api.errors import APIError, api_error_handler, error_response, validation_error_handler
from serving.api.gate import Gate
from serving.api.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from serving.api.state import ServerState
from serving.chat_templates import ChatTemplateError
from serving.errors import GenerationError, QueueFullError, ShuttingDownError
from serving.request import SamplingParams

if TYPE_CHECKING:
    from serving.orchestrator import Completion, RequestHandle

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
RETRY_AFTER_S = "1"
# How often a non-streaming request checks whether its client is still there.
DISCONNECT_POLL_S = 0.25


def create_app(state: ServerState) -> FastAPI:
    """The app over `state`; routes answer 503 until `state` says the engine is ready."""
    app = FastAPI(title="pathserve", summary="LLM inference server (JetStream and OpenAI APIs)")
    app.add_middleware(Gate, state=state)
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.state.server = state

    # -- probes -----------------------------------------------------------------------------

    @app.get("/healthcheck", tags=["probes"])
    def healthcheck() -> JSONResponse:
        """JetStream's health check: 200 once weights are loaded and warmup is compiled."""
        return JSONResponse(
            {"response": {"is_live": state.started}}, status_code=200 if state.started else 503
        )

    @app.get("/startupz", tags=["probes"])
    def startupz() -> JSONResponse:
        """Startup probe: weights loaded and every shape compiled."""
        return _probe(state.started, "starting" if not state.startup_error else state.startup_error)

    @app.get("/readyz", tags=["probes"])
    def readyz() -> JSONResponse:
        """Readiness: started, not draining, admission queue not full."""
        if not state.started:
            return _probe(False, "starting")
        if state.phase == "draining":
            return _probe(False, "draining")
        if state.queue_full():
            return _probe(False, "admission queue full")
        return _probe(True, "ready")

    @app.get("/livez", tags=["probes"])
    def livez() -> JSONResponse:
        """Liveness: the device loop made progress within liveness_timeout_s while work waits."""
        stalled = state.stalled_for()
        if stalled > state.cfg.liveness_timeout_s:
            return _probe(False, f"the device loop made no progress for {stalled:.0f} s")
        return _probe(True, "alive")

    @app.get("/metrics", tags=["probes"])
    def metrics() -> Response:
        orch = state.orchestrator
        text = prometheus.render(orch.metrics if orch else None, dict(state.http_requests))
        return Response(text, media_type=prometheus.CONTENT_TYPE)

    # -- JetStream --------------------------------------------------------------------------

    @app.post("/generate", tags=["jetstream"])
    async def generate(body: GenerateRequest, request: Request) -> Response:
        """JetStream's generate: `{"response": text}`, or JSON lines `{"text": delta}` then a final record."""
        tokenizer = state.tokenizer
        prompt_ids = tokenizer.encode_prompt(body.prompt)
        sampling = _sampling(
            state,
            body.ignore_eos,
            max_tokens=body.max_tokens,
            temperature=body.temperature or 0.0,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=body.seed if body.seed is not None else 0,
        )
        handle = _submit(state, prompt_ids, sampling, body.stop_strings(), "prompt")

        def final(c: Completion) -> dict[str, Any]:
            return {"response": c.text, "finish_reason": c.finish_reason, "usage": _usage(c)}

        if not body.stream:
            completion = await _complete(handle, request)
            return JSONResponse(final(completion))

        async def lines() -> AsyncIterator[str]:
            async with _reading(handle) as deltas:
                async for delta in deltas:
                    yield json.dumps({"text": delta.text}) + "\n"
            yield json.dumps(final(handle.completion)) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson", headers=STREAM_HEADERS)

    # -- OpenAI -----------------------------------------------------------------------------

    @app.get("/v1/models", tags=["openai"])
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "pathserve",
                    "max_model_len": state.cfg.max_target_length,
                }
            ],
        }

    @app.post("/v1/completions", tags=["openai"])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        prompt = body.single_prompt()
        tokenizer = state.tokenizer
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode_prompt(prompt)
        else:
            prompt_ids = _check_token_ids(prompt, tokenizer.vocab_size)
        max_tokens = body.max_tokens or max(1, state.cfg.max_target_length - len(prompt_ids))
        handle = _submit(
            state, prompt_ids, _openai_sampling(state, body, max_tokens), body.stop_strings(), "prompt"
        )
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name

        def chunk(text: str, finish_reason: str | None) -> dict[str, Any]:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            return {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }

        if not body.stream:
            c = await _complete(handle, request)
            return JSONResponse(chunk(c.text, c.finish_reason) | {"usage": _usage(c)})

        def finals(c: Completion) -> Iterable[dict[str, Any]]:
            yield chunk("", c.finish_reason)
            if body.stream_options and body.stream_options.include_usage:
                yield chunk("", None) | {"choices": [], "usage": _usage(c)}

        return _sse(handle, lambda text: chunk(text, None), finals)

    @app.post("/v1/chat/completions", tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt_ids = state.tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from None
        limit = body.limit()
        max_tokens = limit if limit is not None else max(1, state.cfg.max_target_length - len(prompt_ids))
        param = "messages"
        handle = _submit(
            state, prompt_ids, _openai_sampling(state, body, max_tokens), body.stop_strings(), param
        )
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name

        def chunk(delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [choice],
            }

        if not body.stream:
            c = await _complete(handle, request)
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            return JSONResponse(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": _usage(c),
                }
            )

        def finals(c: Completion) -> Iterable[dict[str, Any]]:
            yield chunk({}, c.finish_reason)
            if body.stream_options and body.stream_options.include_usage:
                yield chunk({}, None) | {"choices": [], "usage": _usage(c)}

        return _sse(
            handle,
            lambda text: chunk({"content": text}, None),
            finals,
            first=chunk({"role": "assistant", "content": ""}, None),
        )

    return app


# -- helpers ------------------------------------------------------------------------------------


def _probe(ok: bool, status: str) -> JSONResponse:
    return JSONResponse({"status": status}, status_code=200 if ok else 503)


async def _http_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


def _check_model(state: ServerState, model: str | None) -> None:
    if model and model != state.model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _check_token_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise APIError(
            400, f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt"
        )
    return ids


def _sampling(state: ServerState, ignore_eos: bool, **values: Any) -> SamplingParams:
    top_k = values.pop("top_k") or 0
    top_p = values.pop("top_p")
    seed = values.pop("seed") % (1 << 32)  # any int64 is a valid OpenAI seed; keys take 32 bits
    try:
        return SamplingParams(
            **values,
            seed=seed,
            top_k=max(0, top_k),
            top_p=1.0 if top_p is None else top_p,
            stop_ids=() if ignore_eos else state.tokenizer.eos_ids,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split()[0]) from None


def _openai_sampling(
    state: ServerState, body: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingParams:
    # OpenAI's defaults: temperature 1; no seed means a fresh one per request.
    seed = body.seed if body.seed is not None else secrets.randbits(31)
    return _sampling(
        state,
        body.ignore_eos,
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=seed,
    )


def _submit(
    state: ServerState,
    prompt_ids: list[int],
    sampling: SamplingParams,
    stops: tuple[str, ...],
    prompt_param: str,
) -> RequestHandle:
    assert state.orchestrator is not None  # the gate answers 503 before that
    try:
        return state.orchestrator.submit(prompt_ids, sampling, stops, loop=asyncio.get_running_loop())
    except GenerationError as exc:
        message = str(exc)
        param = "max_tokens" if "max_tokens" in message and "prompt (" in message else prompt_param
        raise APIError(
            400,
            message,
            param=param,
            code="context_length_exceeded" if "exceeds" in message or "more than" in message else None,
        ) from None
    except QueueFullError as exc:
        raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": RETRY_AFTER_S}) from None
    except ShuttingDownError as exc:
        raise APIError(503, str(exc), code="shutting_down") from None


def _usage(c: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
    }


@contextlib.asynccontextmanager
async def _reading(handle: RequestHandle):
    """The request's deltas; leaving early (the client went away) cancels the request."""
    async with contextlib.aclosing(handle.astream()) as deltas:
        yield deltas


class _ClientGone(Exception):
    pass


async def _complete(handle: RequestHandle, request: Request) -> Completion:
    """Wait for the whole completion, cancelling the request if the client disconnects meanwhile."""

    async def drain() -> Completion:
        async with _reading(handle) as deltas:
            async for _ in deltas:
                pass
        assert handle.completion is not None
        return handle.completion

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "the client closed the request", code="client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _sse(
    handle: RequestHandle,
    chunk: Callable[[str], dict[str, Any]],
    finals: Callable[[Completion], Iterable[dict[str, Any]]],
    first: dict[str, Any] | None = None,
) -> StreamingResponse:
    """OpenAI's server-sent events: one `data:` line per delta, the final chunks, then `[DONE]`."""

    async def events() -> AsyncIterator[str]:
        if first is not None:
            yield _event(first)
        async with _reading(handle) as deltas:
            async for delta in deltas:
                yield _event(chunk(delta.text))
        for record in finals(handle.completion):
            yield _event(record)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers=STREAM_HEADERS)


def _event(record: dict[str, Any]) -> str:
    return f"data: {json.dumps(record, ensure_ascii=False)}\n\n"
