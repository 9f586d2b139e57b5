"""loadtest.served_sim runs the served path (HTTP over a unix socket, the orchestrator, the
scheduler) on the mock engine at given call times and reports each batch's rate against the
engine alone, its device calls and their timeline."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_served_simulation_reports_rates_calls_and_their_timeline(tmp_path):
    out = tmp_path / "sim"
    run = subprocess.run(
        [sys.executable, "-m", "loadtest.served_sim", str(out), "--batches", "4", "--max-tokens", "16",
         "--generate", "16=0.01,64=0.02,128=0.03", "--prefill", "0.01", "admission_wait_ms=0"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    point = json.loads((out / "served-sim.json").read_text())["batches"]["b4"]
    assert point["output_tokens"] == 8 * 16 and point["requests"] == 8
    assert point["engine_alone_tok_s"] == 4 * 8 / 0.01  # 4 rows of the 16 bucket, 8 steps a call
    assert 0 < point["over_engine"] <= 1.0
    calls = (out / "calls-b4.txt").read_text().splitlines()
    generates = [line for line in calls if " generate " in line]
    # the bench's first request (2 tokens, its compiles before the clock starts) is in the timeline too
    assert len(generates) == point["device_calls"]["generate_step_seconds_count"] + 1
    assert sum(int(line.rsplit("valid=", 1)[1]) for line in generates) == 8 * 15 + 1  # all but each first token
