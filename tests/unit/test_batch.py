"""The batch runner's rows, shards and resume on the mock engine (local files; no model, no JAX)."""

from __future__ import annotations

import json

from serving.batch.runner import run_batch
from serving.config import ServingConfig
from serving.engine.mock import MockEngine
from tests.batch_mock import TOKENIZER, records, start_mock


def test_every_row_gets_one_record_and_a_rerun_runs_nothing(tmp_path):
    rows = [{"id": f"r{i}", "prompt": "ab"[: 1 + i % 2], "max_tokens": 3 + i % 4, "temperature": 0} for i in range(7)]
    rows.append({"id": "bad", "prompt": "ab", "max_tokens": 0})
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ServingConfig(max_target_length=128, max_prefill_predict_length=64)
    started: list = []
    summary = run_batch(str(source), str(tmp_path / "out"), "mock", cfg, shard_size=3, progress=False, start=start_mock(started))
    assert (summary.rows_ok, summary.rows_failed, summary.shards) == (7, 1, 3)
    got = records(tmp_path / "out")
    assert set(got) == {r["id"] for r in rows}
    for row in rows[:-1]:
        text = got[row["id"]]["response"]["body"]["choices"][0]["text"]
        expected = MockEngine().expected(TOKENIZER.encode(row["prompt"]), _sampling(row["max_tokens"]))
        assert text == TOKENIZER.decode(expected)
    assert got["bad"]["error"] is not None
    again = run_batch(str(source), str(tmp_path / "out"), "mock", cfg, shard_size=3, progress=False, start=start_mock(started))
    assert (again.shards_run, again.shards_skipped, again.rows_ok) == (0, 3, 7)
    assert started == ["mock"]  # the rerun found every shard done and started no engine


def _sampling(max_tokens: int):
    from serving.request import SamplingParams

    return SamplingParams(max_tokens=max_tokens)

