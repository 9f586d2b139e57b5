"""The engine's device-side records: a request's sampling state, a prefill's outputs (the
prefix) and the decode state every compiled step takes and returns (shapes written down)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.limits import MAX_STOP_IDS
from serving.models import KVCache
from serving.request import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, SamplingParams, TokenLogprob

RECENT = MAX_BAD_WORD_TOKENS - 1  # generated tokens a bad word's prefix can span


class SlotSampling(NamedTuple):
    """Per-request sampling state; scalars in a Prefix, [slots, ...] in the decode state."""

    key: jax.Array  # uint32 [2] PRNG key of the request's seed
    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32
    max_tokens: jax.Array  # int32
    stop_ids: jax.Array  # int32 [MAX_STOP_IDS], -1 padded
    logprobs: jax.Array  # bool: the request wants its tokens' logprobs
    lora_slot: jax.Array  # int32: the device slot of the request's LoRA adapter (0: none)
    # logit processing (serving.engine.penalties)
    presence_penalty: jax.Array  # float32
    frequency_penalty: jax.Array  # float32
    repetition_penalty: jax.Array  # float32
    min_p: jax.Array  # float32
    min_tokens: jax.Array  # int32
    bias_ids: jax.Array  # int32 [MAX_LOGIT_BIAS], -1 padded
    bias: jax.Array  # float32 [MAX_LOGIT_BIAS]
    bad_words: jax.Array  # int32 [MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS], each right-aligned, -1 padded


class TokenHistory(NamedTuple):
    """What the logit processing of each slot reads of its sequence so far (serving.engine.penalties)."""

    counts: jax.Array  # int32 [slots, vocab]: times each token was generated (the output only)
    prompt: jax.Array  # bool [slots, vocab]: the token is in the prompt (a final row carries it, or insert)
    recent: jax.Array  # int32 [slots, RECENT]: the last generated tokens, newest last; -2 before


class Logprobs(NamedTuple):
    """Logprobs of chosen tokens and the best alternatives: [rows] and [rows, MAX_LOGPROBS]."""

    ids: jax.Array  # int32: the chosen tokens
    chosen: jax.Array  # float32
    top_ids: jax.Array  # int32, best first
    top: jax.Array  # float32
    rank: jax.Array | None = None  # int32 [rows]: 1 + the tokens likelier than the chosen one


class Prefix(NamedTuple):
    """A whole prompt's prefill (JetStream's prefix): its KV and its first tokens, for `insert`."""

    kv: KVCache  # float [layers, 1, bucket, kv_heads, head_dim]
    length: jax.Array  # int32: true prompt length
    first_tokens: jax.Array  # int32 [choices]
    keys: jax.Array  # uint32 [choices, 2]: each choice's PRNG key
    sampling: SlotSampling  # the request's (its key unused: `keys`)
    first_logprobs: Logprobs | None  # [choices, ...] when the request wants logprobs
    prompt_logprobs: Logprobs | None  # [bucket - 1, ...]: token i + 1 given tokens 0..i
    prompt_seen: jax.Array  # bool [vocab]: the prompt's tokens (the repetition penalty's)


class DecodeState(NamedTuple):
    """Every slot's sequence: free, being prefilled in chunks (inactive, its position parked at
    max_target_length - 1; a generate call writes an inactive row's token into the scratch page),
    or active. Its positions live in the pages its block table names (serving.models.cache); the
    scheduler decides the tables, the executor writes them here before each turn's calls."""

    cache: KVCache  # the page pool [layers, num_pages, page_size, kv_heads, head_dim]
    pages: jax.Array  # int32 [slots, max_pages]: each slot's block table (0: the scratch page)
    tokens: jax.Array  # int32 [slots]: last token, fed at the next step
    positions: jax.Array  # int32 [slots]: where `tokens` is written at the next step
    generated: jax.Array  # int32 [slots]: tokens produced so far (the first one included)
    active: jax.Array  # bool [slots]
    sampling: SlotSampling  # [slots, ...]
    history: TokenHistory  # [slots, ...]


def is_stop(token: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Whether each token is one of its row's stop ids ([..., MAX_STOP_IDS], -1 padded)."""
    return jnp.any(token[..., None] == stop_ids, axis=-1)


def host_key(seed: int) -> np.ndarray:
    """jax.random.PRNGKey(seed) (threefry, 32-bit seeds: [0, seed mod 2**32]) made on the host:
    JAX's own runs a program on the device and reads it back, a round trip a request (1.4 ms on a
    TPU: 64 requests admitted at once left the chip idle for 90 ms)."""
    return np.array([0, seed % (1 << 32)], np.uint32)


def slot_sampling(sampling: SamplingParams) -> SlotSampling:
    """A request's sampling state as host arrays (its key: PRNGKey(seed))."""
    stop = np.full((MAX_STOP_IDS,), -1, np.int32)
    stop[: len(sampling.stop_ids)] = sampling.stop_ids
    bias_ids = np.full((MAX_LOGIT_BIAS,), -1, np.int32)
    bias = np.zeros((MAX_LOGIT_BIAS,), np.float32)
    for i, (token, value) in enumerate(sampling.logit_bias):
        bias_ids[i], bias[i] = token, value
    words = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -1, np.int32)
    for i, word in enumerate(sampling.bad_words):
        words[i, MAX_BAD_WORD_TOKENS - len(word) :] = word
    return SlotSampling(
        key=host_key(sampling.seed),
        temperature=np.float32(sampling.temperature),
        top_k=np.int32(sampling.top_k),
        top_p=np.float32(sampling.top_p),
        max_tokens=np.int32(sampling.max_tokens),
        stop_ids=stop,
        logprobs=np.bool_(sampling.wants_logprobs),
        lora_slot=np.int32(sampling.lora_slot),
        presence_penalty=np.float32(sampling.presence_penalty),
        frequency_penalty=np.float32(sampling.frequency_penalty),
        repetition_penalty=np.float32(sampling.repetition_penalty),
        min_p=np.float32(sampling.min_p),
        min_tokens=np.int32(sampling.min_tokens),
        bias_ids=bias_ids,
        bias=bias,
        bad_words=words,
    )


def stacked_sampling(samplings: list[SamplingParams], rows: int) -> SlotSampling:
    """[rows, ...] host arrays of `samplings`, padded with greedy max_tokens=1 rows."""
    pad = SamplingParams(max_tokens=1)
    each = [slot_sampling(s) for s in samplings] + [slot_sampling(pad)] * (rows - len(samplings))
    return SlotSampling(*(np.stack(field) for field in zip(*each, strict=True)))


def host_logprobs(lp: Logprobs) -> list[TokenLogprob]:
    """Host copies ([rows] numpy) as one TokenLogprob per row."""
    ranks = [None] * len(lp.ids) if lp.rank is None else [int(r) for r in lp.rank]
    return [
        TokenLogprob(int(t), float(c), tuple(zip(ids.tolist(), top.tolist(), strict=True)), rank)
        for t, c, ids, top, rank in zip(lp.ids, lp.chosen, lp.top_ids, lp.top, ranks, strict=True)
    ]
