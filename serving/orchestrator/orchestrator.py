"""Continuous batching: one thread owns the engine, requests come and go through queues.

1. `submit()` (any thread: HTTP handlers, gRPC, the batch runner) checks the request against the
   engine's limits and puts it on the admission queue. The server holds at most slots +
   `max_queued_requests` requests, counting those in slots and those queued alike (a free slot is
   room, even before the device loop has taken anyone into it); beyond that `submit` fails at once
   with `QueueFullError`, so callers can answer "busy" instead of waiting.
2. The device thread loops; each turn is one `_step` (schedule, execute, update), an empty plan an
   idle wait for the next submit:
   a. decide (serving.orchestrator.scheduler, plain Python): the slots of cancelled requests are
      freed (decoding or still prefilling), queued requests take the lowest free slots, the next
      prompt chunks are picked for one batched prefill (prefix-cache blocks reused and kept), a
      generate call runs over the decoding slots (padded to a slot bucket) if any slot decodes (with speculative
      decoding on and proposals, a verify call: serving.orchestrator.proposers); the result is a
      `StepPlan`;
   b. execute (serving.orchestrator.executor): free_resource, LoRA adapter writes, set_pages,
      one prefill_slots call (a chunk that scores the prompt: alone, prefill_slots_scored), then
      generate (k steps per call), on the engine;
   c. deliver: each first token (at once, before the generate call) and each slot's new tokens go
      to their request's stream; finished slots are free for (a) on the next turn, so a waiting
      request starts within one generate call of a slot freeing.
3. Each request's tokens travel through its own queue to whoever reads `RequestHandle.stream()`
   (serving.orchestrator.streams); detokenization and stop strings happen there, off the device
   thread. A stop string ends the request (the slot is freed like a cancellation).
4. A request with n > 1 choices is queued as n requests back to back (it counts as n against the
   bound) and admitted whole: one prefill into n slots. A request under a grammar has one
   matcher per choice (serving.structured), made here and handed to the scheduler, whose records
   hold them: it advances each with its tokens and puts their next-token masks into the plan.
5. The engine's background warmup (serving.engine.warmup) starts a shape only after an idle turn
   and none after a busy one, so its compiles keep out of the way of requests (the executor tells
   it: serving.orchestrator.executor.Executor.idle / run / close).
6. A request naming a LoRA adapter (serving.lora.registry) takes its adapter's device slot as it
   leaves the queue; when every slot of max_loras is held by running requests it waits at the head
   of the queue, as for a decode slot. Its choices give the slot back as they finish. Taking the
   slot only decides (under the submitters' lock, so in memory only): an adapter not resident comes
   with an `AdapterLoad` that goes into this turn's plan, and the executor writes it (its weights
   read from storage there if the host copy is gone, on the device thread, under no lock `submit`
   or the readiness check takes), before the request prefills. A multi-host follower executes the
   same load from the same plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from serving.config import OrchestratorConfig
from serving.engine.api import EngineAPI
from serving.errors import ADAPTER_UNLOADED, ENGINE_FAILED, QueueFullError, ShuttingDownError
from serving.lora.errors import UnknownAdapterError
from serving.orchestrator.ahead import RunAhead, finish, start
from serving.orchestrator.executor import AdapterWeights, Executor, Started
from serving.orchestrator.metrics import EngineMetrics
from serving.orchestrator.proposers import Speculator
from serving.orchestrator.scheduler import Scheduler, StepOutcome, StepPlan, Waiting
from serving.orchestrator.streams import (
    ANSWER,
    END,
    Answer,
    ChoiceGroup,
    Completion,
    Delta,
    LoopQueue,
    PromptLogprobs,
    Request,
    RequestHandle,
)
from serving.request import SamplingParams, TokenLogprob
from serving.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from serving.lora.registry import Acquired, AdapterLoad, AdapterRegistry

log = logging.getLogger(__name__)

__all__ = ["Completion", "Delta", "Orchestrator", "RequestHandle"]

IDLE_WAIT_S = 0.05


class Orchestrator:
    """Owns the engine's device loop; thread-safe `submit`."""

    def __init__(
        self,
        engine: EngineAPI,
        params,
        tokenizer: Tokenizer,
        config: OrchestratorConfig,
        make_executor: Callable[[EngineAPI, Any, AdapterWeights | None], Executor] = Executor,
        adapters: AdapterRegistry | None = None,
    ):
        """`make_executor(engine, params, adapter_weights)` builds the executor on the device thread
        (multi-host: serving.orchestrator.lockstep's, which broadcasts each plan first);
        `adapter_weights` is the registry's `weights` (None without adapters). `adapters`: the LoRA
        adapters (None: requests naming one are refused as unknown)."""
        self.engine = engine
        self.adapters = adapters
        self._adapter_of: dict[int, tuple[str, int]] = {}  # request id -> (adapter, version) it holds
        self._make_executor = make_executor
        self.params = params
        self.tokenizer = tokenizer
        self.config = config
        limits = engine.limits
        self.metrics = EngineMetrics(total_slots=limits.max_concurrent_decodes)
        self.metrics.adapter_stats = adapters.stats if adapters is not None else None
        self.metrics.kv_tokens_capacity = (limits.num_pages - 1) * limits.page_size  # page 0 is scratch
        self.metrics.kv_block_size = limits.page_size
        # The cache-config info's num_gpu_blocks, as the picker's prefix scorer reads it: the pages
        # a cached prefix may stay in (the pool is the prefix cache).
        if config.prefix_cache == "on":
            self.metrics.prefix_cache_blocks = limits.num_pages - 1
        self.metrics.adapters_updated = time.time()
        warmup = engine.background_warmup  # its count from the start, before the loop's first turn
        self.metrics.warmup_shapes_pending = warmup.pending if warmup is not None else 0
        # Unbounded: `submit` bounds what the server holds (`_admits`), slots included.
        self._queue: queue.Queue[Request] = queue.Queue()
        self._submit_lock = threading.Lock()  # a request's choices enter the queue together
        self._held: Request | None = None  # a queue head whose choices did not fit in the free slots
        self._num_in_slots = 0  # requests the device loop took and has not finished (under _submit_lock)
        self._grammars = None  # serving.structured.GrammarCompiler, made at the first grammar
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._failed = False  # the device loop raised (serving.errors.ENGINE_FAILED)
        # request id -> when the device loop ended it, until it is answered (its reader took its
        # last token, or the HTTP answer it went into was sent: `answer_scope`): while an idle
        # loop gathers a burst, answers still being written keep it gathering (a closed loop's
        # clients send their next requests as their answers come)
        self._answering: dict[int, float] = {}
        self._answering_lock = threading.Lock()
        self.last_progress = time.monotonic()  # for liveness: the loop made progress at this time
        self._thread = threading.Thread(target=self._run, name="device-loop", daemon=True)
        self._profile_lock = threading.Lock()
        self._profile: tuple[int, str] | None = None  # (generate calls to trace, directory)
        self._profiling_left = 0

    def start(self) -> Orchestrator:
        config = self.config
        if config.profiler_port:
            import jax

            jax.profiler.start_server(config.profiler_port)
            log.info("profiler server on port %d", config.profiler_port)
        if config.profiler_steps and config.profile_dir:
            self.request_profile(config.profiler_steps, config.profile_dir)
        self._thread.start()
        return self

    def request_profile(self, steps: int, directory: str) -> None:
        """Trace the next `steps` generate calls (with their admissions) into `directory`."""
        with self._profile_lock:
            self._profile = (steps, directory)
        self._wake.set()

    def wake(self) -> None:
        """Have the device loop look at its queue and cancellations now."""
        self._wake.set()

    def answered(self, request: Request) -> None:
        """A request is answered: its reader took its last token (RequestHandle), or the answer
        it went into was written (`answer_scope`)."""
        with self._answering_lock:
            self._answering.pop(request.request_id, None)

    @contextlib.contextmanager
    def answer_scope(self) -> Iterator[None]:
        """The requests submitted within (this context's) are answered when the scope ends, not
        when their readers take their last token: an HTTP route's answer is written after that
        (the gate wraps its generation routes), and a wave of clients sends its next requests as
        the answers arrive."""
        answer = Answer()
        token = ANSWER.set(answer)
        try:
            yield
        finally:
            ANSWER.reset(token)
            answer.written = True
            for request in answer.requests:
                self.answered(request)

    def _answers_pending(self, within: float) -> bool:
        """Whether a request the device loop ended in the last `within` seconds still has its last
        token unread (an older one, whose reader never came, no longer counts)."""
        since = time.monotonic() - within
        with self._answering_lock:
            for rid in [rid for rid, ended in self._answering.items() if ended < since]:
                del self._answering[rid]
            return bool(self._answering)

    def stop(self, timeout: float | None = None) -> None:
        """End the device loop (queued and running requests finish first); its executor's close
        stops the engine's background warmup (after the shape it is compiling, so no compile
        outlives the server)."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The device loop is running (false before start, after a stop, and from the moment it
        failed: the requests it ends then are told after this says so)."""
        return self._thread.is_alive() and not self._failed

    @property
    def has_work(self) -> bool:
        return not self._queue_empty() or self.metrics.active_slots > 0

    def _queue_empty(self) -> bool:
        return self._queue.empty() and self._held is None

    def _waiting(self) -> int:
        """Requests waiting for a slot: the queue's, and the head the device loop holds back
        (it left the queue but still waits)."""
        held = self._held
        return self._queue.qsize() + (held.sampling.n if held is not None else 0)

    def _record_waiting_adapters(self) -> None:
        """The adapters the waiting requests name, for the endpoint picker's LoRA affinity
        (the model-server protocol's `waiting_lora_adapters`), with the time of this reading."""
        with self._queue.mutex:
            waiting = [r.sampling.adapter for r in self._queue.queue]
        held = self._held
        names = {name for name in [*waiting, held.sampling.adapter if held is not None else None] if name}
        with self.metrics.lock:
            self.metrics.waiting_adapters = tuple(sorted(names))
            self.metrics.adapters_updated = time.time()

    @property
    def capacity(self) -> int:
        """Requests the server holds at most: every decode slot plus max_queued_requests waiting."""
        return self.engine.limits.max_concurrent_decodes + self.config.max_queued_requests

    def _admits(self, count: int) -> bool:
        """Whether `count` more requests fit: those in slots and those waiting count alike, so an
        idle server takes a burst of slots + max_queued_requests at once (under _submit_lock)."""
        return self._num_in_slots + self._waiting() + count <= self.capacity

    def full(self) -> bool:
        """No room for one more request (readiness reports it)."""
        with self._submit_lock:
            return not self._admits(1)

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
        if sampling.n != 1:
            raise ValueError("a request with n > 1 choices goes through submit_choices")
        return self.submit_choices(prompt_ids, sampling, stop_strings, loop)[0]

    def submit_choices(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        stop_strings: tuple[str, ...] = (),
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> list[RequestHandle]:
        """`submit` for a request of `sampling.n` choices: one handle per choice, in order."""
        if self._stopping.is_set():
            raise ShuttingDownError("the server is shutting down")
        # n choices need no more than the slots (each a sequence of its own, in chunks)
        self.engine.limits.check(len(prompt_ids), sampling)
        if sampling.adapter is not None:
            if self.adapters is None:
                raise UnknownAdapterError(sampling.adapter)
            self.adapters.check(sampling.adapter)
        matchers = self._matchers(sampling)
        stops = tuple(s for s in stop_strings if s)
        group = ChoiceGroup(sampling.n)
        requests = [
            Request(list(prompt_ids), sampling, stops, choice=i, grammar=matchers[i], group=group)
            for i in range(sampling.n)
        ]
        answer = ANSWER.get()
        for request in requests:
            if loop is not None:
                request.tokens = LoopQueue(loop)
            if answer is not None:
                request.answer = answer
                answer.requests.append(request)
        with self._submit_lock:
            if not self._admits(len(requests)):
                with self.metrics.lock:
                    self.metrics.requests_rejected += 1
                raise QueueFullError(
                    f"the admission queue is full ({self.config.max_queued_requests} requests waiting, "
                    "every decode slot taken)"
                )
            for request in requests:
                self._queue.put_nowait(request)
        self.metrics.queued = self._waiting()
        self._wake.set()
        return [RequestHandle(request, self.tokenizer, self) for request in requests]

    def _matchers(self, sampling: SamplingParams) -> list:
        """One grammar matcher per choice (None without a grammar); GenerationError for a bad one."""
        if sampling.grammar is None:
            return [None] * sampling.n
        if self._grammars is None:
            from serving.structured import GrammarCompiler  # imports the grammar library (slow)

            self._grammars = GrammarCompiler(self.tokenizer)
        compiled = self._grammars.compile(sampling.grammar)
        return [self._grammars.matcher(compiled) for _ in range(sampling.n)]

    # -- the device thread ---------------------------------------------------------------------

    def _run(self) -> None:
        running: dict[int, Request] = {}  # request id -> request, while it holds a slot
        try:
            self._loop(running)
        except Exception:
            # The device loop died (an XLA or kernel error, out of memory): end every stream with
            # ENGINE_FAILED instead of leaving its reader waiting; liveness reports the dead loop.
            log.exception("the device loop failed")
            self._failed = True  # dead from here on (liveness), before any request hears of it
            self._stopping.set()
            for request in running.values():
                self._finish(request, ENGINE_FAILED)
            groups = self._take(self._queue.qsize() + 1 + self.engine.limits.max_concurrent_decodes)
            for group, _load in groups:
                for request in group:
                    self._finish(request, ENGINE_FAILED)

    def _loop(self, running: dict[int, Request]) -> None:
        engine = self.engine
        executor = self._make_executor(engine, self.params, self.adapters.weights if self.adapters else None)
        scheduler = Scheduler(
            engine.limits, engine.decode_steps_per_call, self.config.prefix_cache == "on", self._speculator(),
            handoffs=self.config.disaggregated, burst_first=self.config.admission_wait_ms > 0,
        )
        ahead = RunAhead(
            scheduler, self.config.async_scheduling and getattr(executor, "pipelines", False),
            lambda started: self._finish_started(executor, started),
            lambda plan, outcome, slots, projected: self._update(scheduler, plan, outcome, slots, running, projected),
        )
        while not (self._stopping.is_set() and not running and self._queue_empty()):
            if not running or scheduler.young:  # nothing decodes yet: the queue's requests may be a burst's
                self._gather_arrivals()
            if not self._step(scheduler, executor, ahead, running):
                executor.idle()
                self.last_progress = time.monotonic()
                self._wake.wait(timeout=IDLE_WAIT_S)
                self._wake.clear()
        ahead.land()
        executor.close()

    def _gather_arrivals(self) -> None:
        """With requests queued and nothing running but sequences with their first token only:
        wait while more keep arriving (each within
        `admission_gap_ms` of the last, `admission_wait_ms` at most in all), so that a burst is
        scheduled as one (config.OrchestratorConfig.admission_wait_ms says why), and while the
        answers of requests that just ended are still being written: a wave of clients sends its
        next requests as each reads its answer, and a host writing 64 answers took 80 ms on a
        TPU VM, its arrivals between them more than a gap apart (split into prefill calls of 3,
        1, 9, 35 and 16 rows, decoding out of step)."""
        wait = self.config.admission_wait_ms / 1000
        if wait <= 0 or self._queue_empty() or self._stopping.is_set() or self._slots_spoken_for():
            return
        began, gap = time.monotonic(), self.config.admission_gap_ms / 1000
        deadline, first, ended = began + wait, self._waiting(), "the wait's end"
        while (left := deadline - time.monotonic()) > 0:
            if self._wake.wait(timeout=min(gap, left)):
                self._wake.clear()
                if self._stopping.is_set() or self._slots_spoken_for():  # a stop, or no room left to gather into
                    ended = "a stop" if self._stopping.is_set() else "every free slot taken"
                    break
            elif not self._answers_pending(wait):  # a gap with no arrival, and no answer left to write
                ended = "a gap"
                break
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "gathered %d arrivals to %d waiting in %.1f ms, ended by %s",
                self._waiting() - first, self._waiting(), (time.monotonic() - began) * 1e3, ended,
            )

    def _slots_spoken_for(self) -> bool:
        """The requests waiting take every free slot: a later arrival could not join their turn."""
        with self._submit_lock:
            return self._waiting() >= self.engine.limits.max_concurrent_decodes - self._num_in_slots

    def _step(self, scheduler: Scheduler, executor: Executor, ahead: RunAhead, running: dict[int, Request]) -> bool:
        """One turn of the device loop: schedule (the queue's heads and the cancellations into a
        plan), execute (the plan on the engine, first tokens streamed as they come), update (the
        tokens onto their streams, the scheduler's records, the finished requests ended). With
        async scheduling, where the scheduler `runs_ahead`, the plan's generate call stays in
        flight: the next turn makes and starts its plan first, then reads this one's tokens
        (serving.orchestrator.ahead), so that the device is not idle while the host streams tokens
        and schedules. False when the plan was empty and nothing was in flight (nothing ran)."""
        plan = self._schedule(scheduler, executor, ahead, running)
        if plan.empty:
            return ahead.land()
        slots = {slot: running[r.request_id] for slot, r in scheduler.running.items()}
        ahead.started(plan, self._start(executor, plan, slots), slots)
        return True

    def _schedule(
        self, scheduler: Scheduler, executor: Executor, ahead: RunAhead, running: dict[int, Request]
    ) -> StepPlan:
        """The turn's plan: cancelled requests end, queued ones (with their adapters' loads and their
        grammars' matchers) go to the scheduler; the metrics of the queue and the slots. A
        plan in flight lands first where the scheduler cannot run ahead of it."""
        ahead.land_unless_ahead()
        cancelled = {rid for rid, r in running.items() if r.cancelled.is_set()}
        groups = self._take(scheduler.room(cancelled))
        self._dequeued([group for group, _load in groups])
        for group, _load in groups:
            running.update((r.request_id, r) for r in group)
        waiting = [_waiting(group, load) for group, load in groups]
        plan = scheduler.schedule(waiting, cancelled)
        for rid, tokens in scheduler.take_cached().items():
            if rid in running:
                running[rid].cached_tokens = tokens
        for rid in cancelled:
            self._finish(running.pop(rid), "cancelled")
        self._left_slots(len(cancelled))
        self.metrics.queued = self._waiting()
        self.metrics.active_slots = scheduler.num_used
        if self.adapters is not None:
            self._record_waiting_adapters()
        warmup = executor.background_warmup
        self.metrics.warmup_shapes_pending = warmup.pending if warmup is not None else 0
        return plan

    def _start(self, executor: Executor, plan: StepPlan, slots: dict[int, Request]) -> Started:
        """The plan started on the engine (traced when a profile was asked for): first tokens
        streamed, the prefill calls' times observed, its generate call in flight."""
        if plan.decode_steps:
            self._maybe_start_trace()
        started = start(
            executor, plan, on_first_token=lambda slot, *first, slots=slots: self._first_token(slots[slot], *first)
        )
        for seconds in started.timings.prefills:
            self.metrics.observe("prefill_step", seconds)
        self.last_progress = time.monotonic()
        if log.isEnabledFor(logging.DEBUG):  # the call timeline (PATHSERVE_LOG_LEVEL=DEBUG; make bench-tpu's serve.log)
            log.debug(
                "turn: %d prefill rows (%d tokens, %d final) in %s s, %d decoding x %d steps, %d queued",
                len(plan.rows), sum(len(r.tokens) for r in plan.rows), len(plan.first_token_slots),
                ",".join(f"{t:.3f}" for t in started.timings.prefills), plan.running if plan.decode_steps else 0,
                plan.decode_steps, self.metrics.queued,
            )
        return started

    def _finish_started(self, executor: Executor, started: Started) -> StepOutcome:
        """A started plan's outcome (its generate call's tokens read), the call's time observed."""
        outcome = finish(executor, started)
        if started.timings.generate is not None:
            self.metrics.observe("generate_step", started.timings.generate)
            self._maybe_stop_trace()
        self.last_progress = time.monotonic()
        return outcome

    def _update(
        self, scheduler: Scheduler, plan: StepPlan, outcome: StepOutcome, slots: dict[int, Request],
        running: dict[int, Request], projected: dict[int, int] | None = None,
    ) -> None:
        """The generate call's tokens onto their streams, the scheduler's records updated, and the
        requests that finished ended (stop or length). `projected`: the plan ran ahead
        (Scheduler.project); a request that ended since gets none of its tokens."""
        self._deliver(outcome, slots)
        finished = scheduler.update(plan, outcome, projected)
        for rid, _slot in finished:
            request = running.pop(rid)
            self._finish(request, "stop" if request.last_token in request.sampling.stop_ids else "length")
        self._left_slots(len(finished))
        self._record(scheduler)

    def _speculator(self) -> Speculator | None:
        """Speculative decoding's proposer and policy (None with speculative_method=none)."""
        config = self.config.speculative
        if config.speculative_method == "none":
            return None
        if config.speculative_method == "draft" and self.engine.draft is None:
            raise ValueError("speculative_method=draft, but the engine has no draft model (serving.engine.draft)")
        draft_cost = 0.0
        if config.speculative_method == "draft":
            given = config.speculative_draft_cost_ratio
            draft_cost = given if given >= 0 else self.engine.draft.cost_in_steps
        return Speculator(config, chunk=self.engine.limits.prefill_chunk_size, draft_cost=draft_cost)

    def _record(self, scheduler: Scheduler) -> None:
        """The scheduler's slots and prefix cache into the metrics, after a turn."""
        metrics, pool = self.metrics, scheduler.pool
        with metrics.lock:
            metrics.active_slots = scheduler.num_used
            metrics.kv_tokens_used = scheduler.kv_tokens_used()
            metrics.kv_pages_used = pool.num_used
            metrics.preemptions = scheduler.preemptions
            if scheduler.prefix_caching:
                metrics.prefix_cache_hits, metrics.prefix_cache_misses = pool.hits, pool.misses
                metrics.prefix_cache_bytes = pool.num_cached * self.engine.page_bytes
            if scheduler.speculator is not None:
                stats = scheduler.speculator.stats
                metrics.speculative_method = scheduler.speculator.config.speculative_method
                metrics.spec_proposed, metrics.spec_accepted = stats.proposed, stats.accepted
                metrics.spec_rounds = stats.rounds

    def _take(self, room: int) -> list[tuple[list[Request], AdapterLoad | None]]:
        """Whole requests (each the list of its choices) from the queue, oldest first, while their
        choices fit in `room` slots; a head that does not fit waits (held) for the next turn.
        Cancelled ones end here. Under the submitters' lock: a request's choices are all there, and
        a submitter never sees a head that is neither queued nor held. Each with the adapter load
        its LoRA slot needs, or None (for the plan: nothing is read or written here)."""
        taken: list[tuple[list[Request], AdapterLoad | None]] = []
        cancelled: list[Request] = []
        unknown: list[Request] = []  # their adapter was unloaded while they waited
        with self._submit_lock:
            while True:
                head, self._held = self._held, None
                if head is None:
                    try:
                        head = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if head.sampling.n > room and not head.cancelled.is_set():
                    self._held = head
                    break
                lora = None if head.cancelled.is_set() else self._acquire_adapter(head)
                if lora is False:  # every adapter slot held by running requests: wait for one
                    self._held = head
                    break
                group = [head, *(self._queue.get_nowait() for _ in range(head.sampling.n - 1))]
                if head.cancelled.is_set() or (lora is None and head.sampling.adapter is not None):
                    (cancelled if head.cancelled.is_set() else unknown).extend(group)
                    continue
                load = None
                if lora:
                    self._hold_adapter(group, lora.slot, lora.version)
                    load = lora.load
                taken.append((group, load))
                room -= len(group)
                self._num_in_slots += len(group)
            if self._held is not None:  # the rest wait behind it: those whose clients left end now
                cancelled.extend(self._sweep_cancelled())
        for request in cancelled:
            self._finish(request, "cancelled")
        for request in unknown:
            self._finish(request, ADAPTER_UNLOADED)
        return taken

    def _dequeued(self, groups: list[list[Request]]) -> None:
        """The requests just taken into slots (JetStream's dequeue for prefill): when, for their
        time to first token, and their time in the queue and prompt length, once a request."""
        now = time.perf_counter()
        for group in groups:
            for request in group:
                request.dequeued = now
            self.metrics.admitted(now - group[0].submitted, len(group[0].prompt_ids))

    def _sweep_cancelled(self) -> list[Request]:
        """Take the cancelled requests (each with its choices: a request's n entries are
        consecutive) out of the queue, leaving the others in order, and return them. Without it a
        queue whose head waits for slots kept requests whose clients had gone: they counted as
        waiting (the picker's queue size) and against `max_queued_requests` (429s, readiness 503).
        Under _submit_lock."""
        with self._queue.mutex:
            entries = list(self._queue.queue)
            kept, swept, at = [], [], 0
            while at < len(entries):
                group = entries[at : at + entries[at].sampling.n]
                (swept if group[0].cancelled.is_set() else kept).extend(group)
                at += len(group)
            if swept:
                self._queue.queue.clear()
                self._queue.queue.extend(kept)
        return swept

    def _acquire_adapter(self, head: Request) -> Acquired | tuple[()] | bool | None:
        """The head's adapter's device slot (serving.lora.registry.acquire); () without one; False
        when no slot is free; None when the adapter is no longer loaded."""
        name = head.sampling.adapter
        if name is None or self.adapters is None:
            return ()
        try:
            lora = self.adapters.acquire(name, head.sampling.n)
        except UnknownAdapterError:
            log.warning("request %d: LoRA adapter %r was unloaded before it ran", head.request_id, name)
            return None
        return False if lora is None else lora

    def _hold_adapter(self, group: list[Request], slot: int, version: int) -> None:
        """The group's requests run with the adapter's device slot until each finishes."""
        for request in group:
            request.sampling = dataclasses.replace(request.sampling, lora_slot=slot, lora_version=version)
            self._adapter_of[request.request_id] = (request.sampling.adapter, version)

    def _left_slots(self, count: int) -> None:
        """`count` requests the device loop took have finished: their room is free for `submit`."""
        if count:
            with self._submit_lock:
                self._num_in_slots -= count

    def _first_token(
        self,
        request: Request,
        token: int,
        logprob: TokenLogprob | None,
        prompt_logprobs: tuple[TokenLogprob | None, ...] | None,
    ) -> None:
        """A prefill's token onto its stream at once (before the turn's generate call); with
        max_tokens 0 (scoring the prompt) only the prompt's logprobs. The time to first token is
        JetStream's: from the request's dequeue into its slots, once a request (its choices are
        prefilled together: choice 0's), and once a sequence (a preempted sequence's prefill gives
        its next token, not its first)."""
        first = request.last_token is None and request.choice == 0
        if prompt_logprobs is not None:
            request.tokens.put(PromptLogprobs(prompt_logprobs))
        if request.sampling.max_tokens > 0:
            request.put(token, logprob)
        if first:
            self.metrics.observe("time_to_first_token", time.perf_counter() - request.dequeued)

    def _deliver(self, outcome: StepOutcome, slots: dict[int, Request]) -> None:
        """Each step's tokens of the generate call onto their requests' streams: a request's tokens
        of the call handed over at once, in order (one wake-up of its reader per call)."""
        if not outcome.tokens:
            return
        for slot, request in slots.items():
            if request.ended:  # cancelled (or finished) since its plan ran ahead: nothing more
                continue
            wanted = request.sampling.wants_logprobs and outcome.logprobs is not None
            items = [
                outcome.token_logprob(step, slot) if wanted else step_tokens[slot]
                for step, (step_tokens, step_valid) in enumerate(zip(outcome.tokens, outcome.valid, strict=True))
                if step_valid[slot]
            ]
            request.put_many(items)

    def _maybe_start_trace(self) -> None:
        with self._profile_lock:
            pending, self._profile = self._profile, None
        if pending is None or self._profiling_left:
            return
        import jax

        steps, directory = pending
        # the device's ops and JAX's dispatch, not every Python call: tracing those slowed the
        # served path's host several times over on a TPU VM (its requests admitted apart), so the
        # timeline was no longer the one served; also as JSON that ui.perfetto.dev opens
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0
        jax.profiler.start_trace(directory, create_perfetto_trace=True, profiler_options=options)
        self._profiling_left = steps
        log.info("profiling %d generate calls into %s", steps, directory)

    def _maybe_stop_trace(self) -> None:
        if self._profiling_left:
            self._profiling_left -= 1
            if not self._profiling_left:
                import jax

                jax.profiler.stop_trace()
                log.info("profile written")

    def _finish(self, request: Request, reason: str) -> None:
        request.ended = True
        held = self._adapter_of.pop(request.request_id, None)
        if held is not None:
            self.adapters.release(*held)
        if self.config.admission_wait_ms > 0 and not request.cancelled.is_set():  # its reader takes the end, then answers
            with self._answering_lock:
                self._answering[request.request_id] = time.monotonic()
        request.tokens.put((END, reason))


def _waiting(group: list[Request], load: AdapterLoad | None = None) -> Waiting:
    """The scheduler's view of a request and its choices (all in the same grammar state), with its
    adapter's load (None: no adapter, or it is resident)."""
    head = group[0]
    grammars = tuple(r.grammar for r in group) if head.grammar is not None else ()
    ids = tuple(r.request_id for r in group[1:])
    return Waiting(head.request_id, tuple(head.prompt_ids), head.sampling, ids, grammars, load)
