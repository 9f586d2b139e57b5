"""What the HTTP layer knows about the process: its phase, the orchestrator once it exists, counters.

Phases: `starting` (weights loading, warmup compiling) -> `ready` -> `draining` (SIGTERM: finish what
is in flight, admit nothing new). A failed start records its error and the server exits.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.config import ServerConfig
from serving.openai.fields import UnknownFieldPolicy

if TYPE_CHECKING:  # the API talks to the orchestrator; it never imports JAX itself
    from serving.orchestrator import Orchestrator
    from serving.text.tokenizer import Tokenizer


@dataclass
class ServerState:
    config: ServerConfig
    api_key: str = ""
    phase: str = "starting"
    model_name: str = ""
    model_load_s: float | None = None  # start-up's seconds reading the weights and placing them (/metrics)
    startup_s: float | None = None  # start-up's seconds from loading to the device loop running (/metrics)
    orchestrator: Orchestrator | None = None
    startup_error: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    in_flight: int = 0  # API requests being answered (streams included)
    http_requests: Counter = field(default_factory=Counter)  # (route, status) -> count
    unknown_fields: UnknownFieldPolicy = field(init=False, repr=False)  # per unknown_request_fields

    def __post_init__(self) -> None:
        self.unknown_fields = UnknownFieldPolicy(self.config.unknown_request_fields)

    def set_ready(
        self, orchestrator: Orchestrator, model_name: str, model_load_s: float | None = None,
        startup_s: float | None = None,
    ) -> None:
        """Serve `orchestrator`'s model under `model_name`; its start-up's seconds where measured."""
        self.model_name, self.model_load_s, self.startup_s = model_name, model_load_s, startup_s
        self.orchestrator = orchestrator  # last: what reads it (a scrape, a route) finds the rest set
        with self.lock:
            if self.phase == "starting":
                self.phase = "ready"

    def start_draining(self) -> None:
        with self.lock:
            self.phase = "draining"

    @property
    def started(self) -> bool:
        """Weights loaded and the warmup's shapes compiled (stays true while draining)."""
        return self.orchestrator is not None

    @property
    def tokenizer(self) -> Tokenizer:
        assert self.orchestrator is not None
        return self.orchestrator.tokenizer

    def queue_full(self) -> bool:
        """Every slot taken and max_queued_requests waiting: the next request would get 429."""
        orch = self.orchestrator
        return orch is not None and orch.full()

    def stalled_for(self) -> float:
        """Seconds the device loop has gone without progress while work waits (0 when idle)."""
        orch = self.orchestrator
        if orch is not None and not orch.alive and self.phase != "draining":
            return float("inf")  # the device loop died
        if orch is None or not orch.has_work:
            return 0.0
        return time.monotonic() - orch.last_progress

    @property
    def live(self) -> bool:
        """JetStream's `is_live` (gRPC HealthCheck, HTTP /healthcheck and /v1/health): started, and
        the device loop not stuck with work waiting for longer than liveness_timeout_s (nor dead)."""
        return self.started and self.stalled_for() <= self.config.liveness_timeout_s

    def count(self, route: str, status: int) -> None:
        with self.lock:
            self.http_requests[(route, status)] += 1
