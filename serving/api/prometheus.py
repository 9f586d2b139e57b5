"""Prometheus exposition of the engine's and the HTTP layer's metrics, through prometheus-client.

Names follow JetStream's where JetStream has one (`jetstream_time_to_first_token`, ...), so its
dashboards work; the rest are `pathserve_*`. The orchestrator keeps plain counters
(serving.orchestrator.metrics, no dependency); a collector reads a consistent snapshot of them at
each scrape into a registry of the app's own (no process-global state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from serving import metric_names
from serving.orchestrator.metrics import EngineMetrics, Histogram

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what JetStream's and most scrapers' parsers expect

Source = Callable[[], tuple[EngineMetrics | None, Mapping[tuple[str, int], int], Mapping[str, int]]]


class _Collector(Collector):
    """The metrics of one server: `source()` gives the engine's (None before it is up), the
    HTTP request counts by (route, status) and the ignored request fields by name."""

    def __init__(self, source: Source):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        metrics, http_requests, ignored_fields = self.source()
        requests = CounterMetricFamily(
            "pathserve_http_requests", "HTTP requests by route and status code", labels=["route", "status"]
        )
        for (route, status), count in sorted(http_requests.items()):
            requests.add_metric([route, str(status)], count)
        yield requests
        ignored = CounterMetricFamily(
            "pathserve_ignored_request_fields",
            "requests that sent a field no wire type defines (unknown_request_fields=warn), by field name",
            labels=["field"],
        )
        for name, count in sorted(ignored_fields.items()):
            ignored.add_metric([name], count)
        yield ignored
        if metrics is not None:
            stats = metrics.adapter_stats() if metrics.adapter_stats is not None else None
            with metrics.lock:
                yield from _engine_metrics(metrics)
                yield from _protocol_info(metrics, stats)
            if stats is not None:
                yield from _adapter_metrics(stats)


def _engine_metrics(m: EngineMetrics) -> Iterator[Metric]:
    slots_used = m.active_slots / m.total_slots if m.total_slots else 0.0
    # the pool's pages some sequence holds, as vLLM's usage counts its blocks
    kv_used = m.kv_pages_used * m.kv_block_size / m.kv_tokens_capacity if m.kv_tokens_capacity else 0.0
    for name, help_text, value in (
        (metric_names.QUEUED_REQUESTS, "requests waiting for a decode slot", m.queued),
        ("jetstream_slots_used_percentage", "fraction of decode slots in use", slots_used),
        (metric_names.RUNNING_REQUESTS, "decode slots in use: sequences prefilling or decoding", m.active_slots),
        ("pathserve_total_slots", "decode slots", m.total_slots),
        (metric_names.KV_CACHE_USAGE, "fraction of the KV cache's pages held by sequences (0-1)", kv_used),
        ("pathserve_kv_cache_tokens_used", "KV cache positions holding live sequences", m.kv_tokens_used),
        ("pathserve_kv_cache_pages_used", "pages of the KV cache's pool held by sequences", m.kv_pages_used),
        ("pathserve_prefix_cache_bytes", "bytes of prompt-prefix KV blocks the prefix cache holds",
         m.prefix_cache_bytes),
        ("pathserve_warmup_shapes_pending", "prefill shapes the background warmup has yet to compile",
         m.warmup_shapes_pending),
    ):
        yield GaugeMetricFamily(name, help_text, value=value)
    finished = dict(m.requests_finished)
    success = sum(n for reason, n in finished.items() if reason in ("stop", "length"))
    yield CounterMetricFamily(
        "jetstream_request_success_count", "requests that finished (stop or length)", value=success
    )
    by_reason = CounterMetricFamily("pathserve_requests_finished", "requests by finish reason", labels=["reason"])
    for reason, count in sorted(finished.items()):
        by_reason.add_metric([reason], count)
    yield by_reason
    for name, help_text, value in (
        ("pathserve_prompt_tokens", "prompt tokens of finished requests", m.prompt_tokens),
        ("pathserve_generation_tokens", "tokens generated for finished requests", m.generation_tokens),
        ("pathserve_requests_rejected", "requests refused because the queue was full", m.requests_rejected),
        ("pathserve_preemptions", "sequences that gave up their KV pages and were prefilled again",
         m.preemptions),
        ("pathserve_prefix_cache_hits", "prompt blocks found in the prefix cache", m.prefix_cache_hits),
        ("pathserve_prefix_cache_misses", "prompt blocks looked up in the prefix cache and not found",
         m.prefix_cache_misses),
    ):
        yield CounterMetricFamily(name, help_text, value=value)
    yield from _speculative_metrics(m)
    for name, help_text, histogram in (
        ("jetstream_time_to_first_token", "seconds from submission to the first token", m.time_to_first_token),
        ("jetstream_time_per_output_token", "seconds per output token after the first", m.time_per_output_token),
        ("pathserve_prefill_step_seconds", "seconds per prefill call (one prompt, or a batch of chunks; a call of middle chunks only: its dispatch)",
         m.prefill_step),
        ("pathserve_generate_step_seconds", "seconds per generate call (k decode steps)", m.generate_step),
    ):
        yield _histogram(name, help_text, histogram)


def _protocol_info(m: EngineMetrics, stats) -> Iterator[Metric]:
    """The model-server protocol's info gauges: LoRA adapters, only when LoRA is configured
    (value: when they were last read, so a picker keeps the newest series), and the prefix cache's
    shape in blocks (value 1), which the picker's prefix scorer sizes its index by."""
    if stats is not None and stats.max_loras > 0:
        lora = GaugeMetricFamily(
            metric_names.LORA_INFO,
            "LoRA adapters: slots (max_lora), resident on the device, named by waiting requests",
            labels=list(metric_names.LORA_LABELS),
        )
        labels = [str(stats.max_loras), ",".join(stats.resident_names), ",".join(m.waiting_adapters)]
        lora.add_metric(labels, m.adapters_updated)
        yield lora
    cache = GaugeMetricFamily(
        metric_names.CACHE_CONFIG_INFO,
        "prefix cache shape: tokens per block and the blocks it retains at most "
        "(the KV pool's pages; 0 with prefix_cache=off)",
        labels=list(metric_names.CACHE_CONFIG_LABELS),
    )
    cache.add_metric([str(m.kv_block_size), str(m.prefix_cache_blocks)], 1.0)
    yield cache


def _speculative_metrics(m: EngineMetrics) -> Iterator[Metric]:
    """Speculative decoding's counts, labelled by method (none while it is off)."""
    method = [m.speculative_method]
    for name, help_text, value in (
        ("pathserve_spec_decode_proposed_tokens", "proposed tokens verified", m.spec_proposed),
        ("pathserve_spec_decode_accepted_tokens", "proposed tokens accepted", m.spec_accepted),
        ("pathserve_spec_decode_rounds", "slot-calls that verified proposals", m.spec_rounds),
    ):
        counter = CounterMetricFamily(name, help_text, labels=["method"])
        counter.add_metric(method, value)
        yield counter
    for name, help_text, value in (
        ("pathserve_spec_decode_acceptance_rate", "accepted / proposed tokens",
         m.spec_accepted / m.spec_proposed if m.spec_proposed else 0.0),
        ("pathserve_spec_decode_mean_accepted_length", "accepted tokens per slot-call that verified proposals",
         m.spec_accepted / m.spec_rounds if m.spec_rounds else 0.0),
    ):
        gauge = GaugeMetricFamily(name, help_text, labels=["method"])
        gauge.add_metric(method, value)
        yield gauge


def _adapter_metrics(stats) -> Iterator[Metric]:
    """LoRA adapters (serving.lora.registry.AdapterStats)."""
    for name, help_text, value in (
        ("pathserve_lora_adapters_loaded", "LoRA adapters the server serves by name", stats.loaded),
        ("pathserve_lora_adapters_resident", "LoRA adapters holding a device slot", stats.resident),
        ("pathserve_lora_max_loras", "LoRA adapters' device slots (max_loras)", stats.max_loras),
    ):
        yield GaugeMetricFamily(name, help_text, value=value)
    yield CounterMetricFamily("pathserve_lora_loads", "LoRA adapter reads from storage", value=stats.loads)
    yield CounterMetricFamily(
        "pathserve_lora_load_seconds", "seconds spent reading LoRA adapters from storage", value=stats.load_seconds
    )
    requests = CounterMetricFamily(
        "pathserve_lora_requests", "requests admitted per LoRA adapter (the most requested; the rest as other)",
        labels=["adapter"],
    )
    for adapter, count in sorted(stats.requests.items()):
        requests.add_metric([adapter], count)
    yield requests


def _histogram(name: str, help_text: str, histogram: Histogram) -> HistogramMetricFamily:
    buckets, cumulative = [], 0
    for bound, count in zip(histogram.buckets, histogram.counts, strict=False):
        cumulative += count
        buckets.append((str(bound), cumulative))
    buckets.append(("+Inf", histogram.count))
    return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=histogram.total)


def registry(source: Source) -> CollectorRegistry:
    """A registry of one server's metrics, read from `source` at every scrape."""
    out = CollectorRegistry(auto_describe=False)
    out.register(_Collector(source))
    return out


def render(metrics_registry: CollectorRegistry) -> str:
    """The registry in Prometheus' text format (0.0.4)."""
    return generate_latest(metrics_registry).decode()
