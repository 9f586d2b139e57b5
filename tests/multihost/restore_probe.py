"""One process of a two-process restore: join the group, restore CKPT with shardings that split the
model axes over both processes, and print (as JSON) the bytes tensorstore read and the bytes of the
shards this process's devices hold.

Usage: python restore_probe.py CKPT PROCESS_ID COORDINATOR_PORT
"""

from __future__ import annotations

import json
import os
import sys


def main(path: str, process_id: int, port: int) -> None:
    from serving.config import load_config
    from serving.runtime import init_runtime, make_mesh

    cfg = load_config(None, [
        "runtime=multicontroller", f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
        f"process_id={process_id}", "ici_tensor_parallelism=4", "ici_autoregressive_parallelism=2",
    ])
    init_runtime(cfg.devices)
    import tensorstore as ts
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from serving.checkpoints.checkpoint import leaves, read_metadata
    from serving.checkpoints.restore import restore_params

    mesh = make_mesh(cfg.devices)
    model = ("autoregressive", "tensor")  # the heads / mlp / vocab axes over both processes' devices

    def spec(leaf: tuple[str, ...], ndim: int) -> P:
        if ndim < 2 or leaf[-1] == "scales":
            return P()
        return P(*([None] * (ndim - 1)), model)  # the output features (embed: its embed axis)

    metadata = read_metadata(path)
    stored = leaves(metadata.config, metadata.quantization, metadata.dtype, metadata.scan_layers)
    shardings = {p: NamedSharding(mesh, spec(p, len(shape))) for p, (shape, _, _) in stored.items()}
    before = _bytes_read(ts)
    params = restore_params(path, metadata, shardings=shardings)
    read = _bytes_read(ts) - before
    import jax

    held = 0
    total = 0
    for array in jax.tree.leaves(params):
        total += array.nbytes
        unique = {str(s.index): s.data.nbytes for s in array.addressable_shards}
        held += sum(unique.values())
    print(json.dumps({"process": process_id, "read": read, "held": held, "total": total}), flush=True)
    from serving.orchestrator.lockstep import meet_at_exit

    meet_at_exit()
    if process_id:
        os._exit(0)  # as a follower does: process 0's coordination service may be gone already


def _bytes_read(ts) -> int:
    return sum(
        value["value"]
        for metric in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
        if metric["name"].endswith("/bytes_read")
        for value in metric["values"]
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
