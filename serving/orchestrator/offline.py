"""Run a list of requests to completion on an engine, slots refilled as they free up.

A synchronous driver for tests, benchmarks and offline use, over the same scheduler and executor as
the orchestrator's device loop (which is the concurrent one, with streams).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from serving.engine.api import EngineAPI
from serving.errors import GenerationError
from serving.orchestrator.ahead import RunAhead, finish, start
from serving.orchestrator.disaggregated import DisaggregatedExecutor
from serving.orchestrator.executor import Executor
from serving.orchestrator.proposers import Speculator
from serving.orchestrator.scheduler import Scheduler, Waiting
from serving.request import SamplingParams


@dataclass
class OfflineResult:
    """One request's tokens and finish reason (stop or length)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (with prefix_caching)


def run_to_completion(
    engine: EngineAPI,
    params,
    requests: list[tuple[list[int], SamplingParams]],
    prefix_caching: bool = False,
    speculator: Speculator | None = None,
    prefill: tuple[EngineAPI, object] | None = None,
    executor: Executor | None = None,
) -> list[OfflineResult]:
    """Every request's tokens, in request order: the device loop's scheduler and executor, driven
    synchronously, without threads or streams. `prefix_caching`: share cached prompt pages
    between requests (off by default). `speculator`: speculative decoding's proposer and policy (None: off).
    `prefill`: a disaggregated server's prefill engine and its params (`engine` then generates;
    serving.orchestrator.disaggregated). `executor`: one an earlier call left idle, with its decode
    state (every slot free again, the pool's pages given out anew), so a benchmark's rounds do not
    each allocate and fault in the KV pool (default: a new one on `engine` and `params`)."""
    results = [OfflineResult(list(p), s) for p, s in requests]
    for r in results:
        engine.limits.check(len(r.prompt_ids), r.sampling)
        if r.sampling.n != 1:  # one result a request (the orchestrator streams each choice on its own)
            raise GenerationError(
                f"the offline driver runs one choice a request, not n={r.sampling.n}: send n requests, each with its own seed",
                field="n",
            )
    waiting = deque(range(len(results)))
    scheduler = Scheduler(
        engine.limits, engine.decode_steps_per_call, prefix_caching, speculator, handoffs=prefill is not None
    )
    if executor is None:
        executor = Executor(engine, params) if prefill is None else DisaggregatedExecutor(*prefill, engine, params)
    try:  # the engine's background warmup, if any, starts no shape meanwhile (Executor.run)
        _drive(results, waiting, scheduler, executor)
    finally:
        executor.idle()
    return results


def _drive(results: list[OfflineResult], waiting: deque, scheduler: Scheduler, executor: Executor) -> None:
    """Admit, schedule, execute and record until every request of `results` has finished; the next
    plan made and started before the last one's tokens are read where the scheduler `runs_ahead`
    of it (as the orchestrator's device loop does with async scheduling)."""
    ahead = RunAhead(
        scheduler, getattr(executor, "pipelines", False),
        lambda started: finish(executor, started),
        lambda plan, outcome, slots, projected: _record(plan, outcome, slots, scheduler, results, projected),
    )
    while waiting or scheduler.num_used:
        ahead.land_unless_ahead()
        admit = [waiting.popleft() for _ in range(min(scheduler.room(), len(waiting)))]
        batch = [Waiting(i, tuple(results[i].prompt_ids), results[i].sampling) for i in admit]
        plan = scheduler.schedule(batch)
        for request_id, tokens in scheduler.take_cached().items():
            results[request_id].cached_tokens = tokens
        if plan.empty:
            ahead.land()
            continue
        slots = {slot: results[r.request_id] for slot, r in scheduler.running.items()}
        ahead.started(plan, start(executor, plan), slots)
    ahead.land()


def _record(
    plan, outcome, slots: dict[int, OfflineResult], scheduler: Scheduler, results: list[OfflineResult],
    projected: dict[int, int] | None = None,
) -> None:
    """A plan's tokens onto its requests (not onto one that finished since it ran ahead), then
    the scheduler's records, the finished requests' reasons."""
    for slot, first in zip(plan.first_token_slots, outcome.first_tokens, strict=True):
        if not slots[slot].finish_reason and slots[slot].sampling.max_tokens > 0:  # 0: the prompt scored, no token
            slots[slot].token_ids.append(first)
    for step_tokens, step_valid in zip(outcome.tokens, outcome.valid, strict=True):
        for slot, result in slots.items():
            if step_valid[slot] and not result.finish_reason:
                result.token_ids.append(step_tokens[slot])
    for request_id, _slot in scheduler.update(plan, outcome, projected):
        r = results[request_id]
        r.finish_reason = "stop" if r.token_ids and r.token_ids[-1] in r.sampling.stop_ids else "length"
