"""Counters and histograms the orchestrator keeps for the metrics endpoint (thread-safe, no deps).

A request of n choices is one request here: JetStream's per-request numbers (its success count,
lengths, times) and the prompt tokens are counted once, when its last choice ends (`request_finished`);
the generated tokens of every choice count (`choice_finished`).
"""

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

# JetStream's boundaries for the histograms that carry its names (jetstream/core/metrics/prometheus.py),
# so that its dashboards' quantiles read the same buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
QUEUE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
REQUEST_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
# Tokens: JetStream's DEFAULT_PREFILL_BUCKETS (jetstream/engine/token_utils.py) for prompts.
INPUT_LENGTH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
OUTPUT_LENGTH_BUCKETS = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000,
    1000000, 2000000,
)


SUCCESS_REASONS = ("stop", "length")  # the finish reasons of a request that succeeded


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
    prompt_tokens: int = 0  # once per finished request (cancelled ones included)
    generation_tokens: int = 0  # of every choice of the finished requests
    # JetStream's, per request: the ones of its end only for a request that succeeded (stop or
    # length), as JetStream observes them when a request completes
    queue_duration: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS))  # submission -> slots
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))  # slots -> first token
    time_per_output_token: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    time_per_request: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))  # submission -> end
    request_input_length: Histogram = field(default_factory=lambda: Histogram(INPUT_LENGTH_BUCKETS))
    request_output_length: Histogram = field(default_factory=lambda: Histogram(OUTPUT_LENGTH_BUCKETS))
    prefill_step: Histogram = field(default_factory=Histogram)
    generate_step: Histogram = field(default_factory=Histogram)
    # The LoRA adapters' numbers (serving.lora.registry.AdapterStats), read at each scrape; None
    # when the server has no adapters.
    adapter_stats: Callable[[], Any] | None = None

    def observe(self, name: str, value: float) -> None:
        with self.lock:
            getattr(self, name).observe(value)

    def admitted(self, queue_seconds: float, prompt_tokens: int) -> None:
        """A request left the queue for its slots (JetStream's dequeue for prefill)."""
        with self.lock:
            self.queue_duration.observe(queue_seconds)
            self.request_input_length.observe(prompt_tokens)

    def choice_finished(self, generation_tokens: int) -> None:
        """One choice of a request ended, with the tokens it generated."""
        with self.lock:
            self.generation_tokens += generation_tokens

    def request_finished(
        self, reason: str, prompt_tokens: int, output_tokens: int, seconds: float, seconds_per_output_token: float | None
    ) -> None:
        """A request ended (its last choice): `reason` its finish reason, `output_tokens` its choices'
        together, `seconds` since its submission; `seconds_per_output_token` its choices' mean after
        their first token (None when none had two)."""
        with self.lock:
            self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            if reason not in SUCCESS_REASONS:
                return
            self.request_output_length.observe(output_tokens)
            self.time_per_request.observe(seconds)
            if seconds_per_output_token is not None:
                self.time_per_output_token.observe(seconds_per_output_token)
