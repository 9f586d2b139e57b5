"""Every process of a CPU multi-controller group keeps its own persistent compilation cache entries
(serving/runtime.py): JAX writes from process 0 only and keys entries by a topology fingerprint that
on CPU is each process's own, so a follower compiled every program at every start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.server_process import REPO, free_port

PROBE = Path(__file__).with_name("cache_probe.py")


def run_pair(cache: Path) -> list[dict]:
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the probe's own directory, from its config
    processes = [
        subprocess.Popen([sys.executable, str(PROBE), str(cache), str(i), str(port)], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in (0, 1)
    ]
    outputs = [p.communicate(timeout=240) for p in processes]
    for p, (_, err) in zip(processes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    return [json.JSONDecoder().raw_decode(out[out.index('{"process"'):])[0] for out, _ in outputs]


def test_a_follower_loads_its_programs_from_the_cache_on_its_second_start(tmp_path):
    cache = tmp_path / "jax-cache"
    first = run_pair(cache)
    assert [r["hits"] for r in first] == [0, 0] and all(r["requests"] > 0 for r in first)
    assert first[0]["total"] == first[1]["total"] == 16 * 16 * 8  # every x[i] . x[j] is 8
    second = run_pair(cache)
    for before, after in zip(first, second, strict=True):
        # Every program either process compiled the first time is a hit the second time.
        assert after["hits"] == after["requests"] == before["requests"], (before, after)
