"""`make bench-peers` (`python -m loadtest.peers`): pathserve and vLLM's CPU build side by side, on the
same weights, with identical request sets, in one run.

Both servers run on loopback at once; every cell (request set x sampling x concurrency) is run
against both, one after the other, `--rounds` times, the order flipping from cell to cell and round
to round so that neither server always goes first on a warmer or quieter machine. Requests are
streamed OpenAI completions sent by the same client as `pathserve bench serve`
(`loadtest.bench.run_level`), all with `ignore_eos` and the same `max_tokens`, so that both servers
generate the same number of tokens.

Request sets (prompt token counts are counted with the model's own tokenizer, which both use):
- short: the synthetic set's short prompts (about 20-120 tokens);
- long: 1024-1976 (+ one word) prompt tokens, so that prompt + 64 fits a 2048-token context;
- system: one shared 400-token system prompt before a short question, what a prefix cache serves.
Sampling: greedy (temperature 0) and sampled (temperature 1, top_p 1).

Every (round, cell) draws prompts of its own (both servers get the same ones, one after the other),
so no cell is served from KV a server's prefix cache kept from an earlier cell: a long prompt is
prefilled cold, and the system set's shared prefix is shared within its cell only. (With one set for
every cell, the long set's 8 prompts at 8 concurrent were the 8 the 1-concurrent cell had just sent,
which vLLM's prefix cache, sized by --kv-cache-gib, still held.)

With --prefix-cache-off a second pathserve server (prefix_cache=off) runs the system set too, in the
same rotation, for the prefix cache's effect on TTFT.

Reported per cell: output tokens/s, TTFT and TPOT (median, p90, p99) of each server, the ratio
pathserve / vLLM of each, and the issue's targets, met or not. Writes results/peers-bench.json and
results/peers-bench.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest import dataset
from loadtest.bench import run_level, summarize
from loadtest.client import Result
from loadtest.peers_report import METRICS, NOCACHE, PEERS, add_roofline, cell_report, plot, table, targets

__all__ = ["METRICS", "NOCACHE", "PEERS", "cell_report", "plot", "table", "targets"]

SETS = ("short", "long", "system")
SAMPLING = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "sampled": {"temperature": 1.0, "top_p": 1.0}}
LONG_TOKENS = (1024, 1976)  # + a word's overshoot + 64 output tokens fits 2048
SYSTEM_TOKENS = 400
SHORT_WORDS = (30, 100)  # (median, max) words of the short set
Counter = Callable[[str], int]


@dataclass(frozen=True)
class Cell:
    """One measured point: a request set, a sampling mode and a concurrency level."""

    set: str
    sampling: str
    concurrency: int

    @property
    def key(self) -> str:
        return f"{self.set}/{self.sampling}/c{self.concurrency}"


def words_to_tokens(rng: random.Random, count: Counter, tokens: int, lead: str = "") -> str:
    """`lead` followed by random common words, `tokens` tokens long in all (or the first word count
    past it, when no word count hits it exactly); a binary search over the number of words."""
    words = [rng.choice(dataset.WORDS) for _ in range(tokens * 2 + 8)]

    def text(n: int) -> str:
        return (lead + " " + " ".join(words[:n])).strip()

    low, high = 0, len(words)
    while low < high:
        mid = (low + high) // 2
        if count(text(mid)) < tokens:
            low = mid + 1
        else:
            high = mid
    return text(low)


def request_set(name: str, n: int, count: Counter, seed: int = 0, max_tokens: int = 64) -> list[dataset.Prompt]:
    """`n` prompts of set `name` (see the module docstring), each asking for `max_tokens`."""
    rng = random.Random(f"{name}-{seed}")
    if name == "short":
        base = dataset.synthetic(n, seed, prompt_words=SHORT_WORDS, output_tokens=(max_tokens, max_tokens))
        return [dataset.Prompt(p.text, max_tokens) for p in base]
    if name == "long":
        return [
            dataset.Prompt(words_to_tokens(rng, count, rng.randint(*LONG_TOKENS), rng.choice(dataset.TASKS)), max_tokens)
            for _ in range(n)
        ]
    if name == "system":
        system = words_to_tokens(random.Random(f"system-{seed}"), count, SYSTEM_TOKENS, "You are a helpful assistant.")
        questions = dataset.synthetic(n, seed + 1, prompt_words=(15, 40), output_tokens=(max_tokens, max_tokens))
        return [dataset.Prompt(f"{system}\n\nUser: {q.text}\nAssistant:", max_tokens) for q in questions]
    raise ValueError(f"unknown request set {name!r} (one of {', '.join(SETS)})")


def cells(sets: Sequence[str], sampling: Sequence[str], levels: Sequence[int]) -> list[Cell]:
    return [Cell(s, m, c) for s in sets for m in sampling for c in levels]


def schedule(
    all_cells: Sequence[Cell], rounds: int, peers: Sequence[str] = PEERS, system_peers: Sequence[str] = ()
) -> list[tuple[int, Cell, str]]:
    """(round, cell, peer) in run order: every cell against every peer back to back, round after
    round, the order reversing from one (round, cell) to the next. `system_peers` also run the
    shared-system-prompt cells (pathserve with the prefix cache off)."""
    out = []
    turn = 0
    for r in range(rounds):
        for cell in all_cells:
            these = [*peers, *(system_peers if cell.set == "system" else ())]
            order = these if turn % 2 == 0 else these[::-1]
            out.extend((r, cell, peer) for peer in order)
            turn += 1
    return out


def prompt_sets(
    plan: Sequence[tuple[int, Cell, str]], requests: Callable[[int], int], count: Counter, seed: int, max_tokens: int
) -> dict[tuple[int, Cell], list[dataset.Prompt]]:
    """The prompts of every (round, cell) of `plan`: `requests(concurrency)` of the cell's set, each
    (round, cell) with a seed of its own (see the module docstring)."""
    out: dict[tuple[int, Cell], list[dataset.Prompt]] = {}
    for r, cell, _peer in plan:
        if (r, cell) not in out:
            out[r, cell] = request_set(cell.set, requests(cell.concurrency), count, seed * 10_000 + len(out), max_tokens)
    return out


def measure(
    urls: dict[str, str],
    models: dict[str, str],
    prompts: dict[tuple[int, Cell], list[dataset.Prompt]],
    plan: Sequence[tuple[int, Cell, str]],
    requests: Callable[[int], int],
    max_tokens: int,
) -> list[dict]:
    """Run `plan` and return one `cell_report` per cell, in the plan's first-seen order; `prompts`
    as `prompt_sets` makes them."""
    runs: dict[Cell, dict[str, list[tuple[list[Result], float]]]] = {}
    for r, cell, peer in plan:
        results, wall = asyncio.run(
            run_level(
                urls[peer],
                "completions",
                prompts[r, cell],
                cell.concurrency,
                requests(cell.concurrency),
                None,
                models[peer],
                True,
                {},
                SAMPLING[cell.sampling],
            )
        )
        runs.setdefault(cell, {}).setdefault(peer, []).append((results, wall))
        s = summarize(results, wall, cell.concurrency)
        print(
            f"round {r} {cell.key:<22} {peer:<9} {s['completed']:3d} done {s['errors']:2d} err "
            f"{s['output_tokens_per_s']:7.1f} tok/s TTFT p50 {s['ttft_ms']['median']:8.1f} ms "
            f"TPOT p50 {s['tpot_ms']['median']:6.1f} ms",
            flush=True,
        )
        if s["error_examples"]:
            print(f"    errors, e.g. {s['error_examples'][0]}", flush=True)
    return [cell_report(cell, peer_runs, max_tokens) for cell, peer_runs in runs.items()]


def build_parser(prog: str = "python -m loadtest.peers") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated levels")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)}")
    parser.add_argument("--sampling", default=",".join(SAMPLING), help=f"comma-separated, of {', '.join(SAMPLING)}")
    parser.add_argument("--rounds", type=int, default=2, help="times each cell runs against each server")
    parser.add_argument("--requests", type=int, help="requests per cell and round (default: max(8, 2 x concurrency))")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens of every request (ignore_eos)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pathserve-url", help="a running pathserve server (default: start one here)")
    parser.add_argument("--vllm-url", help="a running vLLM server (default: start one here)")
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="key=value for the pathserve server (last: overrides)"
    )
    parser.add_argument("--vllm-arg", action="append", default=[], help="one more argument for vLLM's api_server")
    parser.add_argument(
        "--vllm-env", action="append", default=[], metavar="KEY=VALUE", help="an environment variable for vLLM's server only"
    )
    parser.add_argument("--vllm-venv", type=Path, default=Path(".venv-vllm"))
    parser.add_argument("--no-install", action="store_true", help="fail instead of installing vLLM when it is missing")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--max-model-len", type=int, default=2048, help="vLLM's context (pathserve: max_target_length)")
    parser.add_argument(
        "--model-dir", type=Path, help="the default model as Hugging Face safetensors (default: exported into $PATHSERVE_HOME once)"
    )
    parser.add_argument(
        "--prefix-cache-off",
        action="store_true",
        help="also start pathserve with prefix_cache=off and run the system set against it (the prefix cache's effect)",
    )
    parser.add_argument(
        "--shape", help="serve a random-weight model of this preset's shape (configs/models/, e.g. llama3.2-1b; built "
        "once with the default model's tokenizer) to both, pathserve with int8w weights, instead of the default model",
    )
    parser.add_argument(
        "--isa", choices=("native", "avx2"), default="native", help="avx2: hold both servers to AVX2 on a CPU that "
        "has more, for an AVX2-only machine's figures (loadtest.vllm_peer.isa_env says how; results get -avx2)",
    )
    parser.add_argument("--out", type=Path, default=Path("results"))
    return parser


def _parse(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[list[str], list[str], list[int]]:
    """The lists of --sets, --sampling and --concurrency; a bad value exits 2 naming the flag."""
    def names(value: str, allowed: Sequence[str], flag: str) -> list[str]:
        out = [v for v in value.split(",") if v]
        bad = [v for v in out if v not in allowed]
        if bad or not out:
            parser.error(f"{flag}: {', '.join(bad) or 'empty'}; choose from {', '.join(allowed)}")
        return out

    try:
        levels = [int(c) for c in ns.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: comma-separated integers, got {ns.concurrency!r}")
    if any(c < 1 for c in levels):
        parser.error("--concurrency: every level must be >= 1")
    if ns.rounds < 1 or (ns.requests is not None and ns.requests < 1) or ns.max_tokens < 2:
        parser.error("--rounds and --requests must be >= 1, --max-tokens >= 2")
    if any("=" not in item for item in ns.vllm_env):
        parser.error(f"--vllm-env: KEY=VALUE, got {next(i for i in ns.vllm_env if '=' not in i)!r}")
    if ns.isa != "native" and (ns.pathserve_url or ns.vllm_url):
        parser.error(f"--isa {ns.isa}: holds the servers started here only; drop --pathserve-url / --vllm-url")
    return names(ns.sets, SETS, "--sets"), names(ns.sampling, tuple(SAMPLING), "--sampling"), levels


def pathserve_args(ns: argparse.Namespace, sets: Sequence[str]) -> list[str]:
    """The pathserve server's arguments (--shape's model first, with int8 weights as the default
    model's profile has them): its default config (`make serve`'s), with vLLM's
    context (--max-model-len) as max_target_length only when the long set runs (the default 1024
    cannot hold its prompts, and a longer KV cache costs every decode step of the other sets),
    then --serve-arg (which may override either)."""
    context = [f"max_target_length={ns.max_model_len}"] if "long" in sets else []
    model = [str(shape_model_dir(ns.shape)), "quantization=int8w"] if ns.shape else []
    return [*model, *context, *ns.serve_arg]


def default_model_dir() -> Path:
    """The default model exported once as bfloat16 safetensors into $PATHSERVE_HOME/export/."""
    from serving.checkpoints.export_hf import export_hf
    from serving.checkpoints.model_source import default_model_path
    from serving.home import pathserve_home

    target = pathserve_home() / "export" / "smollm2-135m-instruct-hf"
    if not (target / "model.safetensors").is_file() or not (target / "config.json").is_file():
        print(f"bench-peers: exporting the default model to {target} (once)", flush=True)
        export_hf(default_model_path(), target, "bfloat16")
    return target


def prompt_tokens_per_output(
    prompts: dict[tuple[int, Cell], list[dataset.Prompt]], count: Counter, max_tokens: int
) -> dict[str, float]:
    """Per request set, the prompt tokens a request computes for each of its `max_tokens` output
    tokens, at most: the text every prompt of a (round, cell) begins with (the system set's shared
    prompt) counts as computed by none of them, as if a prefix cache held all of it (it holds whole
    pages or blocks, after the first request), so a compute bound from it stays a bound."""
    computed: dict[str, list[int]] = {}
    for (_round, cell), cell_prompts in prompts.items():
        texts = [p.text for p in cell_prompts]
        shared = count(_shared_start(texts)) if len(texts) > 1 else 0
        computed.setdefault(cell.set, []).extend(max(count(t) - shared, 0) for t in texts)
    return {name: sum(ts) / len(ts) / max_tokens for name, ts in computed.items()}


def _shared_start(texts: Sequence[str]) -> str:
    """The longest text every one of `texts` begins with (character by character)."""
    return os.path.commonprefix(list(texts))  # noqa: RUF071 - characters, not path components


def shape_model_dir(shape: str) -> Path:
    """A random-weight model of `shape` (loadtest.random_model, bfloat16, the default model's
    tokenizer) built once into $PATHSERVE_HOME/export/."""
    from loadtest.random_model import write_random_model
    from serving.home import pathserve_home

    target = pathserve_home() / "export" / f"random-{shape}-hf"
    if not (target / "model.safetensors").is_file() or not (target / "config.json").is_file():
        print(f"bench-peers: writing a random model of {shape}'s shape to {target} (once)", flush=True)
        write_random_model(target, shape, default_model_dir())
    return target


def measure_bandwidth() -> float:
    """The machine's memory read bandwidth (bytes/s: engine_bench's probe, best of 5), measured
    before the servers start so that neither competes with it."""
    from loadtest.engine_bench import Machine

    return Machine().measure()[0]


def measure_int8_rate(rows: int = 64, size: int = 1024, calls: int = 16) -> float | None:
    """Multiply-adds a second of the int8w matmul pathserve serves with (the CPU kernels, in the
    layout this CPU takes: AMX's where it has it), on `rows` rows and a `size` x `size` weight that
    stays in cache: the rate a compute-bound decode step runs at, best of 5 runs of `calls` calls;
    None where the kernels do not run. Measured before the servers start."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from serving.kernels import cpu_matmul, library

    if not library.status().available:
        return None
    rng = np.random.default_rng(0)
    w = cpu_matmul.pack(jnp.asarray(rng.integers(-127, 128, (size, size), dtype=np.int8)), jnp.ones(size))
    x = jnp.asarray(rng.standard_normal((rows, size)).astype(np.float32))

    @jax.jit
    def run(x):  # x + i: no call is the same as another
        return jax.lax.fori_loop(0, calls, lambda i, acc: acc + cpu_matmul.matmul(x + i, w)[0, 0], 0.0)

    run(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return calls * rows * size * size / best


def main(argv: list[str] | None = None, prog: str = "python -m loadtest.peers") -> int:
    from contextlib import ExitStack

    import httpx

    from loadtest.server import Server
    from loadtest.vllm_peer import (
        PeerError,
        VLLMServer,
        compute_cpus,
        ensure_venv,
        isa_env,
        measure_bf16_rate,
        server_env,
    )
    from serving.text.tokenizer import load_tokenizer

    parser = build_parser(prog)
    ns = parser.parse_args(argv)
    sets, sampling, levels = _parse(ns, parser)
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.shape is not None:
        from serving.config import load_model_config
        from serving.errors import ConfigError

        try:
            model_config = load_model_config(ns.shape)
        except ConfigError as exc:
            parser.error(f"--shape: {exc}")
        model_dir = shape_model_dir(ns.shape)
    else:
        model_dir = ns.model_dir or default_model_dir()
    stem = ("peers-bench" if ns.shape is None else f"peers-bench-{ns.shape}") + ("" if ns.isa == "native" else f"-{ns.isa}")
    ours_env, isa_vllm_env = isa_env(ns.isa, dict(os.environ))
    os.environ.update(ours_env)  # before the probes and pathserve's server, which inherits it
    tokenizer = load_tokenizer(model_dir)
    count: Counter = lambda text: len(tokenizer.encode_prompt(text))  # noqa: E731
    requests: Callable[[int], int] = lambda c: ns.requests or max(8, 2 * c)  # noqa: E731
    plan = schedule(cells(sets, sampling, levels), ns.rounds, system_peers=(NOCACHE,) if ns.prefix_cache_off else ())
    prompts = prompt_sets(plan, requests, count, ns.seed, ns.max_tokens)
    lengths: dict[str, list[int]] = {}
    for (_r, cell), cell_prompts in prompts.items():
        lengths.setdefault(cell.set, []).extend(count(p.text) for p in cell_prompts)
    lengths = {name: sorted(ls) for name, ls in lengths.items()}
    for name, ls in lengths.items():
        print(f"set {name}: {len(ls)} prompts, {ls[0]}-{ls[-1]} prompt tokens (median {ls[len(ls) // 2]})", flush=True)
    bandwidth = measure_bandwidth()
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    int8_rate = measure_int8_rate()
    if int8_rate:
        print(f"int8w matmul (the CPU kernels, in cache) {int8_rate / 1e9:.0f} G multiply-adds/s", flush=True)
    urls = {"pathserve": ns.pathserve_url, "vllm": ns.vllm_url}
    vllm_env = dict(item.split("=", 1) for item in ns.vllm_env)
    if "PYTHONPATH" in vllm_env and "PYTHONPATH" in isa_vllm_env:  # both: --isa's first
        vllm_env["PYTHONPATH"] = os.pathsep.join((isa_vllm_env["PYTHONPATH"], vllm_env["PYTHONPATH"]))
    vllm_env = {**isa_vllm_env, **vllm_env}
    with ExitStack() as stack:
        try:
            if not ns.vllm_url:
                python = ensure_venv(ns.vllm_venv, ns.out / "peers-vllm-install.log", install=not ns.no_install)
                vllm = stack.enter_context(
                    VLLMServer(python, model_dir, ns.out / f"{stem}-vllm-server.log", max_model_len=ns.max_model_len,
                               kv_cache_gib=ns.kv_cache_gib, extra=ns.vllm_arg, env=vllm_env)
                )
                print(f"starting vLLM at {vllm.url} (log: {vllm.log_path}) ...", flush=True)
                urls["vllm"] = vllm.url
            if not ns.pathserve_url:
                args = pathserve_args(ns, sets)
                ours = stack.enter_context(Server(args, ns.out / f"{stem}-pathserve-server.log"))
                print(f"starting pathserve at {ours.url} (log: {ours.log_path}) ...", flush=True)
                urls["pathserve"] = ours.url
            nocache = None
            if ns.prefix_cache_off and "system" in sets:
                args = [*pathserve_args(ns, sets), "prefix_cache=off"]
                nocache = stack.enter_context(Server(args, ns.out / "peers-pathserve-nocache-server.log"))
                print(f"starting pathserve (prefix_cache=off) at {nocache.url} ...", flush=True)
                urls[NOCACHE] = nocache.url
            if not ns.vllm_url:
                vllm.wait_ready()  # first: the peer is the one more likely to fail, and says why
            if not ns.pathserve_url:
                ours.wait_ready()
            if nocache is not None:
                nocache.wait_ready()
            peer_matmul = None  # vLLM's bfloat16 matmul rate on its own cores, both servers idle
            if not ns.vllm_url:
                cpus = compute_cpus(vllm.log_path.read_text(errors="replace")) or sorted(os.sched_getaffinity(0))
                rate, kernel = measure_bf16_rate(python, cpus, vllm_env)
                peer_matmul = {"macs_per_s": rate, "kernel": kernel, "cpus": cpus}
                print(f"vLLM's bfloat16 matmul ({kernel}, in cache, CPUs {cpus}) {rate / 1e9:.0f} G multiply-adds/s", flush=True)
        except (PeerError, RuntimeError, TimeoutError) as exc:
            raise SystemExit(f"{prog}: error: {exc}") from None
        models = {}
        for peer, url in urls.items():
            try:
                models[peer] = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
                raise SystemExit(f"{prog}: error: {peer} at {url}: cannot list models: {exc}") from None
        warmup = request_set("short", 2, count, -1, ns.max_tokens)
        for peer in urls:  # a warm-up request each, not measured
            asyncio.run(run_level(urls[peer], "completions", warmup, 1, 2, None, models[peer], True, {}))
        report_cells = measure(urls, models, prompts, plan, requests, ns.max_tokens)
    if ns.shape is None:
        from serving.config import load_model_config

        model_config = load_model_config("smollm2-135m")  # the default model's shape
    contexts = {name: ls[len(ls) // 2] + ns.max_tokens // 2 for name, ls in lengths.items()}
    rates = {"pathserve": int8_rate, "vllm": peer_matmul and peer_matmul["macs_per_s"]}
    prompt_per_output = prompt_tokens_per_output(prompts, count, ns.max_tokens)
    add_roofline(report_cells, model_config, bandwidth, contexts, rates, prompt_per_output)
    report = {
        "ratio": "pathserve / vllm (above 1 is better for output_tokens_per_s, below 1 for latencies)",
        "urls": urls,
        "models": models,
        "model_dir": str(model_dir),
        "pathserve_args": None if ns.pathserve_url else pathserve_args(ns, sets),
        "vllm_args": {"dtype": "bfloat16", "max_model_len": ns.max_model_len, "kv_cache_gib": ns.kv_cache_gib, "extra": ns.vllm_arg},
        # vLLM's CPU settings as its server saw them (VLLM_CPU_OMP_THREADS_BIND etc. pass through from
        # this environment; unset, vLLM 0.32 binds its threads to all cores but one, kept for its frontend)
        "vllm_env": None if ns.vllm_url else {k: v for k, v in server_env(ns.kv_cache_gib, vllm_env).items() if k.startswith("VLLM_") or k in vllm_env},
        "prompt_tokens": {name: {"min": ls[0], "median": ls[len(ls) // 2], "max": ls[-1]} for name, ls in lengths.items()},
        "args": {k: str(v) for k, v in vars(ns).items()},
        "cells": report_cells,
        "shape": ns.shape,
        "isa": {"asked": ns.isa, "pathserve": ours_env, "vllm": isa_vllm_env},
        "bandwidth_bytes_per_s": bandwidth,
        "int8_macs_per_s": int8_rate,
        "vllm_matmul": peer_matmul,
        "roofline": "per cell and peer: output tok/s if a step read only its weights (pathserve int8w, vLLM bf16) "
        "and its KV cache (pathserve float32, vLLM bf16) once at the measured bandwidth, and the fraction reached; "
        "also if every token, prompt and output, cost only its matmuls' multiply-adds at the peer's measured rate "
        "(pathserve's int8w kernel; vLLM's bfloat16 matmul on the CPUs it binds, `vllm_matmul` naming which; a "
        "prompt token without the head, a prefix every prompt of a cell shares free) (compute_bound_tokens_per_s), "
        "`applies` naming the lower bound",
        "prompt_tokens_computed_per_output_token": prompt_per_output,
        "targets": targets(report_cells, ns.shape),
    }
    path = ns.out / f"{stem}.json"
    path.write_text(json.dumps(report, indent=2))
    png = plot(report_cells, ns.out / f"{stem}.png")
    print(table(report_cells))
    for t in report["targets"]:
        print(f"target: {t['target']}: {t['value']} -> {'met' if t['met'] else 'not met' if t['met'] is False else 'not measured'}")
    print(f"wrote {path}, {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
