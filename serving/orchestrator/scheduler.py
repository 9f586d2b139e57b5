"""Decide, in plain Python: which waiting request goes into which slot, which slots to free, whether
to decode. The device loop asks for a `StepPlan` each turn and hands it to the executor; on a
multi-host slice that plan is what the leader sends to every host.

The scheduler keeps the host mirror of every running slot's position, so that no decision (nor
the attention window the engine reads) needs a value read back from the device.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from serving.engine.limits import Limits, finishes_at_first_token
from serving.request import SamplingParams


@dataclass(frozen=True)
class Waiting:
    """A request at the head of the admission queue."""

    request_id: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams


@dataclass(frozen=True)
class Admission:
    """Prefill a prompt (padded to its bucket) and insert it into `slot`."""

    request_id: int
    slot: int
    padded_tokens: tuple[int, ...]
    true_length: int
    sampling: SamplingParams


@dataclass(frozen=True)
class StepPlan:
    """One turn of the device loop, executed in this order: frees, admissions, one generate call.

    `decode_steps` is 0 (no generate call) or the engine's steps per call; the call is skipped
    when no slot is active after the admissions (`running` slots were active before them, and
    an admission whose first token finished it never becomes active). `max_position` bounds every
    active slot's position at that call.
    """

    frees: tuple[int, ...] = ()
    admissions: tuple[Admission, ...] = ()
    decode_steps: int = 0
    running: int = 0
    max_position: int = 0

    @property
    def empty(self) -> bool:
        return not (self.frees or self.admissions or self.decode_steps)


@dataclass(frozen=True)
class StepOutcome:
    """What executing a plan produced, on the host."""

    first_tokens: tuple[int, ...] = ()  # one per admission, in order
    tokens: Sequence[Sequence[int]] = ()  # [steps][slots] of the generate call (empty: none ran)
    valid: Sequence[Sequence[bool]] = ()
    done: Sequence[Sequence[bool]] = ()


@dataclass
class _Running:
    request_id: int
    position: int  # where the slot's next fed token is written: prompt + tokens generated - 1


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
        """How many waiting requests the next `schedule` can admit, once `cancelled` are freed."""
        return len(self._free) + sum(r.request_id in cancelled for r in self.running.values())

    def schedule(self, waiting: Sequence[Waiting], cancelled: Collection[int] = ()) -> StepPlan:
        """The next turn: free the slots of `cancelled` request ids, admit every `waiting` request
        (at most `room(cancelled)`) into a free slot in order, then decode if anything runs."""
        if len(waiting) > self.room(cancelled):
            raise ValueError(f"{len(waiting)} requests for {self.room(cancelled)} free slots")
        frees = tuple(sorted(s for s, r in self.running.items() if r.request_id in cancelled))
        for slot in frees:
            self._release(slot)
        admissions = []
        for request in waiting:
            slot = self._free.pop()
            admissions.append(
                Admission(
                    request.request_id,
                    slot,
                    tuple(self.limits.pad(list(request.prompt_ids))),
                    len(request.prompt_ids),
                    request.sampling,
                )
            )
            self.running[slot] = _Running(request.request_id, len(request.prompt_ids))
        running_before = len(self.running) - len(admissions)
        return StepPlan(
            frees=frees,
            admissions=tuple(admissions),
            decode_steps=self.decode_steps_per_call if self.running else 0,
            running=running_before,
            max_position=max((r.position for r in self.running.values()), default=0),
        )

    def update(self, plan: StepPlan, outcome: StepOutcome) -> list[tuple[int, int]]:
        """Record what the plan did; returns (request_id, slot) of every slot that finished."""
        finished = []
        for admission, first in zip(plan.admissions, outcome.first_tokens, strict=True):
            if finishes_at_first_token(first, admission.sampling):
                finished.append((admission.request_id, admission.slot))
                self._release(admission.slot)
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
