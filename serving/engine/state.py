"""The engine's device-side records: a request's sampling state, a prefill's outputs (the
prefix) and the decode state every compiled step takes and returns (shapes written down)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.limits import MAX_STOP_IDS
from serving.models import KVCache
from serving.request import SamplingParams


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


class Logprobs(NamedTuple):
    """Logprobs of chosen tokens and the best alternatives: [rows] and [rows, MAX_LOGPROBS]."""

    ids: jax.Array  # int32: the chosen tokens
    chosen: jax.Array  # float32
    top_ids: jax.Array  # int32, best first
    top: jax.Array  # float32


class Prefix(NamedTuple):
    """A whole prompt's prefill (JetStream's prefix): its KV and its first tokens, for `insert`."""

    kv: KVCache  # float [layers, 1, bucket, kv_heads, head_dim]
    length: jax.Array  # int32: true prompt length
    first_tokens: jax.Array  # int32 [choices]
    keys: jax.Array  # uint32 [choices, 2]: each choice's PRNG key
    sampling: SlotSampling  # the request's (its key unused: `keys`)
    first_logprobs: Logprobs | None  # [choices, ...] when the request wants logprobs
    prompt_logprobs: Logprobs | None  # [bucket - 1, ...]: token i + 1 given tokens 0..i


class DecodeState(NamedTuple):
    """Every slot's sequence: free, being prefilled in chunks (inactive, its position parked at
    max_target_length - 1, where a generate call's writes of an inactive row harm nothing), or
    active."""

    cache: KVCache  # [layers, slots, max_target_length, kv_heads, head_dim]
    tokens: jax.Array  # int32 [slots]: last token, fed at the next step
    positions: jax.Array  # int32 [slots]: where `tokens` is written at the next step
    generated: jax.Array  # int32 [slots]: tokens produced so far (the first one included)
    active: jax.Array  # bool [slots]
    sampling: SlotSampling  # [slots, ...]


def is_stop(token: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """Whether each token is one of its row's stop ids ([..., MAX_STOP_IDS], -1 padded)."""
    return jnp.any(token[..., None] == stop_ids, axis=-1)


def slot_sampling(sampling: SamplingParams) -> SlotSampling:
    """A request's sampling state as host arrays (its key: PRNGKey(seed))."""
    stop = np.full((MAX_STOP_IDS,), -1, np.int32)
    stop[: len(sampling.stop_ids)] = sampling.stop_ids
    return SlotSampling(
        key=np.asarray(jax.random.PRNGKey(sampling.seed)),
        temperature=np.float32(sampling.temperature),
        top_k=np.int32(sampling.top_k),
        top_p=np.float32(sampling.top_p),
        max_tokens=np.int32(sampling.max_tokens),
        stop_ids=stop,
        logprobs=np.bool_(sampling.wants_logprobs),
        lora_slot=np.int32(sampling.lora_slot),
    )


def stacked_sampling(samplings: list[SamplingParams], rows: int) -> SlotSampling:
    """[rows, ...] host arrays of `samplings`, padded with greedy max_tokens=1 rows."""
    pad = SamplingParams(max_tokens=1)
    each = [slot_sampling(s) for s in samplings] + [slot_sampling(pad)] * (rows - len(samplings))
    return SlotSampling(*(np.stack(field) for field in zip(*each, strict=True)))
