"""JetStream's own HTTP server's /v1/generate and /v1/health on the mock engine, in a process of its
own (tests/unit/jetstream_http_on_mock.py): the route loads the server's proto modules, which the
stubs tests/grpc generates cannot share a process with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_jetstreams_own_http_server_routes():
    """/v1/generate in a process of its own (tests/unit/jetstream_http_on_mock.py): the route loads
    the server's proto modules, which the stubs tests/grpc generates cannot share a process with."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.unit.jetstream_http_on_mock"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
