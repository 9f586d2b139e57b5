"""The memory plan of a model shape on a TPU, compiled ahead of time on any host with libtpu
installed (no chip needed: jax.experimental.topologies gives the chip's compiler): the slots the
serving profile sizes, the params and KV cache bytes, and the largest programs' temporaries
(serving.engine.compiled_memory), from abstract weights of the shape.

    python -m loadtest.tpu_plan SHAPE [--tokenizer DIR] [--topology v5e:1x1] [key=value ...]

Not a test (CI has no libtpu): how a shape was checked to fit before a chip was at hand, e.g.
Llama 3.1 8B's int8w on one v5e. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

V5E_BYTES_LIMIT = 16_909_336_576  # 15.75 GiB: a v5e's bytes_limit as JAX 0.10.2 reports it


def abstract_model(shape, tokenizer_dir: Path, quantization: str, weight_dtype: str):
    """A LoadedModel of `shape` (a preset's name or a ModelConfig) whose params are
    ShapeDtypeStructs (quantized as `quantization` says)."""
    import jax
    import jax.numpy as jnp

    from serving.checkpoints.model_source import LoadedModel
    from serving.config import load_model_config
    from serving.models.params import LAYER_KEYS, int8_entries, param_shapes
    from serving.models.quantization import QuantizedWeight, scale_axis
    from serving.text.tokenizer import load_tokenizer

    cfg = load_model_config(shape) if isinstance(shape, str) else shape
    dtype = jnp.dtype(weight_dtype)
    params: dict = {"layers": {}}
    for name, dims in param_shapes(cfg).items():
        if name in LAYER_KEYS:
            params["layers"][name] = jax.ShapeDtypeStruct((cfg.num_layers, *dims), dtype)
        else:
            params[name] = jax.ShapeDtypeStruct(dims, dtype)
    names = set(int8_entries(quantization))

    def quantized(name: str, x):  # as serving.models.quantization.quantize_int8 leaves it
        if name not in names:
            return x
        scales = list(x.shape)
        scales[scale_axis(name)] = 1
        return QuantizedWeight(jax.ShapeDtypeStruct(x.shape, jnp.int8), jax.ShapeDtypeStruct(tuple(scales), jnp.float32))

    params = {k: quantized(k, v) for k, v in params.items() if k != "layers"} | {
        "layers": {k: quantized(k, v) for k, v in params["layers"].items()}
    }
    return LoadedModel(cfg, params, load_tokenizer(tokenizer_dir), f"random {cfg.name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape")
    parser.add_argument("--tokenizer", type=Path, required=True, help="a directory with tokenizer.json")
    parser.add_argument("--topology", default="v5e:1x1")
    parser.add_argument("--bytes-limit", type=int, default=V5E_BYTES_LIMIT)
    parser.add_argument("overrides", nargs="*")
    ns = parser.parse_intermixed_args(argv)
    os.environ.setdefault("PATHSERVE_PLATFORM", "tpu")
    from jax.experimental import topologies

    from serving.engine.compiled_memory import compiled_plan
    from serving.engine.engine import Engine
    from serving.runtime import make_mesh
    from serving.startup.plan import size_profile_slots
    from serving.startup.profile import FROM_PROFILE, given_config

    x, y = (int(v) for v in ns.topology.split(":")[1].split("x"))
    topology = topologies.get_topology_desc(
        platform="tpu", topology_name=ns.topology, chip_config_name="default",
        chips_per_host_bounds=(min(x, 2), min(y, 2), 1), num_slices=1,
    )
    devices = list(topology.devices)
    given = given_config(None, ns.overrides, ns.shape)
    cfg = given.config
    model = abstract_model(ns.shape, ns.tokenizer, cfg.quantization, cfg.weight_dtype)
    # sized as serve sizes the profile's slots (and its KV cache's format); a count given stays
    sized, why = (
        size_profile_slots(cfg, model.config, None, devices, given.origins, memory=ns.bytes_limit)
        if given.origin("per_device_batch_size") == FROM_PROFILE else ({}, {})
    )
    cfg = cfg.model_copy(update=sized)
    engine = Engine(model, cfg.engine, make_mesh(cfg.devices, devices))
    started = time.perf_counter()
    plan = compiled_plan(engine)
    where = engine.placement
    params, cache = where.params_bytes_per_chip(), where.cache_bytes_per_chip()
    print(json.dumps({
        "shape": ns.shape, "slots": engine.max_concurrent_decodes, "max_target_length": cfg.max_target_length,
        "sized": why, "kv_cache": engine.summary()["kv_cache"],
        "params_gb": params / 1e9, "kv_cache_gb": cache / 1e9, "resident_as_laid_out_gb": plan.resident / 1e9,
        "programs_gb": {k: v / 1e9 for k, v in plan.programs.items()},
        "total_gb": plan.total / 1e9, "bytes_limit_gb": ns.bytes_limit / 1e9,
        "fits": plan.total <= ns.bytes_limit, "compile_s": time.perf_counter() - started,
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
