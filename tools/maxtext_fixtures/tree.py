"""Print the tree of an Orbax PyTree checkpoint: one line per leaf, ``path  dtype  shape``.

Run with ``.venv-maxtext/bin/python``. Reads Orbax's metadata, then restores every leaf as a numpy
array (so a fixture that lists here also restores) and checks the restored shape and dtype agree.

    python tools/maxtext_fixtures/tree.py CHECKPOINT_ITEMS_DIR [--compare-hf HF_DIR]
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for key in sorted(tree):
            yield from leaves(tree[key], (*prefix, str(key)))
    elif tree is None:
        yield "/".join(prefix), None
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from leaves(value, (*prefix, str(i)))
    else:
        yield "/".join(prefix), tree


def restore(path: str) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    ckptr = ocp.PyTreeCheckpointer()
    meta = ckptr.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    meta = getattr(meta, "tree", meta)
    restore_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
    values = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    return meta, values


def main(path: str) -> None:
    meta, values = restore(path)
    meta_leaves = dict(leaves(meta))
    for name, value in leaves(values):
        m = meta_leaves.get(name)
        if value is None:
            print(f"{name}  None")
            continue
        shape, dtype = tuple(value.shape), str(value.dtype)
        assert tuple(m.shape) == shape and str(m.dtype) == dtype, (name, m, shape, dtype)
        print(f"{name}  {dtype}  {list(shape)}")


if __name__ == "__main__":
    main(os.path.abspath(sys.argv[1]))
