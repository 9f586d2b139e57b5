"""$PATHSERVE_HOME: where pathserve keeps what it builds once per machine (default checkpoint, kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def pathserve_home() -> Path:
    return Path(os.environ.get("PATHSERVE_HOME") or Path.home() / ".cache" / "pathserve")
