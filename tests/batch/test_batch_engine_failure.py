"""The batch runner when the engine fails under it, on the mock engine (local files; no model, no
JAX): no record is written for a row it could not finish, and the rerun serves it. Here, not in
tests/unit: the rerun waits out the failed run's claims (MIN_LEASE_S)."""

from __future__ import annotations

import json

from serving.batch.runner import run_batch
from serving.config import ServingConfig
from serving.engine.mock import MockEngine
from serving.request import SamplingParams
from tests.batch_mock import TOKENIZER, records, start_mock
from tests.failing_engine import FailsAfter


def _sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def test_an_engine_failure_writes_no_record_and_a_rerun_serves_the_rows(tmp_path):
    """The device loop failing under a batch fails the run rather than recording cut-short texts as
    answers; the rerun (the engine back) serves every row, none twice."""
    import pytest

    from serving.batch.claims import MIN_LEASE_S
    from serving.errors import RequestFailed
    from serving.orchestrator import Orchestrator
    from tests.batch_mock import Started

    def failing(cfg: ServingConfig, source: str | None) -> Started:
        engine = FailsAfter(3, slots=2, max_target_length=cfg.max_target_length)
        return Started(Orchestrator(engine, {}, TOKENIZER, cfg.orchestrator).start())

    rows = [{"id": f"r{i}", "prompt": "ab", "max_tokens": 20, "temperature": 0} for i in range(6)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ServingConfig(max_target_length=128, max_prefill_predict_length=64)
    lease = {"lease_s": MIN_LEASE_S}  # the failed run's claims lapse this long after it (a rerun then takes them)
    with pytest.raises(RequestFailed):
        run_batch(str(source), str(tmp_path / "out"), "mock", cfg, shard_size=3, progress=False, start=failing, **lease)
    written = records(tmp_path / "out")
    expected = TOKENIZER.decode(MockEngine().expected(TOKENIZER.encode("ab"), _sampling(20)))
    assert all(r["response"]["body"]["choices"][0]["text"] == expected for r in written.values())  # none cut short
    again = run_batch(str(source), str(tmp_path / "out"), "mock", cfg, shard_size=3, progress=False, start=start_mock([]), **lease)
    assert again.rows_ok + len(written) >= len(rows)
    got = records(tmp_path / "out")
    assert set(got) == {r["id"] for r in rows}
    assert all(g["response"]["body"]["choices"][0]["text"] == expected for g in got.values())
