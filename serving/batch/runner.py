"""`pathserve batch`: run every line of the input through the engine, shard by shard, resumably,
by one worker or many at once on the same input and output.

1. Plan the shards, or join the plan already under the output (checking the job's fingerprint
   against it). Of workers starting together, the one whose manifest write lands first plans
   (a create-if-absent write); the others read its plan.
2. Start the engine only if some shard is unfinished.
3. Claim a shard (serving.batch.claims: a conditional write, so one worker wins each), feed its
   rows continuously: a row is submitted as soon as there is room (slots + admission queue),
   across shard boundaries, so decode slots never wait for a shard to finish; the next shard is
   claimed as soon as the current one's rows are all in. Leases are renewed while shards run.
4. A finished shard is written behind, whole or not at all, by a worker still holding its claim,
   then its claim is marked done with its counts. With nothing left to claim, a worker waits for
   the shards others hold, and takes over any whose lease expired (a killed worker's). A shard
   whose claim this worker lost goes back into its queue.
5. At the end the done claims must cover every shard; else (or when lease renewals kept failing)
   the run fails naming the shards missing.
A rerun (or a restarted worker) skips done shards and redoes interrupted ones from their start,
so every input line ends up in exactly one output record.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from serving.batch import conditional, files, manifest, rows
from serving.batch.claims import CLAIMS_DIR, MIN_LEASE_S, Claims, Held
from serving.batch.errors import BatchError, IncompleteError
from serving.config import ServingConfig
from serving.errors import GenerationError, QueueFullError, failure
from serving.lora.errors import UnknownAdapterError
from serving.openai import convert, ignored
from serving.openai.errors import APIError
from serving.openai.fields import UnknownFieldPolicy

if TYPE_CHECKING:
    from serving.orchestrator import Orchestrator


class Started(Protocol):
    """An engine brought up behind its orchestrator (serving.launch.Launched)."""

    orchestrator: Orchestrator
    model_name: str

    def describe(self) -> str: ...


RETRY_FULL_QUEUE_S = 0.01
DEFAULT_LEASE_S = 60.0  # a dead worker's shard is taken over this long after its last renewal
RENEWAL_TRIES = 3  # failed renewals of one claim in a row (3/4 of a lease) before the worker stops
POLL_S = 1.0  # how often a worker with nothing left to claim looks again


@dataclass
class Summary:
    output: str
    rows_ok: int
    rows_failed: int
    tokens_in: int
    tokens_out: int
    shards: int
    shards_run: int
    shards_skipped: int
    wall_s: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def run_batch(
    input_url: str,
    output_url: str,
    source: str | None,
    cfg: ServingConfig,
    shard_size: int = 1000,
    restart: bool = False,
    progress: bool = True,
    start: Callable[[ServingConfig, str | None], Started] | None = None,
    worker_id: str | None = None,
    lease_s: float = DEFAULT_LEASE_S,
) -> Summary:
    """Run (or resume, or join) the job; returns totals over the whole output.

    Any number of workers may run this at once on the same input and output: they share the
    first one's plan and claim shards (serving.batch.claims). `start` brings up the engine
    behind an orchestrator (default: serving.launch.launch, as `serve` does), only when some shard
    is left to run. `worker_id`: a name stable across restarts of one worker lets it take back
    its own claims at once (default: unique to this process). Raises IncompleteError when the
    job's done claims do not cover every shard at the end, or renewals of a lease kept failing."""
    if lease_s < MIN_LEASE_S:
        raise BatchError(f"--lease-seconds {lease_s:g}: at least {MIN_LEASE_S:g}")
    started = time.perf_counter()
    files.check_output(output_url)
    inputs = files.list_inputs(input_url, output_url)
    fingerprint = manifest.fingerprint(input_url, inputs, source, cfg, shard_size)
    job = _plan_or_join(output_url, inputs, fingerprint, shard_size, restart)
    worker = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    output_names = {s.id: s.output_name for s in job.shards}
    claims = Claims(conditional.store(output_url), job.job, worker, lease_s, results_name=output_names.__getitem__)
    done = _done(job, claims, output_url)
    pending = [s for s in job.shards if s.id not in done]
    _note(f"{len(job.shards)} shards, {len(job.shards) - len(pending)} already finished (worker {worker})", progress)
    ran: list[str] = []
    failed = None
    if pending:
        if start is None:
            from serving.launch import launch as start
        started_engine = start(cfg, source)
        _note(f"engine ready: {started_engine.describe()}", progress)
        orchestrator = started_engine.orchestrator
        try:
            run = _Job(orchestrator, started_engine.model_name, cfg, job, output_url, claims, progress)
            asyncio.run(run.run(pending))
            ran, failed = run.ran, run.failed
        finally:
            orchestrator.stop(timeout=30)
    files.remove_stale_temporaries(output_url, older_than_s=2 * lease_s)
    done = _done(job, claims, output_url)
    totals = {key: sum(c.get(key, 0) for c in done.values()) for key in _COUNTS}
    summary = Summary(
        output=output_url,
        **totals,
        shards=len(job.shards),
        shards_run=len(ran),
        shards_skipped=len(job.shards) - len(ran),
        wall_s=round(time.perf_counter() - started, 3),
    )
    job.finished = {s.id: done[s.id] for s in job.shards if s.id in done}
    manifest.save(output_url, job)  # the same content whichever worker writes it last
    missing = [s.id for s in job.shards if s.id not in done]
    if failed is not None or missing:
        shown = ", ".join(missing[:20]) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
        why = f"{failed}; " if failed is not None else ""
        raise IncompleteError(f"--output {output_url}: {why}{len(missing)} shards not finished: {shown or 'none'}")
    files.write_atomic(files.join(output_url, manifest.SUMMARY), summary.to_json().encode())
    return summary


_COUNTS = ("rows_ok", "rows_failed", "tokens_in", "tokens_out")


def _plan_or_join(
    output_url: str, inputs: list[files.InputFile], fingerprint: dict[str, Any], shard_size: int, restart: bool
) -> manifest.Manifest:
    """The job's manifest: the one under the output (checked against these arguments), or a new
    plan, written only if no other worker's got there first (then theirs)."""
    if restart:
        _clear(output_url)
    for _ in range(3):
        job = manifest.load(output_url)
        if job is not None:
            if changed := "; ".join(manifest.differences(job.fingerprint, fingerprint)):
                raise BatchError(
                    f"--output {output_url} holds a job run with other arguments ({changed}); "
                    "rerun with the same arguments to resume, or add --restart to start over"
                )
            return job
        planned = manifest.Manifest(fingerprint, manifest.plan(inputs, shard_size), job=uuid.uuid4().hex)
        if manifest.create(output_url, planned):
            _remove_foreign_results(output_url, planned)
            return planned
    raise BatchError(f"--output {output_url}: the manifest appeared and vanished; is another job using --restart?")


def _done(job: manifest.Manifest, claims: Claims, output_url: str) -> dict[str, dict[str, int]]:
    """Finished shards (id -> counts) whose results are there: this job's done claims, and the
    manifest's own record of a job run before claims existed."""
    done = {sid: c.counts for sid, c in claims.status([s.id for s in job.shards]).items() if c.state == "done"}
    if not job.job:
        done.update(job.finished)
    output = {s.id: s.output_name for s in job.shards}
    existing = set(files.list_names(output_url))
    return {sid: counts for sid, counts in done.items() if output[sid] in existing}


def _clear(output_url: str) -> None:
    """Remove what an earlier job wrote under the output (only our own files)."""
    ours = {manifest.MANIFEST, manifest.SUMMARY, files.TMP_DIR, CLAIMS_DIR}
    for name in files.list_names(output_url):
        if name in ours or name.startswith(manifest.RESULTS_PREFIX):
            files.remove(files.join(output_url, name))


def _remove_foreign_results(output_url: str, job: manifest.Manifest) -> None:
    """Results of an earlier job's shards that this plan does not have (another shard size): they
    would repeat lines. Results of this plan's shard names are overwritten when each shard runs."""
    planned = {s.output_name for s in job.shards}
    for name in files.list_names(output_url):
        if name.startswith(manifest.RESULTS_PREFIX) and name not in planned:
            files.remove(files.join(output_url, name))


def _note(message: str, progress: bool) -> None:
    if progress:
        print(f"pathserve batch: {message}", file=sys.stderr, flush=True)


def _warn(message: str) -> None:
    """A note printed even with --quiet: something went wrong."""
    print(f"pathserve batch: warning: {message}", file=sys.stderr, flush=True)


class _Job:
    """The asyncio side of a run: rows in, records out, shards written behind."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        model_name: str,
        cfg: ServingConfig,
        job: manifest.Manifest,
        output_url: str,
        claims: Claims,
        progress: bool,
    ):
        self.orchestrator = orchestrator
        self.tokenizer = orchestrator.tokenizer
        self.model_name = model_name
        self.cfg = cfg
        self.job = job
        self.output_url = output_url
        self.claims = claims
        self.held: dict[str, Held] = {}  # claims this worker holds and renews
        self.shards = {s.id: s for s in job.shards}
        self.requeued: dict[str, manifest.Shard] = {}  # shards whose claim this worker lost
        self.renewal_failures: dict[str, int] = {}  # shard id -> failed renewals in a row
        self.failed: str | None = None  # why this worker stopped taking shards
        self.ran: list[str] = []  # shards this worker finished
        self.capacity = orchestrator.capacity  # slots + max_queued_requests: what submit admits at once
        self.unknown_fields = UnknownFieldPolicy(cfg.unknown_request_fields)
        self.bar = None
        self.progress = progress
        self.tokens_out = 0

    async def run(self, pending: list[manifest.Shard]) -> None:
        """Claim a shard, feed its rows, claim the next as soon as they are all in; when nothing is
        left to claim, wait for this worker's writes, then for other workers' shards to finish
        or for their leases to expire (then take them over)."""
        self.loop = asyncio.get_running_loop()
        self.room = asyncio.Semaphore(self.capacity)
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=sum(s.lines for s in pending),
                unit="row",
                file=sys.stderr,
                mininterval=0.5 if sys.stderr.isatty() else 10.0,
                dynamic_ncols=True,
            )
        self.started = time.perf_counter()
        renewing = asyncio.create_task(self._renew_leases())
        writes: list[asyncio.Task] = []
        # Each worker starts its search at its own place, so that workers starting together do
        # not all race for the first shard.
        offset = zlib.crc32(self.claims.worker.encode()) % len(pending)
        order = pending[offset:] + pending[:offset]
        try:
            while self.failed is None:
                order += [s for s in self.requeued.values() if s not in order]
                self.requeued.clear()
                busy = [w for w in writes if not w.done()]
                if not order:  # only this worker's writes left: they may lose a claim (requeued)
                    if not busy:
                        break
                    await asyncio.wait(busy, return_when=asyncio.FIRST_COMPLETED)
                    continue
                claimed, order = await asyncio.to_thread(self._claim_next, order)
                if claimed is None:
                    if order:  # other workers hold the rest: look again after a while
                        await asyncio.wait(busy, timeout=POLL_S) if busy else await asyncio.sleep(POLL_S)
                    continue
                shard, held = claimed
                lines = await asyncio.to_thread(_read, shard)
                tasks = []
                for number, raw in lines:
                    await self.room.acquire()
                    tasks.append(asyncio.create_task(self._row(shard, number, raw)))
                writes.append(asyncio.create_task(self._write(shard, held, tasks)))
            await asyncio.gather(*writes)
        finally:
            renewing.cancel()
        if self.bar is not None:
            self.bar.close()

    def _claim_next(self, order: list[manifest.Shard]) -> tuple[tuple[manifest.Shard, Held] | None, list[manifest.Shard]]:
        """The first shard of `order` this worker could claim, and the shards still to look at
        (those done by anyone dropped; those others hold kept, to take over if they stall)."""
        left = []
        for i, shard in enumerate(order):
            outcome = self.claims.try_claim(shard.id)
            if isinstance(outcome, Held):
                self.held[shard.id] = outcome
                return (shard, outcome), left + order[i + 1 :]
            if outcome == "busy":
                left.append(shard)
        return None, left

    def _lose(self, held: Held, why: str) -> None:
        """This run of the shard is dropped; the shard goes back into the queue (unless this worker
        stopped taking shards), to be found done by another worker or claimed again."""
        _warn(f"shard {held.shard_id}: {why}; dropping this run of it")
        if self.held.get(held.shard_id) is held:  # not a later claim of it by this worker
            del self.held[held.shard_id]
        if self.failed is None:
            self.requeued[held.shard_id] = self.shards[held.shard_id]

    async def _renew_leases(self) -> None:
        """Renew every held claim a few times per lease. A renewal that raises (a transient storage
        error) is logged and retried at the next round; RENEWAL_TRIES in a row stop the worker."""
        while True:
            await asyncio.sleep(self.claims.lease_s / 4)
            for held in list(self.held.values()):
                await self._renew(held)

    async def _renew(self, held: Held) -> None:
        try:
            ours = await asyncio.to_thread(self.claims.renew, held)
        except Exception as exc:  # any storage error: retried, counted
            tries = self.renewal_failures.get(held.shard_id, 0) + 1
            self.renewal_failures[held.shard_id] = tries
            _warn(f"shard {held.shard_id}: renewing its claim failed ({tries} in a row): {exc!r}")
            if tries >= RENEWAL_TRIES and self.failed is None:
                self.failed = f"renewing the claim of shard {held.shard_id} failed {tries} times in a row"
                _warn(f"{self.failed}: taking no more shards")
            return
        self.renewal_failures.pop(held.shard_id, None)
        if not ours:
            self._lose(held, "another worker took its claim over")

    async def _row(self, shard: manifest.Shard, number: int, raw: bytes) -> dict[str, Any]:
        record_id = f"batch_req_{shard.file_index}_{number}"
        custom_id = None
        try:
            row = rows.parse(raw, record_id)
            custom_id = row.custom_id
            self.unknown_fields.check(row.body)  # an error record naming them, unless warn
            ignored.note(row.body)  # fields with no effect here (metadata, user, ...): logged once
            ids = convert.prompt_ids(row.body, self.tokenizer, self.cfg.max_target_length)
            # Without a seed a row samples from one derived from its id: a rerun gives the same text.
            params = convert.openai_sampling(
                row.body,
                self.tokenizer,
                len(ids),
                self.cfg.max_target_length,
                default_seed=zlib.crc32(custom_id.encode()),
            )
            adapter = convert.adapter_of(row.body.model, self.model_name, self.orchestrator.adapters)
            params = replace(params, adapter=adapter)
            handles = await self._submit(ids, params, row.body.stop_strings())
            completions = await asyncio.gather(*(self._drain(h) for h in handles))
            if (failed := failure(c.finish_reason for c in completions)) is not None:
                if failed.kind == "engine":  # no record: the run fails here, and a rerun serves this row
                    raise failed
                self._advance(0)  # the adapter was unloaded while the row waited: 404, as serve answers
                return rows.error_record(record_id, custom_id, 404, "model_not_found", str(failed))
            body = convert.response_body(
                row.body, record_id, int(time.time()), adapter or self.model_name, completions, ids, self.tokenizer
            )
            self._advance(sum(c.completion_tokens for c in completions))
            return rows.ok_record(record_id, custom_id, body)
        except rows.RowError as exc:
            self._advance(0)
            return rows.error_record(record_id, exc.custom_id, exc.status, exc.code, exc.message)
        except APIError as exc:
            self._advance(0)
            return rows.error_record(record_id, custom_id, exc.status, exc.code or "invalid_request", str(exc))
        except GenerationError as exc:
            self._advance(0)
            return rows.error_record(record_id, custom_id, 400, exc.code or "invalid_request", str(exc))
        except UnknownAdapterError as exc:  # unloaded since the row was checked
            self._advance(0)
            return rows.error_record(record_id, custom_id, 404, "model_not_found", str(exc))
        finally:
            self.room.release()

    @staticmethod
    async def _drain(handle):
        async for _ in handle.astream():
            pass
        return handle.completion

    async def _submit(self, ids: list[int], params, stops: tuple[str, ...]):
        """One handle per choice."""
        while True:  # the room semaphore keeps this rare: only other submitters can fill the queue
            try:
                return self.orchestrator.submit_choices(ids, params, stops, loop=self.loop)
            except QueueFullError:
                await asyncio.sleep(RETRY_FULL_QUEUE_S)

    def _advance(self, tokens: int) -> None:
        self.tokens_out += tokens
        if self.bar is not None:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix(tokens_per_s=f"{self.tokens_out / elapsed:.1f}", refresh=False)
            self.bar.update(1)

    async def _write(self, shard: manifest.Shard, held: Held, tasks: list[asyncio.Task]) -> None:
        """The shard's records, written only while this worker still holds its claim; then the
        claim is marked done with the counts (the summary adds them up)."""
        records = await asyncio.gather(*tasks)
        if not await asyncio.to_thread(self.claims.renew, held):  # taken over: theirs is kept
            self._lose(held, "another worker took its claim over")
            return
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        if not await asyncio.to_thread(self.claims.write_results, held, data):
            self._lose(held, "another worker took its claim over before its results were written")
            return
        counts = {
            "rows_ok": sum(r["error"] is None for r in records),
            "rows_failed": sum(r["error"] is not None for r in records),
            "tokens_in": sum(
                r["response"]["body"]["usage"]["prompt_tokens"] for r in records if r["error"] is None
            ),
            "tokens_out": sum(
                r["response"]["body"]["usage"]["completion_tokens"] for r in records if r["error"] is None
            ),
        }
        if await asyncio.to_thread(self.claims.finish, held, counts):
            if self.held.get(shard.id) is held:
                del self.held[shard.id]
            self.ran.append(shard.id)
        else:
            self._lose(held, "another worker took its claim over before it was marked done")


def _read(shard: manifest.Shard) -> list[tuple[int, bytes]]:
    """(line number, bytes) of a shard's non-blank lines."""
    lines = files.iter_lines(shard.file, shard.start, shard.end)
    return [(shard.first_line + i, raw) for i, raw in enumerate(lines) if raw.strip()]
