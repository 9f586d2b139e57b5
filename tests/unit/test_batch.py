"""The batch runner's rows, shards and resume on the mock engine (local files; no model, no JAX)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from serving.batch.runner import run_batch
from serving.config import ServingConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.orchestrator import Orchestrator

TOKENIZER = AsciiTokenizer()


@dataclass
class _Started:
    orchestrator: Orchestrator
    model_name: str = "mock"

    def describe(self) -> str:
        return "the mock engine"


def _start(counter: list):
    def start(cfg: ServingConfig, source: str | None) -> _Started:
        counter.append(source)
        engine = MockEngine(slots=2, max_target_length=cfg.max_target_length)
        return _Started(Orchestrator(engine, {}, TOKENIZER, cfg.orchestrator).start())

    return start


def _records(output: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(output.glob("results-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out[record["custom_id"]] = record
    return out


def test_every_row_gets_one_record_and_a_rerun_runs_nothing(tmp_path):
    rows = [{"id": f"r{i}", "prompt": "ab"[: 1 + i % 2], "max_tokens": 3 + i % 4, "temperature": 0} for i in range(7)]
    rows.append({"id": "bad", "prompt": "ab", "max_tokens": 0})
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ServingConfig(max_target_length=128, max_prefill_predict_length=64)
    started: list = []
    summary = run_batch(str(source), str(tmp_path / "out"), "mock", cfg, shard_size=3, progress=False, start=_start(started))
    assert (summary.rows_ok, summary.rows_failed, summary.shards) == (7, 1, 3)
    records = _records(tmp_path / "out")
    assert set(records) == {r["id"] for r in rows}
    for row in rows[:-1]:
        text = records[row["id"]]["response"]["body"]["choices"][0]["text"]
        expected = MockEngine().expected(TOKENIZER.encode(row["prompt"]), _sampling(row["max_tokens"]))
        assert text == TOKENIZER.decode(expected)
    assert records["bad"]["error"] is not None
    again = run_batch(str(source), str(tmp_path / "out"), "mock", cfg, shard_size=3, progress=False, start=_start(started))
    assert (again.shards_run, again.shards_skipped, again.rows_ok) == (0, 3, 7)
    assert started == ["mock"]  # the rerun found every shard done and started no engine


def _sampling(max_tokens: int):
    from serving.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens)
