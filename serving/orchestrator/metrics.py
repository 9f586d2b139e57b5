"""Counters and histograms the orchestrator keeps for the metrics endpoint (thread-safe, no deps)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Seconds: from a millisecond to a couple of minutes.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass
class EngineMetrics:
    """What the device loop and the request streams record."""

    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    queued: int = 0  # requests waiting for a slot
    active_slots: int = 0
    total_slots: int = 0
    kv_tokens_used: int = 0
    kv_tokens_capacity: int = 0
    kv_block_size: int = 0  # tokens per KV block as the prefix cache counts them (cache-config info)
    waiting_adapters: tuple[str, ...] = ()  # LoRA adapters named by requests waiting for a slot
    adapters_updated: float = 0.0  # time.time() of the last turn that set waiting_adapters
    requests_finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    requests_rejected: int = 0
    prefix_cache_hits: int = 0  # prompt blocks found in the prefix cache at admission
    prefix_cache_misses: int = 0  # prompt blocks looked up and not found
    prefix_cache_bytes: int = 0  # bytes of the blocks the prefix cache holds
    prefix_cache_blocks: int = 0  # blocks the prefix cache retains at most (cache-config info)
    kv_pages_used: int = 0  # pages of the KV cache's pool some sequence holds
    preemptions: int = 0  # sequences that gave up their pages and prefilled again
    speculative_method: str = "none"  # speculative decoding's proposer
    spec_proposed: int = 0  # proposed tokens verified
    spec_accepted: int = 0  # of them accepted
    spec_rounds: int = 0  # slot-calls that verified proposals (mean accepted length: accepted / rounds)
    warmup_shapes_pending: int = 0  # shapes the engine's background warmup has yet to compile
    prompt_tokens: int = 0  # over finished requests (cancelled ones included)
    generation_tokens: int = 0
    time_to_first_token: Histogram = field(default_factory=Histogram)
    time_per_output_token: Histogram = field(default_factory=Histogram)
    prefill_step: Histogram = field(default_factory=Histogram)
    generate_step: Histogram = field(default_factory=Histogram)
    # The LoRA adapters' numbers (serving.lora.registry.AdapterStats), read at each scrape; None
    # when the server has no adapters.
    adapter_stats: Callable[[], Any] | None = None

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            getattr(self, name).observe(value)

    def finished(self, reason: str, prompt_tokens: int = 0, generation_tokens: int = 0) -> None:
        with self.lock:
            self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
