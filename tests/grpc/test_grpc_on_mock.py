"""JetStream's gRPC API on the mock engine (tests/unit/grpc_on_mock.py, in a process of its own;
here, not in the unit tier: the process costs a second)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_grpc_decode_health_and_status_codes_on_the_mock_engine():
    run = subprocess.run(
        [sys.executable, "-m", "tests.unit.grpc_on_mock"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
