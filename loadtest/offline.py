"""Offline engine throughput: the baseline the HTTP server's overhead is measured against
(`pathserve bench offline`, run by `pathserve bench overhead`)."""

from __future__ import annotations

import time

from serving.config import ServingConfig
from serving.request import SamplingParams


def measure(cfg: ServingConfig, source: str | None, prompts: list[str], max_tokens: int) -> dict:
    """Output tokens/s of `run_to_completion` over `prompts` (greedy, exactly `max_tokens` each, after
    compiling): the offline baseline the HTTP server is compared with."""
    from serving.checkpoints.model_source import effective_config, load_model
    from serving.engine.engine import Engine
    from serving.orchestrator.offline import run_to_completion
    from serving.runtime import init_runtime, make_mesh

    init_runtime(cfg.devices)
    cfg = effective_config(source, cfg)
    model = load_model(source, cfg)
    engine = Engine(model, cfg.engine, make_mesh(cfg.devices))
    params = engine.load_params()
    requests = [(model.tokenizer.encode_prompt(p), SamplingParams(max_tokens=max_tokens)) for p in prompts]
    if cfg.enable_model_warmup:
        engine.warmup(params)
        engine.background_warmup.wait()  # a settled engine, as the HTTP side waits for its server's
    run_to_completion(engine, params, requests[: engine.max_concurrent_decodes])  # compile what warmup did not
    started = time.perf_counter()
    done = run_to_completion(engine, params, requests)
    wall = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for c in done)
    return {
        "requests": len(done),
        "slots": engine.max_concurrent_decodes,
        "prompt_tokens": sum(len(ids) for ids, _ in requests),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
    }
