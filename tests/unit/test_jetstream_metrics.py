"""/metrics keeps JetStream's metric contract (its names with its meaning, buckets and labels:
JetStream's jetstream/core/metrics/prometheus.py and core/orchestrator.py), on the mock engine over a
real uvicorn server, read back with prometheus_client's parser as a scraper reads it."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from serving.api import prometheus
from serving.api.state import ServerState
from serving.config import ServingConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.orchestrator import Orchestrator
from serving.orchestrator.metrics import LATENCY_BUCKETS, EngineMetrics
from serving.orchestrator.streams import Completion, _request_finished
from serving.request import SamplingParams
from tests.server_process import wait_for
from tests.unit.test_api import _Running

TOKENIZER = AsciiTokenizer()
CFG = ServingConfig(max_queued_requests=8, max_prefill_predict_length=64, max_target_length=256)

# JetStream's boundaries, as its source writes them (the token ones: DEFAULT_PREFILL_BUCKETS)
JETSTREAM_BUCKETS = {
    "jetstream_time_to_first_token": [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    ],
    "jetstream_time_per_output_token": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5],
    "jetstream_queue_duration": [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0],
    "jetstream_time_per_request": [1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0],
    "jetstream_request_input_length": [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
    "jetstream_request_output_length": [
        1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000,
        1000000, 2000000,
    ],
}
JETSTREAM_GAUGES = (
    "jetstream_prefill_backlog_size",
    "jetstream_slots_used_percentage",
    "num_requests_waiting",
    "kv_cache_utilization_perc",
)


def _serve(model_name: str = "mock", slots: int = 2, step_seconds: float = 0.0, **times) -> _Running:
    orchestrator = Orchestrator(MockEngine(slots=slots, step_seconds=step_seconds), {}, TOKENIZER, CFG.orchestrator)
    state = ServerState(config=CFG.server)
    state.set_ready(orchestrator.start(), model_name, **times)
    return _Running(state)


def _stop(running: _Running) -> None:
    running.stop()
    running.state.orchestrator.stop(timeout=10)


@pytest.fixture(scope="module")
def server():
    running = _serve("Llama-3-8B")
    yield running
    _stop(running)


def scrape(url: str) -> dict[str, list[Sample]]:
    """Family name -> its samples (a counter's family is named without `_total`)."""
    text = httpx.get(f"{url}/metrics").text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(families: dict[str, list[Sample]], family: str, sample: str | None = None, **labels: str) -> float:
    """The sample named `sample` (default: the family's name) of `family` with these labels among
    its own; 0 when there is none yet (a counter's series appears with its first count)."""
    found = [
        s for s in families[family] if s.name == (sample or family) and labels.items() <= s.labels.items()
    ]
    assert len(found) <= 1, found
    return found[0].value if found else 0.0


def _post(running: _Running, **body) -> dict:
    """A completion of "ab" from the served model."""
    body = {"model": running.state.model_name, "prompt": "ab", **body}
    response = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_request_of_n_choices_counts_once_its_prompt_once_and_every_choices_tokens(server):
    """metrics.finished ran per choice: one request with n=2 counted 2 successes and its prompt twice."""
    before = scrape(server.url)
    out = _post(server, n=2, max_tokens=3, temperature=0)
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]

    def grown(family: str, sample: str | None = None, **labels: str) -> float:
        return value(scrape(server.url), family, sample, **labels) - value(before, family, sample, **labels)

    assert wait_for(lambda: grown("jetstream_request_success_count", "jetstream_request_success_count_total") == 1, 5)
    assert grown("pathserve_requests_finished", "pathserve_requests_finished_total", reason="length") == 1
    assert grown("pathserve_prompt_tokens", "pathserve_prompt_tokens_total") == 2  # "ab", once
    assert grown("pathserve_generation_tokens", "pathserve_generation_tokens_total") == 2 * 3  # both choices'
    for family in ("jetstream_queue_duration", "jetstream_time_to_first_token", "jetstream_time_per_output_token",
                   "jetstream_time_per_request", "jetstream_request_input_length"):
        assert grown(family, f"{family}_count") == 1, family
    assert grown("jetstream_request_input_length", "jetstream_request_input_length_sum") == 2
    assert grown("jetstream_request_output_length", "jetstream_request_output_length_count") == 1
    assert grown("jetstream_request_output_length", "jetstream_request_output_length_sum") == 6  # its choices' together


def test_a_request_that_did_not_succeed_is_counted_by_its_reason_and_not_as_a_success():
    """A request's reason: the first of its choices' that is not stop or length; its success, size
    and time histograms only when every choice succeeded."""
    metrics = EngineMetrics()
    choices = [
        Completion("cd", [3, 4], reason, 2, 2, 0.1, [0.1, 0.2], choice=i)
        for i, reason in enumerate(["stop", "cancelled"])
    ]
    _request_finished(metrics, choices, 1.0)
    assert metrics.requests_finished == {"cancelled": 1} and metrics.prompt_tokens == 2
    assert metrics.time_per_request.count == metrics.request_output_length.count == 0
    _request_finished(metrics, [choices[0], Completion("c", [3], "length", 2, 1, 0.1, [0.1], choice=1)], 2.0)
    assert metrics.requests_finished == {"cancelled": 1, "stop": 1}
    assert (metrics.request_output_length.total, metrics.time_per_request.total) == (3, 2.0)
    assert metrics.time_per_output_token.total == pytest.approx(0.1)  # choice 0's; choice 1 had one token


def test_time_to_first_token_runs_from_the_dequeue_and_the_queue_wait_is_its_own_histogram():
    """JetStream's TTFT runs from the request's dequeue for prefill; pathserve's ran from its
    submission, so a request queued behind a long one counted its wait as time to first token."""
    running = _serve(slots=1, step_seconds=0.1)  # each prefill and generate call sleeps 0.1 s
    try:
        first = threading.Thread(target=_post, args=(running,), kwargs={"max_tokens": 16, "ignore_eos": True})
        first.start()  # holds the only slot for 8 generate calls (2 tokens each): ~0.9 s
        assert wait_for(lambda: value(scrape(running.url), "pathserve_active_slots") == 1, 10)
        _post(running, max_tokens=2)  # waits for the slot, then one prefill
        first.join(30)
        families = scrape(running.url)
    finally:
        _stop(running)

    def counts(family: str) -> dict[str, float]:
        return {s.labels["le"]: s.value for s in families[family] if s.name.endswith("_bucket")}

    ttft, queued = counts("jetstream_time_to_first_token"), counts("jetstream_queue_duration")
    assert ttft["+Inf"] == queued["+Inf"] == 2
    assert ttft["0.5"] == 2, ttft  # a prefill each: neither waited for its slot
    assert queued["0.5"] == 1, queued  # the second waited for the first's ~0.9 s
    assert value(families, "jetstream_queue_duration", "jetstream_queue_duration_sum") > 0.5


def test_the_jetstream_histograms_have_jetstreams_buckets_and_pathserves_keep_theirs(server):
    _post(server, max_tokens=3)
    families = scrape(server.url)
    for family, bounds in JETSTREAM_BUCKETS.items():
        les = [float(s.labels["le"]) for s in families[family] if s.name.endswith("_bucket")]
        assert les == [*map(float, bounds), float("inf")], family
    for family in ("pathserve_prefill_step_seconds", "pathserve_generate_step_seconds"):
        les = [float(s.labels["le"]) for s in families[family] if s.name.endswith("_bucket")]
        assert les == [*LATENCY_BUCKETS, float("inf")], family


def test_jetstream_series_carry_id_and_model_name_and_pathserve_series_do_not(server):
    _post(server, max_tokens=2)
    families = scrape(server.url)
    # the id: the pod's name (HOSTNAME), else one made for this process
    assert prometheus.PROCESS_ID == (os.environ.get("HOSTNAME") or prometheus.PROCESS_ID) != ""
    expected = {"id": prometheus.PROCESS_ID, "model_name": "Llama_3_8B"}  # the served name, '-' as '_'
    jetstream = [*JETSTREAM_BUCKETS, *JETSTREAM_GAUGES, "jetstream_request_success_count"]
    for family in jetstream:
        for sample in families[family]:
            labels = {k: v for k, v in sample.labels.items() if k not in ("le", "idx")}
            assert labels == expected, (family, sample)
    assert [s.labels["idx"] for s in families["jetstream_slots_used_percentage"]] == ["0"]
    for family, samples in families.items():
        if family.startswith("pathserve_"):
            assert all("id" not in s.labels and "model_name" not in s.labels for s in samples), family


@pytest.mark.parametrize(
    ("model_name", "label"),
    [
        ("Llama-3-8B", "Llama_3_8B"),
        ("gemma_2b", "gemma_2b"),
        ("", None),  # left out: JetStream's when no name is given
        ("llama-3.1-8b", None),  # left out: not a Prometheus name ('.'), as JetStream leaves it out
        ("meta/llama", None),
        ("8b", None),
    ],
)
def test_the_model_name_label_is_jetstreams(model_name, label):
    labels = prometheus.jetstream_labels(model_name, process_id="pod-0")
    assert labels == {"id": "pod-0", **({"model_name": label} if label else {})}


def test_a_model_name_jetstream_cannot_use_is_left_out_of_the_labels():
    running = _serve("llama-3.1-8b")
    try:
        families = scrape(running.url)
    finally:
        _stop(running)
    (sample,) = families["jetstream_prefill_backlog_size"]
    assert sample.labels == {"id": prometheus.PROCESS_ID}


def test_the_pickers_gauges_equal_pathserves_and_the_start_up_times_are_reported():
    running = _serve(slots=1, step_seconds=0.05, model_load_s=1.5, startup_s=4.25)
    try:
        first = threading.Thread(target=_post, args=(running,), kwargs={"max_tokens": 24, "ignore_eos": True})
        queued = threading.Thread(target=_post, args=(running,), kwargs={"max_tokens": 2})
        first.start()
        assert wait_for(lambda: value(scrape(running.url), "pathserve_active_slots") == 1, 10)
        queued.start()
        seen: dict = {}

        def one_waits_and_pages_are_held() -> bool:  # read from one scrape (a loaded machine's turns lag)
            seen.update(scrape(running.url))
            return value(seen, "jetstream_prefill_backlog_size") == 1 and value(seen, "pathserve_kv_cache_usage_ratio") > 0

        assert wait_for(one_waits_and_pages_are_held, 10)
        families = dict(seen)
        first.join(30)
        queued.join(30)
    finally:
        _stop(running)
    assert value(families, "num_requests_waiting") == value(families, "jetstream_prefill_backlog_size") == 1
    ratio = value(families, "pathserve_kv_cache_usage_ratio")
    assert ratio > 0 and value(families, "kv_cache_utilization_perc") == pytest.approx(100 * ratio)  # JetStream's percent
    assert value(families, "jetstream_model_load_time") == 1.5
    assert value(families, "jetstream_server_startup_latency") == 4.25


def test_start_up_times_are_left_out_where_not_measured(server):
    families = scrape(server.url)
    assert "jetstream_model_load_time" not in families and "jetstream_server_startup_latency" not in families


def test_startupz_says_started_once_started():
    state = ServerState(config=CFG.server)
    running = _Running(state)
    try:
        starting = httpx.get(f"{running.url}/startupz")
        assert (starting.status_code, starting.json()) == (503, {"status": "starting"})
        state.set_ready(Orchestrator(MockEngine(slots=1), {}, TOKENIZER, CFG.orchestrator).start(), "mock")
        started = httpx.get(f"{running.url}/startupz")
        assert (started.status_code, started.json()) == (200, {"status": "started"})
    finally:
        _stop(running)


def test_requests_submitted_straight_to_the_orchestrator_are_counted_alike():
    """The orchestrator counts; the HTTP layer only renders: a request from any front-end (here
    none) is one request."""
    orchestrator = Orchestrator(MockEngine(slots=2), {}, TOKENIZER, CFG.orchestrator).start()
    try:
        handles = orchestrator.submit_choices(TOKENIZER.encode("ab"), SamplingParams(max_tokens=2, n=2))
        assert [h.result().finish_reason for h in handles] == ["length", "length"]
    finally:
        orchestrator.stop(timeout=10)
    m = orchestrator.metrics
    assert (m.requests_finished, m.prompt_tokens, m.generation_tokens) == ({"length": 1}, 2, 4)
    assert m.time_to_first_token.count == m.queue_duration.count == m.request_input_length.count == 1
