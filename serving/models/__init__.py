"""Llama-family model as pure functions over a params pytree.

This package knows nothing of serving: no engine, orchestrator or HTTP imports.
"""

from serving.models.config import ModelConfig, RopeScaling
from serving.models.llama import KVCache, decode_step, init_cache, init_params, prefill, store_prefix
from serving.models.quantization import QuantizedWeight, quantize_params

__all__ = [
    "KVCache",
    "ModelConfig",
    "QuantizedWeight",
    "RopeScaling",
    "decode_step",
    "init_cache",
    "init_params",
    "prefill",
    "quantize_params",
    "store_prefix",
]
