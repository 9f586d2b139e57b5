"""LoRA deltas, batched: every row of a batch applies its own adapter, never merged into the weights.

Adapters sit stacked on the device, one slot each, padded to one rank (serving.lora.stack):

    lora/<matmul>  a [layers, adapters, in, rank]    b [layers, adapters, rank, out]

for each of the layer matmuls (wq, wk, wv, wo, w_gate, w_up, w_down), the scaling (lora_alpha / r,
or rsLoRA's alpha / sqrt(r)) already folded into b. Slot 0 is all zeros: the base model. A row's
delta is (x @ a[slot]) @ b[slot], gathered per row as Punica's BGMV does; a zero-padded rank adds
nothing, so adapters of every rank share one compiled shape.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LoraBatch(NamedTuple):
    """The adapters and which one each row applies."""

    weights: dict  # name -> (a [layers, adapters, in, rank], b [layers, adapters, rank, out])
    rows: jax.Array  # int32 [batch]: each row's adapter slot (0: none)

    def at_layer(self, index: jax.Array | int) -> LoraLayer:
        return LoraLayer(jax.tree.map(lambda w: w[index], self.weights), self.rows)


class LoraLayer(NamedTuple):
    """One layer's adapters (name -> (a [adapters, in, rank], b [adapters, rank, out])) and the rows'."""

    weights: dict
    rows: jax.Array  # int32 [batch]

    def add(self, x: jax.Array, outs: tuple[jax.Array, ...], names: tuple[str, ...]) -> tuple[jax.Array, ...]:
        """outs[i] (= x @ W[names[i]], [batch, seq, out]) plus each row's delta for that matmul."""
        return tuple(self.add_one(x, out, name) for out, name in zip(outs, names, strict=True))

    def add_one(self, x: jax.Array, out: jax.Array, name: str) -> jax.Array:
        if name not in self.weights:
            return out
        a, b = self.weights[name]
        down = jnp.einsum("bsi,bir->bsr", x, a[self.rows].astype(x.dtype))  # [batch, seq, rank]
        delta = jnp.einsum("bsr,bro->bso", down, b[self.rows].astype(x.dtype))  # [batch, seq, out]
        return out + delta.astype(out.dtype)
