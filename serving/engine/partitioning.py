"""Where every params leaf and KV-cache leaf lives on the (fsdp, autoregressive, tensor) mesh.

The one statement of the placement, in plain Python (no JAX): the engine turns these specs into
`NamedSharding`s (serving.engine.sharding) and `pathserve deploy plan` sums bytes per chip from the
same shapes and specs, so the plan cannot drift from what the engine places.

The meaning of the axes is MaxText's, from the logical axis rules of its `base.yml` and inference
configs (our mesh has only three of its axes; the others are size 1 there):

    logical dim      mesh axes                  leaves
    heads            (tensor, autoregressive)   wq's out, wo's in
    kv_heads         (tensor, autoregressive)   wk's and wv's out
    mlp              (tensor, autoregressive)   w_gate's and w_up's out, w_down's in
    vocab            (tensor, autoregressive)   the embedding's rows, lm_head's out
    embed            (fsdp,)                    the other side of every matmul and the embedding
    cache_heads      (autoregressive, tensor)   the KV cache's kv_heads
    (not sharded)                               layers, the cache's slots, positions and head_dim,
                                                the norms (as MaxText's 405B inference rules: norm [])

So `autoregressive` is a second model-parallel axis, not a batch axis: decode slots are not split.
int8 scales follow the dimension they scale (their size-1 axis is not sharded).

A flattened `heads * head_dim` dimension shards in whole heads. Where a dimension does not divide by
the product of its axes (8 kv heads over tensor 8 x autoregressive 2), it shards over the subset of
those axes with the largest product that divides it (tensor: 8) and is replicated over the rest
(2x); that is logged. Axes of size 1 are left out of the specs.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

from serving.models.config import ModelConfig
from serving.models.params import EMBEDDING, LAYER_KEYS, param_shapes

log = logging.getLogger(__name__)

MESH_AXES = ("fsdp", "autoregressive", "tensor")

# Logical dimension -> the mesh axes it shards over, in MaxText's order.
RULES: dict[str, tuple[str, ...]] = {
    "heads": ("tensor", "autoregressive"),
    "kv_heads": ("tensor", "autoregressive"),
    "mlp": ("tensor", "autoregressive"),
    "vocab": ("tensor", "autoregressive"),
    "embed": ("fsdp",),
    "cache_heads": ("autoregressive", "tensor"),
}

# Each matmul weight's [in, out] logical dims (see serving.models.params for the shapes).
WEIGHT_DIMS: dict[str, tuple[str, str]] = {
    "wq": ("embed", "heads"),
    "wk": ("embed", "kv_heads"),
    "wv": ("embed", "kv_heads"),
    "wo": ("heads", "embed"),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "lm_head": ("embed", "vocab"),
    EMBEDDING: ("vocab", "embed"),  # [vocab, embed]; quantized per row
}

DTYPE_BYTES = {"int8": 1, "bfloat16": 2, "float32": 4}
SCALE_DTYPE = "float32"  # int8 weights' and int8 KV's scales

Path = tuple[str, ...]
# Per dimension, the mesh axes it is split over; () = not split.
Spec = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Numerics:
    """The config keys that decide which leaves exist and their dtypes (ServingConfig's names)."""

    weight_dtype: str = "float32"
    dtype: str = "float32"
    quantization: str = ""
    quantize_kvcache: bool = False


@dataclass(frozen=True)
class Leaf:
    """One array of the params or the KV cache: its global shape, dtype and partition spec."""

    shape: tuple[int, ...]
    dtype: str
    spec: Spec

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    def ways(self, axes: Mapping[str, int]) -> int:
        """Into how many pieces the spec cuts the leaf (the mesh size over this is its copies)."""
        return math.prod(axes[a] for dim in self.spec for a in dim)

    def bytes_per_chip(self, axes: Mapping[str, int]) -> int:
        """Bytes of this leaf on every chip: its global bytes over the pieces its spec cuts."""
        return self.nbytes // self.ways(axes)


@dataclass(frozen=True)
class Placement:
    """Every params leaf (paths as in the pytree: ("layers", "wq", "values"), ...) and every KV cache
    leaf (("k",), ("k_scale",), ...) with its spec, for one config on one mesh shape."""

    axes: dict[str, int]
    params: dict[Path, Leaf]
    cache: dict[Path, Leaf]
    notes: tuple[str, ...]  # where a dimension is replicated, and why

    def params_bytes_per_chip(self) -> int:
        return sum(leaf.bytes_per_chip(self.axes) for leaf in self.params.values())

    def cache_bytes_per_chip(self) -> int:
        return sum(leaf.bytes_per_chip(self.axes) for leaf in self.cache.values())


class _Splitter:
    """Chooses the mesh axes of each logical dimension and remembers where it had to replicate."""

    def __init__(self, axes: Mapping[str, int]):
        self.axes = axes
        self.notes: dict[str, str] = {}

    def split(self, logical: str, count: int) -> tuple[str, ...]:
        """The mesh axes of `count` units (heads, rows, ...) of a `logical` dimension."""
        wanted = tuple(a for a in RULES.get(logical, ()) if self.axes[a] > 1)
        best: tuple[str, ...] = ()
        for size in range(len(wanted), 0, -1):
            for subset in itertools.combinations(wanted, size):
                product = math.prod(self.axes[a] for a in subset)
                if count % product == 0 and product > math.prod(self.axes[a] for a in best):
                    best = subset
        replication = math.prod(self.axes[a] for a in wanted) // math.prod(self.axes[a] for a in best)
        if replication > 1 and logical not in self.notes:
            self.notes[logical] = (
                f"{count} {logical} do not divide over {' x '.join(wanted)} = "
                f"{math.prod(self.axes[a] for a in wanted)}: split over {' x '.join(best) or 'nothing'}, "
                f"replicated {replication}x"
            )
        return best


def placement(
    cfg: ModelConfig, numerics: Numerics, axes: Mapping[str, int], slots: int, length: int
) -> Placement:
    """Shapes, dtypes and specs of the params (layers stacked) and of a cache of `slots` x `length`."""
    missing = [a for a in MESH_AXES if a not in axes]
    if missing:
        raise ValueError(f"mesh axes {missing} missing from {dict(axes)}")
    splitter = _Splitter(axes)
    params = _param_leaves(cfg, numerics, splitter)
    cache = _cache_leaves(cfg, numerics, splitter, slots, length)
    for note in splitter.notes.values():
        log.info("sharding: %s", note)
    return Placement(dict(axes), params, cache, tuple(splitter.notes.values()))


def _param_leaves(cfg: ModelConfig, numerics: Numerics, splitter: _Splitter) -> dict[Path, Leaf]:
    quantized = numerics.quantization == "int8"
    out: dict[Path, Leaf] = {}
    for name, shape in param_shapes(cfg).items():
        stacked = name in LAYER_KEYS
        path: Path = ("layers", name) if stacked else (name,)
        lead: tuple[int, ...] = (cfg.num_layers,) if stacked else ()
        lead_spec: Spec = ((),) * len(lead)
        if name not in WEIGHT_DIMS:  # norms
            out[path] = Leaf((*lead, *shape), numerics.weight_dtype, (*lead_spec, ()))
            continue
        d_in, d_out = (splitter.split(dim, _units(cfg, dim)) for dim in WEIGHT_DIMS[name])
        spec = (*lead_spec, d_in, d_out)
        if not quantized:
            out[path] = Leaf((*lead, *shape), numerics.weight_dtype, spec)
        elif name == EMBEDDING:  # int8 rows, one scale per row: scales [vocab, 1]
            out[(*path, "values")] = Leaf(shape, "int8", spec)
            out[(*path, "scales")] = Leaf((shape[0], 1), SCALE_DTYPE, (d_in, ()))
        else:  # int8 [..., in, out], one scale per output channel: scales [..., 1, out]
            out[(*path, "values")] = Leaf((*lead, *shape), "int8", spec)
            out[(*path, "scales")] = Leaf((*lead, 1, shape[1]), SCALE_DTYPE, (*lead_spec, (), d_out))
    return out


def _units(cfg: ModelConfig, logical: str) -> int:
    """How many whole units a logical dimension has: heads, not heads x head_dim."""
    return {
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "cache_heads": cfg.num_kv_heads,
        "mlp": cfg.mlp_dim,
        "vocab": cfg.vocab_size,
        "embed": cfg.embed_dim,
    }[logical]


def _cache_leaves(
    cfg: ModelConfig, numerics: Numerics, splitter: _Splitter, slots: int, length: int
) -> dict[Path, Leaf]:
    """[layers, slots, length, kv_heads, head_dim] keys and values (int8 ones with [..., 1] scales)."""
    spec: Spec = ((), (), (), splitter.split("cache_heads", _units(cfg, "cache_heads")), ())
    shape = (cfg.num_layers, slots, length, cfg.num_kv_heads, cfg.head_dim)
    if not numerics.quantize_kvcache:
        return {(n,): Leaf(shape, numerics.dtype, spec) for n in ("k", "v")}
    out = {(n,): Leaf(shape, "int8", spec) for n in ("k", "v")}
    out.update({(n,): Leaf((*shape[:-1], 1), SCALE_DTYPE, spec) for n in ("k_scale", "v_scale")})
    return out


def describe(spec: Spec) -> str:
    """A spec as text: `[-, tensor x autoregressive]`."""
    return "[" + ", ".join(" x ".join(dim) or "-" for dim in spec) + "]"
