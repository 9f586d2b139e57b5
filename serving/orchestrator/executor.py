"""Execute: run a `StepPlan` on an engine. The only code that calls the engine (and so the device);
it owns the decode state. Every host of a multi-host slice runs the same plans in the same order.

Host syncs: each admission's first token (the plan's stream needs it, and whether the generate
call runs depends on it; with n > 1 choices or logprobs, the prefill's outputs in one read) and the
generate call's tokens (with their logprobs, when it made them). Nothing else is read back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from serving.engine.api import EngineAPI, PrefillOutputs
from serving.engine.limits import finishes_at_first_token
from serving.orchestrator.scheduler import Admission, StepOutcome, StepPlan
from serving.request import TokenLogprob


@dataclass
class Timings:
    """Seconds the last plan's engine calls took (for the metrics)."""

    prefills: list[float] = field(default_factory=list)  # the prefill calls alone
    generate: float | None = None


# on_first_token(admission, choice, token, its logprobs, the prompt's logprobs)
FirstTokenHook = Callable[
    [Admission, int, int, TokenLogprob | None, tuple[TokenLogprob | None, ...] | None], None
]


class Executor:
    def __init__(self, engine: EngineAPI, params):
        self.engine = engine
        self.params = params
        self.state = engine.init_decode_state()
        self.timings = Timings()

    def run(self, plan: StepPlan, on_first_token: FirstTokenHook | None = None) -> StepOutcome:
        """Execute `plan`; `on_first_token` is called for each choice of each admission as soon as
        its prefill has sampled (before the generate call), so a stream need not wait for it."""
        engine, state, timings = self.engine, self.state, Timings()
        for slot in plan.frees:
            state = engine.free_resource(state, slot)
        first_tokens, first_logprobs, prompt_logprobs = [], [], []
        active = plan.running > 0
        for admission in plan.admissions:
            started = time.perf_counter()
            sampling = admission.sampling
            prefix, first = engine.prefill(
                self.params, admission.padded_tokens, admission.true_length, sampling, admission.mask
            )
            outputs = PrefillOutputs((first,))
            if sampling.n > 1 or sampling.wants_logprobs or sampling.prompt_logprobs is not None:
                outputs = engine.prefill_outputs(prefix)
            timings.prefills.append(time.perf_counter() - started)
            prompt_logprobs.append(outputs.prompt_logprobs)
            for choice, (slot, token) in enumerate(zip(admission.slots, outputs.first_tokens, strict=True)):
                logprob = outputs.first_logprobs[choice] if outputs.first_logprobs else None
                if on_first_token is not None:
                    on_first_token(admission, choice, token, logprob, outputs.prompt_logprobs)
                state = engine.insert(prefix, state, slot, choice)
                first_tokens.append(token)
                first_logprobs.append(logprob)
                active = active or not finishes_at_first_token(token, sampling)
        outcome = StepOutcome(tuple(first_tokens), first_logprobs=tuple(first_logprobs),
                              prompt_logprobs=tuple(prompt_logprobs))
        if plan.decode_steps and active:
            expected = 1 if plan.masks is not None else engine.decode_steps_per_call
            if plan.decode_steps != expected:
                raise ValueError(f"a plan of {plan.decode_steps} decode steps for a call of {expected}")
            started = time.perf_counter()
            state, result = engine.generate(
                self.params, state, max_position=plan.max_position, masks=plan.masks
            )
            tokens, valid, done = (np.asarray(x) for x in result[:3])
            extra = {}
            if result.logprobs is not None:
                extra = dict(
                    logprobs=np.asarray(result.logprobs),
                    top_ids=np.asarray(result.top_ids),
                    top_logprobs=np.asarray(result.top_logprobs),
                )
            timings.generate = time.perf_counter() - started
            outcome = StepOutcome(
                outcome.first_tokens, tokens.tolist(), valid.tolist(), done.tolist(),
                outcome.first_logprobs, outcome.prompt_logprobs, **extra,
            )
        self.state, self.timings = state, timings
        return outcome

    def idle(self) -> None:
        """An idle turn of the device loop (nothing to do on one host; see lockstep)."""

    def close(self) -> None:
        """The device loop ended (nothing to release on one host; see lockstep)."""
