"""Many batch workers on one output, without a model: the claim race and the lease takeover on
both conditional stores (a local directory, and the real fake-gcs-server with GCS's generation
preconditions), and N runners on the mock engine sharing one job (every line exactly once)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from serving.batch import conditional, runner
from serving.batch.claims import Claims, Held
from serving.batch.runner import run_batch
from serving.cli.main import build_parser
from serving.config import ServingConfig
from tests.batch_mock import records, start_mock
from tests.gcs_emulator import emulated_bucket

BUCKET = "claims-bucket"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with emulated_bucket(tmp_path_factory.mktemp("gcs"), BUCKET) as url:
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


class _Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_claim_unchanged_for_a_lease_on_the_readers_clock_is_taken_over_once_and_the_slow_worker_loses(output):
    store = conditional.store(output)
    clock = _Clock()
    slow = Claims(store, "job-1", "slow", lease_s=60)
    held = slow.try_claim("s0")
    assert isinstance(held, Held)
    others = [Claims(store, "job-1", f"w{i}", lease_s=10, clock=clock) for i in range(3)]
    assert all(o.try_claim("s0") == "busy" for o in others)  # first seen now
    clock.now += 9
    assert all(o.try_claim("s0") == "busy" for o in others)  # not yet a lease
    assert slow.renew(held)  # a renewal: a new generation, seen afresh
    clock.now += 9
    assert all(o.try_claim("s0") == "busy" for o in others)
    clock.now += 10  # unchanged for a whole lease on the readers' clock
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


def _results_claims(store, worker: str, clock=None) -> Claims:
    return Claims(store, "job-1", worker, lease_s=10, results_name=lambda sid: f"results-{sid}.jsonl", clock=clock or _Clock())


def test_the_results_of_a_worker_that_lost_its_claim_are_not_written_over_the_new_holders(output):
    """renew, pause past the lease, another worker takes over, writes and finishes: the first
    wakes and must not overwrite the results."""
    store = conditional.store(output)
    clock = _Clock()
    slow, fast = _results_claims(store, "slow"), _results_claims(store, "fast", clock)
    held = slow.try_claim("s0")
    assert slow.renew(held) and fast.try_claim("s0") == "busy"
    clock.now += 10
    taken = fast.try_claim("s0")
    assert isinstance(taken, Held)
    assert fast.write_results(taken, b"fast\n") and fast.finish(taken, {"rows_ok": 1})
    assert not slow.write_results(held, b"slow\n") and held.lost
    assert _results(output, "s0") == b"fast\n"


def _results(output: str, shard_id: str) -> bytes:
    if output.startswith("gs://"):
        found = conditional.store(output).read(f"results-{shard_id}.jsonl")
        return found[0]
    return Path(output, f"results-{shard_id}.jsonl").read_bytes()


def test_a_done_claim_whose_results_are_missing_is_run_again(output):
    store = conditional.store(output)
    first, second = _results_claims(store, "w0"), _results_claims(store, "w1")
    held = first.try_claim("s0")
    assert first.finish(held, {"rows_ok": 1})  # done, but its results were never written
    assert isinstance(second.try_claim("s0"), Held)
    held = first.try_claim("s1")
    assert first.write_results(held, b"x\n") and first.finish(held, {"rows_ok": 1})
    assert second.try_claim("s1") == "done"


class _LostReplies:
    """A store whose claim writes land but answer 'precondition failed' (a retried upload whose
    first try landed)."""

    def __init__(self, store) -> None:
        self.store = store

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def replace(self, name: str, data: bytes, generation: int) -> int | None:
        self.store.replace(name, data, generation)
        return None


def test_a_write_whose_reply_was_lost_is_known_as_ours_by_its_content(tmp_path):
    store = conditional.store(str(tmp_path))
    held = Claims(store, "job-1", "w0", lease_s=60).try_claim("s0")
    stale = held.generation
    flaky = Claims(_LostReplies(store), "job-1", "w0", lease_s=60)
    assert flaky.renew(held) and flaky.finish(held, {"rows_ok": 1})
    other = Claims(_LostReplies(store), "job-1", "w1", lease_s=60)
    assert not other.renew(Held("s0", stale))  # a write that did not land: not ours


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
def test_workers_started_together_run_every_line_exactly_once(tmp_path, workers, monkeypatch):
    # A worker that finds the rest claimed by others looks again after runner.POLL_S (1 s): at a
    # 20th of it the test does not sit out a whole second, and the look-again path still runs.
    monkeypatch.setattr(runner, "POLL_S", 0.05)
    rows = [{"id": f"r{i}", "prompt": "abc"[: 1 + i % 3], "max_tokens": 2 + i % 5, "temperature": 0} for i in range(60)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ServingConfig(max_target_length=128, max_prefill_predict_length=64)
    out = str(tmp_path / "out")
    summaries = _together(
        workers,
        lambda i: run_batch(str(source), out, "mock", cfg, shard_size=4, progress=False, start=start_mock([]), lease_s=5),
    )
    assert sum(s.shards_run for s in summaries) == 15  # each shard run once, by someone
    assert all(s.rows_ok == 60 for s in summaries)  # each worker's summary counts the whole job
    got = records(Path(out))
    assert sorted(got) == sorted(r["id"] for r in rows)
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


class _LosesOnce:
    """A local store on which the first results write of shard 0 loses its claim."""

    def __init__(self, store) -> None:
        self.store, self.lost = store, False

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def write_fenced(self, name: str, data: bytes, *args) -> bool:
        if not self.lost and "00000" in name:
            self.lost = True
            return False
        return self.store.write_fenced(name, data, *args)


def test_a_shard_whose_claim_was_lost_goes_back_into_the_queue(tmp_path, monkeypatch):
    rows = [{"id": f"r{i}", "prompt": "ab", "max_tokens": 2, "temperature": 0} for i in range(8)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wrapped = []
    monkeypatch.setattr(runner.conditional, "store", lambda url: wrapped.append(_LosesOnce(conditional.LocalStore(url))) or wrapped[-1])
    cfg = ServingConfig(max_target_length=128, max_prefill_predict_length=64)
    out = tmp_path / "out"
    summary = run_batch(str(source), str(out), "mock", cfg, shard_size=4, progress=False, start=start_mock([]), lease_s=5)
    assert wrapped[0].lost and summary.rows_ok == 8 and summary.shards_run == 2
    assert sorted(records(out)) == sorted(r["id"] for r in rows)


def test_repeated_renewal_failures_stop_the_worker_taking_shards():
    class Failing:
        lease_s = 5.0

        def renew(self, held: Held) -> bool:
            raise OSError("429 Too Many Requests")

    job = SimpleNamespace(shards=[SimpleNamespace(id="s0")])
    orchestrator = SimpleNamespace(tokenizer=None, capacity=1)
    cfg = ServingConfig()
    work = runner._Job(orchestrator, "mock", cfg, job, "out", Failing(), progress=False)
    held = Held("s0", 1)
    work.held["s0"] = held
    for tries in range(1, runner.RENEWAL_TRIES + 1):
        assert work.failed is None
        asyncio.run(work._renew(held))
        assert work.renewal_failures["s0"] == tries
    assert work.failed is not None and "s0" in work.failed


def test_the_lease_has_a_minimum_named_by_its_flag(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["batch", "--input", "i", "--output", "o", "--lease-seconds", "1"])
    assert "--lease-seconds" in capsys.readouterr().err
    with pytest.raises(runner.BatchError, match="--lease-seconds"):
        run_batch("i", "o", None, ServingConfig(), lease_s=1)
