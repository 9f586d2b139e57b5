"""Execute a plan on a disaggregated server (serving.disaggregation): a prefill engine on one set
of devices, the generate engine on another, both driven from this one controller.

The two engines mirror each other: the same slots and a page pool of the same size, so the
scheduler's slot and page ids name the same slot and page on both, and one plan drives both. A
prompt is prefilled (in chunks, reading cached prefix pages) into its slot's pages on the prefill
side; when its final row has run, the plan's `handoffs` move that slot's state and the pages
holding its prompt to the generate side (`engine.handoff` there, `engine.accept` here: a
`jax.device_put` between the meshes) and the prefill side's slot is freed. Each plan:

1. a preempted slot's state goes back to the prefill side first (its token history, which the
   recompute reads), then frees and preemptions on both sides, adapter writes into both engines'
   params (a LoRA request's prompt runs on one side, its tokens on the other), block tables on both;
2. the generate call over the slots already running, dispatched and not read (JAX runs it on the
   generate devices while the host goes on);
3. the `prefill_slots` call on the prefill engine (a row that scores the prompt: alone,
   `prefill_slots_scored`), its first tokens read back (a sync of the prefill devices alone); the
   handoffs. They queue behind the generate call on the generate devices, so a new slot decodes
   from the next plan;
4. the generate call's tokens read back.

So prompts prefill while the running slots decode, and neither side waits for the other except
where a token must reach the host. Admission is the backpressure: a prompt takes a slot and pages
only when the generate side has them, so nothing is prefilled that has nowhere to go.
"""

from __future__ import annotations

import time

from serving.engine.api import BackgroundCompiles, EngineAPI
from serving.lora.registry import AdapterLoad
from serving.orchestrator.executor import AdapterWeights, Executor, FirstTokenHook, _Firsts
from serving.orchestrator.plan import StepOutcome, StepPlan


def check_plan(plan: StepPlan) -> None:
    """ValueError for a plan no disaggregated executor runs: proposals (it does not speculate),
    or final rows without their handoffs."""
    if plan.proposals is not None or plan.draft_rows:
        raise ValueError("a disaggregated server does not speculate: a plan of proposals")
    if plan.rows and len(plan.handoffs) != sum(row.final for row in plan.rows):
        raise ValueError("a disaggregated server's plan hands off every final row (Scheduler(handoffs=True))")


class DisaggregatedExecutor(Executor):
    pipelines = False  # its `run` is its own: no start / finish split

    def __init__(
        self,
        prefill_engine: EngineAPI,
        prefill_params,
        engine: EngineAPI,
        params,
        adapter_weights: AdapterWeights | None = None,
    ):
        """`prefill_engine` and its params on the prefill devices; `engine` (generate) and `params`
        on the generate devices: the same model, config and limits, each placed on its own mesh."""
        if prefill_engine.limits != engine.limits:
            raise ValueError(f"the prefill engine's limits {prefill_engine.limits} differ from {engine.limits}")
        super().__init__(engine, params, adapter_weights)
        self.prefill_engine = prefill_engine
        self.prefill_params = prefill_params
        self.prefill_state = prefill_engine.init_decode_state()
        self.handed_off = 0  # sequences moved to the generate side so far

    @property
    def background_warmup(self) -> BackgroundCompiles | None:
        """The prefill engine's (a prefix hit's partial chunks: prefill shapes); the generate
        engine starts none."""
        return self.prefill_engine.background_warmup

    def run(self, plan: StepPlan, on_first_token: FirstTokenHook | None = None) -> StepOutcome:
        check_plan(plan)
        self._prepare(plan)
        result, started = None, time.perf_counter()
        if plan.decode_steps and plan.running > 0:
            result = self._dispatch(plan)
        firsts = _Firsts()
        if plan.rows:
            prefiller = self.prefill_engine
            self.prefill_state = self._prefill_rows(
                prefiller, self.prefill_params, self.prefill_state, plan, firsts, on_first_token
            )
            for slot, pages in plan.handoffs:
                moved = prefiller.handoff(self.prefill_state, slot, pages)
                self.state = self.engine.accept(self.state, moved, slot, pages)
                self.prefill_state = prefiller.free_resource(self.prefill_state, slot)  # it decodes there
                self.handed_off += 1
        outcome = firsts.outcome()
        return outcome if result is None else self._read(result, outcome, started, self.timings)

    def _prepare(self, plan: StepPlan) -> None:
        prefiller = self.prefill_engine
        for slot in plan.preempted:  # its token history, for the recompute's final row
            self.prefill_state = prefiller.accept(self.prefill_state, self.engine.handoff(self.state, slot, ()), slot, ())
        super()._prepare(plan)
        for slot in (*plan.frees, *plan.preempted):
            self.prefill_state = prefiller.free_resource(self.prefill_state, slot)
        if plan.page_tables:
            self.prefill_state = prefiller.set_pages(self.prefill_state, self.pages)

    def _write_adapter(self, load: AdapterLoad) -> None:
        if self.adapter_weights is None:
            raise ValueError(f"a plan loads LoRA adapter {load.name!r}, but this executor has no adapters")
        weights = self.adapter_weights(load)
        self.params = self.engine.write_adapter(self.params, load.slot, weights)
        self.prefill_params = self.prefill_engine.write_adapter(self.prefill_params, load.slot, weights)
