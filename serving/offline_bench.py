"""Offline engine throughput: the baseline the HTTP server's overhead is measured against
(`pathserve bench offline`, run by `pathserve bench overhead`). Part of the product (it brings the
engine up as serve does); the HTTP benchmarks are loadtest's, run by the CLI as programs of their own."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from serving.config import ServingConfig
from serving.request import SamplingParams


def _load(cfg: ServingConfig, source: str | None, origins: Mapping[str, str] | None = None):
    """(engine, params, tokenizer) brought up as `serve` brings them up (serving.launch.bring_up:
    the plan with `origins`, where each key came from, the engine, its params placed and the
    loaded copy dropped, warmup), with the background compiles settled, as the HTTP side waits
    for its server's."""
    from serving.launch import bring_up

    up = bring_up(cfg, source, origins)
    if up.engine.background_warmup is not None:
        up.engine.background_warmup.wait()
    return up.engine, up.params, up.model.tokenizer


def _round(engine, params, executor, requests: list, batch: int) -> dict:
    """Output tokens/s of `requests` run `batch` at a time (greedy, exactly max_tokens each) on
    `executor`, made once before any round: a new one per run allocated and faulted in the KV pool
    inside the timing (SmolLM2, batch 1: 59-103 tok/s offline against the server's 150-158)."""
    from serving.orchestrator.offline import run_to_completion

    started = time.perf_counter()
    done = []
    for first in range(0, len(requests), batch):
        done += run_to_completion(engine, params, requests[first : first + batch], executor=executor)
    wall = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for c in done)
    return {
        "requests": len(done),
        "batch": batch,
        "slots": engine.max_concurrent_decodes,
        "prompt_tokens": sum(len(ids) for ids, _ in requests),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
    }


def _prepared(cfg: ServingConfig, source: str | None, prompts: list[str], max_tokens: int, origins):
    """`_load`'s engine and params, an executor on them and `prompts` as requests (greedy, exactly
    `max_tokens` each), after one untimed run of a slot-full of them compiled what warmup did not."""
    from serving.orchestrator.executor import Executor
    from serving.orchestrator.offline import run_to_completion

    engine, params, tokenizer = _load(cfg, source, origins)
    executor = Executor(engine, params)
    requests = [(tokenizer.encode_prompt(p), SamplingParams(max_tokens=max_tokens)) for p in prompts]
    run_to_completion(engine, params, requests[: engine.max_concurrent_decodes], executor=executor)
    return engine, params, executor, requests


def measure(
    cfg: ServingConfig, source: str | None, prompts: list[str], max_tokens: int, origins: Mapping[str, str] | None = None
) -> dict:
    """Output tokens/s of `run_to_completion` over `prompts` (greedy, exactly `max_tokens` each, after
    compiling): the offline baseline the HTTP server is compared with."""
    engine, params, executor, requests = _prepared(cfg, source, prompts, max_tokens, origins)
    return _round(engine, params, executor, requests, engine.max_concurrent_decodes)


def serve_rounds(
    cfg: ServingConfig,
    source: str | None,
    prompts: list[str],
    max_tokens: int,
    commands,
    out,
    origins: Mapping[str, str] | None = None,
) -> None:
    """Load once, then for each line "BATCH COUNT" read from `commands` run the first COUNT prompts
    BATCH at a time and write one JSON line of `_round`'s figures to `out`: the offline side of
    rounds that alternate with the HTTP server's (`pathserve bench overhead`), so that the machine's
    drift falls on both alike. Writes {"ready": true} once loaded."""
    engine, params, executor, requests = _prepared(cfg, source, prompts, max_tokens, origins)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in commands:
        if not line.strip():
            continue
        batch, count = (int(v) for v in line.split())
        print(json.dumps(_round(engine, params, executor, requests[:count], batch)), file=out, flush=True)
