"""Shard claims with leases: how N batch workers on one output run every shard exactly once.

Each shard has one claim object, `_claims/<shard id>.json`, holding the job it belongs to, the
worker holding it, its state (`running` or `done`) and when its lease expires. Every change is a
conditional write (serving.batch.conditional), so for each step exactly one worker wins:

1. Claim: create the object only if it does not exist (GCS `ifGenerationMatch=0`).
2. Renew: while it runs the shard, the holder pushes the expiry forward, matching the generation
   it last wrote; a failed renewal means another worker took the shard over.
3. Take over: a `running` claim whose lease expired (its worker died or stalled), or one left by an
   earlier job, is overwritten matching the generation that was read: of two workers trying at
   once, one wins.
4. Finish: the holder renews once more, writes the results (only a holder whose lease is still
   good writes them), then marks the claim `done` with the shard's counts.
A slow worker whose lease expired loses its claim at its next renewal or at its finish and drops
its results; the shard's results are those of the one worker that finished holding the claim.
Leases compare wall clocks across workers: keep them synchronised (NTP), and the lease well above
the longest pause of a worker.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field

from serving.batch.conditional import ConditionalStore

CLAIMS_DIR = "_claims"


@dataclass(frozen=True)
class Claim:
    job: str  # the manifest's job id: a claim of an earlier job counts as absent
    worker: str
    state: str  # "running" or "done"
    expires: float  # time.time() after which another worker may take a running shard over
    counts: dict[str, int] = field(default_factory=dict)  # the finished shard's rows and tokens


@dataclass
class Held:
    """A claim this worker holds: the generation it last wrote."""

    shard_id: str
    generation: int
    lost: bool = False
    finished: bool = False  # marked done: a renewal that comes late must not mark it running again


def _name(shard_id: str) -> str:
    return f"{CLAIMS_DIR}/{shard_id}.json"


class Claims:
    """One worker's side of the claims of one job."""

    def __init__(self, store: ConditionalStore, job: str, worker: str, lease_s: float):
        self.store, self.job, self.worker, self.lease_s = store, job, worker, lease_s
        self._lock = threading.Lock()  # renewals and the finish of one claim run one at a time

    def _encode(self, state: str, counts: dict[str, int] | None = None) -> bytes:
        claim = Claim(self.job, self.worker, state, time.time() + self.lease_s, counts or {})
        return json.dumps(asdict(claim)).encode()

    def read(self, shard_id: str) -> tuple[Claim, int] | None:
        found = self.store.read(_name(shard_id))
        if found is None:
            return None
        data, generation = found
        return Claim(**json.loads(data)), generation

    def try_claim(self, shard_id: str) -> Held | str:
        """Hold the shard if nobody of this job does, or their lease expired, or it is this
        worker's own (a restarted worker with a stable --worker-id); else "done" or "busy"."""
        found = self.read(shard_id)
        data = self._encode("running")
        if found is None:
            generation = self.store.create(_name(shard_id), data)
        else:
            claim, current = found
            if claim.job == self.job:
                if claim.state == "done":
                    return "done"
                if claim.expires > time.time() and claim.worker != self.worker:
                    return "busy"
            generation = self.store.replace(_name(shard_id), data, current)
        return "busy" if generation is None else Held(shard_id, generation)

    def renew(self, held: Held) -> bool:
        """Push the lease forward; False (and `held.lost`) when another worker took the shard."""
        with self._lock:
            if held.lost:
                return False
            if held.finished:
                return True
            generation = self.store.replace(_name(held.shard_id), self._encode("running"), held.generation)
            if generation is None:
                held.lost = True
                return False
            held.generation = generation
            return True

    def finish(self, held: Held, counts: dict[str, int]) -> bool:
        """Mark the shard done with its counts; False when the claim was lost meanwhile."""
        with self._lock:
            if held.lost:
                return False
            generation = self.store.replace(_name(held.shard_id), self._encode("done", counts), held.generation)
            if generation is None:
                held.lost = True
                return False
            held.generation, held.finished = generation, True
            return True

    def status(self, shard_ids: list[str]) -> dict[str, Claim]:
        """This job's claims of these shards, by shard id (absent: unclaimed or an earlier job's)."""
        out = {}
        for shard_id in shard_ids:
            found = self.read(shard_id)
            if found is not None and found[0].job == self.job:
                out[shard_id] = found[0]
        return out
