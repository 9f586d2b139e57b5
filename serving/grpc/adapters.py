"""JetStream's LoRA adapter service (multi_lora_decoding.proto, service `v1`) over the server's
adapter registry (serving.lora.registry): `models`, `load_lora_adapter`, `unload_lora_adapter`.

Registered on the gRPC port when adapters are configured (max_loras or lora_input_adapters_path).
The same gate as Decode: the API key when one is set (UNAUTHENTICATED), the model still loading
(UNAVAILABLE). An unknown adapter -> NOT_FOUND naming it; an adapter that cannot be read or does not
fit the base model, or a name already loaded -> INVALID_ARGUMENT with the reason. Reading an
adapter from storage runs off the event loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from serving.grpc import multi_lora_decoding_pb2 as pb
from serving.grpc import multi_lora_decoding_pb2_grpc as pb_grpc
from serving.grpc.service import authorized
from serving.lora.errors import AdapterError, UnknownAdapterError

if TYPE_CHECKING:
    from serving.api.state import ServerState

# Our adapter status -> JetStream's (AdapterStatus) and its loading cost.
STATUS = {"resident": ("loaded_hbm", 0), "host": ("loaded_cpu", 1), "storage": ("unloaded", 2)}


def add_adapter_service(state: ServerState, server: grpc.aio.Server) -> None:
    pb_grpc.add_v1Servicer_to_server(AdapterService(state), server)


class AdapterService(pb_grpc.v1Servicer):
    def __init__(self, state: ServerState):
        self.state = state

    async def models(self, request: pb.ListAdaptersRequest, context: grpc.aio.ServicerContext) -> pb.ListAdaptersResponse:
        registry = await self._registry(context)
        infos = []
        for adapter in registry.list():
            status, cost = STATUS[adapter.status]
            infos.append(
                pb.AdapterInfo(
                    adapter_id=adapter.name,
                    loading_cost=cost,
                    size_hbm=adapter.nbytes if adapter.status == "resident" else 0,
                    size_cpu=adapter.nbytes if adapter.status != "storage" else 0,
                    last_accessed=adapter.last_access,
                    status=status,
                )
            )
        return pb.ListAdaptersResponse(success=True, adapter_infos=infos)

    async def load_lora_adapter(
        self, request: pb.LoadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadAdapterResponse:
        registry = await self._registry(context)
        if not request.adapter_id or not request.adapter_path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "adapter_id and adapter_path are required")
        try:
            await asyncio.to_thread(registry.load, request.adapter_id, request.adapter_path)
        except AdapterError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.LoadAdapterResponse(success=True)

    async def unload_lora_adapter(
        self, request: pb.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadAdapterResponse:
        registry = await self._registry(context)
        try:
            registry.unload(request.adapter_id)
        except UnknownAdapterError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter_id: {exc}")
        return pb.UnloadAdapterResponse(success=True)

    async def _registry(self, context: grpc.aio.ServicerContext):
        """The orchestrator's adapter registry, or the call aborted (key, loading)."""
        state = self.state
        if state.api_key and not authorized(context, state.api_key):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required (metadata authorization: Bearer KEY)"
            )
        orchestrator = state.orchestrator
        if orchestrator is None or orchestrator.adapters is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry when HealthCheck is live")
        return orchestrator.adapters
