"""One process's share of a disaggregated server on a multi-controller slice: the same plans as
serving.orchestrator.disaggregated's one-controller executor, with each engine call made by the
group whose devices it runs on, and what crosses between the groups moved by a `Link`
(serving.orchestrator.transfer: `jax.experimental.transfer` for arrays, the distributed runtime's
key-value store for the generate call's tokens).

Every process gets every plan (serving.orchestrator.lockstep: process 0, on the prefill side,
schedules and broadcasts) and runs, in this order:

1. each preempted slot's state: generate sends it, prefill accepts it (its recompute reads the
   token history); then each side's frees, preemptions, adapter writes and block tables (both
   engines mirror the same slots and pool pages, so one plan's ids name the same on both);
2. generate: the generate call, dispatched (not read);
3. the `prefill_slots` call on prefill (a row that scores the prompt: alone, `prefill_slots_scored`);
   each final row's slot state and prompt pages sent (a handoff), accepted by generate behind its
   generate call, freed on prefill;
4. generate reads its call's tokens and its lead process tells process 0, which delivers them
   with the prefill's first tokens;
5. every process meets at the distributed runtime's barrier (`Link.meet`), so that neither side
   waits in the next plan's broadcast, a collective with a short deadline, while the other
   compiles a call at its first use.

Process 0 alone reads first tokens and the generate call's tokens into an outcome; a follower's
outcome is thrown away (serving.orchestrator.lockstep.follow).
"""

from __future__ import annotations

import sys
import time

from serving.engine.api import EngineAPI
from serving.orchestrator.disaggregated import check_plan
from serving.orchestrator.executor import AdapterWeights, Executor, FirstTokenHook, _Firsts
from serving.orchestrator.plan import StepOutcome, StepPlan
from serving.orchestrator.transfer import Link


class SplitExecutor(Executor):
    pipelines = False  # its `run` is its own: no start / finish split

    def __init__(self, engine: EngineAPI, params, link: Link, adapter_weights: AdapterWeights | None = None):
        """`engine` and `params`: this process's side's (the prefill engine, mirroring the
        generate engine's limits, on a prefill process; the generate engine on a generate one)."""
        super().__init__(engine, params, adapter_weights)
        self.link = link
        self.groups = link.groups
        self.handed_off = 0  # sequences moved to the generate side so far

    def run(self, plan: StepPlan, on_first_token: FirstTokenHook | None = None) -> StepOutcome:
        check_plan(plan)
        prefills, engine, link = self.groups.on_prefill, self.engine, self.link
        to_generate, to_prefill = (self.groups.prefill, self.groups.generate), (self.groups.generate, self.groups.prefill)
        for slot in plan.preempted:
            moved = link.move(None if prefills else engine.gathered(engine.handoff(self.state, slot, ())), *to_prefill)
            if prefills:
                self.state = engine.accept(self.state, moved, slot, ())
        self._prepare(plan)
        decodes = bool(plan.decode_steps and plan.running > 0)
        result, started = None, time.perf_counter()
        if decodes and not prefills:
            result = self._dispatch(plan)
        firsts = _Firsts()
        if plan.rows and prefills:
            self.state = self._prefill_rows(engine, self.params, self.state, plan, firsts, on_first_token)
        for slot, pages in plan.handoffs:
            if prefills:
                link.move(engine.gathered(engine.handoff(self.state, slot, pages)), *to_generate)
                self.state = engine.free_resource(self.state, slot)  # it decodes there
            else:
                self.state = engine.accept(self.state, link.move(None, *to_generate), slot, pages)
            self.handed_off += 1
        outcome = firsts.outcome()
        if decodes:
            lead = self.groups.generate_lead
            read = self._read(result, outcome, started, self.timings) if self.groups.me == lead else None
            told = link.tell(None if read is None else _generated(read, self.timings.generate), lead, 0)
            if told is not None:
                generated, self.timings.generate = told
                outcome = StepOutcome(outcome.first_tokens, first_logprobs=outcome.first_logprobs, **generated)
        link.meet()  # nobody enters the next broadcast while the other side still compiles
        return outcome


    def close(self) -> None:
        super().close()
        # said on every process's stderr, as the multi-controller runtime says what each process is
        print(
            f"pathserve: process {self.groups.me} ({'prefill' if self.groups.on_prefill else 'generate'}): "
            f"handed off {self.handed_off} prompts; {self.link.moves} moves, "
            f"{self.link.bytes_received} bytes pulled here",
            file=sys.stderr, flush=True,
        )


def _generated(outcome: StepOutcome, seconds: float | None) -> tuple[dict, float | None]:
    """The generate call's part of an outcome, and its seconds: what the lead tells process 0."""
    fields = ("tokens", "valid", "done", "logprobs", "top_ids", "top_logprobs")
    return {name: getattr(outcome, name) for name in fields}, seconds
