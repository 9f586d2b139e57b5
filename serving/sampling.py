"""Token sampling per row: greedy, temperature, top-k and top-p, reproducible from a seed."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Pick one token per row.

    logits [batch, vocab] float32; keys [batch] PRNG keys; temperature, top_p [batch] float32;
    top_k [batch] int32. Rows with temperature 0 take the argmax. Returns [batch] int32.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # Sorting the vocabulary costs more than a decode step on CPU: skip it when every row is greedy.
    return jax.lax.cond(
        jnp.any(temperature > 0),
        lambda: jnp.where(temperature > 0, _draw(logits, keys, temperature, top_k, top_p), greedy),
        lambda: greedy,
    )


def _draw(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
    """Temperature, top-k and top-p sampling for every row."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    ranked = jnp.sort(scaled, axis=-1)[:, ::-1]  # [batch, vocab], best first
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, ranked, -jnp.inf), axis=-1)
    # Keep the smallest prefix whose probability mass reaches top_p (always the best token).
    keep = in_top_k & ((jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None])
    cutoff = jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
