"""Continuous batching over one engine: admission, the device loop, and per-request streams.

Names load lazily, so that `serving.orchestrator.metrics` can be read by the HTTP layer without JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    name: "serving.orchestrator.orchestrator"
    for name in ("Completion", "Delta", "Orchestrator", "RequestHandle")
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serving.orchestrator' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
