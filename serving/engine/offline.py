"""Run a list of requests to completion on an Engine, slots refilled as they free up.

A simple synchronous driver for tests, benchmarks and offline use; the orchestrator is the
concurrent one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from serving.config import ServingConfig
from serving.engine.engine import Engine
from serving.request import SamplingParams


@dataclass
class Completion:
    prompt_ids: list[int]
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""


def generate_all(
    engine: Engine, params: dict, requests: list[tuple[list[int], SamplingParams]]
) -> list[Completion]:
    """Every request's tokens and finish reason (stop or length), in request order."""
    completions = [Completion(list(p), s) for p, s in requests]
    for c in completions:
        engine.limits.check(len(c.prompt_ids), c.sampling)
    waiting = deque(range(len(completions)))
    state = engine.init_decode_state()
    slots: dict[int, int] = {}  # slot -> request index
    free = list(range(engine.max_concurrent_decodes))
    while waiting or slots:
        while waiting and free:
            index = waiting.popleft()
            c = completions[index]
            prefix, first = engine.prefill(
                params, engine.limits.pad(c.prompt_ids), len(c.prompt_ids), c.sampling
            )
            c.token_ids.append(first)
            if first in c.sampling.stop_ids or c.sampling.max_tokens <= 1:
                c.finish_reason = "stop" if first in c.sampling.stop_ids else "length"
                continue
            slot = free.pop()
            state = engine.insert(prefix, state, slot)
            slots[slot] = index
        if not slots:
            continue
        state, result = engine.generate(params, state)
        tokens, valid, done = (np.asarray(x) for x in result)
        for step in range(tokens.shape[0]):
            for slot, index in list(slots.items()):
                if not valid[step, slot]:
                    continue
                c = completions[index]
                token = int(tokens[step, slot])
                c.token_ids.append(token)
                if done[step, slot]:
                    c.finish_reason = "stop" if token in c.sampling.stop_ids else "length"
                    del slots[slot]
                    free.append(slot)
    return completions


def measure(cfg: ServingConfig, source: str | None, prompts: list[str], max_tokens: int) -> dict:
    """Output tokens/s of `generate_all` over `prompts` (greedy, exactly `max_tokens` each, after
    compiling): the offline baseline the HTTP server is compared with."""
    import time

    from serving.checkpoints.model_source import load_model
    from serving.runtime import init_runtime

    init_runtime(cfg)
    model = load_model(source, cfg)
    engine = Engine(model, cfg)
    params = engine.load_params()
    requests = [(model.tokenizer.encode_prompt(p), SamplingParams(max_tokens=max_tokens)) for p in prompts]
    if cfg.enable_model_warmup:
        engine.warmup(params)
    generate_all(engine, params, requests[: engine.max_concurrent_decodes])  # compile what warmup did not
    started = time.perf_counter()
    done = generate_all(engine, params, requests)
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
