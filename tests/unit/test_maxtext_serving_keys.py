"""MaxText's serving keys a JetStream recipe carries: prometheus_port (JetStream's metrics server)
and decode_sampling_* (what a request without sampling fields samples with), on the mock engine."""

from __future__ import annotations

import httpx
import pytest

from loadtest.server import free_port
from serving.api.app import create_app
from serving.api.server import _start_metrics
from serving.api.state import ServerState
from serving.config import ConfigError, load_config
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.orchestrator import Orchestrator
from tests.unit.test_api import _Running

TOKENIZER = AsciiTokenizer()


def _state(*overrides: str) -> ServerState:
    cfg = load_config(None, ["max_prefill_predict_length=64", "max_target_length=256", *overrides])
    state = ServerState(config=cfg.server)
    state.set_ready(Orchestrator(MockEngine(slots=2), {}, TOKENIZER, cfg.orchestrator).start(), "mock")
    return state


def test_prometheus_port_serves_the_apps_metrics_alone():
    port = free_port()
    state = _state(f"prometheus_port={port}", "grpc_port=0")
    try:
        app = create_app(state)
        server = _start_metrics(state, app, "127.0.0.1", free_port())
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            assert "jetstream_prefill_backlog_size" in text and "pathserve_http_requests_total" in text
        finally:
            server.shutdown()
        with pytest.raises(ConfigError, match="prometheus_port"):
            _start_metrics(state, app, "127.0.0.1", port)  # the HTTP port's own
        assert _start_metrics(_state("prometheus_port=0"), app, "127.0.0.1", 8000) is None
    finally:
        state.orchestrator.stop(timeout=10)


def test_generate_without_sampling_fields_samples_as_the_decode_sampling_keys_say():
    running = _Running(_state("decode_sampling_strategy=topk", "decode_sampling_top_k=3",
                              "decode_sampling_temperature=0.5"))
    orchestrator = running.state.orchestrator
    seen = []
    submit = orchestrator.submit_choices

    def spy(ids, sampling, *args, **kwargs):
        seen.append(sampling)
        return submit(ids, sampling, *args, **kwargs)

    orchestrator.submit_choices = spy
    try:
        assert httpx.post(f"{running.url}/generate", json={"prompt": "ab", "max_tokens": 2}, timeout=30).status_code == 200
        given = {"prompt": "ab", "max_tokens": 2, "temperature": 0.0}
        assert httpx.post(f"{running.url}/generate", json=given, timeout=30).status_code == 200
        assert (seen[0].temperature, seen[0].top_k, seen[0].top_p) == (0.5, 3, 1.0)
        assert (seen[1].temperature, seen[1].top_k) == (0.0, 0)  # the request's own fields win
    finally:
        running.stop()
        orchestrator.stop(timeout=10)


def test_decode_sampling_keys_are_checked_as_maxtext_needs_them():
    for overrides, named in [
        (["decode_sampling_strategy=nucleus"], "decode_sampling_nucleus_p"),
        (["decode_sampling_strategy=topk"], "decode_sampling_top_k"),
        (["decode_sampling_strategy=beam"], "decode_sampling_strategy"),
    ]:
        with pytest.raises(ConfigError, match=named):
            load_config(None, overrides)
