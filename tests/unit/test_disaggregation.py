"""Disaggregated prefill and decode (serving.disaggregation, serving.orchestrator.disaggregated):
MaxText's inference_server and JetStream's slice strings read into a device split, errors naming
the key, and the executor's order on two mock engines through the orchestrator's threads: the
generate call over running slots first, each prompt prefilled on the prefill engine, moved and
inserted after it; every request's tokens the mock's hand-computable ones."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serving.config import OrchestratorConfig, ServingConfig
from serving.disaggregation import Disaggregation, disaggregation, slice_chips
from serving.engine.limits import Limits
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.errors import ConfigError
from serving.orchestrator import Orchestrator
from serving.orchestrator.disaggregated import DisaggregatedExecutor
from serving.orchestrator.plan import StepPlan
from serving.request import SamplingParams

TOKENIZER = AsciiTokenizer()


@pytest.mark.parametrize(
    ("spec", "chips"), [("v5e-16", 16), ("v6e-8", 8), ("tpu=8", 8), ("cpu=1", 1), ("v4-16", 8), ("v5p=4", 4)]
)
def test_slices_count_chips_as_jetstream_does(spec, chips):
    assert slice_chips(spec, "prefill_slice") == chips


@pytest.mark.parametrize("spec", ["v5e", "16", "v5e-", "v5e-x", "v5e-0", "v4-1", "-8"])
def test_a_bad_slice_is_an_error_naming_its_key(spec):
    with pytest.raises(ConfigError, match=r"generate_slice="):
        slice_chips(spec, "generate_slice")


def test_the_servers_maxtext_and_the_guide_name():
    assert disaggregation("MaxtextInterleavedServer", "v5e-16", "v5e-16") is None
    assert disaggregation("ExperimentalMaxtextDisaggregatedServer", "v6e-8", "v5e-16") == Disaggregation(8, 16)
    assert disaggregation("ExperimentalMaxtextDisaggregatedServer_8", "v5e-16", "v5e-16") == Disaggregation(8, 8)
    for bad in ("ExperimentalMaxtextDisaggregatedServer_0", "ExperimentalMaxtextDisaggregatedServer_8GPU", "Interleaved"):
        with pytest.raises(ConfigError, match="inference_server="):
            disaggregation(bad, "v5e-16", "v5e-16")


def test_the_split_takes_prefill_first_and_every_device():
    assert Disaggregation(1, 3).split(list("abcd")) == (["a"], ["b", "c", "d"])
    with pytest.raises(ConfigError, match="prefill_slice and generate_slice must name them all"):
        Disaggregation(2, 2).split(list("abc"))


def test_config_reads_the_keys_and_refuses_what_cannot_run_split():
    cfg = ServingConfig(inference_server="ExperimentalMaxtextDisaggregatedServer", prefill_slice="cpu=1", generate_slice="cpu=2")
    assert cfg.disaggregation == cfg.devices.disaggregation == Disaggregation(1, 2)
    assert cfg.engine.disaggregated and not ServingConfig().engine.disaggregated
    with pytest.raises(ValidationError, match="inference_server='Foo'"):
        ServingConfig(inference_server="Foo")
    with pytest.raises(ValidationError, match="prefill_slice='v6e'"):
        ServingConfig(inference_server="ExperimentalMaxtextDisaggregatedServer", prefill_slice="v6e")
    with pytest.raises(ValidationError, match="speculative_method=ngram with inference_server"):
        ServingConfig(inference_server="ExperimentalMaxtextDisaggregatedServer_1", speculative_method="ngram")


def test_every_request_prefills_whole_on_a_disaggregated_server():
    plain, split = Limits(4, 64, 256), Limits(4, 64, 256, whole_prefills_only=True)
    sampling = SamplingParams(max_tokens=4)
    assert not plain.prefills_whole(sampling) and split.prefills_whole(sampling)
    plain.check(100, sampling)  # chunked: up to max_target_length - max_tokens
    with pytest.raises(Exception, match="max_prefill_predict_length=64"):
        split.check(100, sampling)  # whole: one prefill bucket at most


def _disaggregated(slots: int = 4, **engine) -> tuple[Orchestrator, MockEngine, MockEngine]:
    prefill = MockEngine(slots=slots, whole_prefills_only=True, **engine)
    generate = MockEngine(slots=slots, whole_prefills_only=True, **engine)
    config = OrchestratorConfig(max_queued_requests=64, prefix_cache="off")

    def make_executor(engine, params, adapter_weights):
        return DisaggregatedExecutor(prefill, {}, engine, params, adapter_weights)

    return Orchestrator(generate, {}, TOKENIZER, config, make_executor), prefill, generate


def test_prompts_prefill_on_the_prefill_engine_and_decode_on_the_generate_engine():
    orch, prefill, generate = _disaggregated()
    requests = [([(5 * i + j) % 90 for j in range(3 + 7 * i)], SamplingParams(max_tokens=4 + i)) for i in range(8)]
    handles = [orch.submit(p, s) for p, s in requests]  # 8 requests, 4 slots: half wait for room
    orch.start()
    try:
        got = [h.result().token_ids for h in handles]
    finally:
        orch.stop(timeout=10)
    assert got == [generate.expected(p, s) for p, s in requests]
    names = lambda engine: {call[0] for call in engine.calls}  # noqa: E731
    assert names(prefill) == {"prefill"}  # no decode state, no slots, no generate on the prefill side
    assert {"receive", "insert", "generate"} <= names(generate) and "prefill" not in names(generate)
    assert "prefill_slots" not in names(generate)  # no chunks: every prompt whole
    assert [c for c in prefill.calls if c[0] == "prefill"] == [("prefill", tuple(p)) for p, _ in requests]
    assert sum(c[0] == "receive" for c in generate.calls) == len(requests)


def test_the_generate_call_goes_out_before_the_prefill_and_the_new_slot_decodes_next_plan():
    """A plan with a running slot and an admission: generate over the running slot is dispatched
    first, then the prompt prefills on the other engine, and its prefix is moved and inserted
    behind that call; the admitted slot has no token in this plan's call."""
    prefill = MockEngine(slots=2, whole_prefills_only=True)
    generate = MockEngine(slots=2, whole_prefills_only=True)
    executor = DisaggregatedExecutor(prefill, {}, generate, {})
    first = _admission(generate, slot=0, prompt=(1, 2, 3))
    executor.run(StepPlan(admissions=(first,), decode_steps=2, running=0, num_slots=1, max_position=3))
    assert [c[0] for c in generate.calls] == ["init_decode_state", "receive", "insert"]  # nothing ran yet
    generate.calls.clear()
    second = _admission(generate, slot=1, prompt=(7, 8))
    order = []
    prefill_calls, generate_calls = prefill.calls, generate.calls
    prefill.calls = _Recorder(order, "prefill side", prefill_calls)
    generate.calls = _Recorder(order, "generate side", generate_calls)
    outcome = executor.run(StepPlan(admissions=(second,), decode_steps=2, running=1, num_slots=2, max_position=5))
    assert order == [("generate side", "generate"), ("prefill side", "prefill"), ("generate side", "receive"),
                     ("generate side", "insert")]
    assert outcome.first_tokens == (9,)  # the mock's first token: the last prompt token + 1
    assert [row[0] for row in outcome.valid] == [True, True] and [row[1] for row in outcome.valid] == [False, False]


def test_a_plan_of_chunks_or_proposals_is_refused():
    executor = DisaggregatedExecutor(MockEngine(slots=2), {}, MockEngine(slots=2), {})
    from serving.engine.api import PrefillRow

    row = PrefillRow(0, (1, 2), 0, True, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="whole prefills only"):
        executor.run(StepPlan(rows=(row,)))


def _admission(engine: MockEngine, slot: int, prompt: tuple[int, ...]):
    from serving.orchestrator.plan import Admission

    return Admission(slot, slot, tuple(engine.limits.pad(list(prompt))), len(prompt), SamplingParams(max_tokens=8))


class _Recorder(list):
    """An engine's `calls` list that also records (side, call name) into a shared order."""

    def __init__(self, order: list, side: str, calls: list):
        super().__init__(calls)
        self.order, self.side = order, side

    def append(self, call) -> None:
        self.order.append((self.side, call[0]))
        super().append(call)


def test_an_adapter_is_written_into_both_engines_params_from_one_read():
    import numpy as np

    from serving.lora.peft import LoraWeights
    from serving.lora.registry import AdapterLoad

    reads = []

    def weights(load: AdapterLoad) -> LoraWeights:
        reads.append(load.name)
        return LoraWeights(4, {"wq": (np.zeros((1, 2, 4)), np.zeros((1, 4, 2)))}, 1.0)

    prefill, generate = MockEngine(slots=2), MockEngine(slots=2)
    executor = DisaggregatedExecutor(prefill, {}, generate, {}, weights)
    executor.run(StepPlan(adapter_loads=(AdapterLoad(1, "a", 1, "/store/a"),)))
    assert reads == ["a"]
    assert ("write_adapter", 1, 4) in prefill.calls and ("write_adapter", 1, 4) in generate.calls
    assert 1 in executor.params["lora"] and 1 in executor.prefill_params["lora"]
