"""Speculative decoding's settings: validated at the edge, handed to the orchestrator, and the
per-request opt-out from the OpenAI body."""

from __future__ import annotations

import pytest

from serving.config import ServingConfig, load_config
from serving.errors import ConfigError
from serving.openai.convert import openai_sampling
from serving.openai.protocol import CompletionRequest


class _Tokenizer:
    eos_ids = (0,)


def test_speculative_keys_reach_the_orchestrator():
    cfg = ServingConfig(speculative_method="ngram", num_speculative_tokens=6, prompt_lookup_min=1)
    spec = cfg.orchestrator.speculative
    assert spec.speculative_method == "ngram" and spec.num_speculative_tokens == 6 and spec.prompt_lookup_min == 1
    assert ServingConfig().orchestrator.speculative.speculative_method == "none"
    # a draft's cost in the gate: derived (-1) unless given
    assert ServingConfig().orchestrator.speculative.speculative_draft_cost_ratio == -1
    assert ServingConfig(speculative_draft_cost_ratio=0.3).orchestrator.speculative.speculative_draft_cost_ratio == 0.3


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["speculative_method=draft"], "speculative_model"),
        (["speculative_model=/x"], "speculative_model"),
        (["prompt_lookup_min=5", "prompt_lookup_max=3"], "prompt_lookup_min"),
        (["speculative_method=eagle"], "speculative_method"),
        (["speculative_draft_cost_ratio=-2"], "speculative_draft_cost_ratio"),
    ],
)
def test_bad_speculative_settings_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


def test_a_request_opts_out_of_speculation():
    body = CompletionRequest(model="m", prompt="hi", speculative=False)
    assert not openai_sampling(body, _Tokenizer(), 2, 64).speculative
    assert openai_sampling(CompletionRequest(model="m", prompt="hi"), _Tokenizer(), 2, 64).speculative


def test_metrics_report_speculation_per_method_and_bench_serve_reads_them():
    from loadtest.bench import parse_speculative, speculative_summary
    from serving.api.prometheus import Scrape, registry, render
    from serving.orchestrator.metrics import EngineMetrics

    metrics = EngineMetrics(total_slots=4, speculative_method="ngram", spec_proposed=40, spec_accepted=30,
                            spec_rounds=10)
    text = render(registry(lambda: Scrape(metrics)))
    assert 'pathserve_spec_decode_acceptance_rate{method="ngram"} 0.75' in text
    assert 'pathserve_spec_decode_mean_accepted_length{method="ngram"} 3.0' in text
    before = parse_speculative(text)
    assert before == {"ngram": {"proposed_tokens": 40.0, "accepted_tokens": 30.0, "rounds": 10.0}}
    metrics.spec_proposed, metrics.spec_accepted, metrics.spec_rounds = 60, 40, 15
    after = parse_speculative(render(registry(lambda: Scrape(metrics))))
    assert speculative_summary(before, after) == {
        "ngram": {"proposed": 20, "accepted": 10, "acceptance_rate": 0.5, "mean_accepted_length": 2.0}
    }
    assert speculative_summary(after, after) is None
