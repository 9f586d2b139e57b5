"""The engine: JetStream's contract (prefill, insert, generate over decode slots) on a device mesh.

Names load lazily, so that plain-Python parts (`serving.engine.limits`) can be read without JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {name: "serving.engine.engine" for name in ("DecodeState", "Engine", "Prefix", "ResultTokens")}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serving.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
