"""Decide, in plain Python: which waiting request goes into which slot, which slots to free, whether
to decode. The device loop asks for a `StepPlan` each turn and hands it to the executor; on a
multi-host slice that plan is what the leader sends to every host.

The scheduler keeps the host mirror of every running slot's position, so that no decision (nor
the attention window the engine reads) needs a value read back from the device.

A request with `sampling.n` choices takes n slots at once (one prefill, inserted n times). A
request under a grammar brings its first token's mask; while any running slot has one, each
generate call is one step with every slot's mask in the plan (plain numpy, computed by the device
loop from the grammars' states), and a turn that admits such a request runs no generate call (its
next mask depends on the first token).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from serving.engine.limits import Limits, finishes_at_first_token
from serving.request import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class Waiting:
    """A request at the head of the admission queue."""

    request_id: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    choice_ids: tuple[int, ...] = ()  # request ids of choices 1..n-1 (sampling.n > 1)
    mask: np.ndarray | None = None  # int32 [words]: a grammar's mask for the first token

    @property
    def num_slots(self) -> int:
        return 1 + len(self.choice_ids)


@dataclass(frozen=True)
class Admission:
    """Prefill a prompt (padded to its bucket) and insert it into `slot` (choice 0) and
    `choice_slots` (choices 1..n-1)."""

    request_id: int
    slot: int
    padded_tokens: tuple[int, ...]
    true_length: int
    sampling: SamplingParams
    choice_slots: tuple[int, ...] = ()
    mask: np.ndarray | None = None

    @property
    def slots(self) -> tuple[int, ...]:
        return (self.slot, *self.choice_slots)


@dataclass(frozen=True)
class StepPlan:
    """One turn of the device loop, executed in this order: frees, admissions, one generate call.

    `decode_steps` is 0 (no generate call) or the engine's steps per call; the call is skipped
    when no slot is active after the admissions (`running` slots were active before them, and
    an admission whose first token finished it never becomes active). `max_position` bounds every
    active slot's position at that call. `masks` (int32 [slots, words], or None): the grammar masks
    of that call, which is then one step.
    """

    frees: tuple[int, ...] = ()
    admissions: tuple[Admission, ...] = ()
    decode_steps: int = 0
    running: int = 0
    max_position: int = 0
    masks: np.ndarray | None = None

    @property
    def empty(self) -> bool:
        return not (self.frees or self.admissions or self.decode_steps)


@dataclass(frozen=True)
class StepOutcome:
    """What executing a plan produced, on the host."""

    first_tokens: tuple[int, ...] = ()  # one per admitted slot, in order of admissions and their slots
    tokens: Sequence[Sequence[int]] = ()  # [steps][slots] of the generate call (empty: none ran)
    valid: Sequence[Sequence[bool]] = ()
    done: Sequence[Sequence[bool]] = ()
    first_logprobs: tuple[TokenLogprob | None, ...] = ()  # like first_tokens (empty: none asked)
    prompt_logprobs: tuple[tuple[TokenLogprob | None, ...] | None, ...] = ()  # one per admission
    logprobs: np.ndarray | None = None  # [steps, slots] float32, when the generate call made them
    top_ids: np.ndarray | None = None  # [steps, slots, K]
    top_logprobs: np.ndarray | None = None

    def token_logprob(self, step: int, slot: int) -> TokenLogprob:
        """The generate call's logprobs of `slot`'s token at `step`."""
        top = zip(self.top_ids[step, slot].tolist(), self.top_logprobs[step, slot].tolist(), strict=True)
        return TokenLogprob(int(self.tokens[step][slot]), float(self.logprobs[step, slot]), tuple(top))


@dataclass
class _Running:
    request_id: int
    position: int  # where the slot's next fed token is written: prompt + tokens generated - 1
    constrained: bool = False  # under a grammar: generate calls take masks


@dataclass
class Scheduler:
    """Slots and their requests, first come first served."""

    limits: Limits
    decode_steps_per_call: int
    running: dict[int, _Running] = field(default_factory=dict)  # slot -> its request
    _free: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free = list(range(self.limits.max_concurrent_decodes))[::-1]  # slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: int) -> int | None:
        return next((s for s, r in self.running.items() if r.request_id == request_id), None)

    def room(self, cancelled: Collection[int] = ()) -> int:
        """How many slots the next `schedule` can fill, once `cancelled` are freed (a waiting
        request takes `num_slots` of them)."""
        return len(self._free) + sum(r.request_id in cancelled for r in self.running.values())

    def schedule(
        self,
        waiting: Sequence[Waiting],
        cancelled: Collection[int] = (),
        masks: Mapping[int, np.ndarray] | None = None,
    ) -> StepPlan:
        """The next turn: free the slots of `cancelled` request ids, admit every `waiting` request
        (at most `room(cancelled)` slots in all) into free slots in order, then decode if anything
        runs. `masks`: request id -> int32 [words], the next-token mask of every running request
        under a grammar."""
        needed = sum(w.num_slots for w in waiting)
        if needed > self.room(cancelled):
            raise ValueError(f"{needed} slots asked for, {self.room(cancelled)} free")
        frees = tuple(sorted(s for s, r in self.running.items() if r.request_id in cancelled))
        for slot in frees:
            self._release(slot)
        admissions = []
        for request in waiting:
            slots = [self._free.pop() for _ in range(request.num_slots)]
            admissions.append(
                Admission(
                    request.request_id,
                    slots[0],
                    tuple(self.limits.pad(list(request.prompt_ids))),
                    len(request.prompt_ids),
                    request.sampling,
                    tuple(slots[1:]),
                    request.mask,
                )
            )
            constrained = request.sampling.grammar is not None
            for slot, rid in zip(slots, (request.request_id, *request.choice_ids), strict=True):
                self.running[slot] = _Running(rid, len(request.prompt_ids), constrained)
        running_before = len(self.running) - sum(len(a.slots) for a in admissions)
        steps, plan_masks = self.decode_steps_per_call if self.running else 0, None
        if any(r.constrained for r in self.running.values()):
            steps = 0 if any(a.sampling.grammar is not None for a in admissions) else 1
            plan_masks = self._masks(masks or {}) if steps else None
        return StepPlan(
            frees=frees,
            admissions=tuple(admissions),
            decode_steps=steps,
            running=running_before,
            max_position=max((r.position for r in self.running.values()), default=0),
            masks=plan_masks,
        )

    def _masks(self, masks: Mapping[int, np.ndarray]) -> np.ndarray:
        """[slots, words]: each constrained slot's mask, every token allowed elsewhere."""
        if not masks:
            raise ValueError("slots under a grammar are running, but no masks were given")
        words = len(next(iter(masks.values())))
        out = np.full((self.limits.max_concurrent_decodes, words), -1, np.int32)
        for slot, r in self.running.items():
            if r.constrained:
                out[slot] = masks.get(r.request_id, -1)
        return out

    def update(self, plan: StepPlan, outcome: StepOutcome) -> list[tuple[int, int]]:
        """Record what the plan did; returns (request_id, slot) of every slot that finished."""
        finished = []
        slots = [(slot, a.sampling) for a in plan.admissions for slot in a.slots]
        for (slot, sampling), first in zip(slots, outcome.first_tokens, strict=True):
            if finishes_at_first_token(first, sampling):
                finished.append((self.running[slot].request_id, slot))
                self._release(slot)
        for step_valid, step_done in zip(outcome.valid, outcome.done, strict=True):
            for slot, running in list(self.running.items()):
                if step_valid[slot]:
                    running.position += 1
                if step_done[slot]:
                    finished.append((running.request_id, slot))
                    self._release(slot)
        return finished

    def kv_tokens_used(self) -> int:
        """Cache positions holding live sequences (for the metrics; no device read)."""
        return sum(r.position for r in self.running.values())

    def _release(self, slot: int) -> None:
        del self.running[slot]
        self._free.append(slot)
