"""The model's door to compute: the few ops the forward pass calls, and their plain-JAX versions.

The model (serving.models.llama) calls `ops.matmul`, `ops.matmuls`, `ops.decode_attention`,
`ops.chunk_attention`, `ops.split_layers` and `ops.counting` on an `Ops` it is handed; it never names a backend. `XlaOps` is the default:
ordinary jnp / lax code that XLA compiles for any device. A backend with kernels of its own
(serving.kernels.backend) subclasses it, overrides what it speeds up, and brings its own weight
layout (its `prepare` packs the params; the ops recognise the packed weights).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from serving.models.cache import KVCache, read_layer_scaled
from serving.models.config import ModelConfig
from serving.models.layers import attention, attention_with_new_token, matmul
from serving.models.quantization import QuantizedWeight, int8_dot


class Int8Matmul(Protocol):
    """A kernel for weight-only int8 matmuls (serving.kernels.int8_matmul.Int8MatmulKernel)."""

    def serves(self, x: jax.Array, values: jax.Array, transposed: bool = False, out_dtype=None) -> bool:
        """Whether it takes x [..., K] against values [(layers,) K, N] int8 ([N, K] `transposed`)."""

    def __call__(
        self, x: jax.Array, values: jax.Array, scales: jax.Array, layer: jax.Array | int = 0, transposed: bool = False,
        out_dtype=None,
    ) -> jax.Array:
        """x @ (values * scales) in `out_dtype` (default x's; of layer `layer` of a stack;
        `transposed`: values [N, K], scales [1, N])."""


class StackedWeight(NamedTuple):
    """Layer `index` of a stack of int8 weights (values [layers, K, N]), read in place by a
    kernel that takes the index (`TpuXlaOps.split_layers`)."""

    stack: QuantizedWeight
    index: jax.Array | int

    def layer(self) -> QuantizedWeight:
        """The layer's own weight, sliced out (XLA fuses the slice into its dot)."""
        return QuantizedWeight(self.stack.values[self.index], self.stack.scales[self.index], self.stack.activations)


class XlaOps:
    """Plain JAX: XLA's dots and attention. Stateless; one instance serves every model."""

    name = "xla"
    # How the KV pool is stored (serving.models.cache): "tokens", or "lanes" where the TPU's tiling
    # of an array's two minor dimensions wants kv_heads x head_dim merged (`TpuXlaOps`).
    pool_layout = "tokens"
    # The compiled shapes' ladders: prefill lengths from `min_prefill_bucket`, attention windows
    # from `min_window`, each the last times `shape_growth` (serving.engine.limits). A CPU pays for
    # every padded row and little per program; a TPU the other way round (TpuXlaOps).
    min_prefill_bucket = 16
    min_window = 128
    shape_growth = 2
    # The prefill lengths' own growth (0: shape_growth's), where padding a prompt costs more than
    # a program (RaggedPagedOps).
    length_growth = 0
    # Chunk attention reads each row's cached positions in place too (with `reads_cache_in_place`):
    # then chunks after cached positions compile for one history window, not the ladder's.
    chunks_in_place = False

    def matmul(self, x: jax.Array, w) -> jax.Array:
        """x [..., in] @ w [in, out], in x's dtype (w float or a QuantizedWeight)."""
        return matmul(x, w)

    def matmuls(self, x: jax.Array, layer: dict, names: tuple[str, ...]) -> tuple[jax.Array, ...]:
        """x @ layer[name] for each name: matmuls that share their input (q/k/v, gate/up)."""
        return tuple(self.matmul(x, layer[name]) for name in names)

    def tied_head(self, x: jax.Array, table) -> jax.Array:
        """The LM head of a tied embedding: x [..., embed] @ table [vocab, embed] transposed (float
        or a QuantizedWeight, its per-row scales the per-vocab output scales); float32 logits."""
        if isinstance(table, QuantizedWeight) and table.activations:
            return int8_dot(x, table.values, table.scales[:, 0], transposed=True)
        if isinstance(table, QuantizedWeight):
            out = jnp.matmul(x, table.values.astype(x.dtype).T, preferred_element_type=jnp.float32)
            return out * table.scales[:, 0]
        return jnp.matmul(x, table.astype(x.dtype).T, preferred_element_type=jnp.float32)

    def decode_attention(
        self,
        q: jax.Array,
        cache: KVCache,
        layer: jax.Array | int,
        positions: jax.Array,
        k_new: jax.Array,
        v_new: jax.Array,
        window: int,
        pages: jax.Array,
    ) -> jax.Array:
        """One decode step's attention: q [batch, 1, kv_heads, groups, head_dim] over layer `layer`
        of the page pool (serving.models.cache), row b at its positions [0, positions[b]) (all below
        `window`) through its block table pages[b] ([batch, max_pages]), then the token's own
        k_new, v_new [batch, kv_heads, head_dim]. Returns [batch, 1, kv_heads, groups, head_dim]."""
        keys, values, scales = read_layer_scaled(cache, layer, q.dtype, window, pages, q.shape[2])
        earlier = (jnp.arange(window)[None, :] < positions[:, None])[:, None, :]  # [batch, 1, window]
        return attention_with_new_token(q, keys, values, earlier, k_new, v_new, scales)

    def chunk_attention(
        self,
        q: jax.Array,
        cache: KVCache,
        layer: jax.Array | int,
        starts: jax.Array,
        k_new: jax.Array,
        v_new: jax.Array,
        mask: jax.Array,
        window: int,
        pages: jax.Array,
        lengths: jax.Array,
    ) -> jax.Array:
        """Attention of a call with several positions per row (a prompt's chunk after its cached
        positions, speculative verify): q [batch, seq, kv_heads, groups, head_dim] over layer
        `layer` of the page pool, row b's cached positions [0, starts[b]) (all below `window`)
        through its block table pages[b], then the call's own k_new, v_new [batch, seq, kv_heads,
        head_dim]. mask [batch, seq, window + seq]: what each query may attend to (the cached
        positions before starts[b], then causal over the call's own up to its row's true length);
        a backend reading the cache in place computes the same for every query position below
        its row's true length, lengths[b] [batch], and may skip the rest (a chunk's padding),
        returning zeros there instead of this method's values: callers read only the positions
        below each row's length. Returns [batch, seq, kv_heads, groups, head_dim]."""
        old_k, old_v, scales = read_layer_scaled(cache, layer, q.dtype, window, pages, q.shape[2])
        keys = jnp.concatenate([old_k, k_new.astype(q.dtype)], axis=1)
        values = jnp.concatenate([old_v, v_new.astype(q.dtype)], axis=1)
        if scales is not None:  # the call's own k_new, v_new are float: a scale of 1
            ones = jnp.ones((*k_new.shape[:3],), jnp.float32)
            scales = tuple(jnp.concatenate([s, ones], axis=1) for s in scales)
        return attention(q, keys, values, mask, scales)

    def counting(self, counts: jax.Array, span: int) -> XlaOps:
        """These ops for a forward pass whose activations [groups, span, ...] count only each
        group's first counts[g] rows (int32 [groups]): a prompt chunk's true lengths (span: the
        bucket), or a decode call's active rows (1 or 0, span 1). A backend may skip the other rows'
        matmuls and return anything there (callers read only the rows that count; the CPU kernels
        give zeros, their AMX handlers the rows computed); XLA's computes them, as it must compute
        a fixed shape: it returns itself."""
        return self

    def reads_cache_in_place(self, cfg: ModelConfig, cache_dtype: jnp.dtype, dtype: jnp.dtype) -> bool:
        """Whether decode attention reads each row's own positions (then the `window` is unused
        and one window, the whole cache, is all the engine compiles)."""
        return False

    def serves(self, cfg: ModelConfig, quantized_kv: bool, cache_dtype: jnp.dtype, page_size: int) -> bool:
        """Whether this backend's kernels serve `cfg`'s shapes (a refusal logs why; the engine
        then selects without them: serving.engine.engine.model_ops). XLA's serves every shape."""
        return True

    def split_layers(self, layers: dict) -> tuple[dict, dict]:
        """Stacked layer params as (sliced per layer by the layer loop, read in place by index).

        XLA's weights are all sliced; a backend whose kernels take a layer index keeps its packed
        weights whole (a slice would copy each one out of the stack)."""
        return layers, {}

    def at_layer(self, in_place: dict, index: jax.Array | int) -> dict:
        """The in-place weights of `split_layers` as layer `index` reads them."""
        return in_place

    def prepare(self, params: dict) -> dict:
        """params (already placed on devices) in this backend's layout: XLA takes them as they are."""
        return params

    def describe(self) -> str:
        return "XLA's dots and attention"


class TpuXlaOps(XlaOps):
    """XLA's ops on TPUs, over a KV pool in the lanes layout (serving.models.cache): its decode
    attention gathers each call's window of pages, and no program relays the pool out."""

    name = "xla-tpu"
    pool_layout = "lanes"
    # Few programs, each compiled for a v5e in 3-7 s (one per shape, before ready), at shapes the
    # MXU takes whole (128 rows); padding a prompt to 4x costs far less than a program.
    min_prefill_bucket = 128
    min_window = 512
    shape_growth = 4

    def __init__(self, int8_matmul: Int8Matmul | None = None):
        """`int8_matmul`: a kernel for the weight-only int8 (int8w) matmuls it serves (None: XLA's
        dot of the converted weight for all); a layer loop's int8w weights then stay whole, each
        layer's read in place by the kernel (`split_layers`)."""
        self.int8_matmul = int8_matmul

    def matmul(self, x: jax.Array, w) -> jax.Array:
        kernel = self.int8_matmul
        if isinstance(w, StackedWeight):
            if kernel is not None and kernel.serves(x, w.stack.values):
                return kernel(x, w.stack.values, w.stack.scales, w.index)
            return super().matmul(x, w.layer())
        if kernel is not None and _weight_only(w) and kernel.serves(x, w.values):
            return kernel(x, w.values, w.scales)
        return super().matmul(x, w)

    def tied_head(self, x: jax.Array, table) -> jax.Array:
        kernel = self.int8_matmul
        if kernel is not None and _weight_only(table) and kernel.serves(x, table.values, True, jnp.float32):
            scales = table.scales.reshape(1, -1)  # [vocab, 1]: one per output, as the kernel takes them
            return kernel(x, table.values, scales, transposed=True, out_dtype=jnp.float32)  # float32 logits
        return super().tied_head(x, table)

    def split_layers(self, layers: dict) -> tuple[dict, dict]:
        if self.int8_matmul is None:
            return layers, {}
        in_place = {name: w for name, w in layers.items() if _weight_only(w)}
        return {name: w for name, w in layers.items() if name not in in_place}, in_place

    def at_layer(self, in_place: dict, index: jax.Array | int) -> dict:
        return {name: StackedWeight(w, index) for name, w in in_place.items()}

    def describe(self) -> str:
        matmuls = ", int8w matmuls through pathserve's Pallas kernel" if self.int8_matmul is not None else ""
        return f"XLA's dots and attention over a lanes-layout page pool (TPU){matmuls}"


def _weight_only(w) -> bool:
    """An int8 weight dequantized for its matmul (int8w), not W8A8's (activations quantized too)."""
    return isinstance(w, QuantizedWeight) and not w.activations


XLA = XlaOps()
TPU_XLA = TpuXlaOps()
