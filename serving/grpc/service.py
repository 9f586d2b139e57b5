"""The two calls of `jetstream_proto.Orchestrator`, answered from the same orchestrator as HTTP.

Decode passes the same checks as an HTTP generation request, in gRPC's terms: the model still
loading or the server draining -> UNAVAILABLE; a missing or wrong API key (when one is set) ->
UNAUTHENTICATED; a bad field -> INVALID_ARGUMENT naming it; a full admission queue ->
RESOURCE_EXHAUSTED (retry later); a `lora_adapter_id` the server does not know -> NOT_FOUND;
several samples -> UNIMPLEMENTED; a field an older JetStream client set (session_cache, priority) ->
INVALID_ARGUMENT. A stream that the engine could not finish ends INTERNAL (the device loop failed)
or NOT_FOUND (its adapter was unloaded while it waited), never OK with a short output. A stream
counts as a request in flight, so a SIGTERM drain waits for it; a client that cancels (or goes
away) cancels its request, which frees the decode slot at the next step.

HealthCheck's `is_live` is our liveness: true once the engine is warmed up and for as long as the
device loop keeps making progress (draining included: streams in flight are still being served).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from serving.errors import GenerationError, QueueFullError, ShuttingDownError, failure
from serving.grpc import decode
from serving.grpc import jetstream_pb2 as pb
from serving.grpc import jetstream_pb2_grpc as pb_grpc
from serving.lora.errors import UnknownAdapterError

if TYPE_CHECKING:
    from serving.api.state import ServerState
    from serving.orchestrator import RequestHandle


class OrchestratorService(pb_grpc.OrchestratorServicer):
    def __init__(self, state: ServerState):
        self.state = state

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeResponse]:
        state = self.state
        with state.lock:
            state.in_flight += 1
        try:
            try:
                handle, prompt = self._submit(request, context)
            except decode.RequestError as exc:
                await context.abort(exc.code, exc.message)  # raises: the call ends here
                return
            try:
                async for response in responses(handle, prompt):
                    yield response
            except decode.RequestError as exc:  # the request did not finish: its stream ends in an error status
                await context.abort(exc.code, exc.message)
        finally:
            with state.lock:
                state.in_flight -= 1

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        return pb.HealthCheckResponse(is_live=self.state.live)

    def _submit(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> tuple[RequestHandle, decode.Prompt]:
        """Check the call and the request, then queue it; raises decode.RequestError."""
        state = self.state
        if state.api_key and not authorized(context, state.api_key):
            raise decode.RequestError(
                grpc.StatusCode.UNAUTHENTICATED,
                "a valid API key is required (metadata authorization: Bearer KEY)",
            )
        if state.orchestrator is None:
            raise decode.RequestError(
                grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry when HealthCheck is live"
            )
        if state.phase == "draining":
            raise decode.RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        return submit(state, request)


def submit(state: ServerState, request: pb.DecodeRequest) -> tuple[RequestHandle, decode.Prompt]:
    """Check a DecodeRequest (gRPC's, or JetStream's HTTP /v1/generate parsed into one) and queue
    it on the running event loop; raises decode.RequestError. The caller has checked that the
    engine is up and the server not draining."""
    orchestrator = state.orchestrator
    assert orchestrator is not None
    decode.check_supported(request)
    prompt = decode.prompt(request, orchestrator.tokenizer)
    sampling = decode.sampling(request, orchestrator.tokenizer, state.config)
    try:
        handle = orchestrator.submit(prompt.ids, sampling, loop=asyncio.get_running_loop())
    except UnknownAdapterError as exc:
        raise decode.RequestError(grpc.StatusCode.NOT_FOUND, f"lora_adapter_id: {exc}") from None
    except GenerationError as exc:
        raise decode.refusal(exc, prompt) from None
    except QueueFullError as exc:
        raise decode.RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; retry later") from None
    except ShuttingDownError as exc:
        raise decode.RequestError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
    return handle, prompt


async def responses(handle: RequestHandle, prompt: decode.Prompt) -> AsyncIterator[pb.DecodeResponse]:
    """One message per delta; token ids that made no text yet (an end-of-sequence token) come last.

    Leaving early (the call was cancelled) closes the stream, which cancels the request. A request
    the engine could not finish raises decode.RequestError after its last message.
    """
    sent = 0
    async with contextlib.aclosing(handle.astream()) as deltas:
        async for delta in deltas:
            if not prompt.text_out and not delta.token_ids:
                continue  # text flushed at the end, which a token-content client does not read
            sent += len(delta.token_ids)
            yield decode.response(delta.text if prompt.text_out else "", delta.token_ids)
    completion = handle.completion
    assert completion is not None  # the stream ended, so the request has its final record
    if (error := failure([completion.finish_reason])) is not None:
        raise decode.failed(error)
    if len(completion.token_ids) > sent:
        yield decode.response("", completion.token_ids[sent:])


def authorized(context: grpc.aio.ServicerContext, api_key: str) -> bool:
    metadata = dict(context.invocation_metadata() or ())
    scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())
