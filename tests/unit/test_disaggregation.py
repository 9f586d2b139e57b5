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
    assert cfg.orchestrator.disaggregated and not ServingConfig().orchestrator.disaggregated
    with pytest.raises(ValidationError, match="inference_server='Foo'"):
        ServingConfig(inference_server="Foo")
    with pytest.raises(ValidationError, match="prefill_slice='v6e'"):
        ServingConfig(inference_server="ExperimentalMaxtextDisaggregatedServer", prefill_slice="v6e")
    with pytest.raises(ValidationError, match="speculative_method=ngram with inference_server"):
        ServingConfig(inference_server="ExperimentalMaxtextDisaggregatedServer_1", speculative_method="ngram")


def _disaggregated(slots: int = 4, cache: str = "on", **engine) -> tuple[Orchestrator, MockEngine, MockEngine]:
    engine = {"slots": slots, "max_prefill_length": 64, "max_target_length": 512, "prefix_block": 16, **engine}
    prefill, generate = MockEngine(**engine), MockEngine(**engine)
    config = OrchestratorConfig(max_queued_requests=64, prefix_cache=cache, disaggregated=True)

    def make_executor(engine, params, adapter_weights):
        return DisaggregatedExecutor(prefill, {}, engine, params, adapter_weights)

    return Orchestrator(generate, {}, TOKENIZER, config, make_executor), prefill, generate


SYSTEM = [(7 * i) % 90 for i in range(40)]  # a shared system prompt: 2 whole pages of 16 and a half


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """12 prompts of 1..200 tokens, half behind the shared system prompt; two of them score their prompts."""
    lengths = [1, 5, 17, 33, 64, 65, 90, 130, 200, 3, 48, 100]
    prompts = [[(i * 11 + j) % 95 for j in range(n)] for i, n in enumerate(lengths)]
    prompts = [SYSTEM + p if i % 2 else p for i, p in enumerate(prompts)]
    # logprobs go in chunks, and so does the prompt's (scored, each chunk alone), with tokens
    # to generate or none (max_tokens 0, echo)
    samplings = [
        SamplingParams(
            max_tokens=0 if i == 9 else 3 + i % 5, logprobs=1 if i in (2, 4) else None,
            prompt_logprobs=1 if i in (4, 9) else None,
        )
        for i in range(len(prompts))
    ]
    return list(zip(prompts, samplings, strict=True))


def _calls(engine: MockEngine, name: str) -> list[tuple]:
    return [call for call in engine.calls if call[0] == name]


@pytest.mark.parametrize("cache", ["on", "off"])
def test_prompts_prefill_on_one_engine_and_decode_on_the_other_with_the_same_tokens(cache):
    orch, prefill, generate = _disaggregated(cache=cache, prefill_chunk_size=32)
    requests = _requests()
    handles = [orch.submit(p, s) for p, s in requests]  # 12 requests, 4 slots: most wait for room
    orch.start()
    try:
        got = [h.result().token_ids for h in handles]
    finally:
        orch.stop(timeout=10)
    assert got == [generate.expected(p, s) for p, s in requests]
    # chunks and whole prompts prefill on the prefill side only; decoding on the generate side only
    assert _calls(prefill, "prefill_slots") and not _calls(generate, "prefill_slots")
    assert not _calls(prefill, "prefill") and not _calls(generate, "prefill")  # no whole prompt: every one in chunks
    assert _calls(prefill, "prefill_slots_scored") and not _calls(generate, "prefill_slots_scored")
    assert _calls(generate, "generate") and not _calls(prefill, "generate")
    # each chunked prompt moved once, from the slot it prefilled in to the same slot, with its pages
    handed, accepted = _calls(prefill, "handoff"), _calls(generate, "accept")
    assert len(handed) == len(accepted) == len(requests)
    assert [c[1:] for c in handed] == [c[1:] for c in accepted]
    assert not _calls(generate, "receive")  # no whole prefix to move
    if cache == "on":  # the shared system prompt's pages were read from the prefill side's pool
        assert any(start > 0 for call in _calls(prefill, "prefill_slots") for _, start, _, _ in call[1])


def test_a_preempted_sequence_is_recomputed_on_the_prefill_side_and_handed_off_again():
    """Two long generations in a pool that holds one: the newer, already streaming, is preempted
    (its state handed back to the prefill engine), prefilled again there with the tokens it
    streamed, and moved to the generate side again; neither stream repeats or loses a token."""
    orch, prefill, generate = _disaggregated(
        slots=2, max_prefill_length=16, max_target_length=64, prefix_block=4, num_pages=17
    )
    requests = [([5 + i] * 8, SamplingParams(max_tokens=50)) for i in range(2)]
    handles = [orch.submit(p, s) for p, s in requests]
    orch.start()
    try:
        streams = [[t for delta in h.stream() for t in delta.token_ids] for h in handles]
    finally:
        orch.stop(timeout=10)
    assert streams == [generate.expected(p, s) for p, s in requests]
    assert orch.metrics.preemptions > 0
    back = [c for c in _calls(generate, "handoff") if c[2] == ()]  # state only, no pages
    assert back and len(back) == len([c for c in _calls(prefill, "accept") if c[2] == ()])
    assert len(_calls(prefill, "handoff")) == len(requests) + len(back)  # each recompute moved again


def test_a_cancelled_prompt_frees_its_slot_on_both_sides():
    orch, prefill, generate = _disaggregated(slots=1, step_seconds=0.01)
    orch.start()
    try:
        long = orch.submit([1, 2, 3], SamplingParams(max_tokens=400))
        next(iter(long.stream()))  # decoding on the generate side
        long.cancel()
        short = orch.submit([4, 5], SamplingParams(max_tokens=3))  # the one slot again
        assert short.result().token_ids == generate.expected([4, 5], SamplingParams(max_tokens=3))
    finally:
        orch.stop(timeout=10)
    assert ("free_resource", 0) in prefill.calls and ("free_resource", 0) in generate.calls


def test_the_generate_call_goes_out_before_the_prefill_and_the_new_slot_decodes_next_plan():
    """A plan with a running slot and a final row: generate over the running slot is dispatched
    first, then the prompt prefills on the other engine and is handed off behind that call; the
    new slot has no token in this plan's call."""
    from serving.engine.api import PrefillRow

    prefill, generate = MockEngine(slots=2), MockEngine(slots=2)
    executor = DisaggregatedExecutor(prefill, {}, generate, {})
    sampling = SamplingParams(max_tokens=8)
    tables = ((0, (1,)), (1, (2,)))
    first = StepPlan(page_tables=tables, rows=(PrefillRow(0, (1, 2, 3), 0, True, sampling),), decode_steps=2,
                     slots=(0,), max_position=3, handoffs=((0, (1,)),))
    executor.run(first)
    assert [c[0] for c in generate.calls] == ["init_decode_state", "set_pages", "accept"]  # nothing decoded yet
    order: list = []
    prefill.calls = _Recorder(order, "prefill side", prefill.calls)
    generate.calls = _Recorder(order, "generate side", generate.calls)
    second = StepPlan(rows=(PrefillRow(1, (7, 8), 0, True, sampling),), decode_steps=2, running=1, slots=(0, 1),
                      max_position=5, handoffs=((1, (2,)),))
    outcome = executor.run(second)
    assert order == [("generate side", "generate"), ("prefill side", "prefill_slots"), ("prefill side", "handoff"),
                     ("generate side", "accept"), ("prefill side", "free_resource")]
    assert outcome.first_tokens == (9,)  # the mock's first token: the last prompt token + 1
    assert [row[0] for row in outcome.valid] == [True, True] and [row[1] for row in outcome.valid] == [False, False]


def test_a_plan_of_final_rows_without_their_handoffs_or_of_proposals_is_refused():
    import numpy as np

    from serving.engine.api import PrefillRow

    executor = DisaggregatedExecutor(MockEngine(slots=2), {}, MockEngine(slots=2), {})
    row = PrefillRow(0, (1, 2), 0, True, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="hands off every final row"):
        executor.run(StepPlan(rows=(row,)))
    with pytest.raises(ValueError, match="does not speculate"):
        executor.run(StepPlan(proposals=np.zeros((2, 3), np.int32)))
    with pytest.raises(ValueError, match="limits"):
        DisaggregatedExecutor(MockEngine(slots=2), {}, MockEngine(slots=4), {})


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
