"""Restoring a MaxText inference checkpoint (serving.checkpoints.maxtext_layout) as our params.

Each leaf is restored by Orbax straight onto the sharding its runtime leaf will have (with
`shardings`: every process reads only the chunks of its own shards), then reshaped into our layout
on the devices: heads x head_dim flattened, a scanned leaf's layer axis moved to the front, the
query's folded 1/sqrt(head_dim) taken back out (into the int8 scales, for an int8 kernel: the int8
values are never turned into floats), Llama 3.1's interleaved q/k pairs reordered to the
rotate-half layout our rotary embedding uses, and per-layer leaves stacked.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.maxtext_layout import (
    Entry,
    Layout,
    Path,
    check_against,
    describe_tree,
    interleaved_rope,
)
from serving.checkpoints.orbax_io import LeafPath, quiet_orbax_logs
from serving.checkpoints.storage import exists, is_gcs, join
from serving.models.config import ModelConfig
from serving.models.params import LAYER_KEYS

ORBAX_METADATA = "_METADATA"
# Where the conversion scripts leave the items of a step, below the directory a user may name.
ITEMS_BELOW = ("items", "0/items", "checkpoints/0/items")


def items_dir(path: str) -> str | None:
    """The Orbax items directory of a MaxText checkpoint named by `path` (the directory itself, or
    its step's `items`), or None when there is no Orbax tree there."""
    if not is_gcs(path):
        path = os.path.abspath(path)  # Orbax refuses a relative path to an OCDBT checkpoint
    for below in ("", *ITEMS_BELOW):
        candidate = join(path, below) if below else path
        if exists(join(candidate, ORBAX_METADATA)):
            return candidate
    return None


@functools.lru_cache(maxsize=8)
def _metadata_tree(directory: str) -> Any:
    """The Orbax tree at `directory` with each leaf's metadata (shape, dtype). Read once per process:
    it reads every array's metadata (thousands of objects for a large model on gs://), and start-up
    asks for it several times (which format, which leaves are int8, the restore itself)."""
    import orbax.checkpoint as ocp

    quiet_orbax_logs()
    try:
        meta = ocp.PyTreeCheckpointer().metadata(directory)
    except Exception as exc:  # a damaged _METADATA or a missing array directory
        raise CheckpointError(f"{directory}: cannot read the Orbax checkpoint's metadata: {_first_line(exc)}") from None
    item = getattr(meta, "item_metadata", meta)
    if item is None:  # Orbax logs what failed and returns no tree
        raise CheckpointError(f"{directory}: cannot read the Orbax checkpoint's metadata (damaged or truncated)")
    return getattr(item, "tree", item)


def _walk(node: Any, prefix: Path, leaf: Any) -> Any:
    """`node` with every leaf replaced by leaf(path, value) (None drops it; a container left empty
    is dropped too). Keeps Orbax's containers: dicts, and lists such as AQT's scale list."""
    if isinstance(node, Mapping):
        out = {k: _walk(v, (*prefix, str(k)), leaf) for k, v in node.items()}
        return {k: v for k, v in out.items() if v is not None} or None
    if isinstance(node, list | tuple):
        items = [_walk(v, (*prefix, str(i)), leaf) for i, v in enumerate(node)]
        return None if all(v is None for v in items) else type(node)(items)
    return None if node is None or not hasattr(node, "shape") else leaf(prefix, node)


def _flat_metadata(tree: Any) -> dict[Path, tuple[tuple[int, ...], str]]:
    """Every array leaf of a metadata tree: path -> (shape, dtype name)."""
    out: dict[Path, tuple[tuple[int, ...], str]] = {}

    def record(path: Path, meta: Any) -> Any:
        out[path] = (tuple(int(s) for s in meta.shape), str(np.dtype(meta.dtype)))
        return meta

    _walk(tree, (), record)
    return out


def read_layout(path: str) -> Layout | None:
    """The layout of the MaxText checkpoint at `path`, or None when `path` holds none."""
    directory = items_dir(path)
    if directory is None:
        return None
    return describe_tree(_flat_metadata(_metadata_tree(directory)))


def is_maxtext_checkpoint(path: str) -> bool:
    try:
        return items_dir(path) is not None and read_layout(path) is not None
    except CheckpointError:
        return True  # an Orbax tree that names MaxText's leaves but is damaged: refused when loaded


def _runtime_path(entry: Entry, quantized: bool) -> LeafPath:
    base: LeafPath = ("layers", entry.name) if entry.name in LAYER_KEYS else (entry.name,)
    if not quantized:
        return base
    return (*base, "scales" if entry.part == "scale" else "values")


def _leaf_spec(entry: Entry, runtime_spec: tuple) -> tuple:
    """The PartitionSpec entries of a checkpoint leaf from its runtime leaf's: the layer axis (where
    the runtime stacks layers) dropped, or moved to where a scanned leaf keeps it, and a flattened
    heads x head_dim dimension split back into (heads: its axes, head_dim: none)."""
    spec = list(runtime_spec)
    layer_spec = spec.pop(0) if entry.name in LAYER_KEYS else None
    if entry.name in ("wq", "wk", "wv"):
        spec = [spec[0], spec[1], None]
    elif entry.name == "wo":
        spec = [spec[0], None, spec[1]]
    if entry.layer_axis is not None:
        spec.insert(entry.layer_axis, layer_spec)
    return tuple(spec)


def restore_maxtext(
    path: str,
    cfg: ModelConfig,
    model_name: str,
    float_dtype: Any,
    shardings: Mapping[LeafPath, Any] | None = None,
    layout: Layout | None = None,
) -> dict:
    """The params pytree (layers stacked) of the MaxText checkpoint at `path`, for model `cfg`.

    int8 kernels become `QuantizedWeight`s (values int8, scales float32); other leaves are cast to
    `float_dtype`. `shardings` (runtime leaf path -> jax sharding): restore each leaf onto them."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    from serving.models.quantization import QuantizedWeight

    directory = items_dir(path)
    layout = layout or read_layout(path)
    if directory is None or layout is None:
        raise CheckpointError(f"{path}: not a MaxText checkpoint")
    check_against(layout, cfg, path)
    quantized = layout.quantized_names

    def abstract(entry: Entry):
        dtype = np.dtype(entry.dtype) if entry.dtype != "bfloat16" else jnp.bfloat16
        sharding = None
        if shardings is not None:
            target = shardings[_runtime_path(entry, entry.name in quantized)]
            runtime_ndim = (entry.name in LAYER_KEYS) + (1 if entry.name.endswith("norm") else 2)
            spec = _pad(_leaf_spec(entry, _pad(tuple(target.spec), runtime_ndim)), len(entry.shape))
            sharding = NamedSharding(target.mesh, PartitionSpec(*spec))
        return jax.ShapeDtypeStruct(entry.shape, dtype, sharding=sharding)

    wanted = {entry.path: entry for entry in layout.entries}
    item = _walk(_metadata_tree(directory), (), lambda p, _: abstract(wanted[p]) if p in wanted else None)
    quiet_orbax_logs()
    try:
        restore_args = ocp.checkpoint_utils.construct_restore_args(item)
        if shardings is None:  # numpy on the host, then one device_put per leaf below
            restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        tree = ocp.PyTreeCheckpointer().restore(
            directory, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        )
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot restore the MaxText checkpoint: {_first_line(exc)}") from None
    arrays = {entry.path: _get(tree, entry.path) for entry in layout.entries}
    del tree  # each restored leaf is freed once transformed: at most one extra leaf at a time
    transform = _Transform(cfg, interleaved_rope(model_name), float_dtype)
    pieces: dict[tuple[str, str], dict[int | None, Any]] = {}
    for entry in layout.entries:
        value = arrays.pop(entry.path)
        out_sharding = None
        if shardings is not None:
            out_sharding = shardings[_runtime_path(entry, entry.name in quantized)]
            if entry.layer is not None:  # one layer of a stacked runtime leaf
                out_sharding = NamedSharding(out_sharding.mesh, PartitionSpec(*tuple(out_sharding.spec)[1:]))
        pieces.setdefault((entry.name, entry.part), {})[entry.layer] = transform(entry, value, out_sharding)
    params: dict = {"layers": {}}
    for name in {name for name, _ in pieces}:  # per-layer pieces freed as each entry is stacked
        parts = {part: _stacked(pieces.pop((name, part)), shardings, name, part, quantized)
                 for part in [p for n, p in list(pieces) if n == name]}
        value = (
            QuantizedWeight(values=parts["qvalue"], scales=parts["scale"]) if "qvalue" in parts else parts["kernel"]
        )
        (params["layers"] if name in LAYER_KEYS else params)[name] = value
    return params


def _stacked(layers: dict[int | None, Any], shardings, name: str, part: str, quantized) -> Any:
    """One runtime leaf from its restored pieces: a top-level or scanned leaf as it is, per-layer
    leaves stacked on a leading axis (onto the runtime sharding)."""
    if None in layers:
        return layers[None]
    ordered = [layers[i] for i in sorted(layers)]
    target = None
    if shardings is not None:
        entry_part = "scales" if part == "scale" else "values"
        target = shardings[("layers", name, entry_part) if name in quantized else ("layers", name)]
    return _compiled_stack(len(ordered), target)(*ordered)


class _Transform:
    """One checkpoint leaf into our layout (on its devices, under jit; one compiled function per
    kind of leaf, shape and sharding, so a 126-layer model compiles a handful, not thousands)."""

    def __init__(self, cfg: ModelConfig, interleaved: bool, float_dtype: Any):
        import jax.numpy as jnp

        self.interleaved = interleaved
        self.float_dtype = jnp.dtype(float_dtype)
        # The conversion divided the query kernel by sqrt(head_dim) (in its own dtype), and MaxText's
        # attention scales by nothing; ours scales by 1/sqrt(head_dim), so multiply it back in.
        self.query_factor = math.sqrt(cfg.head_dim)

    def __call__(self, entry: Entry, value: Any, sharding: Any) -> Any:
        key = (entry.name, entry.part, entry.layer_axis, self.interleaved, self.query_factor, self.float_dtype)
        return _compiled_transform(key, sharding)(value)


@functools.cache
def _compiled_transform(key: tuple, sharding: Any):
    import jax

    return jax.jit(functools.partial(_to_runtime, *key), out_shardings=sharding)


def _to_runtime(
    name: str, part: str, layer_axis: int | None, interleaved: bool, query_factor: float, float_dtype: Any, x: Any
) -> Any:
    """A MaxText leaf (see maxtext_layout) as our runtime leaf: int8 values, float32 scales, or a
    float weight in `float_dtype`."""
    import jax.numpy as jnp

    if layer_axis is not None:  # scanned: [in..., layers, out...] -> [layers, in..., out...]
        x = jnp.moveaxis(x, layer_axis, 0)
    lead = x.shape[:1] if layer_axis is not None else ()
    dtype = {"qvalue": jnp.int8, "scale": jnp.float32}.get(part, float_dtype)
    if name in ("wq", "wk") and interleaved:
        # Meta's interleaved pairs (x0, x1), (x2, x3)... -> rotate-half: evens, then odds. A
        # query or key scale has the head_dim axis too and is reordered with its values.
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    if name == "wq" and part != "qvalue":
        x = x.astype(jnp.float32) * query_factor
    x = x.astype(dtype)
    if name in ("wq", "wk", "wv"):  # [.., E, H, D] -> [.., E, H*D] (a scale: [.., 1, H*D])
        x = x.reshape(*lead, x.shape[-3], x.shape[-2] * x.shape[-1])
    elif name == "wo":  # [.., H, D, E] -> [.., H*D, E] (a scale: [.., 1, E])
        x = x.reshape(*lead, x.shape[-3] * x.shape[-2], x.shape[-1])
    return x


@functools.cache
def _compiled_stack(count: int, sharding: Any):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)


def _pad(spec: tuple, ndim: int) -> tuple:
    return tuple(spec[:ndim]) + (None,) * (ndim - len(spec))


def _get(tree: Any, path: Path) -> Any:
    node = tree
    for key in path:
        node = node[int(key)] if isinstance(node, list | tuple) else node[key]
    return node


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def describe_maxtext(path: str, layout: Layout) -> dict[str, Any]:
    """What `pathserve inspect` says of a MaxText checkpoint: its format, dtype, whether scanned,
    its layers, bytes and tensors."""
    layers = {e.layer for e in layout.entries if e.layer is not None}
    scanned_layers = {e.shape[e.layer_axis] for e in layout.entries if e.layer_axis is not None}
    return {
        "format": f"maxtext {layout.kind}",
        "source_path": path,
        "items": items_dir(path),
        "dtype": layout.dtype,
        "quantization": "int8 (AQT per-channel qvalue + scale)" if layout.quantized else "none",
        "int8_entries": sorted(layout.quantized_names),
        "scanned": layout.scanned,
        "num_layers": max(scanned_layers) if layout.scanned else len(layers),
        "bytes": layout.nbytes(),
        "tensors": {"/".join(e.path): {"shape": list(e.shape), "dtype": e.dtype} for e in layout.entries},
    }


def describe_table(info: Mapping[str, Any]) -> str:
    rows = [
        ("format", info["format"]),
        ("dtype (float tensors)", info["dtype"]),
        ("quantization", info["quantization"]),
        ("int8 entries", ", ".join(info["int8_entries"]) or "-"),
        ("layers", f"{info['num_layers']} ({'scanned' if info['scanned'] else 'unscanned'})"),
        ("tensors", str(len(info["tensors"]))),
        ("bytes", f"{info['bytes']:,}"),
        ("items", str(info["items"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def verify_maxtext(path: str, layout: Layout) -> tuple[int, list[str]]:
    """Read every tensor of a MaxText checkpoint back, one at a time (MaxText writes no checksums:
    this finds what cannot be read, such as a truncated or missing file, and non-finite floats).
    Returns (tensors checked, problems naming each tensor)."""
    import orbax.checkpoint as ocp

    directory = items_dir(path)
    tree = _metadata_tree(directory)
    bad: list[str] = []
    quiet_orbax_logs()
    for entry in layout.entries:
        item = _walk(tree, (), lambda p, meta, want=entry.path: meta if p == want else None)
        args = _walk(item, (), lambda p, _: ocp.RestoreArgs(restore_type=np.ndarray))
        try:
            restored = ocp.PyTreeCheckpointer().restore(
                directory, args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True)
            )
            value = np.asarray(_get(restored, entry.path))
        except Exception as exc:
            bad.append(f"{'/'.join(entry.path)}: cannot be read: {_first_line(exc)}")
            continue
        if value.shape != entry.shape:
            bad.append(f"{'/'.join(entry.path)}: shape {value.shape}, its metadata says {entry.shape}")
        elif entry.dtype != "int8" and not np.isfinite(value.astype(np.float32)).all():
            bad.append(f"{'/'.join(entry.path)}: holds non-finite values")
    return len(layout.entries), bad


def iter_maxtext_params(path: str, cfg: ModelConfig, model_name: str, layout: Layout | None = None):
    """(ParamKey, float32 [in, out] tensor, checkpoint path) for each entry of a MaxText checkpoint,
    one entry (and one layer) at a time, in our layout: what `pathserve convert` streams. int8
    kernels come out dequantized (qvalue x scale), for convert to store in float or quantize again."""
    import orbax.checkpoint as ocp

    from serving.checkpoints.layout import ParamKey

    directory = items_dir(path)
    layout = layout or read_layout(path)
    if directory is None or layout is None:
        raise CheckpointError(f"{path}: not a MaxText checkpoint")
    check_against(layout, cfg, path)
    tree = _metadata_tree(directory)
    transform = _Transform(cfg, interleaved_rope(model_name), np.float32)
    groups: dict[tuple[str, int | None], dict[str, Entry]] = {}
    for entry in layout.entries:
        groups.setdefault((entry.name, entry.layer), {})[entry.part] = entry
    quiet_orbax_logs()
    for (name, layer), parts in groups.items():
        arrays = {}
        for part, entry in parts.items():
            item = _walk(tree, (), lambda p, meta, want=entry.path: meta if p == want else None)
            args = _walk(item, (), lambda p, _: ocp.RestoreArgs(restore_type=np.ndarray))
            try:
                restored = ocp.PyTreeCheckpointer().restore(
                    directory, args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True)
                )
            except Exception as exc:
                raise CheckpointError(f"{path}: {'/'.join(entry.path)}: {_first_line(exc)}") from None
            arrays[part] = np.asarray(transform(entry, _get(restored, entry.path), None), np.float32)
        tensor = arrays["qvalue"] * arrays["scale"] if "qvalue" in arrays else arrays["kernel"]
        label = "/".join(next(iter(parts.values())).path)
        if layer is None and name in LAYER_KEYS:  # scanned: every layer in one leaf
            for i in range(tensor.shape[0]):
                yield ParamKey(name, i), tensor[i], f"{label}[{i}]"
        else:
            yield ParamKey(name, layer), tensor, label
