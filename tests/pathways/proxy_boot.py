"""Run `pathserve` as on a Pathways cluster, with the IFRT proxy client substituted.

pathwaysutils' proxy backend factory obtains its client from
`jax.extend.backend.ifrt_proxy.get_client(target, options)`, which speaks gRPC to a Pathways
proxy server (`pathways-proxy` on the cluster). No IFRT proxy server ships in any package we can
install, so this is the seam: `get_client` is replaced by a function that records the target it
was asked for and returns a local CPU client with PROXY_TEST_DEVICES devices. Everything else is
our real start-up path: `JAX_PLATFORMS=proxy`, pathwaysutils.initialize(), its backend factory
registered under the name "proxy", jax.devices() through it, the engine and the servers.

Usage: python proxy_boot.py ARGS...   (the arguments of `pathserve`)
"""

from __future__ import annotations

import os
import sys


def _substitute_proxy_client() -> None:
    from jax._src.lib import xla_client
    from jax.extend.backend import ifrt_proxy

    devices = int(os.environ.get("PROXY_TEST_DEVICES", "8"))

    def get_client(target: str, options):
        print(f"proxy_boot: ifrt_proxy.get_client({target!r}) -> a local CPU client of {devices} devices",
              file=sys.stderr, flush=True)
        if not target.startswith("grpc://"):
            raise RuntimeError(f"not a grpc:// target: {target!r}")
        return xla_client.make_cpu_client(num_devices=devices)

    ifrt_proxy.get_client = get_client


if __name__ == "__main__":
    _substitute_proxy_client()
    from serving.cli import main

    sys.exit(main(sys.argv[1:]))
