"""Speculative decoding's benchmark (not a test): one stream on the default model (configs/serving/
default.yml: SmolLM2-135M-Instruct, int8 weights), alternating rounds of speculation off and on,
on an input-copying workload (rewrite a paragraph with one word changed) and on open-ended chat;
then the crossover: ms per plain decode step against ms per verify call (k + 1 positions) at each
slot count, whose ratio says from how many slots speculation stops paying. Offline (the
scheduler and executor driven synchronously: serving.orchestrator.offline), so the figures are the
engine's, not HTTP's. Writes results/spec-bench.json.

    python -m loadtest.spec_bench [--rounds 3] [--max-tokens 96] [--method ngram|draft] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from serving.checkpoints.model_source import default_model_path, load_model
from serving.config import DevicesConfig, config_dir, load_config
from serving.engine.engine import Engine
from serving.orchestrator.executor import Executor
from serving.orchestrator.offline import run_to_completion
from serving.orchestrator.proposers import Speculator
from serving.request import SamplingParams
from serving.runtime import make_mesh

PARAGRAPH = (
    "The lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
    "climbed the narrow stairs, trimmed the wick and polished the great lens, so that ships passing in the "
    "dark could find their way around the rocks and into the safety of the harbour."
)
WORKLOADS = {
    "copy": f"Rewrite this paragraph, changing only the word 'night' to 'evening':\n\n{PARAGRAPH}",
    "chat": "Tell me about your favourite season and why you like it.",
}


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def _stream(engine, params, prompt, max_tokens, speculator, executor) -> tuple[float, int, list[int]]:
    """One request's seconds, token count and tokens, on `executor` (one for every round: a new
    one would allocate the KV pool inside the timing, ~0.7-1.3 s of page faults on this model).
    The request ends at the model's end of turn, as a server's does: past it the model writes a
    new, made-up turn, no longer a copy (the copy workload's last 40 of 96 tokens were that)."""
    sampling = SamplingParams(max_tokens=max_tokens, stop_ids=tuple(engine.model.tokenizer.eos_ids))
    started = time.perf_counter()
    result = run_to_completion(engine, params, [(prompt, sampling)], speculator=speculator, executor=executor)[0]
    return time.perf_counter() - started, len(result.token_ids), result.token_ids


def _crossover(engine, params, k: int, repeats: int = 3) -> dict[int, dict[str, float]]:
    """ms per generate step and per verify call (k proposals, none accepted) at each slot bucket,
    every slot active at position 128."""
    out = {}
    for slots in engine.limits.decode_buckets:
        state = engine.init_decode_state()
        state = state._replace(
            active=state.active.at[:slots].set(True),
            positions=state.positions.at[:slots].set(128),
            sampling=state.sampling._replace(max_tokens=state.sampling.max_tokens.at[:].set(1 << 20)),
        )
        proposals = np.ones((engine.max_concurrent_decodes, k), np.int32)
        counts = np.full((engine.max_concurrent_decodes,), k, np.int32)
        timings = {"generate": [], "verify": []}
        for i in range(repeats + 1):  # the first of each compiles
            started = time.perf_counter()
            state, result = engine.generate(params, state, max_position=200, num_slots=slots)
            jax.block_until_ready(result.tokens)
            if i:
                timings["generate"].append((time.perf_counter() - started) / engine.decode_steps_per_call)
            started = time.perf_counter()
            state, result = engine.verify(params, state, proposals, counts, max_position=200, num_slots=slots)
            jax.block_until_ready(result.tokens)
            if i:
                timings["verify"].append(time.perf_counter() - started)
        step, verify = (1000 * float(np.median(timings[n])) for n in ("generate", "verify"))
        out[slots] = {"step_ms": step, "verify_ms": verify, "ratio": verify / step}
        print(f"slots {slots:3d}: decode step {step:7.1f} ms, verify of {k} {verify:7.1f} ms, x{verify / step:.2f}")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--method", default="ngram", choices=("ngram", "draft"))
    parser.add_argument("--draft-quantization", default="int8w", choices=("", "int8w", "int8"),
                        help="--method draft: the default model drafts for itself with these weights")
    parser.add_argument("--skip-crossover", action="store_true")
    parser.add_argument("--only-crossover", action="store_true")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: copy, chat")
    parser.add_argument("overrides", nargs="*")
    ns = parser.parse_args(argv)
    cfg = load_config(config_dir() / "serving" / "default.yml", ["enable_model_warmup=false", *ns.overrides])
    model = load_model(str(default_model_path()), cfg)
    spec_cfg = cfg.speculative
    if spec_cfg.speculative_method == "none":
        import dataclasses

        spec_cfg = dataclasses.replace(spec_cfg, speculative_method=ns.method)
    mesh = make_mesh(DevicesConfig(), jax.devices()[:1])  # the engine's default: the first device alone
    draft = None
    if spec_cfg.speculative_method == "draft":
        from serving.engine.draft import load_draft

        draft_cfg = cfg.model_copy(update={
            "speculative_model": str(default_model_path()), "quantization": ns.draft_quantization,
            "speculative_method": "draft", "num_speculative_tokens": spec_cfg.num_speculative_tokens,
        })
        draft = load_draft(draft_cfg, cfg.engine, mesh, model.tokenizer, model.config.num_params)
    engine = Engine(model, cfg.engine, mesh, draft=draft)
    params = engine.load_params()
    report: dict = {"config": spec_cfg.__dict__, "target": engine.summary(), "workloads": {}}
    if draft is not None:
        report["draft"] = draft.engine.summary()

    def speculator() -> Speculator:
        return Speculator(spec_cfg, chunk=engine.limits.prefill_chunk_size)

    chosen_workloads = [] if ns.only_crossover else ns.workloads.split(",")
    executor = Executor(engine, params)
    for name, text in ((n, WORKLOADS[n]) for n in chosen_workloads):
        prompt = _prompt(model.tokenizer, text)
        # compile both paths, at every history window the timed runs reach
        _stream(engine, params, prompt, ns.max_tokens, speculator(), executor)
        _stream(engine, params, prompt, ns.max_tokens, None, executor)
        rates: dict[str, list[float]] = {"off": [], "on": []}
        stats = None
        for _ in range(ns.rounds):
            for mode in ("off", "on"):
                chosen = speculator() if mode == "on" else None
                seconds, count, tokens = _stream(engine, params, prompt, ns.max_tokens, chosen, executor)
                rates[mode].append(count / seconds)
                if chosen is not None:
                    stats = chosen.stats
                    tokens_on = tokens
                else:
                    tokens_off = tokens
        assert tokens_on == tokens_off, "greedy tokens differ with speculation"
        off, on = float(np.median(rates["off"])), float(np.median(rates["on"]))
        entry = {
            "tok_s_off": off, "tok_s_on": on, "speedup": on / off, "rounds_off": rates["off"], "rounds_on": rates["on"],
            "proposed": stats.proposed, "accepted": stats.accepted, "verify_rounds": stats.rounds,
            "acceptance_rate": stats.accepted / stats.proposed if stats.proposed else 0.0,
            "mean_accepted_length": stats.accepted / stats.rounds if stats.rounds else 0.0,
        }
        report["workloads"][name] = entry
        print(f"{name}: {off:.1f} -> {on:.1f} tok/s (x{on / off:.2f}); acceptance {entry['acceptance_rate']:.2f}, "
              f"mean accepted {entry['mean_accepted_length']:.2f} of {spec_cfg.num_speculative_tokens}")
    if not ns.skip_crossover:
        report["crossover"] = _crossover(engine, params, spec_cfg.num_speculative_tokens)
    out = Path("results") / "spec-bench.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
