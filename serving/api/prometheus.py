"""Prometheus exposition of the engine's and the HTTP layer's metrics, through prometheus-client.

Names follow JetStream's where JetStream has one (`jetstream_time_to_first_token`, ...), with its
meaning, its bucket boundaries and its labels (JetStream's jetstream/core/metrics/prometheus.py and
core/orchestrator.py), so that its dashboards and queries work: every jetstream_* series (and its
picker-facing `num_requests_waiting` and `kv_cache_utilization_perc`) carries `id` (the HOSTNAME,
else a random id made once per process) and `model_name` (the served model's, '-' as '_'; left out
when that is not a valid Prometheus name), `jetstream_slots_used_percentage` also `idx` (the
generate engine's: one here, 0). The rest are `pathserve_*`, with only their own labels. The
orchestrator keeps plain counters (serving.orchestrator.metrics, no dependency); a collector reads
a consistent snapshot of them at each scrape into a registry of the app's own (no process-global
state but the process's `id`).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from serving import metric_names
from serving.orchestrator.metrics import SUCCESS_REASONS, EngineMetrics, Histogram

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what JetStream's and most scrapers' parsers expect

# JetStream's `id` label: the pod's name where there is one (Kubernetes sets HOSTNAME), else an id
# of this process, so that the series of two servers never merge.
PROCESS_ID = os.environ.get("HOSTNAME") or uuid.uuid4().hex[:12]
_LABEL_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


@dataclass(frozen=True)
class Scrape:
    """What one scrape reads: the engine's metrics (None before it is up), the HTTP request counts
    by (route, status), the ignored request fields by name, and the served model: its name (the
    jetstream_* series' `model_name`) and start-up's seconds (None where not measured)."""

    engine: EngineMetrics | None
    http_requests: Mapping[tuple[str, int], int] = field(default_factory=dict)
    ignored_fields: Mapping[str, int] = field(default_factory=dict)
    model_name: str = ""
    model_load_s: float | None = None  # the weights read and placed on the devices
    startup_s: float | None = None  # from the start of loading to the device loop running


Source = Callable[[], Scrape]


def jetstream_labels(model_name: str, process_id: str = PROCESS_ID) -> dict[str, str]:
    """The labels of every JetStream series, as JetStream makes them: `id`, and `model_name` with
    its '-'s as '_'s, left out when empty or not a valid Prometheus name."""
    labels = {"id": process_id}
    name = model_name.replace("-", "_")
    if _LABEL_NAME.match(name):
        labels["model_name"] = name
    return labels


class _Collector(Collector):
    """The metrics of one server, read from `source()` at each scrape."""

    def __init__(self, source: Source):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        scrape = self.source()
        requests = CounterMetricFamily(
            "pathserve_http_requests", "HTTP requests by route and status code", labels=["route", "status"]
        )
        for (route, status), count in sorted(scrape.http_requests.items()):
            requests.add_metric([route, str(status)], count)
        yield requests
        ignored = CounterMetricFamily(
            "pathserve_ignored_request_fields",
            "requests that sent a field no wire type defines (unknown_request_fields=warn), by field name",
            labels=["field"],
        )
        for name, count in sorted(scrape.ignored_fields.items()):
            ignored.add_metric([name], count)
        yield ignored
        jetstream = _JetStreamFamilies(jetstream_labels(scrape.model_name))
        yield from jetstream.startup(scrape.model_load_s, scrape.startup_s)
        metrics = scrape.engine
        if metrics is not None:
            stats = metrics.adapter_stats() if metrics.adapter_stats is not None else None
            with metrics.lock:
                yield from jetstream.engine(metrics)
                yield from _engine_metrics(metrics)
                yield from _protocol_info(metrics, stats)
            if stats is not None:
                yield from _adapter_metrics(stats)


class _JetStreamFamilies:
    """JetStream's metrics, each series with JetStream's labels."""

    def __init__(self, labels: dict[str, str]):
        self.names, self.values = list(labels), list(labels.values())

    def startup(self, model_load_s: float | None, startup_s: float | None) -> Iterator[Metric]:
        for name, help_text, value in (
            ("jetstream_model_load_time", "seconds to read the weights and place them on the devices", model_load_s),
            ("jetstream_server_startup_latency", "seconds from the start of loading to serving", startup_s),
        ):
            if value is not None:
                yield self._gauge(name, help_text, value)

    def engine(self, m: EngineMetrics) -> Iterator[Metric]:
        kv_used = _kv_usage(m)
        yield self._gauge(metric_names.QUEUED_REQUESTS, "requests waiting for a decode slot", m.queued)
        yield self._gauge("num_requests_waiting", "requests waiting for a decode slot", m.queued)
        # JetStream's unit is percent (0-100); pathserve_kv_cache_usage_ratio is the same reading, 0-1
        yield self._gauge("kv_cache_utilization_perc", "percent of the KV cache's pages held by sequences", 100 * kv_used)
        slots = GaugeMetricFamily(
            "jetstream_slots_used_percentage", "fraction of decode slots in use (0-1)", labels=[*self.names, "idx"]
        )
        slots.add_metric([*self.values, "0"], m.active_slots / m.total_slots if m.total_slots else 0.0)
        yield slots
        success = sum(n for reason, n in m.requests_finished.items() if reason in SUCCESS_REASONS)
        counter = CounterMetricFamily(
            "jetstream_request_success_count", "requests whose every choice finished (stop or length)",
            labels=self.names,
        )
        counter.add_metric(self.values, success)
        yield counter
        for name, help_text, histogram in (
            ("jetstream_queue_duration", "seconds from submission to leaving the queue for decode slots", m.queue_duration),
            ("jetstream_time_to_first_token", "seconds from leaving the queue (for prefill) to the first token",
             m.time_to_first_token),
            ("jetstream_time_per_output_token", "seconds per output token after the first (a succeeded "
             "request's; its choices' mean)", m.time_per_output_token),
            ("jetstream_time_per_request", "seconds from submission to a succeeded request's last token",
             m.time_per_request),
            ("jetstream_request_input_length", "prompt tokens per request (at its dequeue)", m.request_input_length),
            ("jetstream_request_output_length", "output tokens per succeeded request (its choices' together)",
             m.request_output_length),
        ):
            yield self._histogram(name, help_text, histogram)
        # Not jetstream_time_per_prefill_token: JetStream's is a request's own prefill call over its
        # prompt; here a prompt is prefilled in chunks batched with other requests' and between
        # generate calls, and a call of middle chunks is timed at its dispatch only, so no time is
        # a request's prefill alone (pathserve_prefill_step_seconds times the calls).

    def _gauge(self, name: str, help_text: str, value: float) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily(name, help_text, labels=self.names)
        gauge.add_metric(self.values, value)
        return gauge

    def _histogram(self, name: str, help_text: str, histogram: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, help_text, labels=self.names)
        family.add_metric(self.values, _buckets(histogram), histogram.total)
        return family


def _kv_usage(m: EngineMetrics) -> float:
    """The pool's pages some sequence holds, 0-1, as vLLM's usage counts its blocks."""
    return m.kv_pages_used * m.kv_block_size / m.kv_tokens_capacity if m.kv_tokens_capacity else 0.0


def _engine_metrics(m: EngineMetrics) -> Iterator[Metric]:
    for name, help_text, value in (
        (metric_names.RUNNING_REQUESTS, "decode slots in use: sequences prefilling or decoding", m.active_slots),
        ("pathserve_total_slots", "decode slots", m.total_slots),
        (metric_names.KV_CACHE_USAGE, "fraction of the KV cache's pages held by sequences (0-1)", _kv_usage(m)),
        ("pathserve_kv_cache_tokens_used", "KV cache positions holding live sequences", m.kv_tokens_used),
        ("pathserve_kv_cache_pages_used", "pages of the KV cache's pool held by sequences", m.kv_pages_used),
        ("pathserve_prefix_cache_bytes", "bytes of prompt-prefix KV blocks the prefix cache holds",
         m.prefix_cache_bytes),
        ("pathserve_warmup_shapes_pending", "prefill shapes the background warmup has yet to compile",
         m.warmup_shapes_pending),
    ):
        yield GaugeMetricFamily(name, help_text, value=value)
    by_reason = CounterMetricFamily(
        "pathserve_requests_finished",
        "requests by finish reason, a request of n choices once: the first of its choices' reasons "
        "that is not stop or length, else its first choice's",
        labels=["reason"],
    )
    for reason, count in sorted(m.requests_finished.items()):
        by_reason.add_metric([reason], count)
    yield by_reason
    for name, help_text, value in (
        ("pathserve_prompt_tokens", "prompt tokens of finished requests (once a request)", m.prompt_tokens),
        ("pathserve_generation_tokens", "tokens generated for finished requests (every choice's)",
         m.generation_tokens),
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
        ("pathserve_prefill_step_seconds", "seconds per prefill call (one prompt, or a batch of chunks; a call of middle chunks only: its dispatch)",
         m.prefill_step),
        ("pathserve_generate_step_seconds", "seconds per generate call (k decode steps)", m.generate_step),
    ):
        yield HistogramMetricFamily(name, help_text, buckets=_buckets(histogram), sum_value=histogram.total)


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


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    """Cumulative counts by upper bound, the bounds written as prometheus-client writes them."""
    buckets, cumulative = [], 0
    for bound, count in zip(histogram.buckets, histogram.counts, strict=False):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    buckets.append(("+Inf", histogram.count))
    return buckets


def registry(source: Source) -> CollectorRegistry:
    """A registry of one server's metrics, read from `source` at every scrape."""
    out = CollectorRegistry(auto_describe=False)
    out.register(_Collector(source))
    return out


def render(metrics_registry: CollectorRegistry) -> str:
    """The registry in Prometheus' text format (0.0.4)."""
    return generate_latest(metrics_registry).decode()
