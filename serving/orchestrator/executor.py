"""Execute: run a `StepPlan` on an engine. The only code that calls the engine (and so the device);
it owns the decode state and the host copy of every slot's block table (the scheduler decides the
tables, so every host of a multi-host slice holds the same ones). Every host runs the same plans in
the same order.

Order within a plan: frees and preemptions, LoRA adapter writes (`adapter_loads`: each adapter's
weights from `adapter_weights`, written into its device slot by `engine.write_adapter`), the changed
block tables (one write of the whole table), the `prefill_slots` call (a row that scores the
prompt: alone, `prefill_slots_scored`), the generate call (over the plan's `slots`; first the engine's draft
model's proposals when the plan has `draft_rows`).

An adapter's weights come from storage at most here, on the device loop's thread and under no lock
a request's submitter takes: `adapter_weights` is process 0's registry (its host copy, read again
only when the host LRU dropped it) or, on a multi-host follower, a read of the adapter's path.

Host syncs: each first token (the plan's stream needs it, and whether the generate call runs
depends on it: a `prefill_slots` call's final rows in one read, with their logprobs; a scored
row's prompt logprobs beside them) and the generate call's tokens (with their
logprobs, when it made them). Nothing else is read back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from serving.engine.api import BackgroundCompiles, EngineAPI, ResultTokens
from serving.engine.limits import finishes_at_first_token
from serving.lora.peft import LoraWeights
from serving.lora.registry import AdapterLoad
from serving.orchestrator.plan import StepOutcome, StepPlan
from serving.request import TokenLogprob


@dataclass
class Timings:
    """Seconds the last plan's engine calls took (for the metrics)."""

    prefills: list[float] = field(default_factory=list)  # the prefill calls alone (whole or chunked)
    generate: float | None = None


# the weights of a plan's adapter load: process 0's registry (AdapterRegistry.weights) or a
# multi-host follower's read from storage (serving.lora.serving.storage_reader)
AdapterWeights = Callable[[AdapterLoad], LoraWeights]

# on_first_token(slot, token, its logprobs, the prompt's logprobs): once per slot of the plan's
# `first_token_slots`, in that order, before the generate call
FirstTokenHook = Callable[[int, int, TokenLogprob | None, tuple[TokenLogprob | None, ...] | None], None]


@dataclass
class Started:
    """A plan `Executor.start`ed: its outcome before the generate call (first tokens), the call's
    results still on the device (None: no generate call), when it was dispatched, its timings."""

    plan: StepPlan
    outcome: StepOutcome
    result: ResultTokens | None
    dispatched: float
    timings: Timings


@dataclass
class _Firsts:
    """The plan's first tokens as they come, in `first_token_slots` order."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def outcome(self) -> StepOutcome:
        """A plan's outcome before its generate call."""
        return StepOutcome(tuple(self.tokens), first_logprobs=tuple(self.logprobs))


class Executor:
    def __init__(self, engine: EngineAPI, params, adapter_weights: AdapterWeights | None = None):
        """`adapter_weights`: the weights of a plan's adapter load (None: this server has no
        adapters, and a plan that loads one is refused)."""
        self.engine = engine
        self.params = params
        self.adapter_weights = adapter_weights
        self.state = engine.init_decode_state()
        self.pages: np.ndarray | None = None  # the block tables, from the first plan that sets one
        self.timings = Timings()
        # slot -> the prompt logprobs its earlier chunks scored (a request for them, in chunks)
        self._scores: dict[int, tuple[TokenLogprob, ...]] = {}

    # `start` and `finish` split `run` at the generate call (the device loop may make and start
    # the next plan before reading this one's tokens: serving.orchestrator.scheduler.runs_ahead)
    pipelines = True

    def run(self, plan: StepPlan, on_first_token: FirstTokenHook | None = None) -> StepOutcome:
        """Execute `plan`; `on_first_token` is called for each slot that samples its first token
        as soon as its prefill has (before the generate call), so a stream need not wait for it.
        The engine's background warmup starts no shape from here until the next `idle()`."""
        return self.finish(self.start(plan, on_first_token))

    def start(self, plan: StepPlan, on_first_token: FirstTokenHook | None = None) -> Started:
        """`run` up to its generate call, dispatched and not read: the device computes it while the
        host goes on (`finish` reads it). Calls on the device run in the order they are started."""
        self._prepare(plan)
        firsts = _Firsts()
        if plan.rows:
            self.state = self._prefill_rows(self.engine, self.params, self.state, plan, firsts, on_first_token)
        samplings = plan.first_token_samplings
        active = plan.running > 0 or any(
            not finishes_at_first_token(t, s) for t, s in zip(firsts.tokens, samplings, strict=True)
        )
        result, dispatched = None, time.perf_counter()
        if plan.decode_steps and active:
            result = self._dispatch(plan)
        return Started(plan, firsts.outcome(), result, dispatched, self.timings)

    def finish(self, started: Started) -> StepOutcome:
        """A started plan's outcome: its generate call's tokens read back (a wait for the device)."""
        if started.result is None:
            return started.outcome
        return self._read(started.result, started.outcome, started.dispatched, started.timings)

    def _prefill_rows(
        self, engine: EngineAPI, params, state, plan: StepPlan, firsts: _Firsts, on_first_token: FirstTokenHook | None
    ):
        """The plan's `prefill_slots` call on `engine`'s `state` (returned), its final rows' first
        tokens into `firsts`."""
        started = time.perf_counter()
        prompt_logprobs = None
        if plan.rows[0].score:  # a request for the prompt's logprobs: its chunk alone, scored
            (row,) = plan.rows
            state, token, logprob, scores = engine.prefill_slots_scored(params, state, row)
            tokens, logprobs = (token,), (logprob,)
            scored = (*(self._scores.pop(row.slot, ()) if row.start else ()), *scores)
            if row.final:
                prompt_logprobs = (None, *scored)  # the first prompt token has none (OpenAI's echo)
            else:
                self._scores[row.slot] = scored
        else:
            state, tokens, logprobs = engine.prefill_slots(params, state, plan.rows)
        self.timings.prefills.append(time.perf_counter() - started)  # a call of middle chunks only: its dispatch
        for row, token, logprob in zip(plan.rows, tokens, logprobs, strict=True):
            if row.final:
                token = int(token)
                if on_first_token is not None:
                    on_first_token(row.slot, token, logprob, prompt_logprobs)
                firsts.tokens.append(token)
                firsts.logprobs.append(logprob)
        return state

    def _prepare(self, plan: StepPlan) -> None:
        """The plan's frees and preemptions, adapter writes and block tables."""
        if (warmup := self.background_warmup) is not None:
            warmup.busy()
        engine, self.timings = self.engine, Timings()
        for slot in (*plan.frees, *plan.preempted):
            self.state = engine.free_resource(self.state, slot)
            self._scores.pop(slot, None)  # a scoring request's earlier chunks, cancelled before its last
        for load in plan.adapter_loads:
            self._write_adapter(load)
        if plan.page_tables:
            if self.pages is None:
                limits = engine.limits
                self.pages = np.zeros((limits.max_concurrent_decodes, limits.max_pages), np.int32)
            for slot, pages in plan.page_tables:
                self.pages[slot] = 0
                self.pages[slot, : len(pages)] = pages
            self.state = engine.set_pages(self.state, self.pages)

    def _write_adapter(self, load: AdapterLoad) -> None:
        if self.adapter_weights is None:
            raise ValueError(f"a plan loads LoRA adapter {load.name!r}, but this executor has no adapters")
        self.params = self.engine.write_adapter(self.params, load.slot, self.adapter_weights(load))

    def _dispatch(self, plan: StepPlan) -> ResultTokens:
        """The plan's generate (or verify) call, dispatched: its results still on the device."""
        engine = self.engine
        proposals = plan.proposals
        if plan.draft_rows:  # speculative decoding with a draft model (serving.engine.draft)
            if engine.draft is None:
                raise ValueError("a plan of draft rows, but the engine was built without a draft model")
            proposals = engine.draft.propose(plan.draft_rows)
        expected = 1 if plan.masks is not None else engine.decode_steps_per_call
        if proposals is not None:  # speculative decoding: k + 1 steps
            expected = proposals.shape[1] + 1
        if plan.decode_steps != expected:
            raise ValueError(f"a plan of {plan.decode_steps} decode steps for a call of {expected}")
        if proposals is not None:
            self.state, result = engine.verify(
                self.params, self.state, proposals, plan.num_proposed, plan.max_position, slots=plan.slots
            )
        else:
            self.state, result = engine.generate(
                self.params, self.state, max_position=plan.max_position, masks=plan.masks, slots=plan.slots
            )
        return result

    def _read(self, result: ResultTokens, outcome: StepOutcome, started: float, timings: Timings) -> StepOutcome:
        """A generate call's tokens (and logprobs) read back into the outcome; `started`: when it
        was dispatched (`timings`' generate seconds: its plan's)."""
        tokens, valid, done = (np.asarray(x) for x in result[:3])
        extra = {}
        if result.logprobs is not None:
            extra = dict(
                logprobs=np.asarray(result.logprobs),
                top_ids=np.asarray(result.top_ids),
                top_logprobs=np.asarray(result.top_logprobs),
            )
        timings.generate = time.perf_counter() - started
        return StepOutcome(
            outcome.first_tokens, tokens.tolist(), valid.tolist(), done.tolist(), outcome.first_logprobs, **extra,
        )

    @property
    def background_warmup(self) -> BackgroundCompiles | None:
        """The engine's background warmup (serving.engine.warmup), if it started one (the mock
        engine, or one never warmed up, has none). Its shapes compile only between an `idle()` and
        the next `run()`, so they keep out of the way of requests; every device loop (the
        orchestrator's, a lockstep follower's, the offline driver) tells it through these calls."""
        return self.engine.background_warmup

    def idle(self) -> None:
        """An idle turn of the device loop: the background warmup may start its next shape."""
        if (warmup := self.background_warmup) is not None:
            warmup.idle()

    def close(self) -> None:
        """The device loop ended: the background warmup stops after the shape it is compiling, so
        no compile outlives the loop."""
        if (warmup := self.background_warmup) is not None:
            warmup.stop()
