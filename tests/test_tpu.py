"""The `tpu` tier: run on a TPU in one process (`make test-tpu`), skipped elsewhere saying why.

- the tiny model's greedy tokens on the chip (the TPU backend: XLA's ops over a lanes pool, float32
  at jax.default_matmul_precision('highest')) equal to the CPU engine's on the same weights;
- the generate and chunked-prefill programs compiled for the chip hold no copy, copy-start or
  transpose of a KV pool array (values or scales: the pool stays in its lanes layout,
  serving.models.cache);
- the memory plan of the serving profile counts the compiled programs' temporaries and fits.
"""

from __future__ import annotations

import os

import jax
import pytest

from serving.config import DevicesConfig, ServingConfig
from serving.runtime import make_mesh

pytestmark = pytest.mark.tpu

# tests/conftest.py sets JAX_PLATFORMS=cpu unless it is set: `make test-tpu` sets tpu,cpu (the chip,
# and the CPU the tokens are compared with) and PATHSERVE_REQUIRE_TPU=1, so that a run meant for the
# chip fails where it finds none instead of skipping every test
ON_TPU = any(d.platform == "tpu" for d in jax.devices())
if os.environ.get("PATHSERVE_REQUIRE_TPU") == "1" and not ON_TPU:
    raise RuntimeError(f"PATHSERVE_REQUIRE_TPU=1 but JAX sees no TPU: {jax.devices()}")
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
    from serving.engine.api import PrefillRow
    from serving.engine.chunked import _model_inputs
    from serving.request import SamplingParams

    params, state = abstract_params(engine), abstract_state(engine)
    rows = jax.ShapeDtypeStruct((4,), "int32")
    generate = engine._generate_fn.lower(
        params, state, None, rows, window=engine.windows[-1], steps=engine.decode_steps_per_call
    ).compile().as_text()
    chunk = [PrefillRow(i, (1,) * 64, 128, True, SamplingParams(max_tokens=1)) for i in range(2)]
    inputs, shape = engine._slot_inputs(chunk)
    prefill = engine._prefill_slots_fn.lower(
        params, state.cache, state.pages, *_model_inputs(inputs), window=shape[2]
    ).compile().as_text()
    pools = {",".join(str(d) for d in leaf.shape) for leaf in state.cache if leaf is not None}
    for text in (generate, prefill):
        copies = [
            line for line in text.splitlines()
            if (" copy(" in line or " copy-start(" in line or " transpose(" in line)
            and any(f"[{pool}]" in line.split("(")[0] for pool in pools)
        ]
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
