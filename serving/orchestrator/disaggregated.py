"""Execute a plan on a disaggregated server (serving.disaggregation): a prefill engine on one set
of devices, the generate engine on another, both driven from this one controller.

The scheduler plans as for any server whose every request prefills whole (`limits.prefills_whole`):
each admission holds its slots and its pages on the generate side (prompt + max_tokens, never
preempted), so a prompt is prefilled only when the generate side has room for it, and waits
otherwise: that is the backpressure, and nothing is prefilled that has nowhere to go. Each plan:

1. frees, adapter writes (into both engines' params: a LoRA request's prompt runs on the prefill
   side, its tokens on the generate side) and block tables, as `Executor`;
2. the generate call over the slots already running, dispatched and not read (JAX runs it on the
   generate devices while the host goes on);
3. each admission: its prefill on the prefill engine, its first tokens read back (a sync of the
   prefill devices alone), its prefix moved onto the generate engine's shardings
   (`engine.receive`: `jax.device_put`) and inserted into its slots; both queue behind the
   generate call on the generate devices, so an admitted slot decodes from the next plan;
4. the generate call's tokens read back.

So a prompt's prefill overlaps the running slots' decode, and neither side waits for the other
except where a token must reach the host.
"""

from __future__ import annotations

import time

from serving.engine.api import EngineAPI
from serving.lora.registry import AdapterLoad
from serving.orchestrator.executor import AdapterWeights, Executor, FirstTokenHook, _Firsts
from serving.orchestrator.plan import StepOutcome, StepPlan


class DisaggregatedExecutor(Executor):
    def __init__(
        self,
        prefill_engine: EngineAPI,
        prefill_params,
        engine: EngineAPI,
        params,
        adapter_weights: AdapterWeights | None = None,
    ):
        """`prefill_engine` and its params on the prefill devices; `engine` (generate) and `params`
        on the generate devices: the same model and config, each placed on its own mesh."""
        super().__init__(engine, params, adapter_weights)
        self.prefill_engine = prefill_engine
        self.prefill_params = prefill_params

    @property
    def prefill_side(self) -> tuple[EngineAPI, object]:
        return self.prefill_engine, self.prefill_params

    def run(self, plan: StepPlan, on_first_token: FirstTokenHook | None = None) -> StepOutcome:
        if plan.rows or plan.proposals is not None or plan.draft_rows:
            raise ValueError("a disaggregated server's plans admit whole prefills only (no chunks, no proposals)")
        self._prepare(plan)
        result, started = None, time.perf_counter()
        if plan.decode_steps and plan.running > 0:
            result = self._dispatch(plan)
        firsts = _Firsts()
        for admission in plan.admissions:
            self._admit(admission, firsts, on_first_token)
        outcome = firsts.outcome()
        return outcome if result is None else self._read(result, outcome, started)

    def _write_adapter(self, load: AdapterLoad) -> None:
        if self.adapter_weights is None:
            raise ValueError(f"a plan loads LoRA adapter {load.name!r}, but this executor has no adapters")
        weights = self.adapter_weights(load)
        self.params = self.engine.write_adapter(self.params, load.slot, weights)
        self.prefill_params = self.prefill_engine.write_adapter(self.prefill_params, load.slot, weights)
