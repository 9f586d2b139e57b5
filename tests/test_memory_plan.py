"""serve's memory plan counts the compiled programs' temporaries (serving.engine.compiled_memory),
read from XLA before any weight is placed: a plan whose params, KV cache and temporaries exceed the
devices' bytes_limit is refused naming the figures and what to lower, with nothing loaded."""

from __future__ import annotations

import pytest

from serving import launch
from serving.config import ConfigError, ServingConfig
from serving.engine.compiled_memory import program_temporaries
from serving.engine.engine import Engine
from serving.engine.memory import memory_use


def _config(**keys) -> ServingConfig:
    return ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=128, cpu_kernels="off", **keys
    )


def test_the_largest_programs_temporaries_come_from_the_compiler(tiny_model_dir):
    from serving.checkpoints.model_source import load_model

    cfg = _config()
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    programs = program_temporaries(engine)
    assert set(programs) == {
        "generate of 4 slots over 128 positions", "prefill of 1 chunks of 64 after 64 positions", "whole prefill of 64 tokens",
    }
    assert all(v > 0 for v in programs.values())


def test_serve_refuses_a_plan_whose_temporaries_do_not_fit_before_loading(tiny_model_dir, monkeypatch):
    """A bytes_limit that holds the params, the cache and the estimate but not the compiled
    temporaries: refused naming them, and load_params never runs."""
    from serving.checkpoints.model_source import load_model

    cfg = _config()
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    where = engine.placement
    compiled = max(program_temporaries(engine).values())
    estimate = memory_use(engine.model.config, where, cfg.dtype, engine.limits.prefill_batch_tokens, 4)
    limit = where.params_bytes_per_chip() + where.cache_bytes_per_chip() + compiled - 1
    assert estimate.total <= limit or estimate.temporaries < compiled  # the estimate alone would pass or undercount
    monkeypatch.setattr(launch, "device_limit", lambda devices: limit)

    def never(self):
        raise AssertionError("weights placed before the memory plan was checked")

    monkeypatch.setattr(Engine, "load_params", never)
    with pytest.raises(ConfigError) as refused:
        launch.bring_up(cfg, str(tiny_model_dir))
    message = str(refused.value)
    assert "compiled programs' temporaries" in message and "the largest: " in message
    assert "per_device_batch_size" in message and "prefill_chunk_size" in message


def test_serve_starts_when_the_plan_fits(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(launch, "device_limit", lambda devices: 1 << 40)
    up = launch.bring_up(_config(), str(tiny_model_dir))
    assert isinstance(up, launch.BroughtUp) and up.engine.max_concurrent_decodes == 4 and up.params
    assert up.model.params == {} and up.prefill is None  # the placed params are the only copy
