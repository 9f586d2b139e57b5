"""One process of a two-process group that compiles one program over both processes' devices with
the persistent compilation cache at CACHE, and prints (as JSON) how many cache hits and misses it
saw (jax.monitoring's events).

Usage: python cache_probe.py CACHE PROCESS_ID COORDINATOR_PORT
"""

from __future__ import annotations

import json
import os
import sys


def main(cache: str, process_id: int, port: int) -> None:
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # the directory is CACHE, from the config below
    from serving.config import load_config
    from serving.runtime import init_runtime, make_mesh

    cfg = load_config(None, [
        "runtime=multicontroller", f"coordinator_address=127.0.0.1:{port}", "num_processes=2",
        f"process_id={process_id}", "ici_tensor_parallelism=4", "ici_autoregressive_parallelism=2",
        f"jax_compilation_cache_dir={cache}",
    ])
    init_runtime(cfg.devices)
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    events: dict[str, int] = {}
    jax.monitoring.register_event_listener(lambda event, **_: events.__setitem__(event, events.get(event, 0) + 1))
    mesh = make_mesh(cfg.devices)
    sharding = NamedSharding(mesh, P(("autoregressive", "tensor")))
    x = jax.make_array_from_callback((16, 8), sharding, lambda index: jnp.ones((16, 8))[index])

    @jax.jit
    def program(x):  # a sum across both processes' shards: a cross-process collective
        return (x @ x.T).sum()

    total = float(program(x))
    print(json.dumps({
        "process": process_id,
        "total": total,
        "hits": events.get("/jax/compilation_cache/cache_hits", 0),
        "requests": events.get("/jax/compilation_cache/compile_requests_use_cache", 0),
    }), flush=True)
    from serving.orchestrator.lockstep import meet_at_exit

    meet_at_exit()
    # Both leave at once: JAX's exit-time shutdown would wait for the other process (a follower's
    # coordination service may be gone already, and process 0's waits out a heartbeat timeout).
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
