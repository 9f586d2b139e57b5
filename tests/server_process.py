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

__all__ = ["REPO", "ServerProcess", "free_port", "with_free_grpc_port"]

REPO = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`command` must listen on self.port; `wait_ready` records every /healthcheck status it saw."""

    def __init__(self, command: list[str], port: int, env: dict[str, str] | None = None, cwd: Path = REPO):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
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
        self.healthchecks: list[int] = []

    @classmethod
    def pathserve(cls, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        """`pathserve serve ARGS` on free ports, HTTP and gRPC (unless ARGS set grpc_port): the
        defaults, 8000 and 9000, would collide with servers running at once on the machine."""
        port = free_port()
        command = [sys.executable, "-m", "serving.cli", "serve", *with_free_grpc_port(args), "--port", str(port)]
        return cls(command, port, env)

    def wait_ready(self, timeout: float = 300) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status = httpx.get(f"{self.url}/healthcheck", timeout=5).status_code
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            self.healthchecks.append(status)
            if status == 200:
                return self
            time.sleep(0.1)
        raise TimeoutError(f"the server was not ready after {timeout} s:\n{self.output()}")

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


def with_free_grpc_port(args) -> list[str]:
    """`serve` arguments with `grpc_port` set to a free port unless they set it."""
    return [*args] if any(a.startswith("grpc_port=") for a in args) else [*args, f"grpc_port={free_port()}"]


def metric(server: ServerProcess, name: str, labels: str = "") -> float:
    """One sample of the server's /metrics (0 when absent); `labels` as written, e.g. '{code="200"}'."""
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for(condition, timeout: float, interval: float = 0.02) -> bool:
    """Poll `condition` until it holds or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
