"""Sampling: greedy, temperature, top-k, top-p, seeds, and parameter validation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.engine.sampling import argmax, sample
from serving.request import SamplingParams

LOGITS = jnp.log(jnp.array([[0.5, 0.25, 0.125, 0.0625, 0.0625]], jnp.float32))


def _draw(logits, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    batch = jnp.repeat(logits, n, axis=0)
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    return np.asarray(
        jax.jit(sample)(
            batch,
            keys,
            jnp.full((n,), temperature, jnp.float32),
            jnp.full((n,), top_k, jnp.int32),
            jnp.full((n,), top_p, jnp.float32),
        )
    )


def test_temperature_zero_is_argmax():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(6, 50)), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    picked = sample(logits, keys, jnp.zeros(6), jnp.zeros(6, jnp.int32), jnp.ones(6))
    assert np.array_equal(np.asarray(picked), np.argmax(np.asarray(logits), axis=-1))


def test_argmax_is_jnps_on_ties_infinities_and_nans():
    rows = np.random.default_rng(1).normal(size=(7, 300)).astype(np.float32)
    rows[1, [5, 9, 200]] = 50.0  # ties: the first
    rows[2, 17] = np.inf
    rows[3, [4, 99]] = np.nan  # NaN wins, the first one
    rows[4, :] = -np.inf
    rows[5, [0, 299]] = 60.0
    got = np.asarray(jax.jit(argmax)(jnp.asarray(rows)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(rows), axis=-1)))
    assert list(got[1:6]) == [5, 17, 4, 0, 0]


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(_draw(LOGITS, 4000), minlength=5) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.25, 0.125, 0.0625, 0.0625], atol=0.03)


def test_top_k_never_leaves_the_top_k():
    out = _draw(LOGITS, 2000, top_k=2)
    assert set(out.tolist()) == {0, 1}
    assert abs((out == 0).mean() - 2 / 3) < 0.04  # renormalised over the kept tokens


def test_top_p_keeps_the_smallest_sufficient_prefix():
    out = _draw(LOGITS, 2000, top_p=0.7)  # 0.5 + 0.25 reaches 0.7: tokens 0 and 1
    assert set(out.tolist()) == {0, 1}
    assert set(_draw(LOGITS, 200, top_p=0.01).tolist()) == {0}


def test_high_temperature_flattens():
    counts = np.bincount(_draw(LOGITS, 4000, temperature=100.0), minlength=5) / 4000
    np.testing.assert_allclose(counts, [0.2] * 5, atol=0.03)


def test_same_seed_same_tokens_other_seed_other_tokens():
    a, b, c = _draw(LOGITS, 64, seed=1), _draw(LOGITS, 64, seed=1), _draw(LOGITS, 64, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0),
        dict(max_tokens=-1),
        dict(temperature=math.nan),
        dict(temperature=-0.5),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-1),
    ],
)
def test_bad_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)
