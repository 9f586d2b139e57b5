"""Execute: run a `StepPlan` on an engine. The only code that calls the engine (and so the device);
it owns the decode state. Every host of a multi-host slice runs the same plans in the same order.

Host syncs: each admission's first token (the plan's stream needs it, and whether the generate
call runs depends on it) and the generate call's tokens. Nothing else is read back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from serving.engine.api import EngineAPI
from serving.engine.limits import finishes_at_first_token
from serving.orchestrator.scheduler import Admission, StepOutcome, StepPlan


@dataclass
class Timings:
    """Seconds the last plan's engine calls took (for the metrics)."""

    prefills: list[float] = field(default_factory=list)  # the prefill calls alone
    generate: float | None = None


class Executor:
    def __init__(self, engine: EngineAPI, params):
        self.engine = engine
        self.params = params
        self.state = engine.init_decode_state()
        self.timings = Timings()

    def run(
        self, plan: StepPlan, on_first_token: Callable[[Admission, int], None] | None = None
    ) -> StepOutcome:
        """Execute `plan`; `on_first_token(admission, token)` is called as soon as each prefill has
        sampled its first token (before the generate call), so a stream need not wait for it."""
        engine, state, timings = self.engine, self.state, Timings()
        for slot in plan.frees:
            state = engine.free_resource(state, slot)
        first_tokens, active = [], plan.running > 0
        for admission in plan.admissions:
            started = time.perf_counter()
            prefix, first = engine.prefill(
                self.params, admission.padded_tokens, admission.true_length, admission.sampling
            )
            timings.prefills.append(time.perf_counter() - started)
            if on_first_token is not None:
                on_first_token(admission, first)
            state = engine.insert(prefix, state, admission.slot)
            first_tokens.append(first)
            active = active or not finishes_at_first_token(first, admission.sampling)
        outcome = StepOutcome(tuple(first_tokens))
        if plan.decode_steps and active:
            if plan.decode_steps != engine.decode_steps_per_call:
                raise ValueError(f"a plan of {plan.decode_steps} decode steps for an engine of "
                                 f"{engine.decode_steps_per_call}")
            started = time.perf_counter()
            state, result = engine.generate(self.params, state, max_position=plan.max_position)
            tokens, valid, done = (np.asarray(x) for x in result)
            timings.generate = time.perf_counter() - started
            outcome = StepOutcome(outcome.first_tokens, tokens.tolist(), valid.tolist(), done.tolist())
        self.state, self.timings = state, timings
        return outcome

    def idle(self) -> None:
        """An idle turn of the device loop (nothing to do on one host; see lockstep)."""

    def close(self) -> None:
        """The device loop ended (nothing to release on one host; see lockstep)."""
