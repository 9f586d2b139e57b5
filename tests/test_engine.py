"""The engine against the plain generation loop: greedy, batch invariance, seeds, stops, limits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from serving.checkpoints.model_source import load_model
from serving.config import ServingConfig
from serving.engine.engine import Engine
from serving.engine.limits import prefill_buckets
from serving.errors import GenerationError
from serving.orchestrator.executor import Executor
from serving.orchestrator.offline import run_to_completion
from serving.request import SamplingParams
from tests.conftest import DATA
from tests.reference import ReferenceDecoder
from tests.xla_flags import cpu_devices

TEXT = (DATA / "english.txt").read_text()


def _prompts(tokenizer, lengths):
    """Prompts of exactly these token lengths, cut from different places of an English text."""
    ids = tokenizer.encode(TEXT)
    return [ids[i * 11 : i * 11 + n] for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    cfg = ServingConfig(
        per_device_batch_size=8, max_prefill_predict_length=64, max_target_length=128, decode_steps_per_call=3
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    return model, cfg, engine, engine.load_params()


def test_buckets_are_powers_of_two_up_to_the_limit():
    assert prefill_buckets(64) == [16, 32, 64]
    assert prefill_buckets(100) == [16, 32, 64, 100]


def test_batch_of_8_different_lengths_equals_each_request_alone(tiny):
    model, cfg, engine, params = tiny
    prompts = _prompts(model.tokenizer, [1, 3, 5, 8, 13, 21, 30, 40])
    requests = [(p, SamplingParams(max_tokens=12 + i)) for i, p in enumerate(prompts)]
    together = run_to_completion(engine, params, requests)
    generator = ReferenceDecoder(model, cfg)
    for (prompt, sampling), completion in zip(requests, together, strict=True):
        alone = generator.generate(prompt, sampling)
        assert completion.token_ids == alone.token_ids
        assert completion.finish_reason == "length" and len(completion.token_ids) == sampling.max_tokens


def test_int8_activations_engine_equals_the_plain_loop(tiny_model_dir):
    """w8a8 through the engine (rows padded for the int8 dot at every batch) = the plain loop."""
    cfg = ServingConfig(
        per_device_batch_size=5,
        max_prefill_predict_length=64,
        max_target_length=128,
        quantization="int8",  # W8A8
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    prompts = _prompts(model.tokenizer, [2, 7, 12, 20, 33, 5, 9])
    requests = [(p, SamplingParams(max_tokens=6 + i)) for i, p in enumerate(prompts)]
    generator = ReferenceDecoder(model, cfg)
    for (prompt, sampling), completion in zip(
        requests, run_to_completion(engine, engine.load_params(), requests), strict=True
    ):
        assert completion.token_ids == generator.generate(prompt, sampling).token_ids


def test_more_requests_than_slots_reuse_freed_slots(tiny):
    model, cfg, engine, params = tiny
    prompts = _prompts(model.tokenizer, [4, 9, 2, 17, 6, 11, 3, 8, 5, 14, 7, 10])
    requests = [(p, SamplingParams(max_tokens=4 + (i % 5))) for i, p in enumerate(prompts)]
    generator = ReferenceDecoder(model, cfg)
    for (prompt, sampling), completion in zip(requests, run_to_completion(engine, params, requests), strict=True):
        assert completion.token_ids == generator.generate(prompt, sampling).token_ids


def test_seeded_sampling_is_reproducible_and_matches_the_plain_loop(tiny):
    model, cfg, engine, params = tiny
    prompts = _prompts(model.tokenizer, [3, 6, 9])
    requests = [
        (p, SamplingParams(max_tokens=10, temperature=0.8, top_k=40, top_p=0.9, seed=7 + i))
        for i, p in enumerate(prompts)
    ]
    executor = Executor(engine, params)
    first = run_to_completion(engine, params, requests, executor=executor)
    # on the decode state the first run left (its slots freed, its pages written): the same tokens
    second = run_to_completion(engine, params, requests, executor=executor)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    generator = ReferenceDecoder(model, cfg)
    assert [c.token_ids for c in first] == [generator.generate(p, s).token_ids for p, s in requests]
    other = run_to_completion(
        engine, params, [(p, SamplingParams(max_tokens=10, temperature=0.8, seed=99)) for p in prompts]
    )
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


def test_stop_ids_finish_with_stop(tiny):
    model, _cfg, engine, params = tiny
    prompt = _prompts(model.tokenizer, [5])[0]
    free_run = run_to_completion(engine, params, [(prompt, SamplingParams(max_tokens=20))])[0].token_ids
    stop_token = free_run[6]
    stopped = run_to_completion(engine, params, [(prompt, SamplingParams(max_tokens=20, stop_ids=(stop_token,)))])[
        0
    ]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run[: free_run.index(stop_token) + 1]


def test_cancelled_slot_is_freed(tiny):
    model, _cfg, engine, params = tiny
    prompt = _prompts(model.tokenizer, [5])[0]
    state = engine.init_decode_state()
    prefix, _ = engine.prefill(params, engine.limits.pad(prompt), len(prompt), SamplingParams(max_tokens=50))
    state = engine.insert(prefix, state, 3)
    assert bool(state.active[3])
    state = engine.free_resource(state, 3)
    assert not bool(np.asarray(state.active).any())
    state, result = engine.generate(params, state)
    assert not np.asarray(result.valid).any()


def test_generate_and_verify_over_scattered_slots_equal_a_call_over_every_slot(tiny):
    """A decode call computes the slots it is given (the scheduler's running ones, padded to a
    bucket), wherever they lie: sequences in slots 2 and 5 of 8, one penalized (its token history
    read and written), one sampled, decoded and verified over slots (2, 5) give the tokens and the
    state a call over all 8 slots gives."""
    model, _cfg, engine, params = tiny
    prompts = _prompts(model.tokenizer, [5, 9])
    samplings = [
        SamplingParams(max_tokens=30, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(max_tokens=30, temperature=1.0, seed=3),
    ]

    def started():
        state = engine.init_decode_state()
        for slot, prompt, sampling in zip((2, 5), prompts, samplings, strict=True):
            prefix, _ = engine.prefill(params, engine.limits.pad(prompt), len(prompt), sampling)
            state = engine.insert(prefix, state, slot)
        return state

    def same(a, b):  # two calls' results at the decoding slots (elsewhere never valid)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(np.asarray(x)[:, [2, 5]], np.asarray(y)[:, [2, 5]])

    every, scattered = started(), started()
    words = -(-model.config.vocab_size // 32)
    masks = np.full((8, words), -1, np.int32)  # every token allowed, but slot 5 may take token 7 only
    masks[5], masks[5, 0] = 0, 1 << 7
    # the decoding slots alone, then padded with inactive slots between and after them, then masked
    for slots, call_masks in (((2, 5), None), ((0, 2, 5, 7), None), ((0, 2, 5, 7), masks), ((2, 5), None)):
        every, want = engine.generate(params, every, max_position=40, masks=call_masks)
        scattered, got = engine.generate(params, scattered, max_position=40, masks=call_masks, slots=slots)
        same(got, want)
        if call_masks is not None:
            assert int(np.asarray(got.tokens)[0, 5]) == 7
    proposals = np.zeros((8, 4), np.int32)
    proposals[2], proposals[5] = np.asarray(want.tokens)[-1, 2], np.asarray(want.tokens)[-1, 5]
    num_proposed = np.array([0, 0, 4, 0, 0, 2, 0, 0], np.int32)
    every, want = engine.verify(params, every, proposals, num_proposed, max_position=40)
    scattered, got = engine.verify(params, scattered, proposals, num_proposed, max_position=40, slots=(2, 5))
    same(got, want)
    assert not np.asarray(got.valid)[:, [0, 1, 3, 4, 6, 7]].any() and np.asarray(got.valid)[:, 2].sum() >= 1
    for x, y in zip(jax.tree.leaves(scattered._replace(cache=None)), jax.tree.leaves(every._replace(cache=None)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for bad in ((2, 2), (2, 8), (2, 5, 6)):  # repeated, past the slots, no bucket's count
        with pytest.raises(ValueError, match="slots"):
            engine.generate(params, scattered, slots=bad)


def test_limits_are_errors_the_caller_sees(tiny):
    _model, _cfg, engine, _params = tiny
    with pytest.raises(GenerationError, match="max_prefill_predict_length=64"):
        engine.limits.pad(list(range(65)))
    with pytest.raises(GenerationError, match="max_target_length=128"):
        engine.limits.check(60, SamplingParams(max_tokens=100))
    with pytest.raises(GenerationError, match="empty"):
        engine.limits.pad([])


@pytest.mark.slow  # 256 positions of SmolLM2 through the engine and twice teacher-forced (docs/development.md)
def test_int8_kv_cache_agrees_with_float_on_smollm2(smollm2_path):
    """Greedy top-1 agreement >= 95% over 256 positions between the int8 and the float KV cache,
    both fed the float cache's greedy continuation (teacher forcing: one early flip would otherwise
    make every later token differ). The engine's int8 path must also run end to end."""
    import jax
    import jax.numpy as jnp

    from serving.models import decode_step, prefill, store_prefix
    from tests.reference import row_cache

    cfg = ServingConfig(max_prefill_predict_length=64, max_target_length=384, decode_steps_per_call=8)
    model = load_model(str(smollm2_path), cfg)
    ids = model.tokenizer.encode("The history of the lighthouse is closely tied to the history of seafaring.")
    engine = Engine(model, cfg.engine)
    continuation = run_to_completion(engine, engine.load_params(), [(ids, SamplingParams(max_tokens=256))])[
        0
    ].token_ids

    padded = np.zeros((1, 32), np.int32)
    padded[0, : len(ids)] = ids
    logits, kv = prefill(model.params, jnp.asarray(padded), jnp.array([len(ids)]), model.config)
    fed = jnp.asarray(continuation[:-1], jnp.int32)
    positions = len(ids) + jnp.arange(len(continuation) - 1, dtype=jnp.int32)

    @jax.jit
    def forced(params, cache):  # every step of the teacher-forced run in one compiled scan
        def step(cache, token_and_position):
            token, position = token_and_position
            step_logits, cache = decode_step(params, token[None], position[None], cache, model.config, pages=pages)
            return cache, jnp.argmax(step_logits[0])

        return jax.lax.scan(step, cache, (fed, positions))[1]

    predictions = {}
    for quantized in (False, True):
        cache, pages = row_cache(model.config, 1, 384, quantized=quantized)
        cache = store_prefix(cache, kv, pages[0])
        first = int(jnp.argmax(logits[0, len(ids) - 1]))
        predictions[quantized] = np.array([first, *np.asarray(forced(model.params, cache)).tolist()])
    assert list(predictions[False]) == continuation  # the float cache reproduces the engine's run
    agreement = np.mean(predictions[True] == predictions[False])
    assert agreement >= 0.95, agreement

    int8_cfg = cfg.model_copy(update={"quantize_kvcache": True})
    int8_engine = Engine(model, int8_cfg.engine)  # the KV cache's dtype is the engine's, not the model's
    int8_run = run_to_completion(int8_engine, int8_engine.load_params(), [(ids, SamplingParams(max_tokens=256))])[
        0
    ].token_ids
    assert len(int8_run) == 256 and int8_run[:8] == continuation[:8]


SHARDED = textwrap.dedent(
    """
    import json, sys
    import jax
    from jax.sharding import PartitionSpec as P
    from serving.config import ConfigError, ServingConfig
    from serving.engine.engine import Engine
    from serving.orchestrator.offline import run_to_completion
    from serving.checkpoints.model_source import load_model
    from serving.request import SamplingParams

    path, parallel = sys.argv[1], json.loads(sys.argv[2])
    cfg = ServingConfig(per_device_batch_size=1, max_prefill_predict_length=32, max_target_length=64, **parallel)
    model = load_model(path, cfg)
    engine = Engine(model, cfg.engine, jax.sharding.Mesh(
        __import__("numpy").array(jax.devices()[: cfg.ici_fsdp_parallelism * cfg.ici_autoregressive_parallelism * cfg.ici_tensor_parallelism]).reshape(
            cfg.ici_fsdp_parallelism, cfg.ici_autoregressive_parallelism, cfg.ici_tensor_parallelism), ("fsdp", "autoregressive", "tensor")))
    params = engine.load_params()
    specs = {}
    if engine.mesh.size > 1:
        specs["wq"] = list(params["layers"]["wq"].sharding.spec)
        specs["w_down"] = list(params["layers"]["w_down"].sharding.spec)
        state = engine.init_decode_state()
        specs["cache"] = list(state.cache.k.sharding.spec)
        specs["tokens"] = list(state.tokens.sharding.spec)
        # The CPU kernels run on one device: "auto" keeps XLA's dot here, "on" says why not.
        specs["backend_auto"] = engine.ops.name
        try:
            Engine(model, cfg.model_copy(update={"cpu_kernels": "on"}).engine, engine.mesh)
        except ConfigError as e:
            specs["cpu_kernels_on"] = str(e)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17, 18, 19, 20, 21], [22, 23], [24, 25, 26, 27], [28], [29, 30, 31]]
    out = run_to_completion(engine, params, [(p, SamplingParams(max_tokens=10)) for p in prompts])
    print(json.dumps({"tokens": [c.token_ids for c in out], "specs": specs, "slots": engine.max_concurrent_decodes}))
    """
)


def test_sharded_on_8_devices_gives_the_single_device_tokens(tiny_model_dir):
    import json

    env = {**os.environ, **cpu_devices(8)}

    def run(parallel: dict) -> dict:
        result = subprocess.run(
            [sys.executable, "-c", SHARDED, str(tiny_model_dir), json.dumps(parallel)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    single = run({})
    sharded = run({"ici_tensor_parallelism": 4, "ici_autoregressive_parallelism": 2})
    assert sharded["slots"] == 8 and single["slots"] == 1
    assert sharded["tokens"] == single["tokens"]
    on = sharded["specs"].pop("cpu_kernels_on")
    assert "cpu_kernels=on" in on and "one CPU device, not 8 cpu device(s)" in on
    assert sharded["specs"] == {
        "backend_auto": "xla",
        # MaxText's axes (serving.engine.partitioning; every leaf in tests/test_sharding.py): 4 heads
        # over tensor 4 x autoregressive 2 split over tensor; mlp 112 over both; 2 kv heads in the
        # cache over autoregressive; slots not split.
        "wq": [None, None, "tensor"],
        "w_down": [None, ["tensor", "autoregressive"], None],
        "cache": [None, None, None, "autoregressive", None],
        "tokens": [],
    }
