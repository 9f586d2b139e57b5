"""Sampling: greedy, temperature, top-k, top-p, seeds, and parameter validation.

What a row may draw is checked token for token against the sort-based definition (numpy, float64
sums), ties included; the draws against its probabilities by a chi-square test. Few shapes, so
that few programs compile.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from serving.engine import sampling
from serving.engine.sampling import argmax, kept, sample
from serving.request import SamplingParams

VOCAB = 400  # past MAX_CANDIDATES, so that a top-k may take either method
# 0.5, 0.25, 0.125, 0.0625, 0.0625, then tokens of probability 0 up to VOCAB
LOGITS = jnp.log(jnp.zeros((1, VOCAB)).at[0, :5].set(jnp.array([8.0, 4, 2, 1, 1]) / 16))
# (temperature, top_k, top_p): top-k by candidates (1..128), by bisection (129, 300, 399) and none
# (0, VOCAB); top-p none (1) and within either
COMBOS = list(
    itertools.product(
        [0.3, 1.0, 2.5], [0, 1, 7, 50, 128, 129, 300, VOCAB - 1, VOCAB], [1.0, 0.97, 0.9, 0.5, 0.1]
    )
)
# greedy rows (with top-k / top-p set, which they ignore) among sampling rows of every method
MIXED = [
    (0.0, 0, 1.0),
    (1.0, 0, 1.0),
    (0.0, 40, 0.5),
    (0.8, 40, 0.9),
    (1.0, 0, 0.9),
    (0.0, 300, 1.0),
    (1.2, 300, 0.95),
    (0.6, 3, 1.0),
]
NUM_DRAWS = 20_000


def reference_kept(logits: np.ndarray, temperature, top_k, top_p) -> np.ndarray:
    """[batch, vocab] bool by the definition: sort the scaled logits, softmax over the first k,
    keep the sorted prefix whose mass before each token is below top_p, then every token at least
    as good as the last one kept."""
    rows = []
    for row, t, k, p in zip(logits, temperature, top_k, top_p, strict=True):
        scaled = row / np.maximum(np.float32(t), np.float32(1e-6))  # float32, as the sampler does
        vocab = len(scaled)
        k = int(k) if 0 < k < vocab else vocab
        ranked = np.sort(scaled)[::-1]
        weights = np.exp(ranked[:k].astype(np.float64) - ranked[0])
        probs = weights / weights.sum()
        last = k if p >= 1 else int(np.sum(np.cumsum(probs) - probs < p))
        rows.append(scaled >= ranked[last - 1])
    return np.array(rows)


def reference_probs(logits: np.ndarray, temperature, top_k, top_p) -> np.ndarray:
    scaled = logits.astype(np.float64) / np.asarray(temperature, np.float64)[:, None]
    weights = np.exp(scaled - scaled.max(-1, keepdims=True))
    weights = np.where(reference_kept(logits, temperature, top_k, top_p), weights, 0)
    return weights / weights.sum(-1, keepdims=True)


def _params(combos) -> tuple:
    t, k, p = zip(*combos, strict=True)
    return jnp.array(t, jnp.float32), jnp.array(k, jnp.int32), jnp.array(p, jnp.float32)


def _draw(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0, min_p=0.0) -> np.ndarray:
    """NUM_DRAWS tokens from one row of logits, each with a key of its own."""
    n = NUM_DRAWS
    keys = jax.random.split(jax.random.PRNGKey(seed), n)
    return np.asarray(
        jax.jit(sample)(
            jnp.repeat(logits, n, axis=0),
            keys,
            jnp.full((n,), temperature, jnp.float32),
            jnp.full((n,), top_k, jnp.int32),
            jnp.full((n,), top_p, jnp.float32),
            jnp.full((n,), min_p, jnp.float32),
        )
    )


def _mixed_batch(seed=5) -> tuple:
    logits = np.random.default_rng(seed).normal(size=(len(MIXED), VOCAB)) * 2
    keys = jax.random.split(jax.random.PRNGKey(seed), len(MIXED))
    return jnp.asarray(logits, jnp.float32), keys, *_params(MIXED)


@pytest.fixture(scope="module")
def mixed_sampler():
    """sample compiled once for _mixed_batch's shapes."""
    return jax.jit(sample).lower(*_mixed_batch()).compile()


def test_temperature_zero_is_argmax(mixed_sampler):
    logits, keys, _, top_k, top_p = _mixed_batch()
    picked = mixed_sampler(logits, keys, jnp.zeros(len(MIXED)), top_k, top_p)
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


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_set_is_the_sorted_definitions(ties, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(len(COMBOS), VOCAB)) * rng.uniform(0.5, 4, size=(len(COMBOS), 1))
    if ties:  # whole numbers, +0.0 and -0.0 among them: ties at every cut
        logits = np.round(logits)
    logits = logits.astype(np.float32)
    temperature, top_k, top_p = _params(COMBOS)
    got = np.asarray(jax.jit(kept)(jnp.asarray(logits), temperature, top_k, top_p))
    want = reference_kept(logits, np.asarray(temperature), np.asarray(top_k), np.asarray(top_p))
    assert [c for c, g, w in zip(COMBOS, got, want, strict=True) if not np.array_equal(g, w)] == []


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 40, 0.8), (1.0, 300, 0.95), (2.0, 5, 1.0)],
)
def test_draws_follow_the_reference_probabilities(temperature, top_k, top_p):
    logits = np.random.default_rng(3).normal(size=(1, VOCAB)).astype(np.float32) * 1.5
    probs = reference_probs(logits, [temperature], [top_k], [top_p])[0]
    draws = _draw(jnp.asarray(logits), temperature, top_k, top_p, seed=4)
    assert probs[draws].min() > 0  # nothing outside the kept set
    counts, expected = np.bincount(draws, minlength=VOCAB), probs * NUM_DRAWS
    big = expected >= 5  # the other kept tokens pooled into one cell
    observed, expected = list(counts[big]), list(expected[big])
    if (~big & (probs > 0)).any():
        observed.append(counts[~big].sum())
        expected.append(NUM_DRAWS * probs[~big].sum())
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    assert chi2 < stats.chi2.isf(1e-4, len(expected) - 1), (chi2, len(expected))


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [(1.0, 0, 1.0, 0.05), (1.5, 40, 0.9, 0.1)])
def test_min_p_draws_follow_vllms_definition(temperature, top_k, top_p, min_p):
    """vLLM's min_p: after temperature, tokens whose probability is below min_p times the best
    token's are dropped, then top-k and top-p run on what is left."""
    logits = np.random.default_rng(6).normal(size=(1, VOCAB)).astype(np.float32) * 1.5
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    cut = np.where(probs >= min_p, logits, -np.inf).astype(np.float32)  # probs / max(probs) >= min_p
    expected = reference_probs(cut, [temperature], [top_k], [top_p])[0]
    assert 5 < (expected > 0).sum() < (probs > 0).sum()  # min_p cuts, and leaves a few
    draws = _draw(jnp.asarray(logits), temperature, top_k, top_p, seed=9, min_p=min_p)
    assert expected[draws].min() > 0  # nothing min_p (or top-k, top-p) drops
    counts, expected = np.bincount(draws, minlength=VOCAB), expected * NUM_DRAWS
    big = expected >= 5
    observed, cells = [*counts[big], counts[~big].sum()], [*expected[big], expected[~big].sum()]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, cells, strict=True) if e > 0)
    assert chi2 < stats.chi2.isf(1e-4, sum(e > 0 for e in cells) - 1), chi2


def test_temperature_one_follows_the_distribution():
    counts = np.bincount(_draw(LOGITS), minlength=VOCAB)[:5] / NUM_DRAWS
    np.testing.assert_allclose(counts, [0.5, 0.25, 0.125, 0.0625, 0.0625], atol=0.015)


def test_top_k_never_leaves_the_top_k():
    out = _draw(LOGITS, top_k=2)
    assert set(out.tolist()) == {0, 1}
    assert abs((out == 0).mean() - 2 / 3) < 0.015  # renormalised over the kept tokens


def test_top_p_keeps_the_smallest_sufficient_prefix():
    out = _draw(LOGITS, top_p=0.7)  # 0.5 + 0.25 reaches 0.7: tokens 0 and 1
    assert set(out.tolist()) == {0, 1}
    assert set(_draw(LOGITS, top_p=0.01).tolist()) == {0}
    assert set(_draw(LOGITS, top_p=0.9).tolist()) == {0, 1, 2, 3, 4}  # the tie at 0.0625 stays whole


def test_high_temperature_flattens():
    counts = np.bincount(_draw(LOGITS, temperature=100.0), minlength=VOCAB)[:5] / NUM_DRAWS
    np.testing.assert_allclose(counts, [0.2] * 5, atol=0.015)


def test_same_seed_same_tokens_other_seed_other_tokens():
    a, b, c = _draw(LOGITS, seed=1), _draw(LOGITS, seed=1), _draw(LOGITS, seed=2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_greedy_rows_among_sampling_rows_take_the_argmax(mixed_sampler):
    logits, keys, temperature, top_k, top_p = _mixed_batch()
    picked = np.asarray(mixed_sampler(logits, keys, temperature, top_k, top_p))
    greedy = np.asarray(temperature) == 0
    np.testing.assert_array_equal(picked[greedy], np.argmax(np.asarray(logits), axis=-1)[greedy])
    allowed = reference_kept(np.asarray(logits), *(np.asarray(x) for x in (temperature, top_k, top_p)))
    assert all(allowed[i, picked[i]] for i in np.flatnonzero(~greedy))


def test_a_rows_token_depends_on_its_own_logits_key_and_parameters_alone(mixed_sampler):
    """A row among others and alone (every row a copy of it) draws the same token, so the
    engine's batch and a one-request loop agree; the same keys draw it again."""
    batch = _mixed_batch()
    together = np.asarray(mixed_sampler(*batch))
    np.testing.assert_array_equal(np.asarray(mixed_sampler(*batch)), together)
    for row in range(len(MIXED)):
        alone = mixed_sampler(*(jnp.repeat(x[row : row + 1], len(MIXED), axis=0) for x in batch))
        assert int(alone[0]) == together[row], MIXED[row]


def test_only_the_rows_and_methods_that_sample_run(monkeypatch):
    """temperature 0 rows never run the sampling path, whatever their top-k / top-p; sampling
    rows are drawn ROWS_PER_CHUNK at a time, each chunk running only the cuts its rows ask for
    (plain temperature none): counted at run time in the compiled program."""
    calls = []

    def counted(name: str):
        original = getattr(sampling, name)

        def run(*args):
            jax.debug.callback(lambda: calls.append(name))
            return original(*args)

        return run

    for name in ("_draw", "_candidate_cutoff", "_bisection_cutoff"):
        monkeypatch.setattr(sampling, name, counted(name))
    counting = jax.jit(lambda *args: sample(*args))  # traced here, with the counters
    logits, keys, *_ = _mixed_batch()
    greedy = [(0.0, 0, 1.0), (0.0, 40, 0.5), (0.0, 300, 0.9), (0.0, 5, 1.0)] * 2
    plain = (1.0, 0, 1.0)
    assert sampling.ROWS_PER_CHUNK == 4 and len(greedy) == 8
    for rows, runs in [
        (greedy, []),
        ([*greedy[:3], plain, *greedy[4:]], ["_draw"]),
        ([*greedy[:7], (1.0, 50, 1.0)], ["_candidate_cutoff", "_draw"]),
        ([(1.0, 0, 0.95), *greedy[1:]], ["_bisection_cutoff", "_draw"]),
        ([(0.5, 40, 1.0), (1.0, 0, 0.95), *greedy[2:]], ["_bisection_cutoff", "_candidate_cutoff", "_draw"]),
        ([plain] * 5 + greedy[5:], ["_draw", "_draw"]),  # two chunks
    ]:
        calls.clear()
        jax.block_until_ready(counting(logits, keys, *_params(rows)))
        jax.effects_barrier()
        assert sorted(calls) == runs, rows


def test_the_sampler_never_sorts_and_its_greedy_branch_only_returns_the_argmax():
    args = _mixed_batch()
    assert "stablehlo.sort" not in jax.jit(sample).lower(*args).as_text()
    (cond,) = [e for e in jax.make_jaxpr(sample)(*args).eqns if e.primitive.name == "cond"]
    greedy_branch = cond.params["branches"][0].jaxpr  # lax.cond's false branch comes first
    assert greedy_branch.eqns == [] and greedy_branch.outvars[0] in greedy_branch.invars


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


@pytest.mark.parametrize("seed", [0, 1, 42, 2**31 - 1, 2**31, 2**32 + 3, -1, -5, 2**63 - 1, -(2**63)])
def test_host_keys_are_jaxs_prng_keys(seed):
    """A request's key made on the host (no device round trip a request) is jax.random.PRNGKey's:
    a seed samples the same tokens as it did when the device made its key."""
    from serving.engine.state import host_key

    key = host_key(seed)
    assert key.dtype == np.uint32
    np.testing.assert_array_equal(key, np.asarray(jax.random.PRNGKey(seed)))
