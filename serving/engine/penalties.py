"""Per-request logit processing before the sampler, in the compiled step: bad words, min_tokens,
logit bias and the repetition, frequency and presence penalties, with vLLM's definitions and in
vLLM's order (serving.request.SamplingParams says what each field means).

Each slot's sequence so far lives on the device (`TokenHistory`): how often each token was
generated, which tokens the prompt holds (read by the repetition penalty only) and the last few
generated tokens (read by multi-token bad words). Every step adds its tokens (`record`, a scatter of
one token per slot) when some row reads its history. Each kind of processing runs under a
`lax.cond` on whether any active row asks for it, inside one on whether any asks for any, so a
batch that uses none of them compiles them but runs two tests, and a row's logits depend on its
own parameters alone.

Shapes: rows are the rows of one sampling call ([slots] in generate, [slots * (k + 1)] in
speculative decoding's verify); vocab is the decodable vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from serving.engine.state import RECENT, SlotSampling, TokenHistory

NO_TOKEN = -2  # `recent` before the first generated token: matches no bad word's token


def init_history(slots: int, vocab: int) -> TokenHistory:
    """Every slot empty."""
    return TokenHistory(
        counts=jnp.zeros((slots, vocab), jnp.int32), prompt=jnp.zeros((slots, vocab), bool), recent=no_recent(slots)
    )


def no_recent(rows: int) -> jax.Array:
    """recent [rows, RECENT] of sequences with nothing generated yet."""
    return jnp.full((rows, RECENT), NO_TOKEN, jnp.int32)


def started(first: jax.Array, vocab: int) -> tuple[jax.Array, jax.Array]:
    """counts [rows, vocab] and recent [rows, RECENT] of sequences whose first generated token is
    `first` [rows]."""
    counts = jax.nn.one_hot(first, vocab, dtype=jnp.int32)
    recent = no_recent(first.shape[0]).at[:, -1].set(first)
    return counts, recent


def prompt_tokens(tokens: jax.Array, length: jax.Array, vocab: int) -> jax.Array:
    """bool [vocab]: the tokens among tokens[:length] (tokens [bucket], padded)."""
    index = jnp.where(jnp.arange(tokens.shape[0]) < length, tokens, vocab)
    return jnp.zeros((vocab,), bool).at[index].set(True, mode="drop")


def record(
    history: TokenHistory, rows: jax.Array, tokens: jax.Array, valid: jax.Array, reads: jax.Array | None = None
) -> TokenHistory:
    """The history with tokens [n, m] appended to slots `rows` [n] where `valid` [n, m] (a prefix
    of each row: the tokens a step emitted). With `reads` [n] (`reads_history` of the rows'
    sampling) only when some row that emits a token reads the history: a row that reads none
    (no penalty, no bad word) never looks at its own, and a new request's insert starts it afresh,
    so a batch of such rows skips the scatter."""

    def append(history: TokenHistory) -> TokenHistory:
        counts = history.counts.at[rows[:, None], tokens].add(valid.astype(jnp.int32), mode="drop")
        seq = jnp.concatenate([history.recent[rows], tokens], axis=1)  # [n, RECENT + m]
        shift = jnp.sum(valid, axis=1)
        recent = jax.vmap(lambda s, n: lax.dynamic_slice_in_dim(s, n, RECENT))(seq, shift)
        return history._replace(counts=counts, recent=history.recent.at[rows].set(recent, mode="drop"))

    if reads is None:
        return append(history)
    return lax.cond(jnp.any(jnp.any(valid, axis=1) & reads), append, lambda h: h, history)


def penalized(sampling: SlotSampling) -> jax.Array:
    """[rows]: rows with a presence, frequency or repetition penalty."""
    return (sampling.presence_penalty != 0) | (sampling.frequency_penalty != 0) | (sampling.repetition_penalty != 1)


def has_bad_words(sampling: SlotSampling) -> jax.Array:
    """[rows]: rows with at least one bad word (a word's last token is never -1)."""
    return jnp.any(sampling.bad_words[..., -1] >= 0, axis=-1)


def reads_history(sampling: SlotSampling) -> jax.Array:
    """[rows]: rows whose processing reads their token history (counts, prompt or recent tokens)."""
    return penalized(sampling) | has_bad_words(sampling)


def process(
    logits: jax.Array,
    sampling: SlotSampling,
    generated: jax.Array,
    recent: jax.Array,
    history: Callable[[], tuple[jax.Array, jax.Array]] | None,
    active: jax.Array,
) -> jax.Array:
    """logits [rows, vocab] after bad words, min_tokens, logit bias and penalties, in that order.

    sampling: the rows' parameters ([rows, ...]); generated [rows]: tokens generated before this
    one; recent [rows, RECENT]: the last of them; history(): counts and prompt [rows, vocab], called
    only when some active row is penalized (None: nothing generated yet and no prompt tokens kept,
    so the penalties change nothing); active [rows]: rows whose token counts.
    """
    rows, vocab = logits.shape
    row = jnp.arange(rows)[:, None]

    def when(flags: jax.Array, apply: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
        return lax.cond(jnp.any(active & flags), apply, lambda x: x, x)

    def forbid(x: jax.Array, ids: jax.Array) -> jax.Array:  # ids [rows, n], -1 (or any < 0): none
        return x.at[row, jnp.where(ids >= 0, ids, vocab)].set(-jnp.inf, mode="drop")

    words = sampling.bad_words  # [rows, words, tokens], right-aligned, -1 before a word's start
    has_words = has_bad_words(sampling)
    early = generated < sampling.min_tokens
    ids = sampling.bias_ids
    has_bias = jnp.any(ids >= 0, axis=-1)
    rows_penalized = penalized(sampling) if history is not None else jnp.zeros((rows,), bool)

    def bias(x: jax.Array) -> jax.Array:
        return x.at[row, jnp.where(ids >= 0, ids, vocab)].add(sampling.bias, mode="drop")

    def each(x: jax.Array) -> jax.Array:
        x = when(has_words, lambda x: forbid(x, _banned(words, recent)), x)
        x = when(early, lambda x: forbid(x, jnp.where(early[:, None], sampling.stop_ids, -1)), x)
        x = when(has_bias, bias, x)
        if history is None:
            return x
        return when(rows_penalized, lambda x: _penalize(x, sampling, *history()), x)

    # One test for a batch that asks for none of it (the common case: what it costs), then each
    # kind under its own.
    return when(has_words | early | has_bias | rows_penalized, each, logits)


def _banned(words: jax.Array, recent: jax.Array) -> jax.Array:
    """[rows, words]: each word's last token where the tokens before it are the last generated
    ones (a one-token word always), else -1."""
    before, last = words[..., :-1], words[..., -1]
    matches = jnp.all((before == -1) | (before == recent[:, None, :]), axis=-1)
    return jnp.where(matches & (last >= 0), last, -1)


def _penalize(logits: jax.Array, sampling: SlotSampling, counts: jax.Array, prompt: jax.Array) -> jax.Array:
    """vLLM's apply_penalties: repetition over prompt and output, then frequency and presence over
    the output. All [rows, vocab] but the penalties [rows]."""
    seen = counts > 0
    repetition = jnp.where(prompt | seen, sampling.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits -= sampling.frequency_penalty[:, None] * counts
    return logits - sampling.presence_penalty[:, None] * seen
