"""The model-server protocol's signals in /metrics (serving.metric_names), on the mock engine:
read back with prometheus_client's own parser, as an endpoint picker reads them."""

from __future__ import annotations

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from serving import metric_names
from serving.api.prometheus import Scrape, registry, render
from serving.config import OrchestratorConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.lora.peft import LoraWeights
from serving.lora.registry import AdapterRegistry
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams


def _scrape(orchestrator: Orchestrator) -> dict[str, list]:
    """metric name -> its samples, through the exposition format and prometheus_client's parser."""
    text = render(registry(lambda: Scrape(orchestrator.metrics)))
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _adapters(max_loras: int) -> AdapterRegistry:
    def read(path):
        return LoraWeights(1, {"wq": (np.zeros((1, 2, 1)), np.zeros((1, 1, 2)))}, 1.0)

    adapters = AdapterRegistry(read, max_loras, 4)
    for name in ("sql", "chat", "legal"):
        adapters.load(name, f"/adapters/{name}")
    return adapters


def test_every_protocol_name_is_a_gauge_with_its_labels():
    engine = MockEngine(slots=4, max_target_length=512, prefix_block=16, block_bytes=1000)
    config = OrchestratorConfig()
    orchestrator = Orchestrator(engine, {}, AsciiTokenizer(), config, adapters=_adapters(max_loras=2))
    text = render(registry(lambda: Scrape(orchestrator.metrics)))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        metric_names.QUEUED_REQUESTS,
        metric_names.RUNNING_REQUESTS,
        metric_names.KV_CACHE_USAGE,
        metric_names.LORA_INFO,
        metric_names.CACHE_CONFIG_INFO,
    ):
        assert families[name].type == "gauge", name
    (lora,) = families[metric_names.LORA_INFO].samples
    assert lora.labels["max_lora"] == "2"
    (cache,) = families[metric_names.CACHE_CONFIG_INFO].samples
    # The pages a cached prefix may stay in: the pool's, 4 slots x 512 / 16, the scratch page not counted.
    assert cache.labels == {"block_size": "16", "num_gpu_blocks": "128"} and cache.value == 1


def test_without_lora_there_is_no_lora_info_and_no_prefix_cache_means_no_blocks():
    config = OrchestratorConfig(prefix_cache="off")
    orchestrator = Orchestrator(MockEngine(slots=2, max_target_length=512), {}, AsciiTokenizer(), config)
    samples = _scrape(orchestrator)
    assert metric_names.LORA_INFO not in samples
    assert samples[metric_names.CACHE_CONFIG_INFO][0].labels["num_gpu_blocks"] == "0"



def test_lora_info_names_the_resident_and_the_waiting_adapters_with_a_fresh_timestamp():
    adapters = _adapters(max_loras=1)
    orchestrator = Orchestrator(
        MockEngine(slots=2, max_target_length=512), {}, AsciiTokenizer(), OrchestratorConfig(), adapters=adapters
    )
    assert adapters.acquire("sql") is not None  # resident in the only device slot, held by a running request
    for adapter in ("chat", "legal", "chat", None):
        orchestrator.submit([5, 6, 7], SamplingParams(max_tokens=4, adapter=adapter))
    before = orchestrator.metrics.adapters_updated
    orchestrator._record_waiting_adapters()  # what the device loop does each turn
    (lora,) = _scrape(orchestrator)[metric_names.LORA_INFO]
    assert lora.labels == {"max_lora": "1", "running_lora_adapters": "sql", "waiting_lora_adapters": "chat,legal"}
    assert lora.value >= before > 0
    waiting = _scrape(orchestrator)[metric_names.QUEUED_REQUESTS]
    assert waiting[0].value == 4
