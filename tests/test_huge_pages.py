"""serving.kernels.huge_pages: a zeroed pool's whole 2 MB pages are given back advised huge, and
the arrays read and write as before (what a donated call does to the decode state's pool)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.kernels import huge_pages


def test_a_zeroed_pool_reads_zeros_and_takes_writes_after_its_pages_are_given_back():
    pool = jnp.zeros((3 * huge_pages.HUGE_PAGE // 4 + 1000,), jnp.float32)  # ~6 MB: 2 or 3 whole 2 MB pages
    small = jnp.zeros((1000,), jnp.float32)  # no whole 2 MB page inside
    start = pool.unsafe_buffer_pointer()
    whole = ((start + pool.nbytes) // huge_pages.HUGE_PAGE - -(-start // huge_pages.HUGE_PAGE)) * huge_pages.HUGE_PAGE
    advised = huge_pages.advise_zeroed([pool, None, small])
    assert advised == (whole if huge_pages.available() else 0)
    assert whole >= 2 * huge_pages.HUGE_PAGE
    assert float(jnp.abs(pool).sum()) == 0.0

    write = jax.jit(lambda x, at: x.at[at].set(jnp.arange(at.size, dtype=x.dtype) + 1), donate_argnums=0)
    at = jnp.arange(0, pool.size, 4099)  # into every 2 MB page and the edges around them
    pool = write(pool, at)
    expected = np.zeros(pool.size, np.float32)
    expected[np.asarray(at)] = np.arange(at.size) + 1
    np.testing.assert_array_equal(np.asarray(pool), expected)


@pytest.mark.skipif(not huge_pages.available(), reason="needs Linux with transparent huge pages")
def test_the_engine_gives_its_fresh_pool_back_as_huge_pages(tiny_model_dir, monkeypatch):
    """The engine's decode state: every whole 2 MB page of the pool is advised (the bytes advised
    equal the pool's whole pages), and the pool still reads zeros."""
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine.engine import Engine

    cfg = ServingConfig(max_prefill_predict_length=64, max_target_length=4096, per_device_batch_size=16)
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    advised = []
    real = huge_pages.advise_zeroed
    monkeypatch.setattr(huge_pages, "advise_zeroed", lambda arrays: advised.append(real(arrays)) or advised[-1])
    state = engine.init_decode_state()
    whole = 0
    for array in state.cache:
        if array is not None:
            start = array.unsafe_buffer_pointer()
            last, first = (start + array.nbytes) // huge_pages.HUGE_PAGE, -(-start // huge_pages.HUGE_PAGE)
            whole += max(0, last - first) * huge_pages.HUGE_PAGE
    assert whole > 0 and advised == [whole]
    assert all(float(jnp.abs(x).sum()) == 0.0 for x in state.cache if x is not None)
