"""The FastAPI application: JetStream's and OpenAI's routes, probes and metrics over one orchestrator.

Every API request passes the gate first (body size, bearer token, startup and drain state), then is
validated (`protocol`), tokenized and submitted; tokens come back on the event loop (no thread per
request) and go out as one JSON body, server-sent events (OpenAI) or JSON lines (JetStream). A client
that goes away cancels its request, which frees its decode slot at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.api import jetstream, lora, playground, prometheus
from serving.api.errors import api_error_handler, error_response, validation_error_handler
from serving.api.gate import Gate
from serving.api.state import ServerState
from serving.errors import GenerationError, QueueFullError, ShuttingDownError, failure
from serving.lora.errors import UnknownAdapterError
from serving.openai import convert, ignored
from serving.openai.errors import APIError, error_body
from serving.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from serving.openai.streaming import ChoiceStream

if TYPE_CHECKING:
    from serving.orchestrator import Completion, RequestHandle
    from serving.request import SamplingParams

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

    # -- probes -----------------------------------------------------------------------------

    @app.get("/healthcheck", tags=["probes"])
    def healthcheck() -> JSONResponse:
        """JetStream's health check (its HTTP sidecar's): 200 while live (weights loaded, warmup
        compiled, the device loop making progress: gRPC HealthCheck's `is_live`), 503 not."""
        live = state.live
        return JSONResponse({"response": {"is_live": live}}, status_code=200 if live else 503)

    @app.get("/startupz", tags=["probes"])
    def startupz() -> JSONResponse:
        """Startup probe: weights loaded and the warmup's shapes compiled (the background ones may still be compiling)."""
        return _probe(state.started, state.startup_error or ("started" if state.started else "starting"))

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
        if stalled > state.config.liveness_timeout_s:
            return _probe(False, f"the device loop made no progress for {stalled:.0f} s")
        return _probe(True, "alive")

    def snapshot() -> prometheus.Scrape:
        orch = state.orchestrator
        with state.lock:
            http_requests = dict(state.http_requests)
        return prometheus.Scrape(
            orch.metrics if orch else None, http_requests, state.unknown_fields.counts(),
            state.model_name, state.model_load_s, state.startup_s,
        )

    metrics_registry = prometheus.registry(snapshot)
    app.state.metrics_registry = metrics_registry  # also served on prometheus_port (serving.api.server)

    @app.get("/metrics", tags=["probes"])
    def metrics() -> Response:
        return Response(prometheus.render(metrics_registry), media_type=prometheus.CONTENT_TYPE)

    # -- JetStream --------------------------------------------------------------------------

    @app.post("/generate", tags=["jetstream"])
    async def jetstream_generate(body: GenerateRequest, request: Request) -> Response:
        """JetStream's generate (its HTTP sidecar's): `{"response": text}`, or JSON lines `{"text":
        delta}` then a final record (with `"text": ""`); a generation the engine could not finish is
        an error (500, or 404 for an adapter unloaded meanwhile; streamed: a last line `{"error"}`)."""
        state.unknown_fields.check(body)
        tokenizer = state.tokenizer
        prompt_ids = tokenizer.encode_prompt(body.prompt)
        # Without sampling fields, as JetStream's Decode behind the sidecar: the server's MaxText
        # decode_sampling_* keys (greedy by default)
        given = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
        defaults = state.config.decode_sampling() if all(v is None for v in given.values()) else {}
        sampling = convert.sampling(
            tokenizer,
            body.ignore_eos,
            max_tokens=body.max_tokens,
            temperature=defaults.get("temperature", body.temperature or 0.0),
            top_p=defaults.get("top_p", body.top_p),
            top_k=defaults.get("top_k", body.top_k),
            seed=body.seed if body.seed is not None else defaults.get("seed", 0),
        )
        handle = _submit(state, prompt_ids, sampling, body.stop_strings(), "prompt")

        def final(c: Completion) -> dict[str, Any]:
            return {"response": c.text, "finish_reason": c.finish_reason, "usage": convert.usage(c)}

        if not body.stream:
            completion = await _complete(handle, request)
            _raise_failure([completion])
            return JSONResponse(final(completion), headers=ignored.headers(body))

        async def lines() -> AsyncIterator[str]:
            async with _reading(handle) as deltas:
                async for delta in deltas:
                    yield json.dumps({"text": delta.text}) + "\n"
            if (error := _failure([handle.completion])) is not None:
                yield json.dumps(_error_record(error)) + "\n"
            else:  # a client reading every line's "text" reads the last one's too
                yield json.dumps({"text": "", **final(handle.completion)}) + "\n"

        return StreamingResponse(
            lines(), media_type="application/x-ndjson", headers=STREAM_HEADERS | ignored.headers(body)
        )

    jetstream.mount(app, state, STREAM_HEADERS)  # JetStream's own HTTP server's /v1/generate and /v1/health

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
                    "max_model_len": state.config.max_target_length,
                },
                *lora.model_entries(state),
            ],
        }

    @app.post("/v1/completions", tags=["openai"])
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _openai(state, body, request)

    @app.post("/v1/chat/completions", tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _openai(state, body, request)

    lora.mount(app, state)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter
    playground.mount(app)  # GET /: the web playground (serving/api/static/)
    return app


# -- helpers ------------------------------------------------------------------------------------


async def _openai(state: ServerState, body: convert.OpenAIRequest, request: Request) -> Response:
    """Both OpenAI generation routes: submit (n choices), then one body or server-sent events."""
    state.unknown_fields.check(body)
    assert state.orchestrator is not None  # the gate answers 503 before that
    adapter = convert.adapter_of(body.model, state.model_name, state.orchestrator.adapters)
    tokenizer = state.tokenizer
    ids = convert.prompt_ids(body, tokenizer, state.config.max_target_length)
    params = convert.openai_sampling(body, tokenizer, len(ids), state.config.max_target_length)
    params = dataclasses.replace(params, adapter=adapter)
    submit = (state, ids, params, body.stop_strings(), convert.prompt_param(body), asyncio.get_running_loop())
    if params.grammar is not None:  # compiling a grammar (the first time: importing its library) takes a while
        handles = await asyncio.to_thread(_submit_choices, *submit)
    else:
        handles = _submit_choices(*submit)
    chat = isinstance(body, ChatCompletionRequest)
    said = ignored.headers(body, convert.unread_fields(body, tokenizer))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created, model = int(time.time()), adapter or state.model_name
    if not body.stream:
        completions = await _complete_all(handles, request)
        _raise_failure(completions)
        return JSONResponse(
            convert.response_body(body, rid, created, model, completions, ids, tokenizer), headers=said
        )
    streams = [ChoiceStream(body, (rid, created, model), tokenizer, ids, h) for h in handles]

    def usage(completions: list[Completion]) -> Iterable[dict[str, Any]]:
        if body.stream_options and body.stream_options.include_usage:
            record = convert.chat_chunk if chat else convert.completion_chunk
            yield record(rid, created, model, {} if chat else "", None) | {
                "choices": [],
                "usage": convert.usage(completions),
            }

    return _sse(streams, usage, said)


def _probe(ok: bool, status: str) -> JSONResponse:
    return JSONResponse({"status": status}, status_code=200 if ok else 503)


async def _http_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


def _submit(
    state: ServerState,
    prompt_ids: list[int],
    sampling: SamplingParams,
    stops: tuple[str, ...],
    prompt_param: str,
) -> RequestHandle:
    return _submit_choices(state, prompt_ids, sampling, stops, prompt_param, asyncio.get_running_loop())[0]


def _submit_choices(
    state: ServerState,
    prompt_ids: list[int],
    sampling: SamplingParams,
    stops: tuple[str, ...],
    prompt_param: str,
    loop: asyncio.AbstractEventLoop,
) -> list[RequestHandle]:
    """Submit a request of `sampling.n` choices (delivered onto `loop`); orchestrator errors
    become OpenAI errors."""
    assert state.orchestrator is not None  # the gate answers 503 before that
    try:
        return state.orchestrator.submit_choices(prompt_ids, sampling, stops, loop=loop)
    except UnknownAdapterError as exc:  # unloaded since the request was checked
        raise APIError(404, str(exc), param="model", code="model_not_found") from None
    except GenerationError as exc:
        param = prompt_param if exc.field == "prompt" else exc.field  # "prompt" or "messages"
        raise APIError(400, str(exc), param=param, code=exc.code) from None
    except QueueFullError as exc:
        raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": RETRY_AFTER_S}) from None
    except ShuttingDownError as exc:
        raise APIError(503, str(exc), code="shutting_down") from None


@contextlib.asynccontextmanager
async def _reading(handle: RequestHandle):
    """The request's deltas; leaving early (the client went away) cancels the request."""
    async with contextlib.aclosing(handle.astream()) as deltas:
        yield deltas


async def _complete(handle: RequestHandle, request: Request) -> Completion:
    """Wait for the whole completion, cancelling the request if the client disconnects meanwhile."""
    return (await _complete_all([handle], request))[0]


async def _complete_all(handles: list[RequestHandle], request: Request) -> list[Completion]:
    """Every choice's completion, in order; a client that disconnects cancels them all."""

    async def one(handle: RequestHandle) -> Completion:
        async with _reading(handle) as deltas:
            async for _ in deltas:
                pass
        assert handle.completion is not None
        return handle.completion

    async def drain() -> list[Completion]:
        return list(await asyncio.gather(*(one(h) for h in handles)))

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
    streams: list[ChoiceStream],
    usage: Callable[[list[Completion]], Iterable[dict[str, Any]]],
    headers: dict[str, str],
) -> StreamingResponse:
    """OpenAI's server-sent events: each choice's chunks as its tokens arrive (choices interleaved),
    the usage chunk if asked, then `[DONE]`. A client that goes away cancels every choice; a choice
    the engine could not finish ends the stream with an error record (`{"error": ...}`, as vLLM
    streams one) and `[DONE]`, its other choices cancelled."""

    async def events() -> AsyncIterator[str]:
        arrived: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with _reading(streams[i].handle) as deltas:
                    async for delta in deltas:
                        await arrived.put((i, delta))
            finally:
                arrived.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        try:
            for stream in streams:
                for record in stream.opening():
                    yield _event(record)
            remaining, error = len(streams), None
            while remaining and error is None:  # a choice the engine could not finish ends the stream
                i, delta = await arrived.get()
                if delta is not None:
                    records = streams[i].delta(delta)
                else:
                    remaining -= 1
                    error = _failure([streams[i].handle.completion])
                    records = [_error_record(error)] if error else streams[i].final(streams[i].handle.completion)
                for record in records:
                    yield _event(record)
            if error is None:
                for record in usage([s.handle.completion for s in streams]):
                    yield _event(record)
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    return StreamingResponse(events(), media_type="text/event-stream", headers=STREAM_HEADERS | headers)


def _failure(completions: Iterable[Completion]) -> APIError | None:
    """The error to answer instead of a request's completions, when the engine did not finish one
    (serving.errors.failure): 500 when the device loop failed, 404 when the request's adapter was
    unloaded while it waited; None when every choice finished."""
    failed = failure(c.finish_reason for c in completions)
    if failed is None:
        return None
    if failed.kind == "adapter":
        return APIError(404, str(failed), param="model", code="model_not_found")
    return APIError(500, str(failed), code="engine_error")


def _raise_failure(completions: Iterable[Completion]) -> None:
    if (error := _failure(completions)) is not None:
        raise error


def _error_record(error: APIError) -> dict[str, Any]:
    """A stream's last record when its request failed after its answer began (the status was sent)."""
    return error_body(error.status, error.message, error.param, error.code)


def _event(record: dict[str, Any]) -> str:
    return f"data: {json.dumps(record, ensure_ascii=False)}\n\n"
