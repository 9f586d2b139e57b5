"""One process of a two-process restore of a MaxText checkpoint (4 CPU devices each; the mesh from
the FLAGs, e.g. ici_tensor_parallelism=4 ici_autoregressive_parallelism=2): join the group, restore
onto the engine's shardings as `serve` does on a multi-controller slice, and print (as JSON) the
bytes of the shards this process's devices hold and the greedy next token at every position of a
prompt, computed on the sharded params.

Usage: python maxtext_probe.py CKPT PROCESS_ID COORDINATOR_PORT FLAG...
"""

from __future__ import annotations

import json
import os
import sys


def main(path: str, process_id: int, port: int, flags: list[str]) -> None:
    from serving.config import load_config
    from serving.runtime import init_runtime, make_mesh

    cfg = load_config(None, [
        *flags, "runtime=multicontroller", f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
        f"process_id={process_id}",
    ])
    init_runtime(cfg.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from serving.launch import restore_shardings
    from serving.models import prefill
    from serving.startup.plan import plan_launch

    plan = plan_launch(cfg, path)
    mesh = make_mesh(plan.config.devices)
    shardings = restore_shardings(plan, mesh)
    assert shardings is not None, "restored as stored: no quantization on load"
    model = plan.load(shardings)
    held = total = 0
    for array in jax.tree.leaves(model.params):
        total += array.nbytes
        held += sum({str(s.index): s.data.nbytes for s in array.addressable_shards}.values())
    ids = json.loads(os.environ["PROBE_IDS"])
    forward = jax.jit(
        lambda params, tokens: jnp.argmax(prefill(params, tokens, jnp.asarray([tokens.shape[1]]), model.config)[0], -1),
        out_shardings=NamedSharding(mesh, P()),
    )
    tokens = np.asarray(forward(model.params, jnp.asarray([ids], jnp.int32)))[0].tolist()
    report = {"process": process_id, "held": held, "total": total, "tokens": tokens}
    print(json.dumps(report), flush=True)
    from serving.orchestrator.lockstep import meet_at_exit

    meet_at_exit()
    if process_id:
        os._exit(0)  # as a follower does: process 0's coordination service may be gone already


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
