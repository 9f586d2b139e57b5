"""Many batch workers on one output, without a model: the claim race and the lease takeover on
both conditional stores (a local directory, and the real fake-gcs-server with GCS's generation
preconditions), and N runners on the mock engine sharing one job (every line exactly once)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from serving.batch import conditional
from serving.batch.claims import Claims, Held
from serving.batch.runner import run_batch
from serving.config import ServingConfig
from tests.gcs_emulator import apply_env, create_bucket, fake_gcs_server
from tests.unit.test_batch import _records, _start

BUCKET = "claims-bucket"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with fake_gcs_server(tmp_path_factory.mktemp("gcs")) as url:
        create_bucket(url, BUCKET)
        apply_env(url)
        yield url


@pytest.fixture(params=["local", "gcs"])
def output(request, tmp_path) -> str:
    if request.param == "gcs":
        request.getfixturevalue("gcs")
        return f"gs://{BUCKET}/{tmp_path.name}"
    return str(tmp_path / "out")


def _together(count: int, action) -> list:
    """`action(i)` in `count` threads released at the same instant; their results."""
    barrier = threading.Barrier(count)
    results: list = [None] * count

    def run(i: int) -> None:
        barrier.wait()
        results[i] = action(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_the_claim_race_has_one_winner(output):
    store = conditional.store(output)
    workers = [Claims(store, "job-1", f"w{i}", lease_s=60) for i in range(4)]
    for shard in range(8):  # several rounds: each has exactly one winner
        outcomes = _together(4, lambda i, shard=shard: workers[i].try_claim(f"s{shard}"))
        winners = [i for i, o in enumerate(outcomes) if isinstance(o, Held)]
        assert len(winners) == 1 and outcomes.count("busy") == 3, outcomes
        claim, _ = workers[0].read(f"s{shard}")
        assert claim.worker == f"w{winners[0]}" and claim.state == "running"


def test_an_expired_lease_is_taken_over_exactly_once_and_the_slow_worker_loses(output):
    store = conditional.store(output)
    slow = Claims(store, "job-1", "slow", lease_s=0.2)
    held = slow.try_claim("s0")
    assert isinstance(held, Held)
    others = [Claims(store, "job-1", f"w{i}", lease_s=60) for i in range(3)]
    assert all(o.try_claim("s0") == "busy" for o in others)  # lease still good
    time.sleep(0.3)
    outcomes = _together(3, lambda i: others[i].try_claim("s0"))
    winners = [o for o in outcomes if isinstance(o, Held)]
    assert len(winners) == 1, outcomes
    # The slow worker finds out at its next renewal or at its finish: its results are dropped.
    assert not slow.renew(held) and not slow.finish(held, {"rows_ok": 1})
    winner = others[outcomes.index(winners[0])]
    assert winner.finish(winners[0], {"rows_ok": 5})
    claim, _ = slow.read("s0")
    assert (claim.state, claim.worker, claim.counts) == ("done", winner.worker, {"rows_ok": 5})
    assert all(o.try_claim("s0") == "done" for o in others)


def test_an_earlier_jobs_claim_counts_as_absent_and_a_worker_takes_back_its_own(output):
    store = conditional.store(output)
    old = Claims(store, "job-old", "w0", lease_s=60)
    assert isinstance(old.try_claim("s0"), Held) and isinstance(old.try_claim("s1"), Held)
    new = Claims(store, "job-new", "w1", lease_s=60)
    assert isinstance(new.try_claim("s0"), Held)
    restarted = Claims(store, "job-old", "w0", lease_s=60)  # the same --worker-id after a kill
    assert isinstance(restarted.try_claim("s1"), Held)


def test_the_manifest_is_created_by_exactly_one_of_many(output):
    url = f"{output}/_manifest.json"
    created = _together(4, lambda i: conditional.create_new(url, json.dumps({"by": i}).encode()))
    assert created.count(True) == 1


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_started_together_run_every_line_exactly_once(tmp_path, workers):
    rows = [{"id": f"r{i}", "prompt": "abc"[: 1 + i % 3], "max_tokens": 2 + i % 5, "temperature": 0} for i in range(60)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ServingConfig(max_target_length=128, max_prefill_predict_length=64)
    out = str(tmp_path / "out")
    summaries = _together(
        workers,
        lambda i: run_batch(str(source), out, "mock", cfg, shard_size=4, progress=False, start=_start([]), lease_s=5),
    )
    assert sum(s.shards_run for s in summaries) == 15  # each shard run once, by someone
    assert all(s.rows_ok == 60 for s in summaries)  # each worker's summary counts the whole job
    records = _records(Path(out))
    assert sorted(records) == sorted(r["id"] for r in rows)
    assert sum(len(p.read_text().splitlines()) for p in Path(out).glob("results-*.jsonl")) == 60
    manifest = json.loads((Path(out) / "_manifest.json").read_text())
    assert len(manifest["finished"]) == 15


def test_a_renewal_after_the_finish_leaves_the_claim_done(output):
    """The renewal task may hold a claim it read before the shard finished: a bug once marked
    the done shard running again, so its counts vanished from the summary."""
    claims = Claims(conditional.store(output), "job-1", "w0", lease_s=60)
    held = claims.try_claim("s0")
    assert claims.finish(held, {"rows_ok": 3}) and claims.renew(held)
    claim, _ = claims.read("s0")
    assert (claim.state, claim.counts) == ("done", {"rows_ok": 3})
