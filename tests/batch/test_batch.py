"""`pathserve batch` as a real process on the tiny model, against fake-gcs-server and local paths:
ids in = ids out, greedy text = the engine's, bad lines become error records, kill -9 and rerun
loses and repeats nothing, changed arguments are refused."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from serving.checkpoints.model_source import load_model
from serving.cli.main import build_parser
from serving.config import ServingConfig
from serving.deploy.config import load_deployment
from serving.deploy.manifests import render
from serving.engine.engine import Engine
from serving.orchestrator.offline import run_to_completion
from serving.request import SamplingParams
from tests.conftest import DATA
from tests.gcs_emulator import create_bucket, emulator_env, fake_gcs_server, read_claims

BUCKET = "batch-bucket"
# Warmup off (the serving profile would turn it on): each of the many runs compiles what it uses.
OVERRIDES = ["per_device_batch_size=4", "max_prefill_predict_length=64", "enable_model_warmup=false", "max_target_length=256"]
WORDS = (DATA / "english.txt").read_text().split()


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        start = rng.randrange(len(WORDS) - 20)
        out.append(
            {
                "id": f"row-{i}",
                "prompt": " ".join(WORDS[start : start + rng.randint(2, 12)]),
                "max_tokens": 12,
            }
        )
    return out


def write_files(directory: Path, rows: list[dict], files: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        path = directory / f"part-{f}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[f::files]))
        paths.append(path)
    return paths


def upload(url: str, name: str, data: bytes) -> None:
    request = urllib.request.Request(
        f"{url}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={name}", data=data, method="POST"
    )
    urllib.request.urlopen(request, timeout=10).read()


def batch(*args: str, env: dict | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "batch", *args, "--quiet"],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def finish(process: subprocess.Popen, timeout: float = 600) -> dict:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def read_records(read_names, read_text) -> list[dict]:
    """Every record under the output; fails on a partial or malformed line."""
    records = []
    for name in read_names():
        if name.startswith("results-"):
            text = read_text(name)
            assert text.endswith("\n"), f"{name} ends mid-line"
            records += [json.loads(line) for line in text.splitlines()]
    return records


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with fake_gcs_server(tmp_path_factory.mktemp("gcs")) as url:
        create_bucket(url, BUCKET)
        yield url


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    """The engine called directly: greedy text of every prompt."""
    cfg = ServingConfig(per_device_batch_size=8, max_prefill_predict_length=64, max_target_length=256)
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    rows = prompts(200)
    tokenizer = model.tokenizer
    requests = [
        (tokenizer.encode_prompt(r["prompt"]), SamplingParams(max_tokens=12, stop_ids=tokenizer.eos_ids))
        for r in rows
    ]
    done = run_to_completion(engine, params, requests)
    return {r["id"]: tokenizer.decode(c.token_ids) for r, c in zip(rows, done, strict=True)}


def gcs_reader(url: str, prefix: str):
    def names() -> list[str]:
        with urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o?prefix={prefix}/", timeout=10) as r:
            items = json.loads(r.read()).get("items", [])
        return sorted(
            i["name"].rsplit("/", 1)[-1] for i in items if i["name"].count("/") == prefix.count("/") + 1
        )

    def text(name: str) -> str:
        quoted = urllib.request.quote(f"{prefix}/{name}", safe="")
        with urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}/o/{quoted}?alt=media", timeout=10) as r:
            return r.read().decode()

    return names, text


def test_gcs_prompts_give_one_record_per_line_equal_to_the_engine(gcs, tiny_model_dir, expected, tmp_path):
    rows = prompts(200)
    for path in write_files(tmp_path, rows, 3):
        upload(gcs, f"in/{path.name}", path.read_bytes())
    summary = finish(
        batch(
            "--input",
            f"gs://{BUCKET}/in/",
            "--output",
            f"gs://{BUCKET}/out",
            "--shard-size",
            "32",
            str(tiny_model_dir),
            *OVERRIDES,
            env=emulator_env(gcs),
        )
    )
    assert (summary["rows_ok"], summary["rows_failed"], summary["shards_skipped"]) == (200, 0, 0)
    records = read_records(*gcs_reader(gcs, "out"))
    assert sorted(r["custom_id"] for r in records) == sorted(r["id"] for r in rows)
    for record in records:
        body = record["response"]["body"]
        assert record["error"] is None and record["response"]["status_code"] == 200
        assert body["choices"][0]["text"] == expected[record["custom_id"]], record["custom_id"]
    assert summary["tokens_out"] == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in records)
    names, text = gcs_reader(gcs, "out")
    assert "_manifest.json" in names() and json.loads(text("_summary.json")) == summary
    again = finish(
        batch(
            "--input",
            f"gs://{BUCKET}/in/",
            "--output",
            f"gs://{BUCKET}/out",
            "--shard-size",
            "32",
            str(tiny_model_dir),
            *OVERRIDES,
            env=emulator_env(gcs),
        )
    )
    assert again["shards_skipped"] == again["shards"] and again["shards_run"] == 0


def test_kill_9_at_random_points_then_rerun_loses_and_repeats_nothing(
    gcs, tiny_model_dir, expected, tmp_path
):
    rows = prompts(200)
    for path in write_files(tmp_path, rows, 3):
        upload(gcs, f"kill-in/{path.name}", path.read_bytes())
    args = [
        "--input",
        f"gs://{BUCKET}/kill-in/",
        "--output",
        f"gs://{BUCKET}/kill-out",
        "--shard-size",
        "10",
        str(tiny_model_dir),
        *OVERRIDES,
        "max_queued_requests=8",
        # The same worker name at each rerun: it takes back the claim of the shard it was killed
        # in at once, rather than after the claim's lease.
        "--worker-id",
        "solo",
    ]
    rng = random.Random(7)

    def finished() -> int:
        return sum(c["state"] == "done" for c in read_claims(gcs, BUCKET, "kill-out"))

    kills = 0
    for _ in range(3):
        # Kill as soon as a random number of further shards finished (so each rerun both resumes
        # finished shards and redoes an interrupted one: the worker has claimed its next shard by
        # then). No wait after that point: on a fast machine a pause let the job end before the
        # second kill; 3 runs of at most 3 shards each leave most of the 21 for the last run.
        target = finished() + rng.randint(1, 3)
        process = batch(*args, env=emulator_env(gcs))
        deadline = time.monotonic() + 300
        while process.poll() is None and finished() < target and time.monotonic() < deadline:
            time.sleep(0.01)
        if process.poll() is not None:
            break
        process.send_signal(signal.SIGKILL)
        process.wait()
        kills += 1
    assert kills >= 2  # the job must really have been cut, more than once
    summary = finish(batch(*args, env=emulator_env(gcs)))
    records = read_records(*gcs_reader(gcs, "kill-out"))
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)) == 200 and set(ids) == {r["id"] for r in rows}
    assert summary["rows_ok"] == 200 and summary["shards"] == 21
    assert summary["shards_skipped"] > 0  # the reruns resumed: earlier runs' shards were kept
    assert all(r["response"]["body"]["choices"][0]["text"] == expected[r["custom_id"]] for r in records)


def test_bad_lines_become_error_records_and_the_rest_succeed(tiny_model_dir, tmp_path):
    good = prompts(6)
    lines = [json.dumps(r) for r in good[:3]]
    bad = {
        "batch_req_0_4": "{not json",
        "batch_req_0_5": json.dumps({"id": "no-prompt", "max_tokens": 3}),
        "batch_req_0_6": json.dumps({"id": "too-long", "prompt": " ".join(WORDS[:400])}),
        "batch_req_0_7": json.dumps(
            {"custom_id": "neg", "url": "/v1/completions", "body": {"prompt": "a", "max_tokens": -1}}
        ),
        "batch_req_0_8": json.dumps({"custom_id": "route", "url": "/v1/embeddings", "body": {"input": "a"}}),
        "batch_req_0_9": "[1, 2]",
    }
    lines += list(bad.values())
    chat = {
        "custom_id": "chat-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"}],
            "max_tokens": 5,
            "temperature": 0,
        },
    }
    lines += [json.dumps(chat), *(json.dumps(r) for r in good[3:])]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    summary = finish(
        batch("--input", str(tmp_path / "in.jsonl"), "--output", str(out), str(tiny_model_dir), *OVERRIDES)
    )
    assert (summary["rows_ok"], summary["rows_failed"]) == (7, len(bad))
    records = read_records(lambda: sorted(p.name for p in out.iterdir()), lambda n: (out / n).read_text())
    assert len(records) == len(lines)
    by_id = {r["id"]: r for r in records}
    for record_id, _ in bad.items():
        assert by_id[record_id]["response"]["body"] is None and by_id[record_id]["error"]["message"]
        assert by_id[record_id]["response"]["status_code"] == (404 if record_id == "batch_req_0_8" else 400)
    assert "max_target_length=256" in by_id["batch_req_0_6"]["error"]["message"]  # 400 words: past the context
    assert by_id["batch_req_0_6"]["custom_id"] == "too-long"
    assert "max_tokens" in by_id["batch_req_0_7"]["error"]["message"]
    assert by_id["batch_req_0_4"]["error"]["code"] == "invalid_json"
    chat_record = next(r for r in records if r["custom_id"] == "chat-1")
    assert chat_record["response"]["body"]["object"] == "chat.completion"
    assert {r["custom_id"] for r in records if r["error"] is None} == {r["id"] for r in good} | {"chat-1"}


def test_changed_arguments_are_refused_unless_restart(tiny_model_dir, tmp_path):
    write_files(tmp_path / "in", prompts(10), 2)
    args = ["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), str(tiny_model_dir)]
    first = finish(batch(*args, *OVERRIDES))
    assert first["rows_ok"] == 10
    changed = batch(*args, *OVERRIDES[:-1], "max_target_length=512")
    _, err = changed.communicate(timeout=300)
    assert changed.returncode == 2 and "max_target_length: 256 -> 512" in err and "--restart" in err
    restarted = finish(batch(*args, *OVERRIDES[:-1], "max_target_length=512", "--restart"))
    assert restarted["shards_run"] == restarted["shards"] and restarted["rows_ok"] == 10
    records = read_records(
        lambda: sorted(p.name for p in (tmp_path / "out").iterdir()),
        lambda n: (tmp_path / "out" / n).read_text(),
    )
    assert len(records) == 10


def test_missing_input_and_bucket_are_clear_errors(gcs, tmp_path):
    missing = batch("--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "out"))
    _, err = missing.communicate(timeout=300)
    assert missing.returncode == 2 and "nope.jsonl" in err and "Traceback" not in err
    no_bucket = batch("--input", str(tmp_path), "--output", "gs://no-such-bucket/out", env=emulator_env(gcs))
    _, err = no_bucket.communicate(timeout=300)
    assert no_bucket.returncode == 2 and "no-such-bucket" in err and "Traceback" not in err


def test_the_rendered_pathways_job_runs_this_cli():
    config = Path(__file__).resolve().parents[2] / "configs" / "deployments" / "llama3.1-8b-batch-v6e-4.yml"
    (job,) = [o for o in render(load_deployment(config)) if o["kind"] == "PathwaysJob"]
    (main,) = [c for c in _find_containers(job) if c["name"] == "batch"]
    ns, extra = build_parser().parse_known_args(main["args"])
    assert ns.command == "batch" and ns.input.startswith("gs://") and ns.output.startswith("gs://")
    assert all("=" in a for a in [*ns.args, *extra])


def _find_containers(obj):
    if isinstance(obj, dict):
        if "containers" in obj and isinstance(obj["containers"], list):
            yield from obj["containers"]
        for value in obj.values():
            yield from _find_containers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _find_containers(value)
