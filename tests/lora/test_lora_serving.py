"""Adapters through the engine and the orchestrator: each request's greedy tokens equal
transformers + peft (unmerged) for its adapter, alone or batched with other adapters and the base
model, with more adapters than device slots (max_loras=2), and never served from another adapter's
prefix-cache KV."""

from __future__ import annotations

import threading

import pytest

from serving.checkpoints.model_source import load_model
from serving.config import ServingConfig
from serving.engine.engine import Engine
from serving.lora.errors import UnknownAdapterError
from serving.lora.serving import make_registry
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams
from tests.conftest import DATA
from tests.lora.adapters import ADAPTERS, make_adapter, make_adapters, peft_model, reference_greedy
from tests.server_process import wait_for

MAX_TOKENS = 8
TEXT = (DATA / "english.txt").read_text()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    made = make_adapters(tiny_model_dir, root)
    # a fourth: max_loras=2 then serves four adapters
    made["extra-r2"] = make_adapter(tiny_model_dir, root / "extra-r2", 2, 2, ["o_proj", "up_proj"], False, seed=9)
    return root, made


def _serve(model_dir, root, **keys):
    cfg = ServingConfig(
        per_device_batch_size=8, max_prefill_predict_length=64, max_target_length=128, decode_steps_per_call=3,
        lora_input_adapters_path=str(root), max_loras=2, max_lora_rank=16, prefix_block_size=16, **keys,
    )
    model = load_model(str(model_dir), cfg)
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    registry = make_registry(cfg.lora, model.config)
    orchestrator = Orchestrator(engine, params, model.tokenizer, cfg.orchestrator, adapters=registry).start()
    return model, orchestrator


@pytest.fixture(scope="module")
def served(tiny_model_dir, adapters):
    model, orchestrator = _serve(tiny_model_dir, adapters[0])
    yield model, orchestrator
    orchestrator.stop(timeout=30)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters, served):
    """name (None: base) -> prompt index -> peft's greedy tokens."""
    model, _ = served
    prompts = _prompts(model.tokenizer)
    out = {}
    for name in [None, *adapters[1]]:
        reference = peft_model(tiny_model_dir, adapters[1][name] if name else None)
        out[name] = [reference_greedy(reference, p, MAX_TOKENS, model.tokenizer.vocab_size) for p in prompts]
    return out


def _prompts(tokenizer):
    ids = tokenizer.encode(TEXT)
    return [ids[i * 13 : i * 13 + n] for i, n in enumerate((5, 11, 20, 24))]


def _run(orchestrator, jobs):
    """jobs: (prompt, adapter); all submitted at once; their token ids in order."""
    handles = [
        orchestrator.submit(p, SamplingParams(max_tokens=MAX_TOKENS, adapter=name)) for p, name in jobs
    ]
    return [h.result().token_ids for h in handles]


def test_each_adapter_alone_equals_peft(served, expected, adapters):
    model, orchestrator = served
    prompts = _prompts(model.tokenizer)
    for name in [None, *adapters[1]]:
        assert _run(orchestrator, [(prompts[1], name)]) == [expected[name][1]], name


def test_four_adapters_and_the_base_model_in_one_batch_with_two_device_slots(served, expected, adapters):
    """Four adapters (and base requests) at once over max_loras=2: each request waits for a slot,
    none is refused, every one gets its own adapter's tokens."""
    model, orchestrator = served
    prompts = _prompts(model.tokenizer)
    names = [None, *adapters[1]]
    jobs = [(prompts[i % 3], names[(i + 1) % len(names)]) for i in range(12)]
    results = _run(orchestrator, jobs)
    for (prompt, name), tokens in zip(jobs, results, strict=True):
        assert tokens == expected[name][prompts.index(prompt)], name
    listed = {a.name: a for a in orchestrator.adapters.list()}
    assert set(listed) == set(adapters[1])
    assert sum(a.status == "resident" for a in listed.values()) == 2
    assert all(a.requests >= 2 for a in listed.values())


def test_unknown_adapter_is_refused_naming_it(served):
    _, orchestrator = served
    with pytest.raises(UnknownAdapterError, match="no-such"):
        orchestrator.submit([1, 2, 3], SamplingParams(adapter="no-such"))


def test_one_prompt_under_two_adapters_shares_no_prefix_cache_block(served, expected, adapters):
    """The 20-token prompt has a whole 16-token block: the first adapter stores it; the second
    must compute its own (its tokens are its own), and a repeat under the first reuses it."""
    model, orchestrator = served
    prompt = _prompts(model.tokenizer)[3]  # no other test's
    hits = _settled_hits(orchestrator)
    for name in ("attn-r4", "all-r8", None, "attn-r4"):
        assert _run(orchestrator, [(prompt, name)]) == [expected[name][3]], name
    assert _settled_hits(orchestrator) == hits + 1  # the repeat alone


def _settled_hits(orchestrator) -> int:
    """The prefix cache's hits once the device loop has recorded the turns of every request that
    ended so far (it counts them after a request's end is delivered): a 2-token request (no stop
    id, so it ends in a generate call's update, not at its first token) ends in a later update,
    after the last one's record; its 1-token prompt has no block to hit or miss."""
    orchestrator.submit([1], SamplingParams(max_tokens=2, stop_ids=())).result()
    with orchestrator.metrics.lock:
        return orchestrator.metrics.prefix_cache_hits


def test_unloading_an_adapter_in_use_lets_its_requests_finish(served, expected, adapters):
    model, orchestrator = served
    prompts = _prompts(model.tokenizer)
    registry = orchestrator.adapters
    # The device loop's generate calls wait at a gate until the adapter is unloaded, so the request
    # is still running then however fast the machine (a 64-token request is a few calls).
    engine, gate = orchestrator.engine, threading.Event()

    def gated_generate(*args, **kwargs):
        gate.wait(60)
        return type(engine).generate(engine, *args, **kwargs)

    engine.generate = gated_generate
    try:
        handle = orchestrator.submit(prompts[0], SamplingParams(max_tokens=64, adapter="mlp-r16-rs"))
        assert wait_for(lambda: any(a.name == "mlp-r16-rs" and a.running for a in registry.list()), 60)
        registry.unload("mlp-r16-rs")
    finally:
        gate.set()
        del engine.generate
    completion = handle.result()
    assert completion.finish_reason == "length" and completion.token_ids[:MAX_TOKENS] == expected["mlp-r16-rs"][0]
    with pytest.raises(UnknownAdapterError):
        orchestrator.submit(prompts[0], SamplingParams(adapter="mlp-r16-rs"))
    registry.load("mlp-r16-rs", str(adapters[1]["mlp-r16-rs"]))  # a new load: served again
    assert _run(orchestrator, [(prompts[0], "mlp-r16-rs")]) == [expected["mlp-r16-rs"][0]]


def test_adapters_listed_at_start_up(served):
    _, orchestrator = served
    assert sorted(a.name for a in orchestrator.adapters.list()) == sorted([*(a[0] for a in ADAPTERS), "extra-r2"])


def test_speculation_verifies_under_each_slots_adapter(tiny_model_dir, adapters, expected):
    """With n-gram speculation the verify call scores each slot's proposals under that slot's own
    adapter: the tokens stay peft's for the adapter (verifying under the base model would accept
    the base model's continuation instead)."""
    root, made = adapters
    model, orchestrator = _serve(
        tiny_model_dir, root, speculative_method="ngram", num_speculative_tokens=3,
        speculative_cost_ratio=0.0, speculative_min_acceptance=0.0,
    )  # fmt: skip
    try:
        ids = model.tokenizer.encode(TEXT)
        prompt = ids[:6] * 3  # a repetitive prompt; the tiny random model soon repeats itself too
        names = [None, *list(made)[:2]]
        tokens = 32
        want = {
            name: reference_greedy(peft_model(tiny_model_dir, made[name] if name else None), prompt, tokens,
                                   model.tokenizer.vocab_size)
            for name in names
        }  # fmt: skip
        assert len({tuple(w) for w in want.values()}) == len(names)  # the adapters change the tokens
        for name in names:  # one at a time: below speculative_max_slots, each proposes alone
            handle = orchestrator.submit(prompt, SamplingParams(max_tokens=tokens, adapter=name))
            assert handle.result().token_ids == want[name], name
        assert orchestrator.metrics.spec_rounds > 0, want  # the tokens came through verify calls
    finally:
        orchestrator.stop(timeout=30)
