"""Llama-family model as pure functions over a params pytree.

This package knows nothing of serving and names no compute backend: no engine, orchestrator, HTTP
or kernel imports (tests/unit/test_boundaries.py checks it). Its names load
lazily so that `serving.models.config` can be read (by `serving.deploy`, on a laptop) without JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelConfig": "serving.models.config",
    "RopeScaling": "serving.models.config",
    "KVCache": "serving.models.cache",
    "decode_step": "serving.models.llama",
    "init_pool": "serving.models.cache",
    "init_params": "serving.models.llama",
    "prefill": "serving.models.llama",
    "store_prefix": "serving.models.cache",
    "XLA": "serving.models.ops",
    "XlaOps": "serving.models.ops",
    "QuantizedWeight": "serving.models.quantization",
    "quantize_params": "serving.models.quantization",
    "with_int8_activations": "serving.models.quantization",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serving.models' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
