"""Bring up the engine behind an orchestrator: runtime, model, params on the mesh, warmup, device loop.

The one start-up path for everything that serves requests (the HTTP server, the batch runner,
`pathserve generate` and `chat`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from serving.checkpoints.model_source import LoadedModel, effective_config, load_model
from serving.config import ServingConfig
from serving.engine.engine import Engine
from serving.orchestrator import Orchestrator
from serving.runtime import init_runtime, make_mesh


@dataclass
class Launched:
    model: LoadedModel
    engine: Engine
    orchestrator: Orchestrator
    warmup_s: float
    startup_s: float

    @property
    def model_name(self) -> str:
        return self.model.config.name

    def describe(self) -> str:
        what = self.engine.summary()
        return (
            f"{self.model.config.name} from {self.model.source}, {self.engine.max_concurrent_decodes} slots, "
            f"quantization={what['quantization']}, kv cache {what['kv_cache']}, {what['backend']} backend; "
            f"warmup {self.warmup_s:.1f} s, start-up {self.startup_s:.1f} s"
        )


def launch(cfg: ServingConfig, source: str | None) -> Launched:
    """Everything up to a running device loop; raises the loader's errors (ConfigError, CheckpointError, ...)."""
    started = time.perf_counter()
    init_runtime(cfg.devices)  # first: on Pathways it must precede every other JAX call
    cfg = effective_config(source, cfg)
    model = load_model(source, cfg)
    engine = Engine(model, cfg.engine, make_mesh(cfg.devices))
    params = engine.load_params()
    warmup = engine.warmup(params) if cfg.enable_model_warmup else 0.0
    orchestrator = Orchestrator(engine, params, model.tokenizer, cfg.orchestrator).start()
    return Launched(model, engine, orchestrator, warmup, time.perf_counter() - started)
