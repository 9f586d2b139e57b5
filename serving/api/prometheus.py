"""Prometheus text exposition (format 0.0.4) of the engine's and the HTTP layer's metrics.

Names follow JetStream's where JetStream has one (`jetstream_time_to_first_token`, ...), so its
dashboards work; the rest are `pathserve_*`.
"""

from __future__ import annotations

from collections.abc import Mapping

from serving.orchestrator.metrics import EngineMetrics, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render(metrics: EngineMetrics | None, http_requests: Mapping[tuple[str, int], int]) -> str:
    """Every metric as Prometheus text; engine metrics only once the engine is up."""
    out: list[str] = []
    _family(out, "pathserve_http_requests", "counter", "HTTP requests by route and status code")
    for (route, status), count in sorted(http_requests.items()):
        out.append(f'pathserve_http_requests_total{{route="{route}",status="{status}"}} {count}')
    if metrics is None:
        return "\n".join(out) + "\n"
    with metrics.lock:
        finished = dict(metrics.requests_finished)
        success = sum(n for reason, n in finished.items() if reason in ("stop", "length"))
        slots_used = metrics.active_slots / metrics.total_slots if metrics.total_slots else 0.0
        kv_used = metrics.kv_tokens_used / metrics.kv_tokens_capacity if metrics.kv_tokens_capacity else 0.0
        gauges = [
            ("jetstream_prefill_backlog_size", "requests waiting for a decode slot", metrics.queued),
            ("jetstream_slots_used_percentage", "fraction of decode slots in use", slots_used),
            ("pathserve_active_slots", "decode slots in use", metrics.active_slots),
            ("pathserve_total_slots", "decode slots", metrics.total_slots),
            ("pathserve_kv_cache_usage_ratio", "fraction of KV cache positions in use", kv_used),
            ("pathserve_kv_cache_tokens_used", "KV cache positions in use", metrics.kv_tokens_used),
        ]
        for name, help_text, value in gauges:
            _family(out, name, "gauge", help_text)
            out.append(f"{name} {_number(value)}")
        _family(out, "jetstream_request_success_count", "counter", "requests that finished (stop or length)")
        out.append(f"jetstream_request_success_count_total {success}")
        _family(out, "pathserve_requests_finished", "counter", "requests by finish reason")
        for reason, count in sorted(finished.items()):
            out.append(f'pathserve_requests_finished_total{{reason="{reason}"}} {count}')
        tokens = [
            ("pathserve_prompt_tokens", "prompt tokens of finished requests", metrics.prompt_tokens),
            (
                "pathserve_generation_tokens",
                "tokens generated for finished requests",
                metrics.generation_tokens,
            ),
        ]
        for name, help_text, value in tokens:
            _family(out, name, "counter", help_text)
            out.append(f"{name}_total {value}")
        _family(out, "pathserve_requests_rejected", "counter", "requests refused because the queue was full")
        out.append(f"pathserve_requests_rejected_total {metrics.requests_rejected}")
        histograms = [
            (
                "jetstream_time_to_first_token",
                "seconds from submission to the first token",
                metrics.time_to_first_token,
            ),
            (
                "jetstream_time_per_output_token",
                "seconds per output token after the first",
                metrics.time_per_output_token,
            ),
            ("pathserve_prefill_step_seconds", "seconds per prefill call", metrics.prefill_step),
            (
                "pathserve_generate_step_seconds",
                "seconds per generate call (k decode steps)",
                metrics.generate_step,
            ),
        ]
        for name, help_text, histogram in histograms:
            _family(out, name, "histogram", help_text)
            _histogram(out, name, histogram)
    return "\n".join(out) + "\n"


def _family(out: list[str], name: str, kind: str, help_text: str) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")


def _histogram(out: list[str], name: str, histogram: Histogram) -> None:
    cumulative = 0
    for bound, count in zip(histogram.buckets, histogram.counts, strict=False):
        cumulative += count
        out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
    out.append(f'{name}_bucket{{le="+Inf"}} {histogram.count}')
    out.append(f"{name}_sum {_number(histogram.total)}")
    out.append(f"{name}_count {histogram.count}")


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)
