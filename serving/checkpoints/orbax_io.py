"""Orbax checkpoints written one tensor (or one layer of a stacked tensor) at a time.

Orbax saves a whole pytree at once, which would need the whole model in memory. We let Orbax write
the checkpoint's structure (its `_METADATA` and one zarr array per leaf) for placeholder leaves,
then recreate each leaf's zarr array at its real shape with tensorstore and fill it slice by slice.
The result is an ordinary Orbax PyTree checkpoint (zarr v2, no OCDBT), restored with Orbax.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from typing import Any

import ml_dtypes
import numpy as np

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.storage import is_gcs, join, kvstore

MAX_CHUNK_BYTES = 16 << 20
SHARD_SPLITS = 8
ZARR_DTYPES = {
    np.dtype(np.float32): "<f4",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.int8): "|i1",
}

LeafPath = tuple[str, ...]


@cache
def ts_context():
    """One tensorstore context for the process: shared HTTP connections and caches (opening every
    array with its own context exhausts connections against GCS)."""
    import tensorstore as ts

    return ts.Context()


def quiet_orbax_logs() -> None:
    """Orbax logs routine steps (such as skipping an OCDBT merge we never asked for) as warnings."""
    import logging

    logging.getLogger("absl").setLevel(logging.ERROR)


def leaf_name(path: LeafPath) -> str:
    """Orbax's directory name for a leaf: its keys joined with '.'."""
    return ".".join(path)


def chunk_shape(shape: tuple[int, ...], itemsize: int, stacked: bool) -> list[int]:
    """One chunk per layer of a stacked array; each other dimension cut in SHARD_SPLITS pieces where
    it divides (so that a host of a sharded restore reads the chunks of its shards, not the whole
    tensor, up to SHARD_SPLITS-way model parallelism); large dimensions halved until a chunk is small."""
    chunks = list(shape)
    if stacked and chunks:
        chunks[0] = 1
    for axis in range(1 if stacked else 0, len(chunks)):
        if chunks[axis] % SHARD_SPLITS == 0 and chunks[axis] >= SHARD_SPLITS * 8:
            chunks[axis] //= SHARD_SPLITS
    while math.prod(chunks) * itemsize > MAX_CHUNK_BYTES:
        axis = max(range(1 if stacked else 0, len(chunks)), key=lambda i: chunks[i])
        if chunks[axis] < 2:
            break
        chunks[axis] = -(-chunks[axis] // 2)
    return chunks


def _array_spec(
    directory: str, path: LeafPath, shape: tuple[int, ...], dtype: np.dtype, stacked: bool
) -> dict:
    return {
        "driver": "zarr",
        "kvstore": kvstore(join(directory, leaf_name(path))),
        "metadata": {
            "shape": list(shape),
            "chunks": chunk_shape(shape, dtype.itemsize, stacked),
            "dtype": ZARR_DTYPES[dtype],
            "compressor": {"id": "zstd", "level": 1},
            "dimension_separator": ".",
        },
    }


def _nest(flat: Mapping[LeafPath, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


class ArrayWriter:
    """Creates every leaf of a params checkpoint at its final shape, then takes slices."""

    def __init__(self, directory: str, leaves: Mapping[LeafPath, tuple[tuple[int, ...], np.dtype, bool]]):
        """leaves: path -> (shape, dtype, stacked); stacked leaves are written one layer at a time."""
        import orbax.checkpoint as ocp
        import tensorstore as ts

        self.directory = directory
        placeholders = {p: np.zeros((1,) * len(shape), dtype) for p, (shape, dtype, _) in leaves.items()}
        quiet_orbax_logs()
        try:
            ocp.PyTreeCheckpointer(use_ocdbt=False).save(directory, _nest(placeholders))
            self._arrays = {
                path: ts.open(
                    _array_spec(directory, path, shape, np.dtype(dtype), stacked),
                    create=True,
                    delete_existing=True,
                ).result()
                for path, (shape, dtype, stacked) in leaves.items()
            }
        except Exception as exc:
            where = "the bucket" if is_gcs(directory) else "the directory"
            raise CheckpointError(
                f"cannot write the checkpoint to {directory} (check {where}): {exc}"
            ) from None

    def write(self, path: LeafPath, array: np.ndarray, layer: int | None = None) -> None:
        target = self._arrays[path] if layer is None else self._arrays[path][layer]
        target.write(array).result()


def read_leaf(directory: str, path: LeafPath, layer: int | None = None) -> np.ndarray:
    """Read one leaf (or one layer of it) straight from its zarr array."""
    import tensorstore as ts

    array = ts.open(
        {"driver": "zarr", "kvstore": kvstore(join(directory, leaf_name(path)))}, open=True
    ).result()
    return np.asarray((array if layer is None else array[layer]).read().result())


def restore_tree(directory: str, abstract: Mapping[LeafPath, Any] | None = None) -> dict:
    """Restore the params checkpoint: numpy arrays, or jax arrays with the shardings of `abstract`
    (path -> jax.ShapeDtypeStruct with .sharding), each device reading only its shard."""
    import orbax.checkpoint as ocp

    quiet_orbax_logs()
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        if abstract is None:
            return checkpointer.restore(directory)
        tree = _nest(abstract)
        restore_args = ocp.checkpoint_utils.construct_restore_args(tree)
        return checkpointer.restore(
            directory, args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args)
        )
    except FileNotFoundError as exc:
        raise CheckpointError(f"{directory}: not an Orbax checkpoint ({exc})") from None
