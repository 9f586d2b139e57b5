"""The paged KV cache as a part the engine is built with (serving.engine.paged_cache): an engine
given one runs on it; one of another geometry or format is refused where the engine is made (its
backend and memory plan were chosen for the pool its config makes); the block tables are checked."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from serving.checkpoints.model_source import load_model
from serving.config import ServingConfig
from serving.engine.engine import Engine
from serving.engine.paged_cache import PagedCache, PoolFormat
from serving.orchestrator.offline import run_to_completion
from serving.request import SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    cfg = ServingConfig(per_device_batch_size=2, max_prefill_predict_length=64, max_target_length=128,
                        cpu_kernels="off", enable_model_warmup=False)
    model = load_model(str(tiny_model_dir), cfg)
    return model, cfg, Engine(model, cfg.engine)


def test_an_engine_runs_on_the_paged_cache_it_is_given(tiny):
    model, cfg, plain = tiny
    given = PagedCache(model.config, plain.limits, plain.placement, plain.mesh, plain.paged_cache.format)
    engine = Engine(model, cfg.engine, paged_cache=given)
    assert engine.paged_cache is given and engine.page_bytes == plain.page_bytes
    requests = [(list(range(5, 40)), SamplingParams(max_tokens=6)), (list(range(9, 20)), SamplingParams(max_tokens=4))]
    want = run_to_completion(plain, plain.load_params(), requests)
    got = run_to_completion(engine, engine.load_params(), requests)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert engine.summary()["kv_cache"] == cfg.engine.dtype


def test_a_paged_cache_of_another_format_or_size_is_refused(tiny):
    model, cfg, plain = tiny
    cache = plain.paged_cache
    int8 = PagedCache(model.config, plain.limits, plain.placement, plain.mesh,
                      dataclasses.replace(cache.format, quantized=True))
    assert int8.init_pool().k.dtype == jnp.int8 and int8.format.name == "int8"
    with pytest.raises(ValueError, match="quantized=True"):
        Engine(model, cfg.engine, paged_cache=int8)
    smaller = dataclasses.replace(plain.limits, num_pages=plain.limits.num_pages - 1)
    with pytest.raises(ValueError, match=f"{smaller.num_pages} pages"):
        Engine(model, cfg.engine, paged_cache=PagedCache(model.config, smaller, plain.placement, plain.mesh, cache.format))
    assert PoolFormat.of(cfg.engine, "tokens") == cache.format == PoolFormat(jnp.float32)
    other = model.config.model_copy(update={"num_layers": model.config.num_layers + 1})  # another shape
    with pytest.raises(ValueError, match="model, limits, placement"):
        Engine(model, cfg.engine, paged_cache=PagedCache(other, plain.limits, plain.placement, plain.mesh, cache.format))


def test_block_tables_are_checked_before_they_are_placed(tiny):
    _, _, plain = tiny
    cache, limits = plain.paged_cache, plain.limits
    tables = cache.default_tables()
    assert tables.shape == (limits.max_concurrent_decodes, limits.max_pages)
    assert np.asarray(cache.tables(tables)).tolist() == tables.tolist()
    with pytest.raises(ValueError, match="outside the pool"):
        cache.tables(np.full_like(tables, limits.num_pages))
    with pytest.raises(ValueError, match="expected"):
        cache.tables(tables[:1])
