"""Warmup: compile, before the server says ready, every shape serving runs, so that no request
waits for XLA; then, on a background thread at the lowest CPU priority, the partial chunks after
cached positions (a prefix hit's rest), too many to compile before ready."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import jax

from serving.engine.api import PrefillRow
from serving.request import SamplingParams

if TYPE_CHECKING:
    from serving.engine.engine import Engine

log = logging.getLogger("serving.engine.engine")


def warmup(engine: Engine, params: dict, generate: bool = True) -> tuple[float, BackgroundWarmup | None]:
    """Compile what serving runs: every prefill_slots shape of fresh prompts (rows x length within
    the per-call budget) and, for every row count whose full chunks fit the budget, full chunks at
    every history window (long prompts' middle chunks, several at once); a prefix block's save
    and load; generate for every slot bucket and attention window.
    Then, unless `enable_background_warmup` is off, starts a `BackgroundWarmup`, which compiles the
    partial chunks after cached positions (a prefix hit's rest, a long prompt's last chunk: rows x
    length at every history window, minutes of compiling in all) at the lowest CPU priority while
    the server serves; a call that comes before its shape is done compiles it then. Returns the
    seconds spent and that background warmup (None when off), which the engine keeps as its
    `background_warmup` (Engine.warmup). `generate` false: no generate or verify shapes (a
    disaggregated server's prefill engine, which never decodes)."""
    start = time.perf_counter()
    limits = engine.limits
    state = engine.init_decode_state()
    probe = SamplingParams(max_tokens=1)
    rest = rest_shapes(engine)
    workers = parallel_workers(engine)
    compiled = precompile_parallel(engine, params, state, generate, workers)
    if workers:  # compiled with the rest: nothing is left for the background
        rest = []
    marks = [("parallel compiles", time.perf_counter())]
    shapes = chunk_shapes(engine)  # fresh prompts, then long prompts' middle chunks
    for rows, length, at in shapes:
        state, *_ = engine.prefill_slots(params, state, _rows(rows, length, at, probe))
    for slot in range(limits.max_concurrent_decodes):
        state = engine.free_resource(state, slot)
    jax.block_until_ready(state)
    marks.append(("chunk runs", time.perf_counter()))
    if generate:
        state = _warm_generate(engine, params, state)
        state = engine.warm_verify(params, state)  # speculative decoding's verify calls, when it runs
    jax.block_until_ready(state)
    marks.append(("generate runs", time.perf_counter()))
    background = start_background(engine, params, state, rest)
    seconds = time.perf_counter() - start
    at = start
    for name, when in marks:
        log.info("warmup: %s %.1f s", name, when - at)
        at = when
    log.info(
        "warmup: compiled %d chunked prefill shapes and %d generate shapes "
        "(%d slot buckets x %d windows; %d of them compiled in parallel first) in %.1f s",
        len(shapes),
        len(limits.decode_buckets) * len(engine.windows),
        len(limits.decode_buckets),
        len(engine.windows),
        compiled,
        seconds,
    )
    return seconds, background


def _fits(engine: Engine, rows: int, length: int, start: int = 0) -> bool:
    """One row always goes in a prefill_slots call; several within its token budget (a call after
    cached positions: its own, `Limits.batch_tokens`)."""
    return rows == 1 or rows * length <= engine.limits.batch_tokens(start)


def _rows(rows: int, length: int, at: int, probe: SamplingParams) -> list[PrefillRow]:
    """A prefill_slots call's rows of `length` tokens starting at `at`, in slots 0..rows-1."""
    return [PrefillRow(i, (1,) * length, at, True, probe) for i in range(rows)]


def _distinct(engine: Engine, shapes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """`shapes` (rows, length, start) without those whose call is another's program: the same rows
    and length reading the same history window (every start, 0 included, on a backend that reads
    chunks' histories in place through one window: ChunkedPrefill.history_window)."""
    seen: set[tuple[int, int, int]] = set()
    kept = []
    for rows, length, at in shapes:
        key = (rows, length, engine.history_window(at))
        if key not in seen:
            seen.add(key)
            kept.append((rows, length, at))
    return kept


def rest_shapes(engine: Engine, fresh_too: bool = False) -> list[tuple[int, int, int]]:
    """(rows, length, history window) of the partial chunks after cached positions (a prefix hit's
    rest, a long prompt's last chunk), the shortest first: a prefix hit's is usually a short
    question. Without `fresh_too`, none that is a fresh prompt's program too (`chunk_shapes`)."""
    limits = engine.limits
    fresh = set() if fresh_too else {(rows, length, engine.history_window(at)) for rows, length, at in chunk_shapes(engine)}
    return [
        (rows, length, window)
        for length in limits.buckets
        if length < limits.prefill_chunk_size
        for window in engine.history_windows
        for rows in engine.row_buckets
        if _fits(engine, rows, length, window) and (rows, length, window) not in fresh
    ]


def rest_start(engine: Engine, length: int, window: int) -> int | None:
    """Where a rest of `length` tokens reading `window` cached positions starts (None: no such call)."""
    at = min(window, engine.limits.max_target_length - length)
    return at if at > 0 and engine.history_window(at) == window else None


def parallel_workers(engine: Engine) -> int:
    """Threads that compile warmup's shapes at once: a TPU host's cores (each program compiles on
    the host while the chip idles; a v5e host has 13), none on a CPU, whose cores run the programs."""
    if engine.ops.pool_layout != "lanes":
        return 0
    return max(1, min(16, os.cpu_count() or 1))


def chunk_shapes(engine: Engine) -> list[tuple[int, int, int]]:
    """(rows, length, start) of every prefill_slots call warmup runs: fresh prompts of each length
    up to a chunk, and full chunks after each history window (each program once: `_distinct`)."""
    limits, chunk = engine.limits, engine.limits.prefill_chunk_size
    shapes = [
        (rows, length, 0)
        for length in limits.buckets
        if length <= chunk
        for rows in engine.row_buckets
        if _fits(engine, rows, length)
    ]
    for window in engine.history_windows:
        at = min(window, limits.max_target_length - chunk)
        if at > 0 and engine.history_window(at) == window:
            shapes += [(rows, chunk, at) for rows in engine.row_buckets if _fits(engine, rows, chunk, at)]
    return _distinct(engine, shapes)


def compile_jobs(engine: Engine, params, state_spec, generate: bool = True, prefill: bool = True) -> list:
    """Warmup's compiles as (function, arguments), each callable from any thread: every chunk shape
    and prefix-hit rest (with `prefill`; each row count's first-token program beside them), and
    (with `generate`) every generate shape; params and decode
    state abstract or real (shapes and placements are what count). The memory plan runs them in
    its own pool (serving.engine.compiled_memory), so that warmup finds them compiled."""
    probe = SamplingParams(max_tokens=1)
    jobs: list = []
    if prefill:
        starts = [(rows, length, rest_start(engine, length, window)) for rows, length, window in rest_shapes(engine)]
        jobs += [
            (engine.precompile_prefill_slots, (params, state_spec, _rows(rows, length, at, probe)))
            for rows, length, at in [*chunk_shapes(engine), *starts]
            if at is not None
        ]
    if generate:
        jobs += [
            (engine.precompile_generate, (params, state_spec, num_slots, window))
            for num_slots in engine.limits.decode_buckets
            for window in engine.windows
        ]
    return jobs


def run_jobs(jobs: list, workers: int) -> list[tuple[float, object]]:
    """Run `jobs` ((function, arguments)) on `workers` threads (XLA's compiles release the GIL);
    returns each one's (seconds, result), in order; the first error raises."""
    from concurrent.futures import ThreadPoolExecutor

    def timed(fn, *args) -> tuple[float, object]:
        started = time.perf_counter()
        result = fn(*args)
        return time.perf_counter() - started, result

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="warmup-compile") as pool:
        return [future.result() for future in [pool.submit(timed, fn, *args) for fn, args in jobs]]


def precompile_parallel(engine: Engine, params: dict, state, generate: bool, workers: int) -> int:
    """Compile every chunk shape, prefix-hit rest and (with `generate`) generate shape
    (`compile_jobs`) on `workers` threads, so that warmup's runs and requests find them compiled
    (those the memory plan compiled are not compiled again). Returns how many jobs ran (0 with no
    workers)."""
    if workers < 1:
        return 0
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    jobs = compile_jobs(engine, params, spec, generate)
    seconds = [t for t, _ in run_jobs(jobs, workers)]
    if seconds:
        log.info(
            "warmup: %d programs compiled on %d threads (or found compiled), %.1f s in all, the longest %.1f s",
            len(jobs), workers, sum(seconds), max(seconds),
        )
    return len(jobs)


def _warm_generate(engine: Engine, params: dict, state):
    """generate for every slot bucket and attention window (every slot free)."""
    steps = engine.config.decode_steps_per_call
    for num_slots in engine.limits.decode_buckets:
        for window in engine.windows:  # the position that makes generate choose this window
            state, _ = engine.generate(params, state, max_position=window - steps, num_slots=num_slots)
    return state


def warm_generate_side(engine: Engine, params: dict, prefiller: Engine, prefill_params: dict) -> float:
    """A disaggregated server's generate engine (its prefill engine warmed up on its own, without
    generate): a handoff of every page-count bucket both ways (a prompt's pages here, a preempted
    slot's state back), and generate for every slot bucket and attention window. Returns the
    seconds spent."""
    from serving.engine.handoff import padded_pages

    start = time.perf_counter()
    limits = engine.limits
    state, prefill_state = engine.init_decode_state(), prefiller.init_decode_state()
    counts = sorted({len(padded_pages([0] * n)) for n in range(1, limits.max_pages + 1)})
    for count in counts:  # scratch onto scratch: every page-count bucket's compile
        state = engine.accept(state, prefiller.handoff(prefill_state, 0, [0] * count), 0, [0] * count)
    prefill_state = prefiller.accept(prefill_state, engine.handoff(state, 0, ()), 0, ())
    state = _warm_generate(engine, params, engine.free_resource(state, 0))
    jax.block_until_ready((state, prefill_state))
    seconds = time.perf_counter() - start
    log.info(
        "warmup: %d handoff sizes and %d generate shapes on the generate engine in %.1f s",
        len(counts), len(limits.decode_buckets) * len(engine.windows), seconds,
    )
    return seconds


def warm_generate_alone(engine: Engine, params: dict) -> float:
    """A disaggregated server's generate engine on its own processes (multi-controller; the
    prefill group warms up its engine without generate): a handoff's accept for every page-count
    bucket (its own slot read back, scratch onto scratch) and generate for every slot bucket and
    attention window. Returns the seconds spent."""
    from serving.engine.handoff import padded_pages

    start = time.perf_counter()
    state = engine.init_decode_state()
    counts = sorted({len(padded_pages([0] * n)) for n in range(1, engine.limits.max_pages + 1)})
    for count in counts:
        state = engine.accept(state, engine.handoff(state, 0, [0] * count), 0, [0] * count)
    state = _warm_generate(engine, params, engine.free_resource(state, 0))
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    log.info(
        "warmup: %d handoff sizes and %d generate shapes on the generate engine in %.1f s",
        len(counts), len(engine.limits.decode_buckets) * len(engine.windows), seconds,
    )
    return seconds


def start_background(engine: Engine, params: dict, state, shapes: list[tuple[int, int, int]]) -> BackgroundWarmup | None:
    """A started `BackgroundWarmup` over `shapes` (compiled against `state`'s shapes and shardings),
    or None when `enable_background_warmup` is off: those shapes then compile at first use."""
    if not engine.config.enable_background_warmup:
        log.info("background warmup off: %d prefill shapes after cached positions compile at first use", len(shapes))
        return None
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return BackgroundWarmup(engine, params, spec, shapes)


class BackgroundWarmup:
    """A thread compiling prefill_slots for each (rows, length, history window) of `shapes`: rows
    starting after cached positions that read that window. It starts a shape only while the device
    loop is `idle()` (its compile threads are XLA's, at the process's priority: two cores compiling
    halve a running request's speed), at the lowest CPU priority for its own thread (Linux), checks
    `stop` between shapes, and counts what is `pending` (0 once done or stopped: a shape never
    compiled here compiles at first use)."""

    def __init__(self, engine: Engine, params: dict, spec, shapes: list[tuple[int, int, int]]):
        self._engine, self._params, self._spec, self._shapes = engine, params, spec, shapes
        self.pending = len(shapes)
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()  # until a device loop says otherwise
        self._thread = threading.Thread(target=self._run, name="background-warmup", daemon=True)
        # A process that exits without stopping it (an offline run, a CLI command) must not
        # finalize the interpreter under a compile in flight: at exit it stops after that shape.
        atexit.register(self.stop)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every shape is compiled (or it stopped); False when `timeout` ran out first."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def idle(self) -> None:
        """The device loop has nothing to run: the next shape may start."""
        self._idle.set()

    def busy(self) -> None:
        """The device loop runs requests: no new shape starts (the one compiling finishes)."""
        self._idle.clear()

    def stop(self) -> None:
        """Stop after the shape compiling now (seconds at most), and wait for that (also at the
        process's exit, when nobody stopped it)."""
        self._stop.set()
        self._idle.set()
        self._thread.join()

    def _run(self) -> None:
        engine, started, compiled = self._engine, time.perf_counter(), 0
        try:
            if sys.platform == "linux":
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            probe = SamplingParams(max_tokens=1)
            for rows, length, window in self._shapes:
                self._idle.wait()
                if self._stop.is_set():
                    break
                at = rest_start(engine, length, window)
                if at is not None:
                    compiled += engine.precompile_prefill_slots(self._params, self._spec, _rows(rows, length, at, probe))
                self.pending -= 1
        except Exception:  # never the device loop's problem: what is left compiles at first use
            log.exception("background warmup failed; the shapes left compile at first use")
        finally:
            self.pending = 0
            self._engine = self._params = self._spec = None  # the engine is not kept alive by atexit
            atexit.unregister(self.stop)
        log.info(
            "background warmup: compiled %d prefill shapes after cached positions in %.1f s",
            compiled,
            time.perf_counter() - started,
        )
