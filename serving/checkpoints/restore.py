"""Reading a pathserve checkpoint back into the runtime params pytree (stacked layers).

With target shardings, Orbax restores each array straight onto its devices, every device reading
only the chunks of its own shard.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from serving.checkpoints.checkpoint import (
    PARAMS_DIR,
    TOKENIZER_DIR,
    CheckpointMetadata,
    leaves,
    read_metadata,
)
from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.layout import NUMPY_DTYPES
from serving.checkpoints.orbax_io import LeafPath, restore_tree
from serving.checkpoints.storage import join, read_bytes
from serving.models.params import LAYER_KEYS


def restore_params(
    path: str,
    metadata: CheckpointMetadata | None = None,
    weight_dtype: str | None = None,
    shardings: Mapping[LeafPath, Any] | None = None,
) -> dict:
    """The params pytree of checkpoint `path`.

    shardings maps runtime leaf paths (("embed",), ("layers", "wq"), ("layers", "wq", "values"), ...)
    to jax shardings; without it, arrays are restored to the default device.
    """
    import jax
    import jax.numpy as jnp

    from serving.models.quantization import QuantizedWeight

    metadata = metadata or read_metadata(path)
    cfg = metadata.config
    stored = leaves(cfg, metadata.quantization, metadata.dtype, metadata.scan_layers)
    directory = join(path, PARAMS_DIR)
    if shardings is not None and metadata.scan_layers:
        abstract = {
            p: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[p])
            for p, (shape, dtype, _) in stored.items()
        }
        tree = restore_tree(directory, abstract)
    else:
        tree = restore_tree(directory)
        if not metadata.scan_layers:
            tree = _stack_layers(tree, cfg.num_layers)
    float_dtype = NUMPY_DTYPES[weight_dtype or metadata.dtype]

    def to_runtime(path: LeafPath, value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {"values", "scales"}:
            return QuantizedWeight(
                values=to_runtime((*path, "values"), value["values"]),
                scales=to_runtime((*path, "scales"), value["scales"]),
            )
        if isinstance(value, dict):
            return {k: to_runtime((*path, k), v) for k, v in value.items()}
        if value.dtype != np.int8 and path[-1] != "scales":
            value = value.astype(float_dtype)
        if shardings is not None and not metadata.scan_layers:
            return jax.device_put(value, shardings[path])
        return value if isinstance(value, jax.Array) else jnp.asarray(value)

    return to_runtime((), tree)


def _stack_layers(tree: dict, num_layers: int) -> dict:
    """layers_0/NAME ... layers_{n-1}/NAME -> layers/NAME stacked on a leading axis."""
    per_layer = [tree.pop(f"layers_{i}") for i in range(num_layers)]

    def stack(*values):
        if isinstance(values[0], dict):
            return {k: stack(*(v[k] for v in values)) for k in values[0]}
        return np.stack(values)

    tree["layers"] = {name: stack(*(layer[name] for layer in per_layer)) for name in LAYER_KEYS}
    return tree


def load_checkpoint_tokenizer(path: str, metadata: CheckpointMetadata):
    """The tokenizer stored in the checkpoint."""
    files = {name: read_bytes(join(path, TOKENIZER_DIR, name)) for name in metadata.tokenizer_files}
    if not files:
        raise CheckpointError(f"{path}: the checkpoint carries no tokenizer")
    return tokenizer_from_files(files, path)


def tokenizer_from_files(files: dict[str, bytes], where: str = "the model's files"):
    """A tokenizer from a source's or checkpoint's tokenizer files (written to a local temporary
    directory when the tokenizer library needs files); an error names `where` they came from, not
    that directory."""
    from serving.checkpoints.gguf_file import GGUFTokenizerData
    from serving.text.tokenizer import TokenizerError, load_tokenizer, tokenizer_from_gguf

    if "gguf_tokenizer.json" in files:
        return tokenizer_from_gguf(GGUFTokenizerData(**json.loads(files["gguf_tokenizer.json"])))
    with tempfile.TemporaryDirectory(prefix="pathserve-tokenizer-") as local:
        for name, data in files.items():
            (Path(local) / name).write_bytes(data)
        try:
            return load_tokenizer(Path(local))  # reads every file now: the directory can go
        except TokenizerError as exc:
            raise TokenizerError(str(exc).replace(local, str(where))) from None
