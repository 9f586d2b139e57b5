"""Where every params leaf and KV-cache leaf lives on the (fsdp, autoregressive, tensor) mesh.

The one statement of the placement, in plain Python (no JAX): the engine turns these specs into
`NamedSharding`s (serving.engine.sharding) and `pathserve deploy plan` sums bytes per chip from the
same shapes and specs, so the plan cannot drift from what the engine places.

Every leaf carries MaxText's logical axis names, dimension by dimension, and the active
`logical_axis_rules` (MaxText's `base.yml` by default, a recipe file's where one is given; see
serving.maxtext_config) map them to mesh axes exactly as MaxText (Flax) does: rules are read in order, and
a rule names the mesh axes of the first dimension of its logical name not yet assigned, unless one
of those mesh axes is already taken by another dimension of the same array. The names:

    leaf                       MaxText's module               logical names
    embed [vocab, embed]       token_embedder                 vocab, embed
    wq [embed, heads*hd]       self_attention/query           embed, (q_heads, kv)
    wk, wv [embed, kv*hd]      self_attention/key, value      embed, (kv_heads, kv_head_dim)
    wo [heads*hd, embed]       self_attention/out             (heads, kv), embed
    w_gate, w_up [embed, mlp]  mlp/wi_0, wi_1                 embed, mlp
    w_down [mlp, embed]        mlp/wo                         mlp, embed
    lm_head [embed, vocab]     logits_dense                   embed_vocab, vocab
    norms [embed]              *_norm/scale                   norm
    layers axis (stacked)      scanned layers                 layers
    KV pages [layers, pages, page_size, kv_heads, head_dim] layers, cache_batch, cache_sequence,
                                                              cache_heads, cache_kv

A flattened dimension (heads x head_dim) keeps MaxText's two: its mesh axes are the heads' then the
head_dim's, which splits it in whole heads exactly as MaxText splits its [heads, head_dim] pair.
int8 scales carry their kernel's names (their size-1 contraction axis is not split);
`replicate_quant_scale` (MaxText's flag) keeps them whole on every chip. The mesh has only three of
MaxText's axes: the others are size 1, and axes of size 1 are left out of the specs.

Where a dimension does not divide by the product of its axes (8 kv heads over tensor 8 x
autoregressive 2), MaxText would fail to shard; we shard over the subset of those axes with the
largest product that divides it (tensor: 8) and replicate over the rest (2x), and log that.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from serving.maxtext_config import Rules, base_rules, normalize_rules
from serving.models.config import ModelConfig
from serving.models.params import EMBEDDING, LAYER_KEYS, int8_entries, param_shapes
from serving.quantization_mode import Quantization

log = logging.getLogger(__name__)

MESH_AXES = ("fsdp", "autoregressive", "tensor")

# A dimension of a leaf: the logical names it holds (two for a flattened heads x head_dim).
Logical = tuple[str, ...]

# Each matmul weight's [in, out] logical names (see serving.models.params for the shapes).
WEIGHT_NAMES: dict[str, tuple[Logical, Logical]] = {
    "wq": (("embed",), ("q_heads", "kv")),
    "wk": (("embed",), ("kv_heads", "kv_head_dim")),
    "wv": (("embed",), ("kv_heads", "kv_head_dim")),
    "wo": (("heads", "kv"), ("embed",)),
    "w_gate": (("embed",), ("mlp",)),
    "w_up": (("embed",), ("mlp",)),
    "w_down": (("mlp",), ("embed",)),
    "lm_head": (("embed_vocab",), ("vocab",)),
    EMBEDDING: (("vocab",), ("embed",)),  # [vocab, embed]; quantized per row
}
NORM: Logical = ("norm",)
LAYERS: Logical = ("layers",)
CACHE_NAMES: tuple[Logical, ...] = (LAYERS, ("cache_batch",), ("cache_sequence",), ("cache_heads",), ("cache_kv",))

DTYPE_BYTES = {"int8": 1, "bfloat16": 2, "float32": 4, "int32": 4}
SCALE_DTYPE = "float32"  # int8 weights' and int8 KV's scales

Path = tuple[str, ...]
# Per dimension, the mesh axes it is split over; () = not split.
Spec = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Numerics:
    """The config keys that decide which leaves exist, their dtypes and where they live
    (ServingConfig's names; `logical_axis_rules` empty: MaxText base.yml's)."""

    weight_dtype: str = "float32"
    dtype: str = "float32"
    quantization: str = ""
    quantize_kvcache: bool = False
    logical_axis_rules: Rules = ()
    replicate_quant_scale: bool = False
    # The params entries held in int8; None: those `quantization` quantizes (int8_entries). A
    # checkpoint stored in int8 says its own (a MaxText int8 checkpoint: the layers' matmuls only).
    int8: tuple[str, ...] | None = None
    kv_quant_axis: str = "dkv"  # an int8 cache's scales per token and head (dkv) or per token
    pool_layout: str = "tokens"  # how the KV pool is stored (serving.models.cache): the backend's choice

    @classmethod
    def of(cls, config: object, int8: tuple[str, ...] | None = None, pool_layout: str = "tokens") -> Numerics:
        """From a ServingConfig (its `quantization` flag) or an EngineConfig (the decided
        `Quantization`, whose int8 entries stand where `int8` is not given); `pool_layout`: the
        compute backend's (serving.models.ops.XlaOps.pool_layout)."""
        quantization = config.quantization
        if isinstance(quantization, Quantization):
            int8 = quantization.int8 if int8 is None and quantization.stored else int8
            quantization = quantization.mode
        return cls(
            config.weight_dtype,
            config.dtype,
            quantization,
            config.quantize_kvcache,
            normalize_rules(getattr(config, "logical_axis_rules", ())),
            bool(getattr(config, "replicate_quant_scale", False)),
            int8,
            config.kv_quant_axis,
            pool_layout,
        )

    @property
    def int8_entries(self) -> frozenset[str]:
        return frozenset(int8_entries(self.quantization) if self.int8 is None else self.int8)


@dataclass(frozen=True)
class Leaf:
    """One array of the params or the KV cache: its global shape, dtype, logical names and spec."""

    shape: tuple[int, ...]
    dtype: str
    spec: Spec
    logical: tuple[Logical, ...] = ()
    # the minor axis as the device lays it out, rounded up to a multiple of this (a TPU's 128
    # lanes for the lanes pool: serving.models.cache); 1: as the shape says
    lanes: int = 1

    @property
    def nbytes(self) -> int:
        *major, minor = self.shape or (1,)
        return math.prod(major) * -(-minor // self.lanes) * self.lanes * DTYPE_BYTES[self.dtype]

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

    def weight_spec(self, name: str) -> Spec:
        """The spec ([layers], [in], [out]) of layer matmul `name`, float or int8 (its values)."""
        leaf = self.params.get(("layers", name)) or self.params[("layers", name, "values")]
        return leaf.spec


class _Splitter:
    """Maps each leaf's logical names through the rules onto this mesh, and remembers where a
    dimension had to be replicated because its units do not divide."""

    def __init__(self, cfg: ModelConfig, axes: Mapping[str, int], rules: Rules, num_pages: int, page_size: int):
        self.axes, self.rules = axes, rules
        self.units = {
            "vocab": cfg.vocab_size,
            "embed": cfg.embed_dim,
            "embed_vocab": cfg.embed_dim,
            "norm": cfg.embed_dim,
            "q_heads": cfg.num_heads,
            "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads,
            "cache_heads": cfg.num_kv_heads,
            "kv": cfg.head_dim,
            "kv_head_dim": cfg.head_dim,
            "cache_kv": cfg.head_dim,
            "mlp": cfg.mlp_dim,
            "layers": cfg.num_layers,
            "cache_batch": num_pages,
            "cache_sequence": page_size,
        }
        self.notes: dict[str, str] = {}

    def spec(self, names: Sequence[Logical]) -> Spec:
        """The spec of an array whose dimensions hold `names` (a flattened one holds two)."""
        per_name = _assign([n for dim in names for n in dim], self.rules)
        out, i = [], 0
        for dim in names:
            axes: list[str] = []
            for name, mesh in zip(dim, per_name[i : i + len(dim)], strict=True):
                axes.extend(self._divisible(name, mesh))
            out.append(tuple(axes))
            i += len(dim)
        return tuple(out)

    def _divisible(self, logical: str, mesh: tuple[str, ...]) -> tuple[str, ...]:
        """Of the mesh axes `logical` maps to (size-1 and absent axes dropped), the subset with the
        largest product that divides its units, in the rule's order."""
        wanted = tuple(a for a in mesh if self.axes.get(a, 1) > 1)
        count = self.units[logical]
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


def _assign(flat: Sequence[str], rules: Rules) -> list[tuple[str, ...]]:
    """Flax's logical-to-mesh rule: per logical name of one array, its mesh axes (() if no rule)."""
    assigned: list[tuple[str, ...] | None] = [None] * len(flat)
    for name, axes in rules:
        pos = next((i for i, n in enumerate(flat) if n == name and assigned[i] is None), None)
        if pos is None:
            continue
        taken = {a for got in assigned if got for a in got}
        if not taken.intersection(axes):
            assigned[pos] = axes
    return [got or () for got in assigned]


def mesh_axes_of(names: Sequence[Logical], rules: Rules) -> list[tuple[str, ...]]:
    """MaxText's mapping of one array whose dimensions hold `names`: per dimension, the mesh axes
    (any of MaxText's, before sizes or divisibility are looked at) of its logical names in order."""
    per_name = _assign([n for dim in names for n in dim], rules)
    out, i = [], 0
    for dim in names:
        out.append(tuple(a for got in per_name[i : i + len(dim)] for a in got))
        i += len(dim)
    return out


def placement(
    cfg: ModelConfig, numerics: Numerics, axes: Mapping[str, int], num_pages: int, page_size: int
) -> Placement:
    """Shapes, dtypes and specs of the params (layers stacked) and of the KV cache's page pool:
    `num_pages` pages of `page_size` positions (its pages split as MaxText's `cache_batch`, its
    positions as `cache_sequence`)."""
    missing = [a for a in MESH_AXES if a not in axes]
    if missing:
        raise ValueError(f"mesh axes {missing} missing from {dict(axes)}")
    rules = numerics.logical_axis_rules or base_rules()
    splitter = _Splitter(cfg, axes, rules, num_pages, page_size)
    params = _param_leaves(cfg, numerics, splitter)
    cache = _cache_leaves(cfg, numerics, splitter, num_pages, page_size)
    for note in splitter.notes.values():
        log.info("sharding: %s", note)
    return Placement(dict(axes), params, cache, tuple(splitter.notes.values()))


def _param_leaves(cfg: ModelConfig, numerics: Numerics, splitter: _Splitter) -> dict[Path, Leaf]:
    quantized = numerics.int8_entries
    out: dict[Path, Leaf] = {}
    for name, shape in param_shapes(cfg).items():
        stacked = name in LAYER_KEYS
        path: Path = ("layers", name) if stacked else (name,)
        lead: tuple[int, ...] = (cfg.num_layers,) if stacked else ()
        lead_names: tuple[Logical, ...] = (LAYERS,) if stacked else ()
        if name not in WEIGHT_NAMES:  # norms
            names = (*lead_names, NORM)
            out[path] = Leaf((*lead, *shape), numerics.weight_dtype, splitter.spec(names), names)
            continue
        names = (*lead_names, *WEIGHT_NAMES[name])
        spec = splitter.spec(names)
        if name not in quantized:
            out[path] = Leaf((*lead, *shape), numerics.weight_dtype, spec, names)
            continue
        out[(*path, "values")] = Leaf((*lead, *shape), "int8", spec, names)
        if name == EMBEDDING:  # int8 rows, one scale per row: scales [vocab, 1]
            scale_shape, scale_spec = (shape[0], 1), (spec[0], ())
        else:  # int8 [..., in, out], one scale per output channel: scales [..., 1, out]
            scale_shape, scale_spec = (*lead, 1, shape[1]), (*spec[:-2], (), spec[-1])
        if numerics.replicate_quant_scale:
            scale_spec = ((),) * len(scale_shape)
        out[(*path, "scales")] = Leaf(scale_shape, SCALE_DTYPE, scale_spec, names)
    return out


def _cache_leaves(
    cfg: ModelConfig, numerics: Numerics, splitter: _Splitter, num_pages: int, page_size: int
) -> dict[Path, Leaf]:
    """[layers, num_pages, page_size, kv_heads, head_dim] keys and values (int8 ones with [..., 1] scales)."""
    spec = splitter.spec(CACHE_NAMES)
    shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    if numerics.pool_layout == "lanes":
        return _lanes_leaves(numerics, spec, shape)
    if not numerics.quantize_kvcache:
        return {(n,): Leaf(shape, numerics.dtype, spec, CACHE_NAMES) for n in ("k", "v")}
    out = {(n,): Leaf(shape, "int8", spec, CACHE_NAMES) for n in ("k", "v")}
    if numerics.kv_quant_axis == "heads_and_dkv":  # one scale per token, on every chip of its pages
        scale_shape, scale_spec = (*shape[:-2], 1, 1), (*spec[:-2], (), ())
    else:  # one per token and kv head, split as the heads are
        scale_shape, scale_spec = (*shape[:-1], 1), (*spec[:-1], ())
    out.update({(n,): Leaf(scale_shape, SCALE_DTYPE, scale_spec, CACHE_NAMES) for n in ("k_scale", "v_scale")})
    return out


TPU_LANES = 128  # a TPU tile's minor axis: a lanes pool's minor axis is padded to a multiple of it


def _lanes_leaves(numerics: Numerics, spec: Spec, shape: tuple[int, ...]) -> dict[Path, Leaf]:
    """The lanes layout's leaves (serving.models.cache): k, v [layers, pages, page_size,
    kv_heads * head_dim] split as the heads are (a contiguous piece of the merged axis is whole
    heads when the heads divide), int8 values four to an int32 lane, scales [layers, pages,
    kv_heads * page_size] split as the heads are (one per token: [layers, pages, page_size]); their
    bytes as a TPU lays them out (the minor axis padded to 128 lanes: SmolLM2's 3 x 64 int8 takes
    2.67x its values' bytes)."""
    width = shape[3] * shape[4]
    values_spec, names = (*spec[:3], spec[3] + spec[4]), (*CACHE_NAMES[:3], CACHE_NAMES[3] + CACHE_NAMES[4])
    if not numerics.quantize_kvcache:
        return {(n,): Leaf((*shape[:3], width), numerics.dtype, values_spec, names, TPU_LANES) for n in ("k", "v")}
    out = {(n,): Leaf((*shape[:3], width // 4), "int32", values_spec, names, TPU_LANES) for n in ("k", "v")}
    if numerics.kv_quant_axis == "heads_and_dkv":  # one scale per token, on every chip of its pages
        scale = Leaf((*shape[:2], shape[2]), SCALE_DTYPE, (*spec[:2], spec[2]), CACHE_NAMES[:3], TPU_LANES)
    else:  # head-major: split as the heads are
        names_ = (*CACHE_NAMES[:2], CACHE_NAMES[3] + CACHE_NAMES[2])
        scale = Leaf((*shape[:2], shape[3] * shape[2]), SCALE_DTYPE, (*spec[:2], spec[3] + spec[2]), names_, TPU_LANES)
    out.update({(n,): scale for n in ("k_scale", "v_scale")})
    return out


def describe(spec: Spec) -> str:
    """A spec as text: `[-, tensor x autoregressive]`."""
    return "[" + ", ".join(" x ".join(dim) or "-" for dim in spec) + "]"
