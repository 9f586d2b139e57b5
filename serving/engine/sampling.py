"""Token sampling per row: greedy, temperature, min-p, top-k and top-p, reproducible from a seed.

A row with temperature > 0 draws from these tokens, in this order (README, "Sampling"):

1. scaled = logits / temperature; with min_p > 0, the tokens whose probability is below min_p
   times the best token's are dropped (vLLM's min_p, applied before top-k and top-p).
2. top-k (0 < k < vocab): the tokens whose scaled logit is at least the k-th largest; ties with the
   k-th are all kept. Probabilities for step 3 are the softmax over exactly k of them.
3. top-p (p < 1): the smallest best-first prefix whose probability reaches p, i.e. every token
   whose strictly better tokens hold less than p of the mass; ties go together, the best token
   always stays. p = 1 cuts nothing.
4. One token drawn with probability proportional to exp(scaled) among those kept.

Nothing sorts the vocabulary, which on CPU costs more than a decode step. Every cut is a threshold
on the scaled logits, `scaled >= cutoff`, found per row:
- k up to MAX_CANDIDATES: `lax.top_k` gives the best tokens in order, and step 3 runs on them
  exactly as on a sorted vocabulary when k is set.
- otherwise bisection over the float32 values (as ordered integers, so the threshold found is
  exact): on the count of tokens >= t for the k-th value, on the mass of tokens > t for top-p.
  Each pass is one masked sum over the vocabulary, at most 32 passes.
The draw is an inverse CDF in vocabulary order (one uniform per row, block sums, then one block),
not Gumbel-max: a Gumbel per token costs as much as the rest of the sampler on CPU.

Only rows that sample pay: nothing past the argmax runs when no row samples; the sampling rows are
gathered and drawn ROWS_PER_CHUNK at a time, and in a chunk each method runs only when one of its
rows asks for it. A row's token depends on its own logits, key and parameters alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from serving.request import MAX_LOGPROBS

__all__ = ["apply_mask", "sample", "token_logprobs", "token_logprobs_if"]

# top-k up to this k (and a top-p within it) is read from lax.top_k of this size; a larger k
# bisects. On CPU at batch 32, top_k of 64 / 128 / 256 costs about 3.4 / 4.6 / 11 ms.
MAX_CANDIDATES = 128
BLOCK = 256  # vocabulary entries per block of the inverse-CDF draw
# Sampling rows are gathered and drawn this many at a time: the cost grows with the rows that
# sample (one chat request among greedy slots pays for one chunk, not the batch), and a chunk's
# rows stay in cache through the bisection passes (CPU, batch 32, top_p: 14 ms, 23 ms unchunked).
ROWS_PER_CHUNK = 4


def sample(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    min_p: jax.Array | None = None,
) -> jax.Array:
    """Pick one token per row.

    logits [batch, vocab] float32; keys [batch] PRNG keys; temperature, top_p, min_p (None: 0)
    [batch] float32; top_k [batch] int32. Rows with temperature 0 take the argmax. Returns [batch]
    int32.
    """
    greedy = argmax(logits)
    sampling = temperature > 0
    min_p = jnp.zeros_like(top_p) if min_p is None else min_p
    return lax.cond(
        jnp.any(sampling),
        lambda: _draw_sampling_rows(greedy, sampling, logits, keys, temperature, top_k, top_p, min_p),
        lambda: greedy,
    )


def apply_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """logits [batch, vocab] with -inf where `mask` (int32 [batch, ceil(vocab / 32)], bit i % 32 of
    word i // 32 for token i, as grammar libraries lay out their token bitmasks) is 0."""
    index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    bits = jnp.right_shift(mask[:, index // 32], index % 32) & 1
    return jnp.where(bits == 1, logits, -jnp.inf)


def token_logprobs(
    logits: jax.Array, tokens: jax.Array, temperature: jax.Array, num_top: int = MAX_LOGPROBS
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Logprobs of the distribution each row samples from: log_softmax(logits / temperature)
    (temperature 0, greedy: of the logits), before top-k and top-p. logits [batch, vocab], tokens
    and temperature [batch]. Returns the tokens' logprobs [batch] and the `num_top` best tokens
    with theirs, best first ([batch, num_top] int32 and float32)."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    top, top_ids = lax.top_k(logprobs, min(num_top, logits.shape[-1]))
    return chosen, top_ids.astype(jnp.int32), top


def token_logprobs_if(
    wants: jax.Array, logits: jax.Array, tokens: jax.Array, temperature: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`token_logprobs` where `wants` (a scalar: some row asked for them), else zeros of the same
    shapes: a call whose rows want none skips the log-softmax and the top-k over the vocabulary."""
    rows, vocab = logits.shape
    num_top = min(MAX_LOGPROBS, vocab)

    def none(logits, tokens, temperature):
        return jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, num_top), jnp.int32), jnp.zeros((rows, num_top))

    return lax.cond(wants, token_logprobs, none, logits, tokens, temperature)


def argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (first maximum; first NaN if any) as two plain reductions,
    which XLA:CPU runs about 3x faster than argmax's (value, index) reduction. int32."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    hit = (logits == top) | (jnp.isnan(logits) & jnp.isnan(top))
    index = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def kept(
    logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array | None = None
) -> jax.Array:
    """[batch, vocab] bool: the tokens each row (every row sampling) may draw."""
    scaled, weights = _scale(logits, temperature)
    if min_p is None:
        min_p = jnp.zeros_like(top_p)
    scaled, weights = _min_p(scaled, weights, min_p)
    cutoff = _cutoffs(scaled, weights, top_k, top_p, temperature > 0)
    return (scaled >= cutoff[:, None]) & ((scaled > -jnp.inf) | (min_p[:, None] <= 0))


def _draw_sampling_rows(greedy: jax.Array, sampling: jax.Array, *rows: jax.Array) -> jax.Array:
    """greedy [batch] with the rows where `sampling` drawn by _draw, ROWS_PER_CHUNK at a time;
    `rows` are sample's arguments."""
    batch = greedy.shape[0]
    chunk = min(ROWS_PER_CHUNK, batch)
    num_sampling = jnp.sum(sampling)
    # the sampling rows first; a last partial chunk repeats the first of them (same token again)
    order = jnp.nonzero(sampling, size=-(-batch // chunk) * chunk, fill_value=0)[0]
    order = jnp.where(jnp.arange(order.shape[0]) < num_sampling, order, order[0])

    def draw_chunk(i: jax.Array, tokens: jax.Array) -> jax.Array:
        picked = lax.dynamic_slice_in_dim(order, i * chunk, chunk)
        return tokens.at[picked].set(_draw(*(x[picked] for x in rows)))

    return lax.fori_loop(0, -(-num_sampling // chunk), draw_chunk, greedy)


def _draw(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array
) -> jax.Array:
    """Temperature, min-p, top-k and top-p sampling for every row."""
    scaled, weights = _scale(logits, temperature)
    scaled, weights = _min_p(scaled, weights, min_p)
    cutoff = _cutoffs(scaled, weights, top_k, top_p, temperature > 0)
    uniform = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    return _inverse_cdf(jnp.where(scaled >= cutoff[:, None], weights, 0.0), uniform)


def _scale(logits: jax.Array, temperature: jax.Array) -> tuple[jax.Array, jax.Array]:
    """scaled logits and exp(scaled - row max), both [batch, vocab]; the best token weighs 1."""
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    return scaled, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))


def _min_p(scaled: jax.Array, weights: jax.Array, min_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """scaled and weights ([batch, vocab]) with the tokens whose probability is below min_p [batch]
    times the best one's at -inf and 0 (weights are exp(scaled - max): that ratio itself); runs
    only when some row sets min_p."""

    def cut() -> tuple[jax.Array, jax.Array]:
        keep = weights >= min_p[:, None]
        return jnp.where(keep, scaled, -jnp.inf), jnp.where(keep, weights, 0.0)

    return lax.cond(jnp.any(min_p > 0), cut, lambda: (scaled, weights))


def _cutoffs(
    scaled: jax.Array, weights: jax.Array, top_k: jax.Array, top_p: jax.Array, sampling: jax.Array
) -> jax.Array:
    """[batch] float32: the smallest scaled logit each row keeps (-inf: all of them).

    Rows where `sampling` is False get -inf, and a method runs only when some sampling row needs
    it, so that a row's cutoff depends on its own parameters alone.
    """
    vocab = scaled.shape[-1]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    size = min(MAX_CANDIDATES, vocab)
    by_candidates = sampling & (k < vocab) & (k <= size)
    by_bisection = sampling & ~by_candidates & ((k < vocab) | (top_p < 1))
    none = jnp.full(k.shape, -jnp.inf, jnp.float32)

    def candidates() -> jax.Array:
        return _candidate_cutoff(scaled, k, top_p, size)

    def bisection() -> jax.Array:
        return _bisection_cutoff(scaled, weights, k, jnp.where(by_bisection, top_p, 1.0), by_bisection)

    cutoff = jnp.where(by_candidates, lax.cond(jnp.any(by_candidates), candidates, lambda: none), none)
    return jnp.where(by_bisection, lax.cond(jnp.any(by_bisection), bisection, lambda: none), cutoff)


def _candidate_cutoff(scaled: jax.Array, k: jax.Array, top_p: jax.Array, size: int) -> jax.Array:
    """Cutoffs for rows with k <= size, from their `size` best tokens, as on a sorted vocabulary."""
    ranked = lax.top_k(scaled, size)[0]  # [batch, size], best first
    in_top_k = jnp.arange(size)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
    before = _running_sum(probs) - probs  # mass of the better tokens
    keep = in_top_k & ((before < top_p[:, None]) | (top_p[:, None] >= 1))
    last = jnp.sum(keep, axis=-1) - 1  # keep is a prefix holding the best token
    return jnp.take_along_axis(ranked, last[:, None], axis=-1)[:, 0]


def _bisection_cutoff(
    scaled: jax.Array, weights: jax.Array, k: jax.Array, top_p: jax.Array, rows: jax.Array
) -> jax.Array:
    """Cutoffs for `rows` by bisection over the vocabulary: the k-th value (k < vocab), then the
    top-p threshold above it (top_p < 1). Other rows get nonsense."""
    vocab = scaled.shape[-1]
    top = jnp.max(scaled, axis=-1)
    cuts_k = rows & (k < vocab)
    floor = lax.cond(
        jnp.any(cuts_k), lambda: _kth_largest(scaled, k, cuts_k), lambda: jnp.full(k.shape, -jnp.inf)
    )
    floor = jnp.where(cuts_k, floor, -jnp.inf)
    cuts_p = rows & (top_p < 1)

    def nucleus() -> jax.Array:
        # Probabilities are over exactly k tokens: ties with the k-th value count up to k.
        above = scaled > floor[:, None]
        num_above = jnp.sum(above, axis=-1)
        total = jnp.sum(jnp.where(above, weights, 0.0), axis=-1)
        total += jnp.where(floor > -jnp.inf, (k - num_above) * jnp.exp(floor - top), 0.0)
        return _nucleus_cutoff(scaled, weights, top, total, floor, top_p, cuts_p)

    return jnp.where(cuts_p, lax.cond(jnp.any(cuts_p), nucleus, lambda: floor), floor)


def _kth_largest(scaled: jax.Array, k: jax.Array, rows: jax.Array) -> jax.Array:
    """[batch] the k-th largest scaled logit of each of `rows` (with multiplicity)."""
    # count(scaled >= t) >= k holds at the smallest value and fails above the largest.
    lo = _ordered(jnp.min(scaled, axis=-1))
    hi = _ordered(jnp.max(scaled, axis=-1)) + 1
    lo = jnp.where(rows, lo, hi - 1)

    def fails(t: jax.Array) -> jax.Array:
        return jnp.sum(scaled >= t[:, None], axis=-1) < k

    lo, _ = _bisect(lo, hi, fails)
    return _unordered(lo)


def _nucleus_cutoff(scaled, weights, top, total, floor, top_p, rows) -> jax.Array:
    """[batch] the smallest value whose strictly better tokens (>= floor) hold less than top_p of
    `total`, for `rows`. All [batch] but scaled and weights [batch, vocab]."""
    target = top_p * total
    # Tokens below top + log((1 - p) * total / vocab) together hold less than 1 - p of the mass,
    # so the threshold is above it (one e-fold of slack for rounding): fewer passes.
    vocab = scaled.shape[-1]
    bound = jnp.where(rows, top + jnp.log((1 - top_p) * total / vocab) - 1, -jnp.inf)
    # Thresholds t are compared as scaled > t: start just below floor (-0.0 for a floor of 0,
    # which compares equal to +0.0), at -inf itself when there is no floor.
    below_floor = jnp.where(
        floor == -jnp.inf, _ordered(floor), _ordered(jnp.where(floor == 0, -0.0, floor)) - 1
    )
    lo = jnp.maximum(below_floor, _ordered(bound))
    hi = _ordered(top)  # nothing is strictly above the best token
    lo = jnp.where(rows & (lo < hi), lo, hi - 1)

    def holds_little(t: jax.Array) -> jax.Array:
        mass = jnp.sum(jnp.where(scaled > t[:, None], weights, 0.0), axis=-1)
        return mass < target

    _, hi = _bisect(lo, hi, holds_little)
    return _unordered(hi)


def _bisect(lo: jax.Array, hi: jax.Array, upper) -> tuple[jax.Array, jax.Array]:
    """Ordered keys [batch] with upper(lo) False and upper(hi) True, upper monotone in t:
    returns them adjacent (hi = lo + 1, or as given where hi <= lo + 1)."""

    def unfinished(state) -> jax.Array:
        lo, hi = state
        return jnp.any(hi - lo > 1)

    def step(state):
        lo, hi = state
        mid = lo + (hi - lo) // 2
        up = upper(_unordered(mid))
        return jnp.where(up, lo, mid), jnp.where(up, mid, hi)

    return lax.while_loop(unfinished, step, (lo, hi))


def _ordered(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (NaN aside; -0.0 just below +0.0)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _unordered(key: jax.Array) -> jax.Array:
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _inverse_cdf(weights: jax.Array, uniform: jax.Array) -> jax.Array:
    """[batch] int32: per row the first index whose running sum of weights [batch, vocab] (>= 0,
    some > 0) passes uniform * total, so index i with probability weights[i] / total. Only an
    index of positive weight comes back, whatever the rounding."""
    batch, vocab = weights.shape
    num_blocks = -(-vocab // BLOCK)
    blocks = jnp.pad(weights, ((0, 0), (0, num_blocks * BLOCK - vocab))).reshape(batch, num_blocks, BLOCK)
    block_mass = jnp.sum(blocks, axis=-1)  # [batch, blocks]
    running = _running_sum(block_mass)
    target = uniform * running[:, -1]
    block = _first_past(running, block_mass, target)
    running_before = jnp.pad(running[:, :-1], ((0, 0), (1, 0)))  # the mass of the blocks before
    before = jnp.take_along_axis(running_before, block[:, None], axis=-1)[:, 0]
    inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [batch, BLOCK]
    index = _first_past(_running_sum(inside), inside, jnp.maximum(target - before, 0.0))
    return (block * BLOCK + index).astype(jnp.int32)


def _first_past(running: jax.Array, weights: jax.Array, target: jax.Array) -> jax.Array:
    """[batch] the first index whose running sum exceeds target, else the last of positive
    weight (rounding can leave target at or past the total)."""
    index = jnp.arange(running.shape[-1])
    first = jnp.sum(running <= target[:, None], axis=-1)
    last = jnp.max(jnp.where(weights > 0, index, 0), axis=-1)
    return jnp.minimum(first, last)


def _running_sum(x: jax.Array) -> jax.Array:
    """Inclusive sums along the last (short) axis, each added left to right, so they never
    decrease for x >= 0; as a window reduction, which XLA:CPU compiles faster than jnp.cumsum."""
    n = x.shape[-1]
    pad = [(0, 0)] * (x.ndim - 1) + [(n - 1, 0)]
    return lax.reduce_window(x, 0.0, lax.add, (1,) * (x.ndim - 1) + (n,), (1,) * x.ndim, pad)
