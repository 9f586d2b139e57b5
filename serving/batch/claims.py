"""Shard claims with leases: how N batch workers on one output run every shard exactly once.

Each shard has one claim object, `_claims/<shard id>.json`, holding the job it belongs to, the
worker holding it, its state (`running` or `done`) and the generation its results object had when
it was claimed. Every change is a conditional write (serving.batch.conditional), so for each step
exactly one worker wins:

1. Claim: create the object only if it does not exist (GCS `ifGenerationMatch=0`).
2. Renew: while it runs the shard, the holder rewrites the claim, matching the generation it last
   wrote; a failed renewal means another worker took the shard over.
3. Take over: a `running` claim of another worker whose generation a reader has seen unchanged for
   the lease, by the reader's own monotonic clock (its worker died or stalled), or one left by an
   earlier job, is overwritten matching the generation that was read: of two workers trying at
   once, one wins. No clocks are compared across machines.
4. Finish: the holder writes the results fenced (GCS: matching the results object's generation
   recorded in the claim; locally: renamed into place under the store's lock while the claim is
   still this worker's), then marks the claim `done` with the shard's counts.
A slow worker whose lease ran out loses its claim at its next renewal, at its results write or at
its finish, and drops its results. A `done` claim whose results are missing counts as not done.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

from serving.batch.conditional import ConditionalStore

CLAIMS_DIR = "_claims"
MIN_LEASE_S = 5.0  # renewals come every lease / 4: GCS allows about one write a second per object


@dataclass(frozen=True)
class Claim:
    job: str  # the manifest's job id: a claim of an earlier job counts as absent
    worker: str
    state: str  # "running" or "done"
    results_generation: int = 0  # the results object's generation when claimed (0: absent)
    counts: dict[str, int] = field(default_factory=dict)  # the finished shard's rows and tokens
    token: str = ""  # unique to each write: a write whose reply was lost is known by its content

    @classmethod
    def decode(cls, data: bytes) -> Claim:
        """A claim from its JSON (fields this version does not know are ignored)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(data).items() if k in known})


@dataclass
class Held:
    """A claim this worker holds: the generation it last wrote."""

    shard_id: str
    generation: int
    results_generation: int = 0
    lost: bool = False
    finished: bool = False  # marked done: a renewal that comes late must not mark it running again


def _name(shard_id: str) -> str:
    return f"{CLAIMS_DIR}/{shard_id}.json"


class Claims:
    """One worker's side of the claims of one job.

    `results_name(shard_id)`: the shard's results object, relative to the store (None: results
    are not checked, as in tests of the claims alone). `clock`: the monotonic clock the lease is
    measured on (injected by tests)."""

    def __init__(
        self,
        store: ConditionalStore,
        job: str,
        worker: str,
        lease_s: float,
        results_name: Callable[[str], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.job, self.worker, self.lease_s = store, job, worker, lease_s
        self.results_name, self.clock = results_name, clock
        self._lock = threading.Lock()  # renewals, the results write and the finish of a claim
        self._seen: dict[str, tuple[int, float]] = {}  # shard id -> (generation, first seen at)

    def _encode(self, state: str, results_generation: int, counts: dict[str, int] | None = None) -> bytes:
        claim = Claim(self.job, self.worker, state, results_generation, counts or {}, uuid.uuid4().hex)
        return json.dumps(asdict(claim)).encode()

    def read(self, shard_id: str) -> tuple[Claim, int] | None:
        found = self.store.read(_name(shard_id))
        if found is None:
            return None
        data, generation = found
        return Claim.decode(data), generation

    def _write(self, shard_id: str, data: bytes, generation: int | None) -> int | None:
        """Create (generation None) or replace the claim; its new generation, or None when another
        worker's write came first. A failed precondition after a retried upload whose first try
        landed (the reply was lost) is recognised by the claim's content, unique to this write."""
        name = _name(shard_id)
        written = self.store.create(name, data) if generation is None else self.store.replace(name, data, generation)
        if written is None:
            found = self.store.read(name)
            if found is not None and found[0] == data:
                return found[1]
        return written

    def _stale(self, shard_id: str, generation: int) -> bool:
        """True once this worker has seen the claim at `generation` for the whole lease."""
        now = self.clock()
        seen = self._seen.get(shard_id)
        if seen is None or seen[0] != generation:
            self._seen[shard_id] = (generation, now)
            return False
        return now - seen[1] >= self.lease_s

    def has_results(self, shard_id: str) -> bool:
        """Whether the shard's results object exists (True when results are not checked)."""
        return self.results_name is None or self.store.generation(self.results_name(shard_id)) != 0

    def try_claim(self, shard_id: str) -> Held | str:
        """Hold the shard if nobody of this job does, or its holder stopped renewing for a lease,
        or it is this worker's own (a restarted worker with a stable --worker-id); else "done"
        (done, with its results there) or "busy"."""
        found = self.read(shard_id)
        current = None
        if found is not None:
            claim, current = found
            if claim.job == self.job:
                if claim.state == "done" and self.has_results(shard_id):
                    return "done"
                if claim.state == "running" and claim.worker != self.worker and not self._stale(shard_id, current):
                    return "busy"
        results_generation = 0 if self.results_name is None else self.store.generation(self.results_name(shard_id))
        generation = self._write(shard_id, self._encode("running", results_generation), current)
        self._seen.pop(shard_id, None)
        return "busy" if generation is None else Held(shard_id, generation, results_generation)

    def renew(self, held: Held) -> bool:
        """Rewrite the claim; False (and `held.lost`) when another worker took the shard."""
        with self._lock:
            if held.lost:
                return False
            if held.finished:
                return True
            generation = self._write(held.shard_id, self._encode("running", held.results_generation), held.generation)
            if generation is None:
                held.lost = True
                return False
            held.generation = generation
            return True

    def write_results(self, held: Held, data: bytes) -> bool:
        """Write the shard's results only while the claim is this worker's (fenced: see the module
        docstring); False (and `held.lost`) when another worker's results or claim came first."""
        assert self.results_name is not None, "write_results needs results_name"
        with self._lock:
            if held.lost:
                return False
            written = self.store.write_fenced(
                self.results_name(held.shard_id), data, _name(held.shard_id), held.generation, held.results_generation
            )
            if not written:
                held.lost = True
            return written

    def finish(self, held: Held, counts: dict[str, int]) -> bool:
        """Mark the shard done with its counts; False when the claim was lost meanwhile."""
        with self._lock:
            if held.lost:
                return False
            data = self._encode("done", held.results_generation, counts)
            generation = self._write(held.shard_id, data, held.generation)
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
