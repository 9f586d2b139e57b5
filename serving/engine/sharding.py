"""NamedShardings over the (fsdp, autoregressive, tensor) mesh, from serving.engine.partitioning.

The specs themselves (MaxText's meaning of the axes, where a dimension is replicated) live in
`partitioning`, without JAX, so that `pathserve deploy plan` reads the same ones; this module only
puts them on a `Mesh` and onto the params pytree and the KV cache.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from serving.engine.partitioning import Numerics, Placement, Spec, placement
from serving.models.cache import KVCache
from serving.models.config import ModelConfig
from serving.models.quantization import QuantizedWeight


def mesh_axes(mesh: Mesh) -> dict[str, int]:
    """The mesh's axis sizes by name."""
    return {name: int(size) for name, size in mesh.shape.items()}


def engine_placement(
    cfg: ModelConfig, numerics: Numerics, mesh: Mesh, num_pages: int, page_size: int
) -> Placement:
    """The partitioning of this engine's params and KV page pool on `mesh` (logs where it replicates)."""
    return placement(cfg, numerics, mesh_axes(mesh), num_pages, page_size)


def partition_spec(spec: Spec) -> P:
    """partitioning's spec as a PartitionSpec: () -> None, (a,) -> a, (a, b) -> (a, b)."""
    return P(*(None if not dim else dim[0] if len(dim) == 1 else dim for dim in spec))


def param_shardings(params: dict, mesh: Mesh, where: Placement) -> dict:
    """NamedShardings with the params pytree's structure (layers stacked, QuantizedWeight leaves
    included); a leaf the placement does not know, or of another shape, is an error."""

    def sharding(path: tuple[str, ...], value) -> NamedSharding:
        leaf = where.params.get(path)
        if leaf is None or tuple(value.shape) != leaf.shape:
            raise ValueError(
                f"params leaf {'/'.join(path)} {tuple(value.shape)} is not in the placement "
                f"({leaf.shape if leaf else 'unknown'})"
            )
        return NamedSharding(mesh, partition_spec(leaf.spec))

    def visit(tree: dict, prefix: tuple[str, ...]) -> dict:
        out = {}
        for name, value in tree.items():
            path = (*prefix, name)
            if isinstance(value, dict):
                out[name] = visit(value, path)
            elif isinstance(value, QuantizedWeight):
                out[name] = QuantizedWeight(
                    values=sharding((*path, "values"), value.values),
                    scales=sharding((*path, "scales"), value.scales),
                    activations=value.activations,
                )
            else:
                out[name] = sharding(path, value)
        return out

    return visit(params, ())


def unstacked_shardings(shardings: dict, num_layers: int) -> dict:
    """The shardings of `unstack_layers(params)`: each layer's leaves without the layers axis."""

    def drop_layers(s: NamedSharding) -> NamedSharding:
        return NamedSharding(s.mesh, P(*s.spec[1:]))

    layer = jax.tree.map(drop_layers, shardings["layers"])
    return {**shardings, "layers": [layer] * num_layers}


def cache_shardings(mesh: Mesh, where: Placement) -> KVCache:
    """KVCache of NamedShardings (None for the scales of a float cache)."""
    return KVCache(
        *(
            NamedSharding(mesh, partition_spec(where.cache[(name,)].spec)) if (name,) in where.cache else None
            for name in KVCache._fields
        )
    )


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array: the decode state's per-slot scalars (small; the cache's slots
    may still split over cache_batch's axes)."""
    return NamedSharding(mesh, P())
