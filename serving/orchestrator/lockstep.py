"""Multi-controller lockstep: process 0 decides, every process executes the same engine calls.

On a multi-host slice without Pathways (runtime=multicontroller) each host runs its own Python
process over the global mesh, and every compiled call must be entered by all of them, in the same
order, or the first collective deadlocks. So:

1. Process 0 alone takes requests (HTTP, gRPC, the batch reader) and runs the orchestrator's
   scheduler. Its executor is a `LockstepExecutor`: before executing a `StepPlan` it broadcasts it
   (`PlanChannel.send`: pickled, in one fixed-size frame, a second collective for what does not fit).
2. Every other process runs `follow()`: receive a plan, execute it on its own `Executor` (the same
   engine calls, on the same global arrays), repeat. Sampled tokens come back replicated, so each
   process reads the same values; only process 0 delivers them to streams.
3. While idle, process 0 sends a keepalive every KEEPALIVE_S, so a dead follower is noticed even
   without traffic; when its device loop stops it sends STOP and the followers return.
4. A dead peer fails the next collective on every survivor (gloo: connection reset; the
   coordination service's heartbeat timeout catches a stalled one). On process 0 the device loop
   dies: in-flight streams end with an error, /livez fails, and `exit_when_loop_dies` exits the
   process non-zero so that Kubernetes restarts the group. A follower whose leader is gone raises
   out of `follow()` and exits non-zero too. A normal stop ends with every process meeting at
   `meet_at_exit`; then the followers exit 0.

5. LoRA adapters: an adapter's device write is part of a plan (`StepPlan.adapter_loads`: slot,
   name, load version, path; serving.orchestrator.plan), so every process writes the same slot at
   the same point of the same plan, with no message of its own. Process 0's executor takes the
   weights from its registry's host copy; a follower's (`follow_plans`: serving.lora.serving's
   `storage_reader`) reads them from the path, which every process must read alike (gs:// or a
   shared path). The plans carry each request's adapter slot in its sampling.

The plan is treated as an opaque picklable object; nothing here depends on its fields.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from serving.orchestrator.executor import Executor

log = logging.getLogger(__name__)

FRAME_BYTES = 4096  # one collective carries a plan up to this size (8 of them are the length)
KEEPALIVE_S = 1.0
EXIT_GRACE_S = 3.0  # after the device loop dies: /livez answers 503 and error bodies flush meanwhile
WATCH_S = 0.2
_HEADER = 8


class _Keepalive:
    """The idle message (a plan of nothing)."""


class _Stop:
    """The leader's device loop has ended: followers return."""


KEEPALIVE, STOP = _Keepalive(), _Stop()


class PlanChannel:
    """Process 0 -> every process, by `jax.experimental.multihost_utils.broadcast_one_to_all`.

    A message is sent as frames of fixed shapes, so that the broadcast compiles once per shape:
    frame 0 ([FRAME_BYTES] uint8) holds the payload's length and its start; a longer payload sends
    the rest as one more frame padded to a power of two."""

    def __init__(self) -> None:
        import jax

        self.is_leader = jax.process_index() == 0

    def send(self, message: object) -> None:
        """Process 0: broadcast `message` (picklable)."""
        if not self.is_leader:
            raise RuntimeError("only process 0 sends plans")
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = np.zeros((FRAME_BYTES,), np.uint8)
        frame[:_HEADER] = np.frombuffer(np.int64(len(payload)).tobytes(), np.uint8)
        head = payload[: FRAME_BYTES - _HEADER]
        frame[_HEADER : _HEADER + len(head)] = np.frombuffer(head, np.uint8)
        _broadcast(frame)
        rest = payload[len(head) :]
        if rest:
            tail = np.zeros((_padded(len(rest)),), np.uint8)
            tail[: len(rest)] = np.frombuffer(rest, np.uint8)
            _broadcast(tail)

    def receive(self) -> object:
        """A follower: the next message from process 0 (blocks until it is sent)."""
        frame = _broadcast(np.zeros((FRAME_BYTES,), np.uint8))
        length = int(np.frombuffer(frame[:_HEADER].tobytes(), np.int64)[0])
        payload = frame[_HEADER : _HEADER + length].tobytes()
        rest = length - len(payload)
        if rest > 0:
            payload += _broadcast(np.zeros((_padded(rest),), np.uint8))[:rest].tobytes()
        return pickle.loads(payload)


def _padded(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


def _broadcast(frame: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(frame))


class LockstepExecutor:
    """Process 0's executor: broadcasts each plan, then executes it like `Executor` does."""

    def __init__(self, executor: Executor, channel: PlanChannel):
        self.executor = executor
        self.channel = channel
        self._last_sent = time.monotonic()
        self.closed = False

    @property
    def timings(self):
        return self.executor.timings

    @property
    def background_warmup(self):
        """This process's engine's background warmup (Executor.background_warmup)."""
        return self.executor.background_warmup

    def run(self, plan: Any, on_first_token: Callable | None = None) -> Any:
        self.channel.send(plan)
        self._last_sent = time.monotonic()
        return self.executor.run(plan, on_first_token=on_first_token)

    def idle(self) -> None:
        """An idle turn: a keepalive now and then (a dead follower fails it)."""
        self.executor.idle()
        if time.monotonic() - self._last_sent >= KEEPALIVE_S:
            self.channel.send(KEEPALIVE)
            self._last_sent = time.monotonic()

    def close(self) -> None:
        """The device loop ended normally: the followers return from `follow()`."""
        self.executor.close()
        self.channel.send(STOP)
        meet_at_exit()
        self.closed = True
        log.info("lockstep: told the followers to stop")


def follow(executor: Executor, channel: PlanChannel) -> int:
    """A follower's device loop: execute every plan process 0 broadcasts, until STOP.

    Returns the number of plans executed; raises what a failed collective raises (the leader died)."""
    import jax

    log.info("process %d follows process 0's plans", jax.process_index())
    executed = 0
    # this process's background warmup compiles while process 0's loop idles (its keepalives)
    while True:
        message = channel.receive()
        if isinstance(message, _Stop):
            executor.close()
            meet_at_exit()
            log.info("lockstep: process 0 stopped; %d plans executed", executed)
            return executed
        if isinstance(message, _Keepalive):
            executor.idle()
            continue
        executor.run(message)
        executed += 1


def meet_at_exit() -> None:
    """Every process, once the lockstep has ended: a last collective. After it a follower leaves at
    once (`os._exit(0)`): JAX's exit-time shutdown would call process 0's coordination service,
    which may already be gone (multi-controller tasks are recoverable, so process 0 does not wait)."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("pathserve: lockstep stopped")


def exit_when_loop_dies(
    is_alive: Callable[[], bool],
    closed: Callable[[], bool],
    stalled_for: Callable[[], float] = lambda: 0.0,
    max_stall_s: float = float("inf"),
) -> threading.Thread:
    """Process 0: once the device loop has ended without the lockstep executor's `close()` (a
    collective or the loop failed), or has made no progress for `max_stall_s` while work waits (a
    peer stalled inside a collective), wait EXIT_GRACE_S and exit with status 1; the group's peers
    cannot continue without it, nor it without them."""

    def watch() -> None:
        while is_alive() and stalled_for() <= max_stall_s:
            time.sleep(WATCH_S)
        if not is_alive() and closed():
            return
        what = "failed" if not is_alive() else f"made no progress for {max_stall_s:g} s"
        print(
            f"pathserve: the lockstep device loop {what} (a peer process died or stalled); "
            f"exiting with status 1 in {EXIT_GRACE_S:g} s",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(EXIT_GRACE_S)
        os._exit(1)  # not sys.exit: JAX's shutdown would wait for the dead peer

    thread = threading.Thread(target=watch, name="lockstep-watch", daemon=True)
    thread.start()
    return thread
