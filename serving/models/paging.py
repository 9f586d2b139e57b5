"""Block-table arithmetic of the paged KV cache (serving.models.cache), without JAX: how many pages
hold a sequence, and the tables of a pool in which every row owns its own pages."""

from __future__ import annotations

import numpy as np

SCRATCH_PAGE = 0  # no sequence keeps anything here; unused table entries point at it


def pages_for(length: int, page_size: int) -> int:
    """Pages that hold `length` positions."""
    return -(-length // page_size)


def dedicated_pages(batch: int, length: int, page_size: int) -> np.ndarray:
    """int32 [batch, pages_for(length)]: row b owns pages 1 + b * n .. (n per row), as a pool of
    1 + batch * n pages lays them out (a contiguous cache's arrangement)."""
    n = pages_for(length, page_size)
    return (1 + np.arange(batch * n, dtype=np.int32)).reshape(batch, n)
