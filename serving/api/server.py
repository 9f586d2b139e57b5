"""`pathserve serve`: the HTTP and gRPC servers in front of one engine, from first byte to graceful exit.

1. The config is validated before anything else (the CLI did that).
2. The gRPC server (JetStream's API on grpc_port, unless 0) binds first: a port in use fails the
   start at once, exit status 2. Then uvicorn starts listening, so probes answer while weights
   load: /healthcheck and /startupz say 503 (gRPC HealthCheck `is_live: false`) until the engine is
   warmed up, then 200.
3. A loader thread loads the model, builds the engine, compiles every shape (warmup) and starts the
   orchestrator's device loop; a failure there is printed and the process exits non-zero. Both
   front-ends submit to that one orchestrator.
4. SIGTERM (or Ctrl-C): readiness turns 503 at once, new API requests get 503 (gRPC: UNAVAILABLE),
   requests and streams in flight on either front-end finish (up to drain_timeout_s), then both
   servers stop and the process exits 0. A second signal stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from types import FrameType

import uvicorn

from serving.api.app import create_app
from serving.api.state import ServerState
from serving.config import ConfigError, ServingConfig
from serving.errors import UserError

log = logging.getLogger(__name__)

API_KEY_ENV = "PATHSERVE_API_KEY"
DRAIN_POLL_S = 0.05
# After the drain, calls still open on the gRPC server get this long before they are cancelled.
GRPC_STOP_GRACE_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains instead of closing the listening socket."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._drain: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handler: that one re-raises the signal after shutdown (exit status -15).
        if self._drain is not None or not self.state.started:
            self.should_exit = True
            if self._drain is not None:
                self.force_exit = True
            return
        _say(f"received {signal.Signals(sig).name}: draining (up to {self.state.config.drain_timeout_s:g} s)")
        self.state.start_draining()
        self._drain = threading.Thread(target=self._wait_then_exit, name="drain", daemon=True)
        self._drain.start()

    def _wait_then_exit(self) -> None:
        state = self.state
        deadline = time.monotonic() + state.config.drain_timeout_s
        while time.monotonic() < deadline:
            orch = state.orchestrator
            if state.in_flight == 0 and (orch is None or not orch.has_work):
                break
            time.sleep(DRAIN_POLL_S)
        else:
            _say(f"drain timeout: {state.in_flight} requests still in flight are cut off")
        self.should_exit = True


def _bind(config: uvicorn.Config) -> socket.socket:
    """The listening socket, bound before anything says it listens or starts loading (a port in
    use, a host that does not resolve, a unix socket path that exists or whose folder does not:
    OSError, which `serve` answers with exit status 2); uvicorn serves on it. As uvicorn binds."""
    if config.uds is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(config.uds)
            os.chmod(config.uds, 0o666)  # uvicorn's: any local client may connect
        except OSError:
            sock.close()
            raise
        return sock
    family = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family=family, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((config.host, config.port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def grpc_socket(uds: str) -> str:
    """The gRPC address beside an HTTP unix socket `uds`: `unix:` + uds + ".grpc"."""
    return f"unix:{uds}.grpc"


def serve(
    cfg: ServingConfig,
    source: str | None,
    host: str,
    port: int,
    origins: Mapping[str, str] | None = None,
    uds: str | None = None,
) -> int:
    """Serve until SIGTERM; returns the process exit status (2 when the model cannot be loaded).
    `origins`: where each key of `cfg` came from (serving.launch.launch). `uds`: listen on this
    unix socket instead of host:port (a sidecar's or a gateway's; a TPU VM without TCP), gRPC on
    `grpc_socket(uds)` unless grpc_port=0."""
    state = ServerState(config=cfg.server, api_key=cfg.api_key or os.environ.get(API_KEY_ENV, ""))
    where = dict(uds=uds) if uds else dict(host=host, port=port)
    config = uvicorn.Config(
        create_app(state),
        **where,
        log_level="warning",
        timeout_graceful_shutdown=5,
        # The API answers 429 from its own queue; keep uvicorn from refusing connections first.
        backlog=4096,
    )
    server = _Server(config, state)
    try:
        listening = _bind(config)
    except OSError as exc:
        where = f"--uds {uds}" if uds else f"--host {host} --port {port}"
        print(f"pathserve serve: error: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        grpc_server = _start_grpc(state, host, port, grpc_socket(uds) if uds else None)
        metrics_server = _start_metrics(state, config.app, host, None if uds else port)
    except UserError as exc:
        listening.close()
        print(f"pathserve serve: error: {exc}", file=sys.stderr)
        return 2
    loader = threading.Thread(target=_load, args=(cfg, state, server, source, origins), name="loader", daemon=True)
    url = f"http+unix://{uds}" if uds else f"http://{host}:{port}"
    _say(f"listening on {url} (loading the model; /readyz says when to send requests)")
    loader.start()
    server.run(sockets=[listening])
    if grpc_server is not None:
        grpc_server.stop(0.0 if server.force_exit else GRPC_STOP_GRACE_S)
    if metrics_server is not None:
        metrics_server.shutdown()
    orch = state.orchestrator
    if orch is not None:
        orch.stop(timeout=10)
    if state.startup_error:
        print(f"pathserve serve: error: {state.startup_error}", file=sys.stderr)
        return 2 if not state.startup_error.startswith("internal:") else 1
    _say("stopped")
    return 0


def _start_grpc(state: ServerState, host: str, http_port: int, address: str | None = None):
    """JetStream's gRPC API on grpc_port, or on `address` (a `unix:` one beside --uds); None when
    grpc_port=0; raises UserError if it cannot bind."""
    port = state.config.grpc_port
    if port == 0:
        return None
    if port == http_port and address is None:
        raise ConfigError(f"grpc_port={port} is also the HTTP --port; give them different ports")
    from serving.grpc.server import GrpcServer

    grpc_server = GrpcServer(state, host, port, address).start()
    _say(f"gRPC (jetstream_proto.Orchestrator) on {grpc_server.address}")
    return grpc_server


def _start_metrics(state: ServerState, app, host: str, http_port: int | None):
    """MaxText's prometheus_port: the app's /metrics also on that port, alone (as JetStream's
    metrics server; prometheus-client's, answering any path); None when 0. Raises UserError if it
    cannot bind."""
    port = state.config.prometheus_port
    if port == 0:
        return None
    if port in (http_port, state.config.grpc_port):
        raise ConfigError(f"prometheus_port={port} is also the HTTP or gRPC port; give it a port of its own")
    from prometheus_client import start_http_server

    try:
        metrics_server, _thread = start_http_server(port, addr=host, registry=app.state.metrics_registry)
    except OSError as exc:
        raise ConfigError(f"prometheus_port={port}: cannot listen on {host}:{port} ({exc.strerror})") from None
    _say(f"metrics (prometheus_port) on http://{host}:{port}/metrics")
    return metrics_server


def _load(
    cfg: ServingConfig, state: ServerState, server: _Server, source: str | None, origins: Mapping[str, str] | None
) -> None:
    from serving.launch import launch

    try:
        launched = launch(cfg, source, origins)
    except UserError as exc:
        state.startup_error = str(exc)
        server.should_exit = True
        return
    except Exception as exc:  # reported, then the server exits non-zero
        log.exception("loading the model failed")
        state.startup_error = f"internal: loading the model failed: {exc!r}"
        server.should_exit = True
        return
    state.set_ready(launched.orchestrator, launched.model.config.name, launched.model_load_s, launched.startup_s)
    _say(f"ready: {launched.describe()}")


def _say(message: str) -> None:
    print(f"pathserve serve: {message}", file=sys.stderr, flush=True)
