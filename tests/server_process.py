"""A real `pathserve serve` process on loopback for tests: start, wait until ready, stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.server import free_port
from tests.xla_flags import tiny_model_flags

__all__ = ["REPO", "ServerProcess", "free_port", "grpc_is_live", "with_free_grpc_port"]

REPO = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`command` must listen on self.port; `wait_ready` records every /healthcheck status it saw."""

    def __init__(
        self, command: list[str], port: int, env: dict[str, str] | None = None, cwd: Path = REPO, uds: str | None = None
    ):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.uds = uds  # a server on a unix socket (`serve --uds`): every poll goes through it
        self._http = httpx.Client(transport=httpx.HTTPTransport(uds=uds)) if uds else httpx
        # Kept after stop() for assertions; in the test session's scratch directory, removed with it.
        logs = Path(os.environ.get("PATHSERVE_TEST_SCRATCH") or tempfile.gettempdir()) / "server-logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the process
            "w+", prefix="pathserve-serve-", suffix=".log", dir=logs, delete=False
        )
        self.proc = subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # signals go to the server (and make's children), not to pytest
        )
        self.healthchecks: list[int] = []  # every /healthcheck status wait_ready saw
        # With a gRPC address: (HealthCheck's is_live, /healthcheck's status) at each of those polls.
        self.grpc_address: str | None = None
        self.health_while_starting: list[tuple[bool, int]] = []

    @classmethod
    def pathserve(cls, *args: str, env: dict[str, str] | None = None, quick_compile: bool = True) -> ServerProcess:
        """`pathserve serve ARGS` of a tiny model on free ports, HTTP and gRPC (unless ARGS set
        grpc_port): the defaults, 8000 and 9000, would collide with servers running at once on the
        machine; with `enable_background_warmup=false` unless ARGS set it. `quick_compile`: at
        XLA's optimization level 0 (tests/xla_flags.py: a few requests' programs compile in half
        the time); False for a server that runs many (the shared tiny server's schemathesis run took
        123 s at level 0, 16 s at XLA's default)."""
        port = free_port()
        env = dict(env or {})
        if quick_compile:
            env["XLA_FLAGS"] = tiny_model_flags(env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")))
        args = with_free_grpc_port(args)
        # No background warmup unless a test asks for it: minutes of compiling at the lowest
        # priority on the two cores the rest of the suite runs on (serving/engine/warmup.py).
        if not any(a.startswith("enable_background_warmup=") for a in args):
            args = [*args, "enable_background_warmup=false"]
        command = [sys.executable, "-m", "serving.cli", "serve", *args, "--port", str(port)]
        process = cls(command, port, env)
        grpc_port = next(a.split("=", 1)[1] for a in args if a.startswith("grpc_port="))
        process.grpc_address = f"127.0.0.1:{grpc_port}" if int(grpc_port) else None
        return process

    @classmethod
    def pathserve_uds(cls, uds: str, *args: str) -> ServerProcess:
        """`pathserve serve ARGS --uds UDS` of a tiny model (gRPC on unix:UDS.grpc), at XLA's
        optimization level 0 and without the background warmup."""
        env = {"XLA_FLAGS": tiny_model_flags(os.environ.get("XLA_FLAGS", ""))}
        command = [sys.executable, "-m", "serving.cli", "serve", *args, "enable_background_warmup=false", "--uds", uds]
        process = cls(command, 0, env, uds=uds)
        process.url = "http://pathserve"  # any host: the transport goes to the socket
        process.grpc_address = f"unix:{uds}.grpc"
        return process

    def wait_ready(self, timeout: float = 300, grpc: bool = False) -> ServerProcess:
        """Poll /healthcheck until ready, recording each status; with `grpc`, HealthCheck on the
        gRPC address too (ready when both say so), recording the pairs."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status = self._http.get(f"{self.url}/healthcheck", timeout=5).status_code
                live = grpc_is_live(self.grpc_address) if grpc else None
            except (httpx.TransportError, ConnectionError):
                time.sleep(0.05)
                continue
            self.healthchecks.append(status)
            if live is not None:
                self.health_while_starting.append((live, status))
            if status == 200 and live is not False:
                return self
            time.sleep(0.05)
        output = self.output()
        self.stop(timeout=10)  # a server left running would hold its cores for the rest of the session
        raise TimeoutError(f"the server was not ready after {timeout} s:\n{output}")

    def output(self) -> str:
        return Path(self.log.name).read_text()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def grpc_is_live(address: str, timeout: float = 2) -> bool:
    """JetStream's HealthCheck, called without stubs: tests/grpc/ generates its own copy of the
    proto's messages, and protobuf's one descriptor pool refuses a second (tests/grpc/conftest.py).
    HealthCheckRequest is empty; the response's only field is `bool is_live = 1`, so its bytes
    are b"" (false) or b"\\x08\\x01". Raises ConnectionError while nothing answers."""
    import grpc

    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(
            "/jetstream_proto.Orchestrator/HealthCheck",
            request_serializer=lambda _: b"",
            response_deserializer=lambda data: data,
        )
        try:
            return call(None, timeout=timeout) == b"\x08\x01"
        except grpc.RpcError as exc:
            raise ConnectionError(f"gRPC HealthCheck on {address}: {exc.code()}") from None


def with_free_grpc_port(args) -> list[str]:
    """`serve` arguments with `grpc_port` set to a free port unless they set it."""
    return [*args] if any(a.startswith("grpc_port=") for a in args) else [*args, f"grpc_port={free_port()}"]


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics (0 when absent); `labels` as written, e.g. '{code="200"}';
    without them, the name's first series whatever its labels (a jetstream_* one carries JetStream's
    id and model_name)."""
    text = httpx.get(f"{server.url}/metrics").text
    written = re.escape(labels) if labels else r"(?:\{[^}]*\})?"
    match = re.search(rf"^{re.escape(name)}{written} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for(condition, timeout: float, interval: float = 0.02) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
