"""The host's Python heap once the server is up: start-up's objects frozen out of the collector's way.

Bringing a model up leaves hundreds of thousands of long-lived Python objects behind (JAX's
traced and lowered programs in its caches, the tokenizer's tables, the config): 572,000 after a
cold bring-up of the 1B shape on a TPU VM, where one full collection over them took 225 ms (and
494,000 after a CPU bring-up of the default model: 300 ms). Serving allocates as it goes
(requests, token lists, answers), and when the collector's count says so it runs a full
collection over all of them, holding the GIL: that server took a burst of 39 requests in over
306 ms where the same server started with its programs loaded (a smaller heap) took 64 in 34, and
the burst was split in two prefill calls that decoded one call apart. Frozen, each wave of 64
came in within 52-62 ms, and HTTP at 64 went from 0.71x to 0.84x of the engine alone (docs/tpu.md).
`settle()` collects once and freezes what is left (`gc.freeze`: the permanent generation, which no
later collection scans), as the end of start-up, and thaws it at exit (the last collection frees
it, else nanobind's bindings report its objects leaked); `log_long_pauses()` names every collection
longer than `PAUSE_LOG_S` (PATHSERVE_LOG_LEVEL=DEBUG) so that a pause shows in the turn log.
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

log = logging.getLogger(__name__)

PAUSE_LOG_S = 0.01  # collections longer than this are logged at DEBUG
_thawed_at_exit: list[bool] = []


def settle() -> float:
    """Collect start-up's garbage, then freeze every object left out of later collections; the
    seconds it took (a full collection: ~0.3 s after a bring-up)."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    if not _thawed_at_exit:  # at exit the collector sees them again (native bindings count leaks)
        atexit.register(gc.unfreeze)
        _thawed_at_exit.append(True)
    seconds = time.perf_counter() - started
    log.info("host heap: %d start-up objects frozen out of the collector's scans (%.2f s)", gc.get_freeze_count(), seconds)
    return seconds


class _PauseLog:
    """A `gc.callbacks` entry timing each collection and logging the long ones."""

    def __init__(self, threshold_s: float):
        self.threshold_s, self.began = threshold_s, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.began = time.perf_counter()
            return
        paused = time.perf_counter() - self.began
        if paused >= self.threshold_s:
            log.debug(
                "a generation-%d collection paused the host %.1f ms (%d collected)",
                info["generation"], paused * 1e3, info["collected"],
            )


def log_long_pauses(threshold_s: float = PAUSE_LOG_S) -> bool:
    """Log (DEBUG) every collection longer than `threshold_s`, when DEBUG is on (the callback
    costs every collection a clock read, so not otherwise); whether it was installed."""
    if not log.isEnabledFor(logging.DEBUG) or any(isinstance(c, _PauseLog) for c in gc.callbacks):
        return False
    gc.callbacks.append(_PauseLog(threshold_s))
    return True
