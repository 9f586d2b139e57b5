"""Llama-family forward pass: `prefill` over a padded prompt and a one-token `decode_step`.

Params pytree (layers stacked on a leading axis so they can run under `lax.scan`):

    embed        [vocab, embed]
    layers/      attn_norm [layers, embed]
                 wq [layers, embed, heads * head_dim]    wk, wv [layers, embed, kv_heads * head_dim]
                 wo [layers, heads * head_dim, embed]
                 mlp_norm [layers, embed]
                 w_gate, w_up [layers, embed, mlp]       w_down [layers, mlp, embed]
    final_norm   [embed]
    lm_head      [embed, vocab]   (absent when the embedding is tied)

Any matmul weight, and the embedding, may be a `QuantizedWeight` instead of a float array. Every
matmul and decode attention goes through the ops the caller hands in (`serving.models.ops.XlaOps` by
default, or a backend's subclass), so a backend with its own weight layout plugs in without this
file naming it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from serving.models.cache import KVCache, quantize_kv, write_new_tokens
from serving.models.config import ModelConfig
from serving.models.layers import apply_rope, attention, rms_norm, rope_frequencies, rope_tables
from serving.models.lora import LoraBatch, LoraLayer
from serving.models.ops import XLA, XlaOps
from serving.models.params import LAYER_MATMULS, param_shapes
from serving.models.quantization import QuantizedWeight


def init_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> dict:
    """Random params with the shapes of `cfg` (for tests and benchmarks)."""
    shapes = param_shapes(cfg)
    n = cfg.num_layers
    keys = jax.random.split(key, len(LAYER_MATMULS) + 2)
    layers = {
        name: (jax.random.normal(k, (n, *shapes[name]), jnp.float32) * shapes[name][0] ** -0.5).astype(dtype)
        for k, name in zip(keys, LAYER_MATMULS, strict=False)
    }
    layers["attn_norm"] = jnp.ones((n, *shapes["attn_norm"]), dtype)
    layers["mlp_norm"] = jnp.ones((n, *shapes["mlp_norm"]), dtype)
    params = {
        "embed": jax.random.normal(keys[-2], shapes["embed"], jnp.float32).astype(dtype),
        "layers": layers,
        "final_norm": jnp.ones(shapes["final_norm"], dtype),
    }
    if "lm_head" in shapes:
        params["lm_head"] = (jax.random.normal(keys[-1], shapes["lm_head"]) * cfg.embed_dim**-0.5).astype(dtype)
    return params


def _project_qkv(
    cfg: ModelConfig,
    ops: XlaOps,
    layer: dict,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    lora: LoraLayer | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [batch, seq, kv_heads, groups, head_dim]; k, v [batch, seq, kv_heads, head_dim]."""
    batch, seq, _ = x.shape
    h = rms_norm(x, layer["attn_norm"], cfg.norm_eps)
    q, k, v = _matmuls(ops, h, layer, ("wq", "wk", "wv"), lora)
    q = q.reshape(batch, seq, cfg.num_heads, cfg.head_dim)
    k = k.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(batch, seq, cfg.num_kv_heads, cfg.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q.reshape(batch, seq, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim), k, v


def _attention_out_and_mlp(
    cfg: ModelConfig, ops: XlaOps, layer: dict, x: jax.Array, attn: jax.Array, lora: LoraLayer | None = None
) -> jax.Array:
    """Residual output projection, then the residual SwiGLU MLP. x [batch, seq, embed]."""
    batch, seq, _ = x.shape
    (out,) = _matmuls(ops, attn.reshape(batch, seq, cfg.num_heads * cfg.head_dim), layer, ("wo",), lora)
    x = x + out
    h = rms_norm(x, layer["mlp_norm"], cfg.norm_eps)
    gate, up = _matmuls(ops, h, layer, ("w_gate", "w_up"), lora)
    (down,) = _matmuls(ops, jax.nn.silu(gate) * up, layer, ("w_down",), lora)
    return x + down


def _matmuls(ops: XlaOps, x: jax.Array, layer: dict, names: tuple[str, ...], lora: LoraLayer | None):
    """x @ layer[name] for each name, through the backend's ops, plus each row's LoRA delta."""
    outs = ops.matmuls(x, layer, names) if len(names) > 1 else (ops.matmul(x, layer[names[0]]),)
    return outs if lora is None else lora.add(x, outs, names)


def _run_layers(
    body: Callable, carry, layers: dict | list[dict], num_layers: int, scan_layers: bool, ops: XlaOps
):
    """Apply body(carry, (layer, index)) -> (carry, out) over the layers.

    `layers` is stacked (a dict of [layers, ...] arrays) or a list of per-layer dicts (see
    `unstack_layers`). A list is unrolled; a stacked dict is scanned, or, with scan_layers=False,
    unrolled with a slice per layer (each slice is a copy: unstack the params instead).
    """
    if isinstance(layers, list):
        outs = []
        for i, layer in enumerate(layers):
            carry, out = body(carry, (layer, i))
            outs.append(out)
        return carry, _stack_outputs(outs)
    sliced, in_place = ops.split_layers(layers)  # weights a backend reads by layer index stay whole

    def step(carry, layer_and_index):
        layer, index = layer_and_index
        return body(carry, ({**layer, **ops.at_layer(in_place, index)}, index))

    xs = (sliced, jnp.arange(num_layers))
    if scan_layers:
        return jax.lax.scan(step, carry, xs)
    outs = []
    for i in range(num_layers):
        carry, out = step(carry, jax.tree.map(lambda a, i=i: a[i], xs))
        outs.append(out)
    return carry, _stack_outputs(outs)


def _stack_outputs(outs: list):
    return jax.tree.map(lambda *a: jnp.stack(a), *outs) if outs[0] is not None else None


def unstack_layers(params: dict) -> dict:
    """params with `layers` as a list of per-layer dicts instead of stacked arrays.

    Why: inside a scan (or an unrolled loop over stacked arrays) XLA:CPU copies each layer's weight
    slice before its dot; per-layer arrays are read in place (SmolLM2 float32 with XLA's dots:
    19 -> 27 tok/s at batch 1, but 205 -> 171 at batch 32). A backend whose kernels take a layer
    index reads stacked layers in place anyway. The price is a layer loop unrolled at compile time.
    """
    layers = params["layers"]
    if isinstance(layers, list):
        return params
    count = jax.tree.leaves(layers)[0].shape[0]
    split = [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(count)]
    return {**params, "layers": split}


def _embed(params: dict, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Token embeddings [..., embed] in the compute dtype."""
    table = params["embed"]
    if isinstance(table, QuantizedWeight):
        return table.values[tokens].astype(dtype) * table.scales[tokens].astype(dtype)
    return table[tokens].astype(dtype)


def _logits(params: dict, cfg: ModelConfig, x: jax.Array, ops: XlaOps) -> jax.Array:
    """Final norm and LM head; float32 logits [..., vocab]."""
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    if "lm_head" in params:  # untied, or a backend's layout gave the tied embedding a head of its own
        return ops.matmul(x, params["lm_head"]).astype(jnp.float32)
    return ops.tied_head(x, params["embed"])


def prefill(
    params: dict,
    tokens: jax.Array,
    true_lengths: jax.Array,
    cfg: ModelConfig,
    scan_layers: bool = True,
    dtype: jnp.dtype = jnp.float32,
    ops: XlaOps = XLA,
    starts: jax.Array | None = None,
    cache: KVCache | None = None,
    pages: jax.Array | None = None,
    window: int = 0,
    quantized_kv: bool = False,
    lora: LoraBatch | None = None,
    kv_scale_per_head: bool = True,
    last: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Run a padded prompt, or a chunk of one, for every row (row b with the LoRA adapter of slot
    lora.rows[b], serving.models.lora; without `lora`, the base model).

    tokens [batch, seq] (padded), true_lengths [batch] (the tokens of each row that count).
    Without `starts` the rows start at position 0. With them, row b's tokens sit at positions
    starts[b] + 0..seq-1 and also attend to its cached positions [0, starts[b]) (all below
    `window`) in the page pool `cache` (float, or int8 with scales) through its block table
    pages[b] ([batch, max_pages]), read layer by layer by `ops.chunk_attention` (in place where
    the backend can). `quantized_kv`: attend to the chunk's keys and values as an int8 cache
    will hold them, its scales per token and head or (not `kv_scale_per_head`) per token (so that a
    prompt reads the same numbers whether prefilled whole, in chunks or from cached pages).

    Returns logits [batch, seq, vocab] (rows past a sequence's true length are meaningless), or
    with `last` [batch] only row b's at position last[b], [batch, vocab] (the LM head, a vocabulary
    wide, then runs on one position per row: a 32-token chunk of SmolLM2 spent ~1.8 GFLOP on the
    31 it threw away); and the chunk's float KV [layers, batch, seq, kv_heads, head_dim].
    """
    batch, seq = tokens.shape
    ops = ops.counting(true_lengths, seq)  # a backend may skip the padding's matmuls
    x = _embed(params, tokens, dtype)
    offsets = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    positions = offsets if starts is None else offsets + starts[:, None]
    cos, sin = rope_tables(positions, rope_frequencies(cfg))
    causal = offsets[:, :, None] >= offsets[:, None, :]
    mask = causal & (offsets[:, None, :] < true_lengths[:, None, None])  # [batch, seq, seq]
    if cache is not None:
        earlier = jnp.arange(window)[None, None, :] < starts[:, None, None]  # [batch, 1, window]
        mask = jnp.concatenate([jnp.broadcast_to(earlier, (batch, seq, window)), mask], axis=-1)

    def body(x, layer_and_index):
        layer, index = layer_and_index
        adapters = None if lora is None else lora.at_layer(index)
        q, k, v = _project_qkv(cfg, ops, layer, x, cos, sin, adapters)
        keys, values = k, v
        if quantized_kv:
            (kq, ks), (vq, vs) = quantize_kv(k, kv_scale_per_head), quantize_kv(v, kv_scale_per_head)
            keys, values = kq.astype(k.dtype) * ks.astype(k.dtype), vq.astype(v.dtype) * vs.astype(v.dtype)
        if cache is not None:
            out = ops.chunk_attention(q, cache, index, starts, keys, values, mask, window, pages, true_lengths)
        else:
            out = attention(q, keys, values, mask)
        return _attention_out_and_mlp(cfg, ops, layer, x, out, adapters), (k, v)

    x, (ks, vs) = _run_layers(body, x, params["layers"], cfg.num_layers, scan_layers, ops)
    if last is not None:
        x = x[jnp.arange(batch), last]  # [batch, dim]
    return _logits(params, cfg, x, ops), KVCache(ks, vs)


def decode_step(
    params: dict,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: ModelConfig,
    scan_layers: bool = True,
    dtype: jnp.dtype = jnp.float32,
    window: int | None = None,
    ops: XlaOps = XLA,
    lora: LoraBatch | None = None,
    *,
    pages: jax.Array,
    write_pages: jax.Array | None = None,
    active: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Advance every row by one token (each with its LoRA adapter of `lora`, as `prefill`).

    `cache` is the page pool (serving.models.cache); row b's block table is pages[b]
    ([batch, max_pages]). tokens [batch] attend to their rows' entries before their positions
    [batch] and to themselves, then are written at those positions through `write_pages` (default
    `pages`; a row that must write nowhere points at the scratch page). Returns logits
    [batch, vocab] and the updated cache. Only the first `window` positions are read (every row's
    position must be below it): decode cost follows the longest live sequence, not
    max_target_length.

    The cache is read-only inside the layer loop and written once after it, so the loop never
    carries (and copies) the whole cache from layer to layer. `active` [batch] (bool): the rows
    whose results are read; a backend may skip the others' matmuls (`XlaOps.counting`) and return
    anything for them.
    """
    if active is not None:
        ops = ops.counting(active.astype(jnp.int32), 1)
    x = _embed(params, tokens, dtype)[:, None, :]  # [batch, 1, embed]
    cos, sin = rope_tables(positions[:, None], rope_frequencies(cfg))
    capacity = pages.shape[1] * cache.k.shape[2]
    window = capacity if window is None else min(window, capacity)

    def body(x, layer_and_index):
        layer, index = layer_and_index
        adapters = None if lora is None else lora.at_layer(index)
        q, k, v = _project_qkv(cfg, ops, layer, x, cos, sin, adapters)
        k, v = k[:, 0], v[:, 0]  # [batch, kv_heads, head_dim]
        if cache.quantized:  # attend to the token as the cache will hold it
            per_head = cache.scale_per_head
            (kq, ks), (vq, vs) = quantize_kv(k, per_head), quantize_kv(v, per_head)
            stored = KVCache(kq, vq, ks, vs)
            k, v = kq.astype(dtype) * ks.astype(dtype), vq.astype(dtype) * vs.astype(dtype)
        else:
            stored = KVCache(k, v)
        out = ops.decode_attention(q, cache, index, positions, k, v, window, pages)
        return _attention_out_and_mlp(cfg, ops, layer, x, out, adapters), stored

    x, new = _run_layers(body, x, params["layers"], cfg.num_layers, scan_layers, ops)
    write_pages = pages if write_pages is None else write_pages
    return _logits(params, cfg, x[:, 0], ops), write_new_tokens(cache, positions, new, write_pages)
