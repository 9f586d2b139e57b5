"""Partition specs over the (fsdp, autoregressive, tensor) mesh.

Weights shard over `tensor` along heads / MLP hidden (and over `fsdp` along the other matrix axis);
decode slots shard over `autoregressive`; the KV cache shards its kv heads over `tensor` when they
divide evenly and is replicated across `tensor` otherwise.
"""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from serving.models.config import ModelConfig
from serving.models.quantization import QuantizedWeight

log = logging.getLogger(__name__)

COLUMN = {"wq", "wk", "wv", "w_gate", "w_up", "lm_head"}  # [.., in, out]: out over tensor
ROW = {"wo", "w_down"}  # [.., in, out]: in over tensor


def _weight_spec(name: str, stacked: bool, is_scales: bool) -> P:
    lead = (None,) if stacked else ()
    if name == "embed":  # [vocab, embed] (scales [vocab, 1])
        return P(None, None) if is_scales else P("fsdp", "tensor")
    if name in COLUMN:
        return P(*lead, None, "tensor") if is_scales else P(*lead, "fsdp", "tensor")
    if name in ROW:
        return P(*lead, None, "fsdp") if is_scales else P(*lead, "tensor", "fsdp")
    return P(*lead, None)  # norms


def param_shardings(params: dict, mesh: Mesh) -> dict:
    """NamedShardings with the params pytree's structure (QuantizedWeight leaves included)."""

    def visit(tree: dict, stacked: bool) -> dict:
        out = {}
        for name, value in tree.items():
            if isinstance(value, dict):
                out[name] = visit(value, stacked=name == "layers")
            elif isinstance(value, QuantizedWeight):
                out[name] = QuantizedWeight(
                    values=NamedSharding(mesh, _weight_spec(name, stacked, False)),
                    scales=NamedSharding(mesh, _weight_spec(name, stacked, True)),
                    activations=value.activations,
                )
            else:
                out[name] = NamedSharding(mesh, _weight_spec(name, stacked, False))
        return out

    return visit(params, stacked=False)


def kv_heads_axis(cfg: ModelConfig, mesh: Mesh) -> str | None:
    tp = mesh.shape["tensor"]
    if tp > 1 and cfg.num_kv_heads % tp:
        log.info(
            "%d kv heads over tensor parallelism %d: the KV cache is replicated across 'tensor'",
            cfg.num_kv_heads,
            tp,
        )
        return None
    return "tensor"


def cache_spec(cfg: ModelConfig, mesh: Mesh, scales: bool = False) -> P:
    """[layers, slots, cache, kv_heads, head_dim] (scales: [..., 1])."""
    return P(None, "autoregressive", None, kv_heads_axis(cfg, mesh), None)


def slots_spec() -> P:
    return P("autoregressive")


def shard(tree, shardings):
    return jax.device_put(tree, shardings)
