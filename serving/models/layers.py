"""Building blocks of the Llama forward pass: norm, rotary embedding, matmul, attention.

Axis names used in shape comments: batch, seq (query positions), cache (key positions),
kv_heads, groups (query heads per kv head), head_dim, embed, mlp, vocab.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from serving.models.config import ModelConfig
from serving.models.quantization import QuantizedWeight, int8_dot

_NEG_INF = -1e30


def matmul(x: jax.Array, w: jax.Array | QuantizedWeight) -> jax.Array:
    """x[..., in] @ w[in, out] for a float weight or an int8 `QuantizedWeight`."""
    if isinstance(w, QuantizedWeight):
        if w.activations:
            return int8_dot(x, w.values, w.scales[0]).astype(x.dtype)
        # Dequantize inside the jit: XLA fuses the convert into the dot's operand.
        y = jnp.matmul(x, w.values.astype(x.dtype))
        return y * w.scales[0].astype(x.dtype)
    return jnp.matmul(x, w.astype(x.dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with Llama 3.1 scaling when configured."""
    exponents = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32) / cfg.head_dim
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponents)).astype(np.float32)
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = scaling.original_max_position
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [batch, seq, head_dim] for integer positions [batch, seq]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [batch, seq, heads, head_dim] (half-split convention, as in HF's Llama)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return (x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin).astype(x.dtype)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scales: tuple[jax.Array, jax.Array] | None = None
) -> jax.Array:
    """Grouped-query attention with softmax in float32.

    q: [batch, seq, kv_heads, groups, head_dim]; k, v: [batch, cache, kv_heads, head_dim];
    mask: [batch, seq, cache] (True = may attend); `scales`: int8 k and v's (k_scale, v_scale
    [batch, cache, kv_heads] float32), applied to the scores and the probabilities (see
    `_scaled`). Returns [batch, seq, kv_heads, groups, head_dim].
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("bskgd,bckd->bkgsc", q, k, preferred_element_type=jnp.float32) * scale
    scores = _scaled(scores, scales, 0)
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
    probs = _scaled(jax.nn.softmax(scores, axis=-1), scales, 1).astype(v.dtype)
    return jnp.einsum("bkgsc,bckd->bskgd", probs, v)


def _scaled(x: jax.Array, scales: tuple[jax.Array, jax.Array] | None, which: int) -> jax.Array:
    """x [batch, kv_heads, groups, seq, cache] times the cache positions' k (which 0) or v (1)
    scales [batch, cache, kv_heads]: q . (k * s) = (q . k) s, and sum p (v * s) = sum (p s) v, so
    an int8 cache's values go into the dots as they are (cast exactly) and its scales, in float32,
    multiply a tensor of the scores' size, not the cache's (whose dequantized copy XLA would
    make)."""
    if scales is None:
        return x
    return x * jnp.transpose(scales[which], (0, 2, 1))[:, :, None, None, :]


def attention_with_new_token(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    scales: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """One decode step's attention over the cache plus the token's own key and value.

    q: [batch, 1, kv_heads, groups, head_dim]; k, v: [batch, cache, kv_heads, head_dim] (positions
    before the token); mask: [batch, 1, cache]; k_new, v_new: [batch, kv_heads, head_dim]; `scales`
    as `attention`'s (k and v int8 values, k_new and v_new not).
    Same result as writing the token into the cache first and calling `attention`, without
    needing the cache written before it is read.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("bskgd,bckd->bkgsc", q, k, preferred_element_type=jnp.float32) * scale
    scores = _scaled(scores, scales, 0)
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG_INF)
    own = jnp.einsum("bskgd,bkd->bkgs", q, k_new, preferred_element_type=jnp.float32)[..., None] * scale
    top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), own)
    weights, own_weight = jnp.exp(scores - top), jnp.exp(own - top)
    total = jnp.sum(weights, axis=-1, keepdims=True) + own_weight
    probs, own_prob = _scaled(weights / total, scales, 1).astype(v.dtype), (own_weight / total).astype(v.dtype)
    return jnp.einsum("bkgsc,bckd->bskgd", probs, v) + jnp.einsum("bkgs,bkd->bskgd", own_prob[..., 0], v_new)
