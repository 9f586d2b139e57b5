"""The paged KV cache's benchmark (not a test): what paging buys at real, mixed lengths, and that it
costs nothing where it buys nothing. Offline (the scheduler and executor driven synchronously), on
the default model (configs/serving/default.yml: SmolLM2-135M-Instruct, int8w), greedy with no stop
id (every request generates its max_tokens, as `ignore_eos` would). Writes results/paged-bench.json
and results/paged-bench.png.

Each measurement runs in a fresh process (`--worker`) against a source tree: this one, or the
baseline's (`--baseline-ref`, default the last commit with the contiguous cache: a git worktree of that commit, made once under
$PATHSERVE_HOME/bench-trees), so a version without the paged cache is measured in the same run. Rounds alternate
between the two. Figures:

- **mixed**: 128 requests, prompt and output lengths lognormal (means ~250 and ~150 tokens, seeded,
  cut to fit max_target_length=1024). `today`: the baseline's 16 slots of 1024 positions. `paged`:
  this tree, 64 slots sharing a pool of the same bytes (kv_cache_bytes_per_chip = 16 x 1024
  positions). Sequences decoding at once (the most, and the mean over decode calls) and output tok/s.
- **one** / **short32**: the default config, one request of 64 tokens, and 32 short requests (~40
  prompt tokens, 32 output tokens) at once: baseline against this tree.
- **prefix**: a 2,048-token shared system prompt (max_target_length 4096), the prefix cache on: the
  second request's time to its first token, baseline (copies the cached blocks into its slot)
  against this tree (its table names the cached pages).

    python -m loadtest.paged_bench [--rounds 2] [--baseline-ref REF | --baseline-tree DIR] [--model SOURCE]
        [--scenarios mixed,one,short32,prefix]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
SCENARIOS = ("mixed", "one", "short32", "prefix")
CONTIGUOUS = "0812c4e"  # the last commit whose KV cache was one contiguous row per slot
MIXED_REQUESTS = 128
REPEATS = 5  # timed runs of the short scenarios per worker (the median one is reported)
TARGET = 1024


def _lognormal(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    """A lognormal draw with this mean (not median), cut to [low, high]."""
    mu = math.log(mean) - sigma * sigma / 2
    return int(min(high, max(low, round(rng.lognormvariate(mu, sigma)))))


def mixed_lengths(n: int, seed: int = 0, target: int = TARGET) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of `n` requests, means ~250 and ~150, long-tailed, each pair
    fitting `target` positions."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = _lognormal(rng, 250, 0.8, 8, target - 64)
        output = _lognormal(rng, 150, 0.8, 4, target - prompt)
        out.append((prompt, output))
    return out


# -- the worker: one measurement in this process, against whichever `serving` is on the path ----------


def _text_ids(tokenizer, count: int, offset: int) -> list[int]:
    text = (REPO / "tests" / "data" / "english.txt").read_text()
    ids = tokenizer.encode(text)
    ids = ids * (1 + (offset + count) // len(ids))
    return ids[offset : offset + count]


def _drive(engine, params, requests, prefix: bool = False) -> dict:
    """Serve `requests` [(prompt ids, SamplingParams)] to completion, all queued at once: wall
    seconds, output tokens, sequences decoding per generate call, each request's first-token time."""
    from serving.orchestrator.executor import Executor
    from serving.orchestrator.scheduler import Scheduler, Waiting

    caching = prefix
    try:  # the baseline's prefix cache is an index of copied blocks under a byte budget
        from serving.orchestrator.prefix_cache import PrefixCache

        if prefix:
            caching = PrefixCache(engine.limits.prefix_block, engine.prefix_block_bytes, 1 << 30)
        else:
            caching = None
    except ImportError:
        pass
    scheduler = Scheduler(engine.limits, engine.decode_steps_per_call, caching)
    executor = Executor(engine, params)
    waiting = list(range(len(requests)))
    firsts: dict[int, float] = {}
    decoding, tokens, prefill_s, generate_s = [], 0, 0.0, 0.0
    started = time.perf_counter()
    while waiting or scheduler.num_used:
        room = min(scheduler.room(), len(waiting))
        admit, waiting = waiting[:room], waiting[room:]
        plan = scheduler.schedule([Waiting(i, tuple(requests[i][0]), requests[i][1]) for i in admit])
        slots = {slot: r.request_id for slot, r in scheduler.running.items()}
        outcome = executor.run(plan)
        prefill_s += sum(executor.timings.prefills)
        generate_s += executor.timings.generate or 0.0
        now = time.perf_counter() - started
        for slot in plan.first_token_slots:
            firsts.setdefault(slots[slot], now)
        tokens += len(outcome.first_tokens) + sum(sum(v) for v in outcome.valid)
        if outcome.tokens:
            decoding.append(sum(outcome.valid[0]))
        scheduler.update(plan, outcome)
    return {
        "seconds": time.perf_counter() - started,
        "tokens": tokens,
        "decoding_max": max(decoding, default=0),
        "decoding_mean": sum(decoding) / len(decoding) if decoding else 0.0,
        "first_token_s": [firsts[i] for i in sorted(firsts)],
        "preemptions": getattr(scheduler, "preemptions", 0),
        "prefill_s": prefill_s,
        "generate_s": generate_s,
    }


def _engine(overrides: list[str], source: str | None = None):
    from serving.checkpoints.model_source import default_model_path, load_model
    from serving.config import config_dir, load_config
    from serving.engine.engine import Engine

    cfg = load_config(config_dir() / "serving" / "default.yml", ["enable_model_warmup=false", *overrides])
    model = load_model(source or str(default_model_path()), cfg)
    engine = Engine(model, cfg.engine)
    return model, engine, engine.load_params()


def worker(scenario: str, variant: str, kv_bytes: int, source: str | None = None) -> dict:
    """One scenario's measurement (after an untimed run that compiles its shapes), on the model
    `source` (default: the default model)."""
    from serving.request import SamplingParams

    if scenario == "mixed":
        overrides = ["per_device_batch_size=16"] if variant == "today" else [
            "per_device_batch_size=64", f"kv_cache_bytes_per_chip={kv_bytes}"]
        model, engine, params = _engine(overrides, source)
        lengths = mixed_lengths(MIXED_REQUESTS)
        requests = [
            (_text_ids(model.tokenizer, p, 37 * i), SamplingParams(max_tokens=o)) for i, (p, o) in enumerate(lengths)
        ]
        _drive(engine, params, requests)  # compiles every shape the timed run takes
        out = _drive(engine, params, requests)
        out["kv_bytes"] = engine.placement.cache_bytes_per_chip()
        return out
    if scenario in ("one", "short32"):
        model, engine, params = _engine([], source)
        if scenario == "one":
            requests = [(_text_ids(model.tokenizer, 40, 0), SamplingParams(max_tokens=64))]
        else:
            requests = [(_text_ids(model.tokenizer, 30 + i % 20, 53 * i), SamplingParams(max_tokens=32)) for i in range(32)]
        _drive(engine, params, requests)
        runs = sorted((_drive(engine, params, requests) for _ in range(REPEATS)), key=lambda r: r["seconds"])
        return runs[len(runs) // 2]  # the median run: a short measurement repeated
    if scenario == "prefix":
        model, engine, params = _engine(["max_target_length=4096", "max_prefill_predict_length=512", "per_device_batch_size=4"], source)
        system = _text_ids(model.tokenizer, 2048, 0)
        questions = [_text_ids(model.tokenizer, 24, 3000 + 97 * i) for i in range(2 + REPEATS)]
        one = SamplingParams(max_tokens=1)
        _drive(engine, params, [(system + questions[0], one), (system + questions[1], one)], prefix=True)  # compile
        return _drive_pair(engine, params, system, questions[2:])
    raise ValueError(scenario)


def _drive_pair(engine, params, system, questions) -> dict:
    """The first request (the system prompt and a question) to completion, then each next one
    alone: their seconds to the first token with the first one's pages (or blocks) cached (the
    median of them as `second_s`)."""
    from serving.orchestrator.executor import Executor
    from serving.orchestrator.scheduler import Scheduler, Waiting
    from serving.request import SamplingParams

    try:
        from serving.orchestrator.prefix_cache import PrefixCache

        caching = PrefixCache(engine.limits.prefix_block, engine.prefix_block_bytes, 1 << 30)
    except ImportError:
        caching = True
    scheduler, executor = Scheduler(engine.limits, engine.decode_steps_per_call, caching), Executor(engine, params)
    times = []
    for i, question in enumerate(questions):
        started = time.perf_counter()
        plan = scheduler.schedule([Waiting(i, tuple(system + question), SamplingParams(max_tokens=1))])
        while True:
            outcome = executor.run(plan)
            scheduler.update(plan, outcome)
            if outcome.first_tokens:
                break
            plan = scheduler.schedule([])
        times.append(time.perf_counter() - started)
    later = sorted(times[1:])
    return {"first_s": times[0], "second_s": later[len(later) // 2], "later_s": times[1:]}


# -- the parent: trees, alternating rounds, the report ------------------------------------------------


def _baseline_tree(ref: str) -> Path:
    """A worktree of `ref` outside the repository (under PATHSERVE_HOME), made once per commit."""
    from serving.home import pathserve_home

    commit = subprocess.run(["git", "rev-parse", ref], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    tree = pathserve_home() / "bench-trees" / commit[:12]
    if not tree.exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True,
                       capture_output=True)
    return tree


def _measure(tree: Path, scenario: str, variant: str, kv_bytes: int, source: str | None = None) -> dict:
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)  # the tree's `serving` first
    env = {**os.environ, "PYTHONPATH": path, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    args = [sys.executable, str(Path(__file__).resolve()), "--worker", scenario, variant, str(kv_bytes)]
    args += ["--model", source] if source else []
    run = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{scenario}/{variant} in {tree} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _kv_bytes_per_position(source: str | None = None) -> int:
    from serving.checkpoints.model_source import describe_model
    from serving.config import config_dir, load_config, load_model_config

    cfg = load_config(config_dir() / "serving" / "default.yml", ["enable_model_warmup=false"])
    model = describe_model(source, cfg) if source else load_model_config("smollm2-135m")
    itemsize = 1 if cfg.quantize_kvcache else (4 if cfg.dtype == "float32" else 2)
    return model.num_layers * 2 * model.num_kv_heads * model.head_dim * itemsize


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline-ref", default=CONTIGUOUS, help="the tree measured as today's")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="a source tree to measure as today's instead of --baseline-ref's worktree")
    parser.add_argument("--model", default=None, help="a model source (default: the default model)")
    parser.add_argument("--worker", nargs=3, metavar=("SCENARIO", "VARIANT", "KV_BYTES"), help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.worker:
        scenario, variant, kv_bytes = ns.worker
        print(json.dumps(worker(scenario, variant, int(kv_bytes), ns.model)))
        return {}
    baseline = ns.baseline_tree.resolve() if ns.baseline_tree else _baseline_tree(ns.baseline_ref)
    kv_bytes = 16 * TARGET * _kv_bytes_per_position(ns.model)
    report: dict = {
        "baseline_ref": str(ns.baseline_tree) if ns.baseline_tree else ns.baseline_ref,
        "model": ns.model or "default",
        "kv_cache_bytes_per_chip": kv_bytes,
        "scenarios": {},
    }
    for scenario in ns.scenarios.split(","):
        rounds: dict[str, list[dict]] = {"today": [], "paged": []}
        for _ in range(ns.rounds):
            for variant, tree in (("today", baseline), ("paged", REPO)):
                rounds[variant].append(_measure(tree, scenario, variant, kv_bytes, ns.model))
                print(scenario, variant, json.dumps({k: v for k, v in rounds[variant][-1].items() if k != "first_token_s"}),
                      flush=True)
        report["scenarios"][scenario] = {"rounds": rounds, **_summary(scenario, rounds)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "paged-bench.json").write_text(json.dumps(report, indent=2))
    _plot(report)
    for name, entry in report["scenarios"].items():
        print(name, {k: v for k, v in entry.items() if k != "rounds"})
    return report


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _summary(scenario: str, rounds: dict[str, list[dict]]) -> dict:
    if scenario == "prefix":
        today, paged = (_median([r["second_s"] for r in rounds[v]]) for v in ("today", "paged"))
        return {"second_ttft_today_s": today, "second_ttft_paged_s": paged, "ratio": paged / today}
    rate = {v: _median([r["tokens"] / r["seconds"] for r in rounds[v]]) for v in rounds}
    out = {"tok_s_today": rate["today"], "tok_s_paged": rate["paged"], "ratio": rate["paged"] / rate["today"]}
    if scenario == "mixed":
        for v in rounds:
            out[f"decoding_max_{v}"] = max(r["decoding_max"] for r in rounds[v])
            out[f"decoding_mean_{v}"] = _median([r["decoding_mean"] for r in rounds[v]])
            out[f"preemptions_{v}"] = max(r["preemptions"] for r in rounds[v])
    return out


def _plot(report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["scenarios"])
    ratios = [report["scenarios"][n]["ratio"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, ratios, color=["tab:green" if r >= 1 else "tab:orange" for r in ratios])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("paged / today (tok/s; prefix: TTFT)")
    ax.set_title("Paged KV cache against the contiguous one, same run")
    fig.tight_layout()
    fig.savefig(RESULTS / "paged-bench.png", dpi=120)


if __name__ == "__main__":
    main()
