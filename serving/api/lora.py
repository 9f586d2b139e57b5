"""vLLM's adapter routes: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API
key, like every API route), and the adapters' entries of GET /v1/models (`parent`: the base model).
They talk to the orchestrator's adapter registry only (serving.lora.registry)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from starlette.responses import PlainTextResponse

from serving.api.state import ServerState
from serving.lora.errors import AdapterError, UnknownAdapterError
from serving.openai.errors import APIError
from serving.openai.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest


def mount(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/load_lora_adapter", tags=["openai"])
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        state.unknown_fields.check(body)
        registry = _registry(state)
        try:
            await asyncio.to_thread(registry.load, body.lora_name, body.lora_path)
        except AdapterError as exc:
            raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", tags=["openai"])
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        state.unknown_fields.check(body)
        try:
            _registry(state).unload(body.lora_name)
        except UnknownAdapterError as exc:
            raise APIError(404, str(exc), param="lora_name", code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def model_entries(state: ServerState) -> list[dict[str, Any]]:
    """/v1/models entries of the adapters, as vLLM lists them, with where each is now (`status`:
    resident on the device, in host memory, or to be read from storage)."""
    orchestrator = state.orchestrator
    if orchestrator is None or orchestrator.adapters is None:
        return []
    return [
        {
            "id": adapter.name,
            "object": "model",
            "created": state.created,
            "owned_by": "pathserve",
            "root": adapter.path,
            "parent": state.model_name,
            "max_model_len": state.config.max_target_length,
            "status": adapter.status,
        }
        for adapter in orchestrator.adapters.list()
    ]


def _registry(state: ServerState):
    orchestrator = state.orchestrator
    assert orchestrator is not None  # the gate answers 503 before that
    if orchestrator.adapters is None:
        raise APIError(400, "LoRA adapters are not served: start the server with max_loras=N (or lora_input_adapters_path)")
    return orchestrator.adapters
