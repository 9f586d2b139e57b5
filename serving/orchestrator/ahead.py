"""Async scheduling's one plan in flight, for a device loop (the orchestrator's and the offline
driver's): a plan's generate call stays on the device while the loop makes and starts the next
plan, then its tokens are read and recorded (`land`). Where the scheduler cannot run ahead of it
(serving.orchestrator.scheduler.Scheduler.runs_ahead), it lands before the next plan is made.

The loop owns what a plan's outcome means (streams, results): `finish` reads a started plan's
outcome, `record(plan, outcome, slots, projected)` takes it, in the order the plans started.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from serving.orchestrator.executor import FirstTokenHook, Started
from serving.orchestrator.plan import StepOutcome, StepPlan
from serving.orchestrator.scheduler import Scheduler

Record = Callable[[StepPlan, StepOutcome, dict[int, Any], dict[int, int] | None], None]


def start(executor, plan: StepPlan, on_first_token: FirstTokenHook | None = None) -> Started:
    """`plan` started on `executor`; one that runs a plan whole (lockstep, disaggregated: no
    `pipelines`) runs it, and nothing is left in flight."""
    if getattr(executor, "pipelines", False):
        return executor.start(plan, on_first_token=on_first_token)
    return Started(plan, executor.run(plan, on_first_token=on_first_token), None, 0.0, executor.timings)


def finish(executor, started: Started) -> StepOutcome:
    """A started plan's outcome: its generate call's tokens read, where one is in flight."""
    return started.outcome if started.result is None else executor.finish(started)


@dataclass
class _InFlight:
    """A started plan whose generate call's tokens are not read yet: its slots' requests when it was
    made, and what Scheduler.project moved."""

    plan: StepPlan
    started: Started
    slots: dict[int, Any]
    projected: dict[int, int]


class RunAhead:
    """At most one plan in flight over `scheduler` (none when not `enabled`)."""

    def __init__(
        self, scheduler: Scheduler, enabled: bool, finish: Callable[[Started], StepOutcome], record: Record
    ):
        self.scheduler, self.enabled, self.finish, self.record = scheduler, enabled, finish, record
        self._in_flight: _InFlight | None = None

    def land(self) -> bool:
        """The plan in flight (if any): its tokens read and recorded. Whether there was one."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return False
        self.record(flight.plan, self.finish(flight.started), flight.slots, flight.projected)
        return True

    def land_unless_ahead(self) -> None:
        """Land the plan in flight where the next plan may need its tokens (whichever requests it
        admits: Scheduler.runs_ahead)."""
        if self._in_flight is not None and not self.scheduler.runs_ahead():
            self.land()

    def started(self, plan: StepPlan, started: Started, slots: dict[int, Any]) -> None:
        """`plan` (the last one scheduled, its slots' requests) was started: it stays in flight
        where its generate call is on the device, and the one before lands; else it is recorded
        after that one."""
        previous, self._in_flight = self._in_flight, None
        if self.enabled and started.result is not None:
            self._in_flight = _InFlight(plan, started, slots, self.scheduler.project(plan))
        if previous is not None:
            self.record(previous.plan, self.finish(previous.started), previous.slots, previous.projected)
        if self._in_flight is None:
            self.record(plan, self.finish(started), slots, None)
