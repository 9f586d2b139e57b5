"""Decode attention through JAX's Pallas paged-attention kernel (serving.kernels.tpu_paged) on CPU,
in the kernel's TPU interpret mode, against numpy reading each row's positions through its
shuffled page table; and serving.kernels.backend.select choosing it on TPUs."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from serving.errors import ConfigError
from serving.kernels.backend import select  # the function itself: tests/backends.py may wrap it later
from serving.kernels.tpu_paged import PallasPagedOps, compute_block
from serving.models.cache import KVCache, quantize_kv
from serving.models.ops import TPU_XLA, XlaOps

KV_HEADS = 2
MAX_PAGES = {8: 6, 16: 4}  # page_size -> table width: 48 and 64 positions


def _bf16(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _positions(page_size: int) -> list[int]:
    """Row positions: the first, second, ends of the first pages, and the table's last two."""
    last = MAX_PAGES[page_size] * page_size - 1
    return [0, 1, 7, 17, last - 1, last]


def _tables(rng, positions: list[int], page_size: int, num_pages: int) -> np.ndarray:
    """Page tables [batch, max_pages]: each row's pages drawn from a shuffle of pages 1.., so that
    rows' pages interleave; entries past a row's position stay 0 (scratch). One more row without
    pages (all 0): a parked row."""
    shuffled = iter(rng.permutation(np.arange(1, num_pages)))
    tables = np.zeros((len(positions) + 1, MAX_PAGES[page_size]), np.int32)
    for row, position in enumerate(positions):
        for index in range(position // page_size + 1):
            tables[row, index] = next(shuffled)
    return tables


def _case(rng, layers: int, page_size: int, groups: int, head_dim: int, int8: bool, dtype=jnp.float32):
    """q [layers, batch, 1, kv_heads, groups, head_dim], the pool, tables, positions and each
    layer's new k, v [layers, batch, kv_heads, head_dim] as the model passes them (an int8 pool's
    new token already quantized and dequantized: decode_step attends to it as the cache holds it)."""
    positions = _positions(page_size)
    batch = len(positions) + 1
    num_pages = 1 + sum(p // page_size + 1 for p in positions) + 3  # scratch, rows' pages, spare
    tables = _tables(rng, positions, page_size, num_pages)
    shape = (layers, num_pages, page_size, KV_HEADS, head_dim)
    # every entry random, page 0 and unowned pages included: a misread shows
    k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    new_shape = (layers, batch, KV_HEADS, head_dim)
    k_new, v_new = (jnp.asarray(rng.standard_normal(new_shape), dtype) for _ in range(2))
    if int8:
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        cache = KVCache(kq, vq, ks, vs)
        k_new, v_new = (
            x.astype(dtype) * s.astype(dtype) for x, s in (quantize_kv(k_new), quantize_kv(v_new))
        )
    else:
        cache = KVCache(k, v)
    q = jnp.asarray(rng.standard_normal((layers, batch, 1, KV_HEADS, groups, head_dim)), dtype)
    parked = np.array([*positions, 30], np.int32)  # the parked row's position is anything
    return q, cache, jnp.asarray(tables), jnp.asarray(parked), k_new, v_new


def _reference(q, cache: KVCache, layer: int, tables, positions, k_new, v_new, round_kv: bool):
    """Attention in float64: row b over its positions [0, positions[b]) looked up page by page in
    its table, then its own k_new, v_new; zeros for a row without pages. `round_kv`: K/V rounded
    to bfloat16 first, as the kernel loads float pages."""
    q, tables, positions = (np.asarray(x) for x in (q, tables, positions))
    page_size, head_dim = cache.k.shape[2], q.shape[-1]
    out = np.zeros(q.shape, np.float64)  # [batch, 1, kv_heads, groups, head_dim]
    for b, position in enumerate(positions):
        if tables[b, 0] == 0:
            continue
        t = np.arange(position)
        page, offset = tables[b, t // page_size], t % page_size

        def gather(values, scales, new, b=b, page=page, offset=offset):
            x = np.asarray(values[layer], np.float64)[page, offset]  # [position, kv_heads, head_dim]
            if scales is not None:
                x = x * np.asarray(scales[layer], np.float64)[page, offset]
            x = np.concatenate([x, np.asarray(new, np.float64)[b][None]])
            return _bf16(x).astype(np.float64) if round_kv else x

        keys, values = gather(cache.k, cache.k_scale, k_new), gather(cache.v, cache.v_scale, v_new)
        scores = np.einsum("kgd,tkd->kgt", q[b, 0].astype(np.float64), keys) / np.sqrt(head_dim)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[b, 0] = np.einsum("kgt,tkd->kgd", weights / weights.sum(-1, keepdims=True), values)
    return out


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_in_a_layer_scan_matches_numpy(int8, page_size, groups, head_dim):
    """jit of a lax.scan over layers with a traced layer index, as decode_step runs it."""
    layers = 2
    rng = np.random.default_rng(page_size * 1000 + groups * 100 + head_dim + int8)
    q, cache, tables, positions, k_new, v_new = _case(rng, layers, page_size, groups, head_dim, int8)
    ops = PallasPagedOps()

    @jax.jit
    def run(q, cache, tables, positions, k_new, v_new):
        def body(_, per_layer):
            index, q, k, v = per_layer
            return None, ops.decode_attention(q, cache, index, positions, k, v, 0, tables)

        return jax.lax.scan(body, None, (jnp.arange(layers), q, k_new, v_new))[1]

    with pltpu.force_tpu_interpret_mode():
        got = np.asarray(run(q, cache, tables, positions, k_new, v_new))
    assert got.shape == q.shape and got.dtype == np.float32
    for layer in range(layers):
        args = (q[layer], cache, layer, tables, positions, k_new[layer], v_new[layer])
        # The kernel loads float pages as bfloat16 (and int8 ones dequantized in float32): against
        # K/V rounded the same way only float32 rounding is left: at most 8e-7 here, outputs up to 4.
        want = _reference(*args, round_kv=not int8)
        np.testing.assert_allclose(got[layer], want, rtol=1e-5, atol=1e-5)
        assert not got[layer, -1].any()  # the parked row: no pages, zeros
        if not int8:  # against float32 K/V, the bfloat16 rounding shows: up to 8e-3 here
            np.testing.assert_allclose(got[layer], _reference(*args, round_kv=False), atol=2e-2)


def test_bfloat16_pool_python_layer_and_eight_groups():
    """A bfloat16 pool and queries, a Python int layer, and 8 groups (the kernel then launches q
    in its own dtype and blocks, a second code path)."""
    rng = np.random.default_rng(7)
    q, cache, tables, positions, k_new, v_new = _case(rng, 2, 16, 8, 128, False, jnp.bfloat16)
    run = jax.jit(
        lambda q, cache, k, v: PallasPagedOps().decode_attention(q, cache, 1, positions, k, v, 0, tables)
    )
    with pltpu.force_tpu_interpret_mode():
        got = run(q[1], cache, k_new[1], v_new[1])
    assert got.dtype == jnp.bfloat16
    want = _reference(q[1], cache, 1, tables, positions, k_new[1], v_new[1], round_kv=False)
    # the inputs are bfloat16 already, the output is rounded to it: about 2^-9 relative
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)


def test_compute_block_is_the_largest_divisor_not_above_the_limit():
    assert [compute_block(n, 4) for n in (1, 2, 3, 4, 6, 7, 8, 9, 12)] == [1, 2, 3, 4, 3, 1, 4, 3, 4]
    assert compute_block(64, 16) == 16 and compute_block(6, 1) == 1
    with pytest.raises(ValueError, match="pages_per_compute_block"):
        PallasPagedOps(pages_per_compute_block=0)


def _devices(platform: str, count: int = 4) -> list:
    return [SimpleNamespace(platform=platform)] * count


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_select_takes_the_pallas_kernel_on_tpus_with_attention_paged(cpu_kernels, caplog):
    with caplog.at_level(logging.INFO, logger="serving.kernels.backend"):
        ops = select(cpu_kernels, "int8w", "bfloat16", _devices("tpu"), attention="paged")
    assert isinstance(ops, PallasPagedOps) and ops.name == "pallas-tpu" and ops.pool_layout == "tokens"
    assert "Pallas paged-attention kernel" in caplog.text


@pytest.mark.parametrize("attention", ["autoselected", "dot_product"])
def test_select_takes_xla_over_a_lanes_pool_on_tpus_otherwise(attention, caplog):
    """The kernel copies each layer's whole pool into its layout every step (the module docstring):
    on a v5e, 18 tok/s at batch 1 against XLA's window gather's 63 (loadtest.tpu_probe)."""
    with caplog.at_level(logging.INFO, logger="serving.kernels.backend"):
        ops = select("auto", "int8w", "bfloat16", _devices("tpu"), attention=attention)
    assert ops is TPU_XLA and ops.pool_layout == "lanes"
    assert "gathers each call's window" in caplog.text


@pytest.mark.parametrize("platform", ["tpu", "cpu"])
@pytest.mark.parametrize("attention", ["autoselected", "paged"])
@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_slot_sizing_knows_the_pool_layout_select_chooses(platform, attention, cpu_kernels):
    """serving.startup sizes slots before JAX has chosen a backend: the same layout, so the same bytes."""
    from serving.startup.slots import pool_layout_on

    devices = _devices(platform, 1)
    ops = select(cpu_kernels, "int8w", "bfloat16", devices, attention=attention)
    assert pool_layout_on(devices, cpu_kernels, attention) == ops.pool_layout


def test_select_takes_xla_elsewhere_and_where_the_kernel_does_not_import(monkeypatch, caplog):
    assert type(select("auto", "int8w", "bfloat16", _devices("gpu"))) is XlaOps
    assert type(select("auto", "int8w", "bfloat16", _devices("tpu")[:1] + _devices("cpu", 1))) is XlaOps
    with pytest.raises(ConfigError, match="cpu_kernels=on"):
        select("on", "int8w", "float32", _devices("tpu"))
    monkeypatch.setitem(sys.modules, "serving.kernels.tpu_paged", None)  # import raises ImportError
    with caplog.at_level(logging.INFO, logger="serving.kernels.backend"):
        assert type(select("auto", "int8w", "bfloat16", _devices("tpu"), attention="paged")) is XlaOps
    assert "did not import" in caplog.text
