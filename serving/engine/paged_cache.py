"""The paged KV cache, a part the engine is built with: what the page pool is (its geometry from
the engine's limits, its format: the activations' dtype or int8 with scales per token and head or
per token, the backend's layout) and where it lives (the engine's placement on its mesh), and the
block tables that name each slot's pages.

- `init_pool()`: the pool, zeros (serving.models.cache.init_pool), placed;
- `default_tables()`: the tables before a scheduler sets any (JetStream's contract runs without one);
- `tables(pages)`: the scheduler's tables checked and placed (the engine's `set_pages`);
- `page_bytes`: one page's bytes on each chip (the prefix cache's metric);
- `like_pool(kv)`: shardings for the KV of some pages (a handoff's), the pool's layer and kv-head
  placement.

The format is decided once (`PoolFormat.of` the engine's config and backend), and the engine's
calls take it from here (a whole prefill's KV quantized as the pool holds it) or from the pool
they are given (`KVCache.quantized`, `scale_per_head`), not from the raw flags again.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from serving.config import EngineConfig
from serving.engine.limits import Limits
from serving.engine.partitioning import Placement
from serving.engine.sharding import cache_shardings, replicated
from serving.models.cache import KVCache, Layout, dedicated_pages, init_pool
from serving.models.config import ModelConfig


@dataclass(frozen=True)
class PoolFormat:
    """How a page pool holds its numbers: `dtype` (float pages; the activations'), or int8 with
    float32 scales per token and kv head (`scale_per_head`, kv_quant_axis=dkv) or per token
    (heads_and_dkv); `layout`, the backend's (serving.models.cache)."""

    dtype: jnp.dtype
    quantized: bool = False
    scale_per_head: bool = True
    layout: Layout = "tokens"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))  # jnp.bfloat16 and "bfloat16" alike

    @classmethod
    def of(cls, config: EngineConfig, layout: Layout) -> PoolFormat:
        """The format `config` asks for (quantize_kvcache, kv_quant_axis), in the backend's `layout`."""
        return cls(
            jnp.dtype(config.dtype), config.quantize_kvcache, config.kv_quant_axis != "heads_and_dkv", layout
        )

    @property
    def name(self) -> str:
        """int8, or the float dtype's name (the engine's summary)."""
        return "int8" if self.quantized else self.dtype.name


class PagedCache:
    """The page pool and block tables of one engine (module docstring)."""

    def __init__(self, model: ModelConfig, limits: Limits, placement: Placement, mesh: Mesh, pool: PoolFormat):
        self.model = model
        self.limits = limits
        self.placement = placement
        self.mesh = mesh
        self.format = pool

    def same_as(self, other: PagedCache) -> bool:
        """Whether `other` is this pool: the same model shape, geometry, placement, mesh and format."""
        mine = (self.model, self.limits, self.placement, self.mesh, self.format)
        return mine == (other.model, other.limits, other.placement, other.mesh, other.format)

    @property
    def shardings(self) -> KVCache:
        """Where the pool's leaves live (layers and kv heads as the placement splits them)."""
        return cache_shardings(self.mesh, self.placement)

    @property
    def tables_sharding(self) -> NamedSharding:
        """The block tables: whole on every device (slots are not split, MaxText's cache_batch)."""
        return replicated(self.mesh)

    def init_pool(self) -> KVCache:
        """The zeroed pool: [layers, pages, page_size, kv_heads, head_dim] in the format's layout."""
        limits, pool = self.limits, self.format
        return init_pool(
            self.model, limits.num_pages, limits.page_size, pool.dtype, quantized=pool.quantized,
            scale_per_head=pool.scale_per_head, layout=pool.layout,
        )

    def default_tables(self) -> np.ndarray:
        """int32 [slots, max_pages]: where the pool holds every slot's full length, slot s owns its
        own run of pages (a contiguous cache's arrangement), so the engine serves JetStream's
        prefill / insert / generate without a scheduler; otherwise every entry is the scratch page
        and `tables` (set_pages) must come first."""
        limits = self.limits
        slots = limits.max_concurrent_decodes
        if limits.num_pages < slots * limits.max_pages + 1:
            return np.zeros((slots, limits.max_pages), np.int32)
        return dedicated_pages(slots, limits.max_target_length, limits.page_size)

    def tables(self, pages: np.ndarray) -> jax.Array:
        """The block tables `pages` (int32 [slots, max_pages]; the same host values on every process
        of a slice) checked and placed; ValueError for a wrong shape or a page outside the pool."""
        pages = np.array(pages, np.int32)  # a copy: the caller's table changes, the device's must not
        expected = (self.limits.max_concurrent_decodes, self.limits.max_pages)
        if pages.shape != expected:
            raise ValueError(f"block tables of shape {pages.shape}, expected {expected}")
        if pages.min() < 0 or pages.max() >= self.limits.num_pages:
            raise ValueError(f"a block table names a page outside the pool's {self.limits.num_pages}")
        return jax.make_array_from_callback(pages.shape, self.tables_sharding, lambda index: pages[index])

    @property
    def page_bytes(self) -> int:
        """Device bytes of one page of the pool on each chip (every layer's keys, values, scales)."""
        return self.placement.cache_bytes_per_chip() // self.limits.num_pages

    def like_pool(self, kv: KVCache) -> KVCache:
        """Shardings for KV shaped [layers, n, positions, kv_heads, head_dim]: the pool's layer and
        kv-head placement, the rest unsplit."""

        def like(sharding, leaf):
            if sharding is None or leaf is None:
                return None
            spec = (*sharding.spec, *([None] * (leaf.ndim - len(sharding.spec))))
            return NamedSharding(self.mesh, P(spec[0], None, None, *spec[3:]))

        return KVCache(*map(like, self.shardings, kv))
