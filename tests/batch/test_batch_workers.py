"""Many `pathserve batch` workers (real processes, the tiny model) on one input on fake-gcs-server:
started together they finish with every line exactly once (the stall of two workers before shard
claims: they both planned, both ran every shard, and one swept the other's temporaries away); and
with workers killed by SIGKILL at seeded random points and restarted, nothing is lost or repeated."""

from __future__ import annotations

import random
import signal
import time

from tests.batch.test_batch import (  # noqa: F401 - gcs and expected are fixtures
    BUCKET,
    OVERRIDES,
    batch,
    expected,
    finish,
    gcs,
    gcs_reader,
    prompts,
    read_records,
    upload,
    write_files,
)
from tests.gcs_emulator import emulator_env, read_claims

LEASE = "10"  # seconds: a killed worker's shard is taken over this long after its last renewal


def _args(gcs_prefix: str, tiny_model_dir, shard_size: int) -> list[str]:
    return [
        "--input",
        f"gs://{BUCKET}/{gcs_prefix}-in/",
        "--output",
        f"gs://{BUCKET}/{gcs_prefix}-out",
        "--shard-size",
        str(shard_size),
        "--lease-seconds",
        LEASE,
        str(tiny_model_dir),
        *OVERRIDES,
    ]


def _check_output(gcs, prefix: str, rows: list[dict], expected) -> list[dict]:  # noqa: F811
    records = read_records(*gcs_reader(gcs, prefix))
    ids = [r["custom_id"] for r in records]
    assert len(ids) == len(set(ids)) == len(rows) and set(ids) == {r["id"] for r in rows}
    assert all(r["response"]["body"]["choices"][0]["text"] == expected[r["custom_id"]] for r in records)
    return records


def test_two_workers_started_together_finish_with_every_line_once(gcs, tiny_model_dir, expected, tmp_path):  # noqa: F811
    rows = prompts(60)
    for path in write_files(tmp_path, rows, 2):
        upload(gcs, f"two-in/{path.name}", path.read_bytes())
    args = _args("two", tiny_model_dir, 5)
    workers = [batch(*args, "--worker-id", f"w{i}", env=emulator_env(gcs)) for i in range(2)]
    summaries = [finish(w, timeout=300) for w in workers]
    assert sum(s["shards_run"] for s in summaries) == summaries[0]["shards"] == 12
    assert all(s["rows_ok"] == 60 for s in summaries)
    _check_output(gcs, "two-out", rows, expected)
    names, _ = gcs_reader(gcs, "two-out")
    assert "_tmp" not in names()  # gs:// writes are single uploads: no temporaries, no moves


def test_four_workers_two_killed_at_seeded_random_points_lose_and_repeat_nothing(
    gcs, tiny_model_dir, expected, tmp_path  # noqa: F811
):
    rng = random.Random(44)
    rows = prompts(60)  # 12 shards of 5 (the note's run: 400 lines, measured by hand)
    for path in write_files(tmp_path, rows, 2):
        upload(gcs, f"kill4-in/{path.name}", path.read_bytes())
    args = _args("kill4", tiny_model_dir, 5)
    env = emulator_env(gcs)
    workers = {f"w{i}": batch(*args, "--worker-id", f"w{i}", env=env) for i in range(4)}
    victims = rng.sample(sorted(workers), 2)

    def done() -> int:
        return sum(c["state"] == "done" for c in read_claims(gcs, BUCKET, "kill4-out"))

    kills = []
    for n, victim in enumerate(victims):
        target = done() + rng.randint(1, 3)
        deadline = time.monotonic() + 240
        # killed as soon as the target is reached (no pause after it, which a fast machine filled
        # with the rest of the job)
        while workers[victim].poll() is None and done() < target and time.monotonic() < deadline:
            time.sleep(0.01)
        if workers[victim].poll() is not None:
            continue
        workers[victim].send_signal(signal.SIGKILL)
        workers[victim].wait()
        kills.append(victim)
        # The first comes back under its own name (it takes back its claim at once); the second
        # under a new one, so that its shard in flight waits for the lease to expire and is
        # taken over by whichever worker claims it first.
        name = victim if n == 0 else f"{victim}-again"
        workers[name] = batch(*args, "--worker-id", name, env=env)
    assert kills, "no worker was killed: the job finished before the first kill point"
    live = [p for p in workers.values() if p.returncode is None]
    summaries = [finish(p, timeout=300) for p in live]
    assert all(s["rows_ok"] == 60 and s["shards"] == 12 for s in summaries)
    _check_output(gcs, "kill4-out", rows, expected)
    claims = read_claims(gcs, BUCKET, "kill4-out")
    assert len(claims) == 12 and all(c["state"] == "done" for c in claims)
