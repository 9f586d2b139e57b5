"""The `tpu` tier: run on a TPU in one process (`make test-tpu`), skipped elsewhere saying why.

- the tiny model's greedy tokens on the chip (the TPU backend: XLA's ops over a lanes pool, float32
  at jax.default_matmul_precision('highest')) equal to the CPU engine's on the same weights;
- the generate and chunked-prefill programs compiled for the chip hold no copy of the KV pool
  (the pool stays in its lanes layout: serving.models.cache);
- the memory plan of the serving profile counts the compiled programs' temporaries and fits.
"""

from __future__ import annotations

import jax
import pytest

from serving.config import DevicesConfig, ServingConfig
from serving.runtime import make_mesh

pytestmark = pytest.mark.tpu

ON_TPU = any(d.platform == "tpu" for d in jax.devices())
requires_tpu = pytest.mark.skipif(not ON_TPU, reason="no TPU here (jax.devices() has none): the tpu tier runs on a TPU host")


def _config(**keys) -> ServingConfig:
    return ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=256, prefill_chunk_size=64, **keys
    )


def _tokens(engine, params) -> list[list[int]]:
    from serving.orchestrator.offline import run_to_completion
    from serving.request import SamplingParams

    requests = [(list(range(3, 3 + n)), SamplingParams(max_tokens=16)) for n in (5, 60, 130, 9)]
    return [r.token_ids for r in run_to_completion(engine, params, requests, prefix_caching=True)]


@requires_tpu
def test_tiny_models_greedy_tokens_on_the_chip_equal_the_cpu_engines(tiny_model_dir):
    from serving.checkpoints.model_source import load_model
    from serving.engine.engine import Engine

    cfg = _config(cpu_kernels="off")
    model = load_model(str(tiny_model_dir), cfg)
    with jax.default_matmul_precision("highest"):
        cpu = Engine(model, cfg.engine, make_mesh(DevicesConfig(), jax.devices("cpu")[:1]))
        tpu = Engine(model, cfg.engine, make_mesh(DevicesConfig(), jax.devices("tpu")[:1]))
        assert tpu.ops.pool_layout == "lanes" and cpu.ops.pool_layout == "tokens"
        assert _tokens(tpu, tpu.load_params()) == _tokens(cpu, cpu.load_params())


@requires_tpu
def test_no_program_copies_the_kv_pool(tiny_model_dir):
    from serving.checkpoints.model_source import load_model
    from serving.engine.compiled_memory import abstract_params, abstract_state
    from serving.engine.engine import Engine

    cfg = _config(dtype="bfloat16", quantize_kvcache=True)
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    params, state = abstract_params(engine), abstract_state(engine)
    rows = jax.ShapeDtypeStruct((4,), "int32")
    text = engine._generate_fn.lower(
        params, state, None, rows, window=engine.windows[-1], steps=engine.decode_steps_per_call
    ).compile().as_text()
    pool = ",".join(str(d) for d in state.cache.k.shape)
    copies = [line for line in text.splitlines() if " copy(" in line and f"[{pool}]" in line.split(" copy(")[0]]
    assert copies == []


@requires_tpu
def test_the_serving_profiles_plan_fits_with_its_compiled_temporaries(tiny_model_dir, monkeypatch):
    from serving.launch import bring_up
    from serving.startup.profile import given_config

    monkeypatch.setenv("PATHSERVE_PLATFORM", "tpu")
    given = given_config(None, ["enable_model_warmup=false"], str(tiny_model_dir))
    up = bring_up(given.config, str(tiny_model_dir), given.origins)
    engine, params = up.engine, up.params
    assert engine.max_concurrent_decodes == 128 and engine.config.max_target_length == 2048
    assert _tokens(engine, params)


@requires_tpu
def test_every_slot_filled_to_its_maximum_length_fits(tiny_model_dir, monkeypatch):
    """The TPU profile's 128 slots each to max_target_length at once: the pool, the programs'
    temporaries and the windows at their widest, without RESOURCE_EXHAUSTED."""
    from serving.launch import bring_up
    from serving.orchestrator.offline import run_to_completion
    from serving.request import SamplingParams
    from serving.startup.profile import given_config

    monkeypatch.setenv("PATHSERVE_PLATFORM", "tpu")
    given = given_config(None, ["enable_model_warmup=false"], str(tiny_model_dir))
    up = bring_up(given.config, str(tiny_model_dir), given.origins)
    engine, length = up.engine, up.engine.config.max_target_length
    prompt = 1000
    requests = [([3 + (i + j) % 250 for j in range(prompt)], SamplingParams(max_tokens=length - prompt)) for i in range(128)]
    done = run_to_completion(engine, up.params, requests)
    assert [len(r.token_ids) for r in done] == [length - prompt] * 128
