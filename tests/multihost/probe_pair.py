"""Run a probe script as the two processes of a multi-controller group on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.server_process import REPO, free_port
from tests.xla_flags import cpu_devices


def run_probe_pair(probe: Path, first: str, rest: list[str] = (), env: dict[str, str] | None = None,
                   timeout: float = 300) -> list[dict]:
    """`python probe FIRST PROCESS_ID COORDINATOR_PORT *REST` as processes 0 and 1 at once, 4 virtual
    CPU devices each (one 8-device group); each must exit 0 and print one JSON object starting
    `{"process"`: returned in process order."""
    port = free_port()
    env = {**os.environ, **(env or {}), **cpu_devices(4)}
    processes = [
        subprocess.Popen([sys.executable, str(probe), first, str(i), str(port), *rest], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in (0, 1)
    ]
    outputs = [p.communicate(timeout=timeout) for p in processes]
    for p, (_, err) in zip(processes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.JSONDecoder().raw_decode(out[out.index('{"process"'):])[0] for out, _ in outputs]
