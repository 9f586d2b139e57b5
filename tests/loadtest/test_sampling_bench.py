"""loadtest.sampling_bench measures what it says: its `without` arm's step really has no logit
processing (a penalized request decodes as a plain one there, and differently on today's step),
and every arm decodes at some rate. On the tiny model, XLA's ops."""

from __future__ import annotations

import numpy as np

from loadtest.engine_bench import engine_decode_rate
from loadtest.sampling_bench import ARMS, without_processing
from serving.engine.engine import Engine
from serving.request import SamplingParams
from tests.conftest import tiny_engine

STRONG = dict(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=3.0)


def greedy_tokens(engine: Engine, params: dict, prompt: list[int], fields: dict, steps: int = 12) -> list[int]:
    """Slot 0's first token and the next ones, `steps` generate calls."""
    state = engine.init_decode_state()
    prefix, first = engine.prefill(params, engine.limits.pad(prompt), len(prompt), SamplingParams(max_tokens=64, **fields))
    state = engine.insert(prefix, state, 0)
    tokens = [int(np.asarray(first).reshape(-1)[0])]
    for _ in range(steps):
        state, result = engine.generate(params, state, max_position=len(prompt) + len(tokens) + 4)
        valid, out = np.asarray(result.valid), np.asarray(result.tokens)
        tokens += [int(t) for t in out[:, 0][valid[:, 0]]]
    return tokens


def test_the_without_arm_has_no_logit_processing_and_todays_step_has(tiny_model_dir):
    prompt = list(range(5, 25)) * 2
    with without_processing():
        _, bare, bare_params = tiny_engine(tiny_model_dir, decode_steps_per_call=2)
        stripped = greedy_tokens(bare, bare_params, prompt, STRONG)
        rates = {name: engine_decode_rate(bare, bare_params, prompt, 2, 4, fields) for name, fields in ARMS.items()}
    _, engine, params = tiny_engine(tiny_model_dir, decode_steps_per_call=2)
    plain = greedy_tokens(engine, params, prompt, {})
    assert stripped == plain
    assert greedy_tokens(engine, params, prompt, STRONG) != plain
    assert all(rate > 0 for rate in rates.values()), rates
