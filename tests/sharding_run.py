"""Run by tests/test_sharding.py in a subprocess with 16 virtual CPU devices (the device count is fixed
when JAX starts): for each (model preset, mesh) it builds the engine on that mesh, runs greedy requests
through prefill, insert and multi-step generate, and prints one JSON line per case with the tokens,
every params and cache leaf's PartitionSpec, and the bytes each device holds.

argv: TOKENIZER_DIR, then a JSON list of {"model", "mesh", "flags" (ServingConfig keys), "generate",
"maxtext" (a MaxText config file the flags override, optional)};
model presets come from $PATHSERVE_CONFIG_DIR/models.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np

from serving.checkpoints.model_source import LoadedModel
from serving.config import ServingConfig, load_config, load_model_config
from serving.engine.engine import Engine
from serving.models import quantize_params, with_int8_activations
from serving.models.params import LAYER_KEYS, int8_entries, param_shapes
from serving.orchestrator.offline import run_to_completion
from serving.request import SamplingParams
from serving.runtime import make_mesh
from serving.text.tokenizer import load_tokenizer

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13], [14, 15, 16, 17, 18, 19, 20, 21], [22, 23], [24, 25, 26]]


def spec_of(array: jax.Array) -> list[list[str]]:
    spec = list(array.sharding.spec) + [None] * (array.ndim - len(array.sharding.spec))
    return [[] if d is None else [d] if isinstance(d, str) else list(d) for d in spec]


def leaves(tree) -> dict[str, jax.Array]:
    """'layers/wq/values' -> array, with per-layer lists folded (every layer must agree)."""
    out: dict[str, jax.Array] = {}
    for path, array in jax.tree_util.tree_leaves_with_path(tree):
        names = []
        for key in path:
            name = getattr(key, "key", None) or getattr(key, "name", None)
            if name is None:  # a list index: a layer of unstacked params
                continue
            names.append(str(name))
        out.setdefault("/".join(names), []).append(array)
    return out


def bytes_per_device(arrays) -> dict[str, int]:
    held: dict[str, int] = {}
    for array in arrays:
        for shard in array.addressable_shards:
            held[str(shard.device)] = held.get(str(shard.device), 0) + shard.data.nbytes
    return held


def random_params(model_cfg) -> dict:
    """Random float32 weights (numpy: no compile per shape), norms around 1."""
    rng = np.random.default_rng(7)
    params: dict = {"layers": {}}
    for name, shape in param_shapes(model_cfg).items():
        full = (model_cfg.num_layers, *shape) if name in LAYER_KEYS else shape
        if "norm" in name:
            value = rng.uniform(0.5, 1.5, full)
        else:
            value = rng.standard_normal(full) * shape[0] ** -0.5
        (params["layers"] if name in LAYER_KEYS else params)[name] = value.astype(np.float32)
    return params


def run(tokenizer, case: dict) -> dict:
    if case.get("maxtext"):  # a MaxText recipe file with the flags after it, as `serve` reads them
        cfg = load_config(case["maxtext"], [f"{k}={json.dumps(v)}" for k, v in case["flags"].items()])
    else:
        cfg = ServingConfig(**case["flags"])
    model_cfg = load_model_config(case["model"])
    # As a float checkpoint loads under cfg.quantization (int8: MaxText's W8A8, the layers' matmuls).
    params = quantize_params(random_params(model_cfg), int8_entries(cfg.quantization))
    params = with_int8_activations(params) if cfg.quantization == "int8" else params
    model = LoadedModel(model_cfg, params, tokenizer, case["model"])
    mesh = make_mesh(cfg.devices, jax.devices()[: math.prod(case["mesh"].values())])
    engine = Engine(model, cfg.engine, mesh)
    placed = engine.load_params()
    state = engine.init_decode_state()
    param_leaves, cache_leaves = leaves(placed), leaves(state.cache._asdict())
    specs = {}
    for name, arrays in {**param_leaves, **{f"cache/{k}": v for k, v in cache_leaves.items()}}.items():
        each = {json.dumps(spec_of(a)) for a in arrays}
        assert len(each) == 1, (name, each)
        specs[name] = json.loads(each.pop())
    tokens = None
    if case.get("generate", True):
        results = run_to_completion(engine, placed, [(p, SamplingParams(max_tokens=12)) for p in PROMPTS])
        tokens = [r.token_ids for r in results]
    return {
        **case,
        "slots": engine.max_concurrent_decodes,
        "tokens": tokens,
        "specs": specs,
        "param_bytes": bytes_per_device(a for arrays in param_leaves.values() for a in arrays),
        "cache_bytes": bytes_per_device(a for arrays in cache_leaves.values() for a in arrays),
        "placement_notes": list(engine.placement.notes),
    }


def main() -> None:
    assert jax.device_count() == 16, jax.devices()
    tokenizer = load_tokenizer(Path(sys.argv[1]))
    for case in json.loads(sys.argv[2]):
        print(json.dumps(run(tokenizer, case)), flush=True)


if __name__ == "__main__":
    main()
