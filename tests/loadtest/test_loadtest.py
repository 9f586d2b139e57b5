"""Load tests against a real server process with the tiny model: a headless locust session, the
serving benchmark's JSON and plots, and the HTTP-vs-offline overhead benchmark end to end."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys

import httpx
import matplotlib.image
import pytest

from loadtest import dataset
from tests.server_process import REPO, ServerProcess

# The tiny model's tokenizer spends about 5 tokens per word (and ChatML adds a system prompt).
SMALL = ["--max-prompt-words", "12", "--max-output-tokens", "24"]


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # the session's shared server (tests/conftest.py)


def generated_tokens(server: ServerProcess) -> int:
    text = httpx.get(f"{server.url}/metrics").text
    return int(float(re.search(r"^pathserve_generation_tokens_total (\S+)$", text, re.M).group(1)))


def test_synthetic_dataset_is_reproducible_and_spread():
    a, b = dataset.synthetic(200, seed=3), dataset.synthetic(200, seed=3)
    assert a == b and a != dataset.synthetic(200, seed=4)
    words = sorted(len(p.text.split()) for p in a)
    tokens = sorted(p.max_tokens for p in a)
    assert words[10] * 2 < words[190] and tokens[10] * 2 < tokens[190]  # a real spread, not one size
    assert max(tokens) <= 512


def test_sharegpt_file_is_read(tmp_path):
    path = tmp_path / "sharegpt.json"
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}?"},
                {"from": "gpt", "value": "word " * 20},
            ]
        }
        for i in range(5)
    ]
    path.write_text(json.dumps([{"conversations": []}, *conversations]))
    prompts = dataset.sharegpt(path, 3)
    assert len(prompts) == 3 and all(p.text.startswith("Question") and p.max_tokens == 26 for p in prompts)


def test_headless_locust_session_has_no_failures_and_records_ttft(server, tmp_path):
    run = subprocess.run(
        [
            sys.executable, "-m", "locust", "-f", str(REPO / "loadtest" / "locustfile.py"),
            "--host", server.url, "--headless", "-u", "6", "-r", "6", "-t", "12s",
            "--csv", str(tmp_path / "locust"), "--only-summary", *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    with (tmp_path / "locust_stats.csv").open() as f:
        rows = list(csv.DictReader(f))
    aggregated = next(r for r in rows if r["Name"] == "Aggregated")
    assert int(aggregated["Request Count"]) > 10 and int(aggregated["Failure Count"]) == 0
    ttft = {r["Name"] for r in rows if r["Type"] == "TTFT" and int(r["Request Count"]) > 0}
    assert ttft >= {"/v1/completions [stream]", "/v1/chat/completions [stream]", "/generate [stream]"}
    streamed = next(r for r in rows if r["Name"] == "/v1/completions [stream]")
    assert 0 < float(streamed["Average Content Size"]) <= 24  # output tokens from usage
    assert (tmp_path / "locust_failures.csv").exists()


def test_bench_serve_writes_numbers_that_add_up_and_plots(server, tmp_path):
    before = generated_tokens(server)
    run = subprocess.run(
        [
            sys.executable, "-m", "serving.cli", "bench", "serve", "--url", server.url,
            "--concurrency", "1,4", "--requests", "8", "--out", str(tmp_path), *SMALL,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "serve-bench.json").read_text())
    levels = report["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 4]
    for lv in levels:
        assert lv["completed"] == lv["requests"] == 8 and lv["errors"] == 0
        assert lv["output_tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["wall_s"])
        assert lv["request_throughput"] == pytest.approx(8 / lv["wall_s"])
        for metric in ("ttft_ms", "e2e_ms"):
            stats = lv[metric]
            assert 0 < stats["median"] <= stats["p90"] <= stats["p99"] and stats["count"] == 8
        assert lv["ttft_ms"]["median"] <= lv["e2e_ms"]["median"]
    assert sum(lv["output_tokens"] for lv in levels) == generated_tokens(server) - before
    for name in ("serve-bench-throughput.png", "serve-bench-latency.png"):
        image = matplotlib.image.imread(tmp_path / name)
        assert image.shape[0] > 200 and image.shape[1] > 300
    assert "TTFT p50" in run.stdout


def test_bench_overhead_alternates_offline_and_http_rounds_on_the_same_prompts(tiny_model_dir, tmp_path):
    run = subprocess.run(
        [
            sys.executable, "-m", "serving.cli", "bench", "overhead", str(tiny_model_dir),
            "max_prefill_predict_length=256", "max_target_length=512", "quantization=",
            "enable_model_warmup=false",  # compiled by the first rounds instead: a faster test
            "--batches", "1,4", "--rounds", "2", "--requests", "8", "--max-tokens", "16",
            "--max-prompt-words", "10", "--out", str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "serve-overhead.json").read_text())
    assert [p["batch"] for p in report["points"]] == [1, 4]
    for point in report["points"]:
        count = point["requests"]
        assert count == (2 if point["batch"] == 1 else 8)
        assert len(point["offline"]) == len(point["http"]) == 2  # alternating rounds
        for offline, http in zip(point["offline"], point["http"], strict=True):
            assert offline["batch"] == http["concurrency"] == point["batch"]
            assert offline["output_tokens"] == http["output_tokens"] == count * 16
            assert offline["prompt_tokens"] == http["prompt_tokens"]
        assert point["ratio"] > 0
    assert run.stdout.count("HTTP/offline") == 2


def test_an_offline_round_runs_on_the_executor_it_is_given(monkeypatch):
    """The offline side's rounds time requests only: a new executor per run allocated the KV pool
    inside the timing (the default model at batch 1 read 59-103 tok/s offline against 150-158 over
    HTTP). On the mock engine, whose tokens are known."""
    from serving import offline_bench as offline
    from serving.engine.mock import MockEngine
    from serving.orchestrator import offline as driver
    from serving.orchestrator.executor import Executor
    from serving.request import SamplingParams

    engine = MockEngine(slots=2, max_prefill_length=16, max_target_length=64)
    executor = Executor(engine, {})

    def refused(*args, **kwargs):
        raise AssertionError("an executor built inside a timed round")

    monkeypatch.setattr(driver, "Executor", refused)
    requests = [([3, 4, 5 + i], SamplingParams(max_tokens=6)) for i in range(5)]
    for batch in (1, 2):
        round_ = offline._round(engine, {}, executor, requests, batch)
        assert round_["output_tokens"] == 5 * 6 and round_["requests"] == 5 and round_["batch"] == batch


def test_the_offline_engine_takes_the_config_serve_takes(monkeypatch, tmp_path, capsys):
    """`bench overhead` runs the HTTP server and `bench offline` on the same arguments: the offline
    side read them without the serving profile (4 decode steps a call, no slot buckets, prompts
    prefilled one at a time), so HTTP / offline compared two configs. Through `pathserve bench
    offline` itself, with the measurement replaced by one that records what it was given."""
    import serving.offline_bench
    from serving.cli.main import _given, build_parser, main

    given = {}

    def record(cfg, source, prompts, max_tokens, origins=None):
        given.update(cfg=cfg, source=source, origins=dict(origins or {}))
        return {"tokens_per_s": 1.0}

    monkeypatch.setattr(serving.offline_bench, "measure", record)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"prompt": "Hello"}]))
    args = [str(tmp_path), "quantization=int8w", "per_device_batch_size=32"]  # SOURCE: a path that exists
    assert main(["bench", "offline", "--prompts", str(prompts), "--max-tokens", "4", *args]) == 0
    served = _given(build_parser().parse_args(["serve", *args]))[0]
    assert given["cfg"] == served.config and given["origins"] == dict(served.origins)
    assert given["cfg"].decode_slot_buckets and given["origins"]["decode_slot_buckets"] == "serving profile"
    assert given["origins"]["per_device_batch_size"] == "command line"
    assert json.loads(capsys.readouterr().out) == {"tokens_per_s": 1.0}
