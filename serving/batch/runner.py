"""`pathserve batch`: run every line of the input through the engine, shard by shard, resumably.

1. Plan (or, on a rerun, reload) the shards and check the job's fingerprint against the manifest's.
2. Start the engine only if some shard is unfinished.
3. Feed rows continuously: a row is submitted as soon as there is room (slots + admission queue),
   across shard boundaries, so decode slots never wait for a shard to finish. The next shard's lines
   are read while the current one runs; finished shards are written behind, each atomically,
   then recorded in the manifest (also written atomically).
A rerun skips finished shards; a shard that was running when the job died is run again from its
start and replaces nothing, so every input line ends up in exactly one output record.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from serving.batch import files, manifest, rows
from serving.batch.errors import BatchError
from serving.config import ServingConfig
from serving.errors import GenerationError, QueueFullError
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
) -> Summary:
    """Run (or resume) the job; returns totals over the whole output.

    `start` brings up the engine behind an orchestrator (default: serving.launch.launch, as
    `serve` does), only when some shard is left to run."""
    started = time.perf_counter()
    files.check_output(output_url)
    inputs = files.list_inputs(input_url)
    fingerprint = manifest.fingerprint(input_url, inputs, source, cfg, shard_size)
    job = None if restart else manifest.load(output_url)
    if job is not None and job.fingerprint != fingerprint:
        changed = "; ".join(manifest.differences(job.fingerprint, fingerprint))
        raise BatchError(
            f"--output {output_url} holds a job run with other arguments ({changed}); "
            "rerun with the same arguments to resume, or add --restart to start over"
        )
    if job is None:
        _clear(output_url)
        job = manifest.Manifest(fingerprint, manifest.plan(inputs, shard_size))
        manifest.save(output_url, job)
    pending = [
        s
        for s in job.shards
        if s.id not in job.finished or not files.exists(files.join(output_url, s.output_name))
    ]
    _note(f"{len(job.shards)} shards, {len(job.shards) - len(pending)} already finished", progress)
    if pending:
        if start is None:
            from serving.launch import launch as start
        started_engine = start(cfg, source)
        _note(f"engine ready: {started_engine.describe()}", progress)
        orchestrator = started_engine.orchestrator
        try:
            asyncio.run(_Job(orchestrator, started_engine.model_name, cfg, job, output_url, progress).run(pending))
        finally:
            orchestrator.stop(timeout=30)
    files.remove(files.join(output_url, files.TMP_DIR))  # temporaries of writes a kill interrupted
    totals = {key: sum(c[key] for c in job.finished.values()) for key in _COUNTS}
    summary = Summary(
        output=output_url,
        **totals,
        shards=len(job.shards),
        shards_run=len(pending),
        shards_skipped=len(job.shards) - len(pending),
        wall_s=round(time.perf_counter() - started, 3),
    )
    files.write_atomic(files.join(output_url, manifest.SUMMARY), summary.to_json().encode())
    return summary


_COUNTS = ("rows_ok", "rows_failed", "tokens_in", "tokens_out")


def _clear(output_url: str) -> None:
    """Remove what an earlier job wrote under the output (only our own files)."""
    ours = {manifest.MANIFEST, manifest.SUMMARY, files.TMP_DIR}
    for name in files.list_names(output_url):
        if name in ours or name.startswith(manifest.RESULTS_PREFIX):
            files.remove(files.join(output_url, name))


def _note(message: str, progress: bool) -> None:
    if progress:
        print(f"pathserve batch: {message}", file=sys.stderr, flush=True)


class _Job:
    """The asyncio side of a run: rows in, records out, shards written behind."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        model_name: str,
        cfg: ServingConfig,
        job: manifest.Manifest,
        output_url: str,
        progress: bool,
    ):
        self.orchestrator = orchestrator
        self.tokenizer = orchestrator.tokenizer
        self.model_name = model_name
        self.cfg = cfg
        self.job = job
        self.output_url = output_url
        self.capacity = orchestrator.capacity  # slots + max_queued_requests: what submit admits at once
        self.unknown_fields = UnknownFieldPolicy(cfg.unknown_request_fields)
        self.bar = None
        self.progress = progress
        self.tokens_out = 0

    async def run(self, pending: list[manifest.Shard]) -> None:
        self.loop = asyncio.get_running_loop()
        self.room = asyncio.Semaphore(self.capacity)
        self.manifest_lock = asyncio.Lock()
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
        writes = []
        ahead = asyncio.create_task(asyncio.to_thread(_read, pending[0]))
        for i, shard in enumerate(pending):
            lines = await ahead
            if i + 1 < len(pending):  # read the next shard while this one runs
                ahead = asyncio.create_task(asyncio.to_thread(_read, pending[i + 1]))
            tasks = []
            for number, raw in lines:
                await self.room.acquire()
                tasks.append(asyncio.create_task(self._row(shard, number, raw)))
            writes.append(asyncio.create_task(self._write(shard, tasks)))
        await asyncio.gather(*writes)
        if self.bar is not None:
            self.bar.close()

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
            body = convert.response_body(
                row.body, record_id, int(time.time()), adapter or self.model_name, completions, ids, self.tokenizer
            )
            self._advance(sum(c.completion_tokens for c in completions))
            return rows.ok_record(record_id, custom_id, body)
        except rows.RowError as exc:
            self._advance(0)
            return rows.error_record(record_id, exc.custom_id, exc.code, exc.message)
        except (APIError, GenerationError) as exc:
            self._advance(0)
            code = exc.code or "invalid_request"
            return rows.error_record(record_id, custom_id, code, str(exc))
        except UnknownAdapterError as exc:  # unloaded since the row was checked
            self._advance(0)
            return rows.error_record(record_id, custom_id, "model_not_found", str(exc))
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

    async def _write(self, shard: manifest.Shard, tasks: list[asyncio.Task]) -> None:
        records = await asyncio.gather(*tasks)
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
        await asyncio.to_thread(files.write_atomic, files.join(self.output_url, shard.output_name), data)
        counts = {
            "rows_ok": sum(r["error"] is None for r in records),
            "rows_failed": sum(r["error"] is not None for r in records),
            "tokens_in": sum(
                r["response"]["body"]["usage"]["prompt_tokens"] for r in records if r["response"]
            ),
            "tokens_out": sum(
                r["response"]["body"]["usage"]["completion_tokens"] for r in records if r["response"]
            ),
        }
        async with self.manifest_lock:
            self.job.finished[shard.id] = counts
            text = self.job.to_json().encode()
            await asyncio.to_thread(files.write_atomic, files.join(self.output_url, manifest.MANIFEST), text)


def _read(shard: manifest.Shard) -> list[tuple[int, bytes]]:
    """(line number, bytes) of a shard's non-blank lines."""
    lines = files.iter_lines(shard.file, shard.start, shard.end)
    return [(shard.first_line + i, raw) for i, raw in enumerate(lines) if raw.strip()]
