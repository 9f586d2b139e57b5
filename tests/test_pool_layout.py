"""The KV pool's two stored layouts (serving.models.cache): "tokens" (the CPU kernels' and the Pallas
wrapper's) and "lanes" (TPU: kv_heads x head_dim merged, int8 packed four to an int32 lane). The
same requests give the same greedy and seeded tokens on either, through chunked prefill, the prefix
cache, decode and an int8 cache with either scale layout; lanes round-trips its values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from serving.checkpoints.model_source import load_model
from serving.config import ServingConfig
from serving.engine import engine as engine_module
from serving.engine.engine import Engine
from serving.models.cache import from_lanes, init_pool, quantize_kv, read_layer, store_chunks, to_lanes
from serving.models.ops import TPU_XLA, XLA
from serving.orchestrator.offline import run_to_completion
from serving.request import SamplingParams


def _tokens(model, cfg: ServingConfig, ops, monkeypatch) -> list[list[int]]:
    monkeypatch.setattr(engine_module.backend, "select", lambda *args, **kwargs: ops)
    engine = Engine(model, cfg.engine)
    assert engine.ops is ops and engine.init_decode_state().cache.lanes == (ops is TPU_XLA)
    params = engine.load_params()
    lengths = [3, 40, 100, 7, 70, 100]  # chunks of 32, prompts sharing their first pages
    requests = [
        (list(range(5, 5 + n)), SamplingParams(max_tokens=12, seed=i, temperature=0.0 if i % 2 else 1.0))
        for i, n in enumerate(lengths)
    ]
    return [r.token_ids for r in run_to_completion(engine, params, requests, prefix_caching=True)]


@pytest.mark.parametrize("kv", ["float", "dkv", "heads_and_dkv"])
def test_lanes_pool_serves_the_tokens_of_the_tokens_pool(tiny_model_dir, kv, monkeypatch):
    cfg = ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=128, prefill_chunk_size=32,
        prefix_block_size=16, cpu_kernels="off", quantize_kvcache=kv != "float",
        kv_quant_axis="heads_and_dkv" if kv == "heads_and_dkv" else "dkv",
    )
    model = load_model(str(tiny_model_dir), cfg)
    tokens = _tokens(model, cfg, XLA, monkeypatch)
    assert _tokens(model, cfg, TPU_XLA, monkeypatch) == tokens
    assert all(len(t) == 12 for t in tokens)


@pytest.mark.parametrize("quantized", [False, True])
def test_lanes_pool_reads_what_was_written(tiny_cfg, quantized):
    """Chunks written at shuffled pages read back as the tokens layout holds them."""
    rng = np.random.default_rng(0)
    kv_heads, head_dim, page_size = tiny_cfg.num_kv_heads, tiny_cfg.head_dim, 8
    chunk = rng.standard_normal((tiny_cfg.num_layers, 2, 16, kv_heads, head_dim)).astype(np.float32)
    pages = jnp.asarray([[3, 1, 0, 0], [2, 4, 0, 0]], jnp.int32)
    starts = jnp.asarray([0, 0], jnp.int32)
    from serving.models.cache import KVCache

    kv = KVCache(jnp.asarray(chunk), jnp.asarray(-chunk))
    read = {}
    for layout in ("tokens", "lanes"):
        pool = init_pool(tiny_cfg, 5, page_size, jnp.float32, quantized=quantized, layout=layout)
        pool = store_chunks(pool, kv, pages, starts)
        assert pool.lanes == (layout == "lanes")
        read[layout] = [np.asarray(x) for x in read_layer(pool, 1, jnp.float32, 16, pages, kv_heads)]
    for tokens, lanes in zip(read["tokens"], read["lanes"], strict=True):
        np.testing.assert_array_equal(tokens, lanes)
    if not quantized:
        np.testing.assert_array_equal(read["lanes"][0], chunk[1])


def test_int8_lanes_pack_four_values_a_lane():
    values, _ = quantize_kv(jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, 8)), jnp.float32))
    packed = to_lanes(values, jnp.zeros((1,), jnp.int32))
    assert packed.shape == (3, 4) and packed.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(from_lanes(packed, 2)), np.asarray(values))


def test_warmup_compiles_in_parallel_and_runs_what_it_compiled(tiny_model_dir, monkeypatch):
    """On a lanes pool (TPU), warmup first compiles every chunk, prefix-hit rest and generate shape
    on threads (nothing left for the background, so no request compiles); the generate calls then
    run those executables, with the tokens of a warmup without them."""
    from serving.engine import warmup

    cfg = ServingConfig(  # the TPU ladders: prefill buckets 128 and 256, windows 512 and 1024
        per_device_batch_size=2, max_prefill_predict_length=256, max_target_length=1024, prefill_chunk_size=256,
        max_prefill_batch=1, cpu_kernels="off",
    )
    model = load_model(str(tiny_model_dir), cfg)
    monkeypatch.setattr(engine_module.backend, "select", lambda *args, **kwargs: TPU_XLA)
    monkeypatch.setattr(warmup.os, "cpu_count", lambda: 2)
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    assert warmup.parallel_workers(engine) == 2
    engine.warmup(params)
    generate = {(rows, window) for rows in engine.limits.decode_buckets for window in engine.windows}
    assert {(rows, window) for rows, window, _steps in engine._generate_compiled} == generate
    rest = [r for r in warmup.rest_shapes(engine) if warmup.rest_start(engine, r[1], r[2]) is not None]
    assert rest and len(engine.chunks._precompiled) == len(warmup.chunk_shapes(engine)) + len(rest)
    assert engine.background_warmup is None or engine.background_warmup.pending == 0
    requests = [(list(range(4, 4 + n)), SamplingParams(max_tokens=8)) for n in (3, 300)]

    def compiles(*args, **kwargs):
        raise AssertionError("a generate shape compiled after warmup")

    monkeypatch.setattr(engine, "_generate_fn", compiles)  # every call runs a precompiled executable
    warmed = [r.token_ids for r in run_to_completion(engine, params, requests)]
    monkeypatch.setattr(warmup, "parallel_workers", lambda engine: 0)
    cold = Engine(model, cfg.engine)
    cold_params = cold.load_params()
    assert not cold._generate_compiled
    assert [r.token_ids for r in run_to_completion(cold, cold_params, requests)] == warmed


def test_a_lanes_pools_bytes_count_the_tpus_padding_of_a_narrow_minor_axis():
    """Slots are sized from these bytes: a lanes pool pads its minor axis to 128 lanes on a TPU, so
    SmolLM2's int8 3 x 64 (48 int32 lanes, scales 3 x 32) takes 128 of each; Llama 3.2 1B's 8 x 64
    (128 lanes, scales 8 x 32) nothing more."""
    from serving.config import load_model_config
    from serving.engine.partitioning import Numerics, placement

    cfg = ServingConfig(quantize_kvcache=True)
    axes = {"fsdp": 1, "autoregressive": 1, "tensor": 1}

    def kv_bytes(shape: str, layout: str) -> int:
        where = placement(load_model_config(shape), Numerics.of(cfg, pool_layout=layout), axes, 1, 32)
        return where.cache_bytes_per_chip()

    model = load_model_config("smollm2-135m")
    # one page of k and v: 32 positions x 128 int32 lanes of values, one row of 128 float32 scales
    padded = 2 * model.num_layers * (32 * 128 * 4 + 128 * 4)
    assert kv_bytes("smollm2-135m", "lanes") == padded > kv_bytes("smollm2-135m", "tokens")
    assert kv_bytes("llama3.2-1b", "lanes") == kv_bytes("llama3.2-1b", "tokens")


def test_scale_rows_take_every_write_of_consecutive_positions():
    """`_write_scale_rows` (a lanes pool's scales, whole page rows read, changed and written back)
    against single-value writes: chunks from any offset of a page, across pages, past a row's
    table (the scratch page, page 0, is anyone's: not compared), one token a row (a decode)."""
    import jax.numpy as jnp
    import numpy as np

    from serving.models.cache import _write_scale_rows

    rng = np.random.default_rng(0)
    for _ in range(12):
        heads, page_size, batch = int(rng.choice([1, 3])), int(rng.choice([4, 8])), int(rng.integers(1, 4))
        n, max_pages, num_pages = int(rng.choice([1, 2, 5, 9, 17])), 6, 40
        owned = rng.permutation(np.arange(1, num_pages))
        table = np.zeros((batch, max_pages), np.int32)
        for b in range(batch):
            k = int(rng.integers(0, max_pages + 1))
            table[b, :k] = owned[b * max_pages : b * max_pages + k]
        positions = (rng.integers(0, max_pages * page_size + 3, size=batch)[:, None] + np.arange(n)).astype(np.int32)
        pool = rng.standard_normal((2, num_pages, heads * page_size)).astype(np.float32)
        x = rng.standard_normal((2, batch, n, heads)).astype(np.float32)
        want = pool.copy()
        for b in range(batch):
            for j, p in enumerate(positions[b]):
                column = p // page_size
                page = table[b, column] if column < max_pages else 0
                want[:, page, np.arange(heads) * page_size + p % page_size] = x[:, b, j]
        got = np.asarray(_write_scale_rows(jnp.asarray(pool), jnp.asarray(table), jnp.asarray(positions), jnp.asarray(x)))
        np.testing.assert_array_equal(got[:, 1:], want[:, 1:])
