"""A grpc.aio server for `jetstream_proto.Orchestrator`, on a thread and event loop of its own.

`pathserve serve` starts it beside uvicorn before the model loads (HealthCheck answers
`is_live: false` meanwhile) and stops it after the HTTP server's drain. One event loop serves every
stream: an open Decode call costs a coroutine, not a thread. Its own loop keeps the HTTP loop's
latency independent of the gRPC traffic and lets it start and stop without touching uvicorn.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING

import grpc

from serving.errors import UserError
from serving.grpc import jetstream_pb2_grpc as pb_grpc
from serving.grpc.adapters import add_adapter_service
from serving.grpc.service import OrchestratorService

if TYPE_CHECKING:
    from serving.api.state import ServerState

START_TIMEOUT_S = 30.0
OPTIONS = [
    # Without this a second server on the same port would bind too, and take half the calls.
    ("grpc.so_reuseport", 0),
]


class GrpcServer:
    """`start()` binds `host:port`, or a `unix:PATH` address (or raises UserError), and serves until
    `stop()`."""

    def __init__(self, state: ServerState, host: str, port: int, address: str | None = None):
        self.state = state
        self.address = address or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        self.port = port  # the bound port once started (differs when `port` is 0)
        self._bound = threading.Event()
        self._error: str = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace_s = 0.0
        self._thread = threading.Thread(target=self._run, name="grpc", daemon=True)

    def start(self) -> GrpcServer:
        self._thread.start()
        if not self._bound.wait(START_TIMEOUT_S):
            raise UserError(f"grpc_port: the gRPC server did not start within {START_TIMEOUT_S:g} s")
        if self._error:
            raise UserError(self._error)
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop listening; calls still open get `grace_s` seconds, then are cancelled."""
        loop, stop = self._loop, self._stop
        if loop is None or stop is None or not self._thread.is_alive():
            return
        self._grace_s = grace_s
        loop.call_soon_threadsafe(stop.set)
        self._thread.join(grace_s + 5)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        server = grpc.aio.server(options=OPTIONS)
        pb_grpc.add_OrchestratorServicer_to_server(OrchestratorService(self.state), server)
        if self.state.config.max_loras:  # JetStream's adapter service (service v1)
            add_adapter_service(self.state, server)
        try:
            self.port = server.add_insecure_port(self.address)
        except RuntimeError as exc:
            where = "another socket path (--uds)" if self.address.startswith("unix:") else "another port"
            self._error = (
                f"grpc_port: cannot listen on {self.address} ({exc}); choose {where}, or grpc_port=0 to serve HTTP only"
            )
            self._bound.set()
            return
        await server.start()
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._bound.set()
        await self._stop.wait()
        await server.stop(self._grace_s)
