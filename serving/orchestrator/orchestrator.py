"""Continuous batching: one thread owns the engine, requests come and go through queues.

1. `submit()` (any thread: HTTP handlers, the batch runner) checks the request against the engine's
   limits and puts it on the bounded admission queue. A full queue fails at once with
   `QueueFullError`, so callers can answer "busy" instead of waiting.
2. The device thread loops:
   a. frees the slots of cancelled requests (`Engine.free_resource`);
   b. admits queued requests while slots are free: `prefill` then `insert`; the first token goes
      to the request's stream right away;
   c. runs `generate` for all active slots (k steps per call) and hands each slot's new tokens to
      its request's stream; slots whose request finished become free for (b) on the next turn,
      so a waiting request starts within one generate call of a slot freeing.
3. Each request's tokens travel through its own queue to whoever reads `RequestHandle.stream()`;
   detokenization and stop strings happen there, off the device thread. A stop string ends the
   request (the slot is freed like a cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import jax
import numpy as np

from serving.engine.engine import Engine
from serving.errors import GenerationError, QueueFullError, ShuttingDownError
from serving.orchestrator.metrics import EngineMetrics
from serving.request import SamplingParams
from serving.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["Completion", "Delta", "Orchestrator", "QueueFullError", "RequestHandle", "ShuttingDownError"]


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]


@dataclass
class Completion:
    """The final record of a request."""

    text: str
    token_ids: list[int]
    finish_reason: str  # stop, length or cancelled
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float
    token_times: list[float]  # seconds since submission, one per completion token


_END = object()


class _LoopQueue:
    """Items put by the device thread, awaited on an asyncio event loop (no thread per reader)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is reading any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def get_async(self):
        return await self._queue.get()


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    # ints, then (_END, reason); a SimpleQueue for thread readers, a _LoopQueue for asyncio readers
    tokens: queue.SimpleQueue | _LoopQueue = field(default_factory=queue.SimpleQueue)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)


class _Assembler:
    """Turns a request's token items into text deltas: UTF-8 safe, stop strings held back and cut."""

    def __init__(self, request: _Request, tokenizer: Tokenizer):
        self.request = request
        self.decoder = tokenizer.incremental_decoder()
        self.text = ""
        self.ids: list[int] = []
        self.times: list[float] = []
        self.emitted = 0  # characters of `text` already handed out
        self.emitted_ids = 0
        self.hold = max((len(s) for s in request.stop_strings), default=1) - 1
        self.reason = ""

    def feed(self, item) -> Delta | None:
        """The delta this item makes available (if any); sets `reason` when the request ended."""
        request = self.request
        if isinstance(item, tuple) and item[0] is _END:
            self.reason = item[1]
            self.text += self.decoder.flush()
            return self._delta(len(self.text))
        self.ids.append(item)
        self.times.append(time.perf_counter() - request.submitted)
        self.text += self.decoder.push(item)
        stop_at = _find_stop(self.text, request.stop_strings, self.emitted)
        if stop_at is not None:
            self.text, self.reason = self.text[:stop_at], "stop"
            return self._delta(len(self.text))
        return self._delta(len(self.text) - self.hold if request.stop_strings else len(self.text))

    def _delta(self, safe: int) -> Delta | None:
        if safe <= self.emitted:
            return None  # nothing new to show yet; its tokens travel with the next delta
        delta = Delta(self.text[self.emitted : safe], self.ids[self.emitted_ids :])
        self.emitted, self.emitted_ids = safe, len(self.ids)
        return delta

    def completion(self) -> Completion:
        return Completion(
            text=self.text,
            token_ids=self.ids,
            finish_reason=self.reason,
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=len(self.ids),
            time_to_first_token=self.times[0] if self.times else 0.0,
            token_times=self.times,
        )


class RequestHandle:
    """A submitted request: iterate `stream()` (threads) or `astream()` (asyncio, when submitted
    with `loop=`) for text deltas; `completion` afterwards."""

    def __init__(self, request: _Request, tokenizer: Tokenizer, orchestrator: Orchestrator):
        self._request = request
        self._orchestrator = orchestrator
        self._assembler = _Assembler(request, tokenizer)
        self.completion: Completion | None = None

    def cancel(self) -> None:
        """Stop generating (the client went away); the slot is freed at the next step."""
        self._request.cancelled.set()
        self._orchestrator._wake.set()

    def stream(self) -> Iterator[Delta]:
        """Text deltas as tokens arrive; never splits a UTF-8 character; honours stop strings."""
        tokens = self._request.tokens
        if not isinstance(tokens, queue.SimpleQueue):
            raise TypeError("this request was submitted for asyncio: read it with astream()")
        while not self._assembler.reason:
            delta = self._assembler.feed(tokens.get())
            if delta is not None:
                yield delta
        self._finish()

    async def astream(self) -> AsyncIterator[Delta]:
        """`stream()` for asyncio readers. Leaving early (the client went away) cancels the request."""
        tokens = self._request.tokens
        if not isinstance(tokens, _LoopQueue):
            raise TypeError("this request was not submitted with loop=: read it with stream()")
        try:
            while not self._assembler.reason:
                delta = self._assembler.feed(await tokens.get_async())
                if delta is not None:
                    yield delta
        finally:
            if not self._assembler.reason:
                self._assembler.reason = "cancelled"
            self._finish()

    def result(self) -> Completion:
        """Drain the stream and return the final record."""
        for _ in self.stream():
            pass
        if self.completion is None:
            raise RuntimeError("the stream ended without a final record")
        return self.completion

    def _finish(self) -> None:
        if self.completion is not None:
            return
        if self._assembler.reason in ("stop", "cancelled") and not self._request.cancelled.is_set():
            self.cancel()  # a stop string or a reader that left: free the slot
        self.completion = self._assembler.completion()
        metrics = self._orchestrator.metrics
        c = self.completion
        metrics.finished(c.finish_reason, c.prompt_tokens, c.completion_tokens)
        times = self.completion.token_times
        if len(times) > 1:
            metrics.observe("time_per_output_token", (times[-1] - times[0]) / (len(times) - 1))


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> int | None:
    positions = [i for s in stops if (i := text.find(s, max(0, start - len(s)))) >= 0]
    return min(positions) if positions else None


class Orchestrator:
    """Owns the engine's device loop; thread-safe `submit`."""

    def __init__(self, engine: Engine, params: dict, tokenizer: Tokenizer, max_queued_requests: int):
        self.engine = engine
        self.params = params
        self.tokenizer = tokenizer
        self.metrics = EngineMetrics(total_slots=engine.max_concurrent_decodes)
        self.metrics.kv_tokens_capacity = engine.max_concurrent_decodes * engine.cfg.max_target_length
        self._queue: queue.Queue[_Request] = queue.Queue(maxsize=max_queued_requests)
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self.last_progress = time.monotonic()  # for liveness: the loop made progress at this time
        self._thread = threading.Thread(target=self._run, name="device-loop", daemon=True)
        self._profile_lock = threading.Lock()
        self._profile: tuple[int, str] | None = None  # (generate calls to trace, directory)
        self._profiling_left = 0

    def start(self) -> Orchestrator:
        cfg = self.engine.cfg
        if cfg.profiler_port:
            jax.profiler.start_server(cfg.profiler_port)
            log.info("profiler server on port %d", cfg.profiler_port)
        if cfg.profiler_steps and cfg.profile_dir:
            self.request_profile(cfg.profiler_steps, cfg.profile_dir)
        self._thread.start()
        return self

    def request_profile(self, steps: int, directory: str) -> None:
        """Trace the next `steps` generate calls (with their admissions) into `directory`."""
        with self._profile_lock:
            self._profile = (steps, directory)
        self._wake.set()

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The device loop is running (false before start and after a crash or stop)."""
        return self._thread.is_alive()

    @property
    def has_work(self) -> bool:
        return not self._queue.empty() or self.metrics.active_slots > 0

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stop_strings: tuple[str, ...] = (),
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestHandle:
        """Queue a request; raises GenerationError (bad request), QueueFullError or ShuttingDownError.

        With `loop`, the tokens are delivered onto that event loop: read them with `astream()`.
        """
        if self._stopping.is_set():
            raise ShuttingDownError("the server is shutting down")
        self.engine.limits.check(len(prompt_ids), sampling)
        request = _Request(list(prompt_ids), sampling, tuple(s for s in stop_strings if s))
        if loop is not None:
            request.tokens = _LoopQueue(loop)
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            with self.metrics.lock:
                self.metrics.requests_rejected += 1
            raise QueueFullError(
                f"the admission queue is full ({self._queue.maxsize} requests waiting)"
            ) from None
        self.metrics.queued = self._queue.qsize()
        self._wake.set()
        return RequestHandle(request, self.tokenizer, self)

    # -- the device thread ---------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        state = engine.init_decode_state()
        slots: dict[int, _Request] = {}
        free = list(range(engine.max_concurrent_decodes))[::-1]
        while not (self._stopping.is_set() and not slots and self._queue.empty()):
            for slot, request in list(slots.items()):
                if request.cancelled.is_set():
                    state = engine.free_resource(state, slot)
                    self._finish(slots.pop(slot), "cancelled")
                    free.append(slot)
            while free and not self._queue.empty():
                request = self._queue.get_nowait()
                if request.cancelled.is_set():
                    self._finish(request, "cancelled")
                    continue
                state = self._admit(request, state, free, slots)
            self.metrics.queued = self._queue.qsize()
            self.metrics.active_slots = len(slots)
            if not slots:
                self.last_progress = time.monotonic()
                self._wake.wait(timeout=0.05)
                self._wake.clear()
                continue
            self._maybe_start_trace()
            started = time.perf_counter()
            state, result = engine.generate(self.params, state)
            tokens, valid, done = (np.asarray(x) for x in result)
            self.metrics.observe("generate_step", time.perf_counter() - started)
            self._maybe_stop_trace()
            self.last_progress = time.monotonic()
            for step in range(tokens.shape[0]):
                for slot, request in list(slots.items()):
                    if not valid[step, slot]:
                        continue
                    token = int(tokens[step, slot])
                    request.tokens.put(token)
                    if done[step, slot]:
                        self._finish(
                            slots.pop(slot), "stop" if token in request.sampling.stop_ids else "length"
                        )
                        free.append(slot)
            self.metrics.kv_tokens_used = int(np.asarray(state.positions)[list(slots)].sum()) if slots else 0

    def _maybe_start_trace(self) -> None:
        with self._profile_lock:
            pending, self._profile = self._profile, None
        if pending is None or self._profiling_left:
            return
        steps, directory = pending
        jax.profiler.start_trace(directory)
        self._profiling_left = steps
        log.info("profiling %d generate calls into %s", steps, directory)

    def _maybe_stop_trace(self) -> None:
        if self._profiling_left:
            self._profiling_left -= 1
            if not self._profiling_left:
                jax.profiler.stop_trace()
                log.info("profile written")

    def _admit(self, request: _Request, state, free: list[int], slots: dict[int, _Request]):
        engine = self.engine
        started = time.perf_counter()
        try:
            prefix, first = engine.prefill(
                self.params, engine.limits.pad(request.prompt_ids), len(request.prompt_ids), request.sampling
            )
        except GenerationError as exc:  # checked at submit; kept as a guard for the loop
            log.warning("request rejected at prefill: %s", exc)
            self._finish(request, "error")
            return state
        self.metrics.observe("prefill_step", time.perf_counter() - started)
        request.tokens.put(first)
        self.metrics.observe("time_to_first_token", time.perf_counter() - request.submitted)
        if first in request.sampling.stop_ids or request.sampling.max_tokens <= 1:
            self._finish(request, "stop" if first in request.sampling.stop_ids else "length")
            return state
        slot = free.pop()
        slots[slot] = request
        return engine.insert(prefix, state, slot)

    def _finish(self, request: _Request, reason: str) -> None:
        request.tokens.put((_END, reason))
