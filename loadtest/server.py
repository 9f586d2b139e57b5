"""Start a `pathserve serve` process for a benchmark and stop it afterwards (HTTP only from here)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

_GIVEN: set[int] = set()  # the ports free_port has handed out in this process


def free_port() -> int:
    """A loopback port the kernel says is free, never one this process was given before: the
    kernel may offer a just-released port again, and a server asked for its HTTP and gRPC ports
    by two calls once got the same one for both ("grpc_port=... is also the HTTP --port")."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError("the kernel offered no loopback port this process has not used")


class Server:
    """`pathserve serve ARGS` on a free loopback port; its log goes to `log_path`."""

    def __init__(self, args: list[str], log_path: Path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "serving.cli", "serve", *args, *self._grpc(args), "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=os.environ.copy(),
        )
        self.log_path = log_path

    @staticmethod
    def _grpc(args: list[str]) -> list[str]:
        """gRPC off unless ARGS set grpc_port: 9000 would collide between servers on one machine."""
        return [] if any(a.startswith("grpc_port=") for a in args) else ["grpc_port=0"]

    def wait_ready(self, timeout: float = 900) -> Server:
        """Until /readyz says ready and the background warmup has compiled its last shape (a
        benchmark measures a settled server, not one still compiling beside its requests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited ({self.process.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200 and not self._compiling():
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server was not ready after {timeout} s; see {self.log_path}")

    def _compiling(self) -> bool:
        """Whether /metrics reports shapes the background warmup has yet to compile."""
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith("pathserve_warmup_shapes_pending "):
                return float(line.split()[1]) > 0
        return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
