"""Adapters on an 8-device mesh (tensor=4 x autoregressive=2, virtual CPU devices): the stacked
adapters are split as their base weights are, and every request's tokens equal one device's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.lora.adapters import make_adapters
from tests.xla_flags import cpu_devices

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine.engine import Engine
    from serving.lora.serving import make_registry
    from serving.orchestrator import Orchestrator
    from serving.request import SamplingParams
    from serving.runtime import make_mesh

    source, root, parallel = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cfg = ServingConfig(per_device_batch_size=1, max_prefill_predict_length=16, max_target_length=64,
                        cpu_kernels="off", lora_input_adapters_path=root, max_loras=2, **parallel)
    model = load_model(source, cfg)
    mesh = make_mesh(cfg.devices, jax.devices()[: 8 if parallel else 1])
    engine = Engine(model, cfg.engine, mesh)
    params = engine.load_params()
    orchestrator = Orchestrator(engine, params, model.tokenizer, cfg.orchestrator,
                                adapters=make_registry(cfg.lora, model.config)).start()
    names = [None, "attn-r4", "all-r8", "mlp-r16-rs"]
    handles = [orchestrator.submit([12, 40, 77, 5 + i], SamplingParams(max_tokens=8, adapter=n))
               for i, n in enumerate(names)]
    tokens = [h.result().token_ids for h in handles]
    orchestrator.stop(timeout=30)
    a, b = params["lora"]["w_down"]
    specs = {"w_down_a": [list(x) if isinstance(x, tuple) else x for x in a.sharding.spec],
             "wq_b": [list(x) if isinstance(x, tuple) else x for x in params["lora"]["wq"][1].sharding.spec]}
    print(json.dumps({"tokens": tokens, "slots": engine.max_concurrent_decodes, "specs": specs}))
    """
)


def test_sharded_adapters_give_the_single_device_tokens(tiny_model_dir, tmp_path):
    root = tmp_path / "adapters"
    make_adapters(tiny_model_dir, root)
    env = {**os.environ, **cpu_devices(8)}

    def run(parallel: dict) -> dict:
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(root), json.dumps(parallel)],
            capture_output=True, text=True, env=env, timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    single = run({})
    sharded = run({"ici_tensor_parallelism": 4, "ici_autoregressive_parallelism": 2})
    assert sharded["slots"] == 8 and single["slots"] == 1
    assert sharded["tokens"] == single["tokens"]
    assert len({tuple(t) for t in single["tokens"]}) == 4  # each adapter its own tokens
    # as the base weights: w_down's input (mlp) over tensor x autoregressive, wq's output over tensor
    assert sharded["specs"] == {
        "w_down_a": [None, None, ["tensor", "autoregressive"], None],
        "wq_b": [None, None, None, "tensor"],
    }
