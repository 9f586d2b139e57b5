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

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import jax
import numpy as np

from serving.engine.engine import Engine
from serving.errors import GenerationError
from serving.metrics import EngineMetrics
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The admission queue is full; try again later."""


class ShuttingDownError(RuntimeError):
    """The orchestrator no longer accepts requests."""


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


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    submitted: float = field(default_factory=time.perf_counter)
    tokens: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # ints, then (_END, reason)
    cancelled: threading.Event = field(default_factory=threading.Event)


class RequestHandle:
    """A submitted request: iterate `stream()` for text deltas; `completion` afterwards."""

    def __init__(self, request: _Request, tokenizer: Tokenizer, orchestrator: Orchestrator):
        self._request = request
        self._tokenizer = tokenizer
        self._orchestrator = orchestrator
        self.completion: Completion | None = None

    def cancel(self) -> None:
        """Stop generating (the client went away); the slot is freed at the next step."""
        self._request.cancelled.set()
        self._orchestrator._wake.set()

    def stream(self) -> Iterator[Delta]:
        """Text deltas as tokens arrive; never splits a UTF-8 character; honours stop strings."""
        request = self._request
        decoder = self._tokenizer.incremental_decoder()
        text, ids, times = "", [], []
        emitted = 0  # characters of `text` already handed out
        hold = max((len(s) for s in request.stop_strings), default=1) - 1
        reason = "length"
        while True:
            item = request.tokens.get()
            if isinstance(item, tuple) and item[0] is _END:
                reason = item[1]
                text += decoder.flush()
                break
            ids.append(item)
            times.append(time.perf_counter() - request.submitted)
            text += decoder.push(item)
            stop_at = _find_stop(text, request.stop_strings, emitted)
            if stop_at is not None:
                text, reason = text[:stop_at], "stop"
                self.cancel()
                break
            safe = len(text) - hold if request.stop_strings else len(text)
            if safe > emitted:
                yield Delta(text[emitted:safe], [])
                emitted = safe
        if len(text) > emitted:
            yield Delta(text[emitted:], [])
        self.completion = Completion(
            text=text,
            token_ids=ids,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(ids),
            time_to_first_token=times[0] if times else 0.0,
            token_times=times,
        )
        metrics = self._orchestrator.metrics
        metrics.finished(reason)
        if len(times) > 1:
            metrics.observe("time_per_output_token", (times[-1] - times[0]) / (len(times) - 1))

    def result(self) -> Completion:
        """Drain the stream and return the final record."""
        for _ in self.stream():
            pass
        if self.completion is None:
            raise RuntimeError("the stream ended without a final record")
        return self.completion


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
    def has_work(self) -> bool:
        return not self._queue.empty() or self.metrics.active_slots > 0

    def submit(
        self, prompt_ids: list[int], sampling: SamplingParams, stop_strings: tuple[str, ...] = ()
    ) -> RequestHandle:
        """Queue a request; raises GenerationError (bad request), QueueFullError or ShuttingDownError."""
        if self._stopping.is_set():
            raise ShuttingDownError("the server is shutting down")
        self.engine.check_request(len(prompt_ids), sampling)
        request = _Request(list(prompt_ids), sampling, tuple(s for s in stop_strings if s))
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
                self.params, engine.pad_prompt(request.prompt_ids), len(request.prompt_ids), request.sampling
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
