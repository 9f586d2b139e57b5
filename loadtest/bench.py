"""`pathserve bench serve`: drive a running server at several concurrency levels and report
request throughput, output tokens/s, TTFT, TPOT, ITL and end-to-end latency (mean, median, p90,
p99) per level. Writes results/serve-bench.json, -throughput.png and -latency.png; prints a table.

Speaks HTTP (the OpenAI routes, streamed) or, with `--grpc HOST:PORT`, JetStream's gRPC API the
way JetStream's own benchmark does (prompts tokenized here, `token_content`, token ids streamed
back); works against a local server or a deployed Service. Without --url or an address it starts
the default model's server here. `--temperature` and `--top-p` go on every HTTP request (default
greedy); JetStream's proto has no sampling fields, so gRPC runs are greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from loadtest import dataset
from loadtest.client import Result, request_body, stream_one
from loadtest.server import Server, free_port

PERCENTILES = (50, 90, 99)
LOCAL = "local"  # --grpc without an address: start the server here and bench its gRPC port


async def run_level(
    url: str,
    api: str,
    prompts: list[dataset.Prompt],
    concurrency: int,
    requests: int | None,
    duration: float | None,
    model: str | None,
    ignore_eos: bool,
    headers: dict[str, str],
    sampling: dict[str, float] | None = None,
) -> tuple[list[Result], float]:
    """`concurrency` workers send prompts back to back until `requests` are done or `duration` is up.

    `sampling` (temperature, top_p) goes into every request body."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def send(i: int) -> Result:
            prompt = prompts[i]
            body = request_body(api, prompt.text, prompt.max_tokens, model, ignore_eos) | (sampling or {})
            return await stream_one(client, url, api, body, headers)

        return await _drive(send, len(prompts), concurrency, requests, duration)


async def run_grpc_level(
    address: str,
    prompts: list[dataset.Prompt],
    prompt_ids: list[list[int]],
    concurrency: int,
    requests: int | None,
    duration: float | None,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[list[Result], float]:
    """`run_level` over gRPC: `prompt_ids[i]` is `prompts[i]` tokenized on this side."""
    from loadtest import grpc_client

    async with grpc_client.channel(address) as chan:
        orchestrator = grpc_client.stub(chan)

        async def send(i: int) -> Result:
            return await grpc_client.stream_one(orchestrator, prompt_ids[i], prompts[i].max_tokens, metadata)

        return await _drive(send, len(prompts), concurrency, requests, duration)


async def _drive(
    send: Callable[[int], Awaitable[Result]],
    num_prompts: int,
    concurrency: int,
    requests: int | None,
    duration: float | None,
) -> tuple[list[Result], float]:
    """`concurrency` workers `send` prompt indices in turn (cycling); returns the results and the wall time."""
    next_index = 0
    results: list[Result] = []
    deadline = time.perf_counter() + duration if duration else None

    async def worker() -> None:
        nonlocal next_index
        while True:
            if requests is not None and next_index >= requests:
                return
            if deadline is not None and time.perf_counter() >= deadline:
                return
            index = next_index % num_prompts
            next_index += 1
            results.append(await send(index))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - started


def summarize(results: list[Result], wall: float, concurrency: int) -> dict:
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "wall_s": wall,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "output_tokens_per_s": out_tokens / wall if wall else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": _stats([gap for r in ok for gap in r.itl]),
        "e2e_ms": _stats([r.e2e for r in ok]),
    }


SPEC_COUNTERS = ("proposed_tokens", "accepted_tokens", "rounds")


def speculative_counts(url: str, headers: dict[str, str]) -> dict[str, dict[str, float]]:
    """The server's speculative decoding counters from /metrics: method -> counter -> value
    (empty when the server has none, or /metrics cannot be read)."""
    try:
        return parse_speculative(httpx.get(f"{url}/metrics", headers=headers, timeout=10).text)
    except httpx.HTTPError:
        return {}


def parse_speculative(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> method -> speculative counter -> value."""
    counts: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        for name in SPEC_COUNTERS:
            prefix = f"pathserve_spec_decode_{name}_total{{method=\""
            if line.startswith(prefix):
                method, value = line[len(prefix) :].split('"}')
                counts.setdefault(method, {})[name] = float(value)
    return counts


def speculative_summary(before: dict, after: dict) -> dict | None:
    """A level's speculative decoding (the counters' growth over it): proposed and accepted
    tokens, acceptance rate and mean accepted length per verified slot-call, per method."""
    out = {}
    for method, counts in after.items():
        grown = {n: counts.get(n, 0.0) - before.get(method, {}).get(n, 0.0) for n in SPEC_COUNTERS}
        if method == "none" or not grown["proposed_tokens"]:
            continue
        out[method] = {
            "proposed": int(grown["proposed_tokens"]),
            "accepted": int(grown["accepted_tokens"]),
            "acceptance_rate": grown["accepted_tokens"] / grown["proposed_tokens"],
            "mean_accepted_length": grown["accepted_tokens"] / grown["rounds"] if grown["rounds"] else 0.0,
        }
    return out or None


def _stats(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "count": 0}
    ms = sorted(s * 1000 for s in seconds)
    out = {"mean": statistics.fmean(ms), "median": statistics.median(ms), "count": len(ms)}
    for p in PERCENTILES[1:]:
        out[f"p{p}"] = ms[min(len(ms) - 1, max(0, round(p / 100 * len(ms)) - 1))]
    return out


def plot(levels: list[dict], out: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [level["concurrency"] for level in levels]
    paths = [out / "serve-bench-throughput.png", out / "serve-bench-latency.png"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [level["output_tokens_per_s"] for level in levels], "o-", label="output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(
        xs, [level["request_throughput"] for level in levels], "s--", color="tab:orange", label="requests/s"
    )
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    ax2.set_ylabel("requests/s")
    ax.set_title(f"{title}: throughput")
    ax.grid(True, alpha=0.3)
    fig.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, metric in zip(axes.flat, ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"), strict=True):
        for key, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(xs, [level[metric][key] for level in levels], style, label=key)
        ax.set_title(metric.removesuffix("_ms").upper() + " (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("concurrent requests")
    fig.suptitle(f"{title}: latency percentiles")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def table(levels: list[dict]) -> str:
    head = f"{'conc':>4} {'done':>5} {'err':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ITL p50':>8} {'E2E p50':>8}"
    rows = [head]
    for lv in levels:
        rows.append(
            f"{lv['concurrency']:4d} {lv['completed']:5d} {lv['errors']:4d} {lv['request_throughput']:7.2f} "
            f"{lv['output_tokens_per_s']:9.1f} {lv['ttft_ms']['median']:9.1f} {lv['ttft_ms']['p99']:9.1f} "
            f"{lv['tpot_ms']['median']:9.1f} {lv['itl_ms']['median']:8.1f} {lv['e2e_ms']['median']:8.1f}"
        )
        for method, spec in lv.get("speculative", {}).items():
            rows.append(
                f"     speculative ({method}): {spec['proposed']} proposed, {spec['accepted']} accepted, "
                f"acceptance {spec['acceptance_rate']:.2f}, mean accepted length {spec['mean_accepted_length']:.2f}"
            )
    return "\n".join(rows)


def build_parser(prog: str = "pathserve bench serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", help="the server, e.g. http://127.0.0.1:8000 (default: start the default model here)"
    )
    parser.add_argument(
        "--grpc",
        nargs="?",
        const=LOCAL,
        metavar="HOST:PORT",
        help="bench JetStream's gRPC API at HOST:PORT instead of HTTP "
        "(no address: on the server started here)",
    )
    parser.add_argument(
        "--tokenizer",
        help="--grpc: tokenize prompts here with this (a Hugging Face directory, tokenizer.json, "
        "tokenizer.model or GGUF file; default: the default model's)",
    )
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="key=value for the server started without --url"
    )
    parser.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    parser.add_argument("--requests", type=int, help="requests per level (default: 4 x concurrency)")
    parser.add_argument("--duration", type=float, help="seconds per level instead of a request count")
    parser.add_argument("--api", choices=("completions", "chat"), default="completions")
    parser.add_argument("--dataset", help="a ShareGPT JSON file (default: a synthetic set)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-words", type=int, default=300)
    parser.add_argument("--max-output-tokens", type=int, default=256)
    parser.add_argument("--ignore-eos", action="store_true", help="generate every requested token")
    parser.add_argument("--temperature", type=float, default=0.0, help="on every request; 0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="on every request")
    parser.add_argument("--model", help="model name to send (default: the server's /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("PATHSERVE_API_KEY", ""))
    parser.add_argument("--out", type=Path, default=Path("results"))
    return parser


def main(argv: list[str] | None = None, prog: str = "pathserve bench serve") -> int:
    ns = build_parser(prog).parse_args(argv)
    try:
        levels_asked = [int(c) for c in ns.concurrency.split(",")]
    except ValueError:
        raise SystemExit(
            f"{prog}: error: --concurrency: comma-separated integers, got {ns.concurrency!r}"
        ) from None
    if any(c < 1 for c in levels_asked):
        raise SystemExit(f"{prog}: error: --concurrency: every level must be >= 1")
    _check_options(ns, prog)
    if ns.url:
        return _bench(ns, levels_asked, prog, url=ns.url.rstrip("/"))
    if ns.grpc and ns.grpc != LOCAL:
        return _bench(ns, levels_asked, prog, grpc_address=ns.grpc)
    grpc_port = free_port() if ns.grpc else 0
    args = [*ns.serve_arg, f"per_device_batch_size={max(levels_asked)}", f"grpc_port={grpc_port}"]
    with Server(args, ns.out / "serve-bench-server.log") as server:
        print(f"starting the server at {server.url} (log: {server.log_path}) ...", flush=True)
        server.wait_ready()
        if ns.grpc:
            return _bench(ns, levels_asked, prog, grpc_address=f"127.0.0.1:{grpc_port}")
        return _bench(ns, levels_asked, prog, url=server.url)


def _check_options(ns: argparse.Namespace, prog: str) -> None:
    if ns.grpc and ns.url:
        raise SystemExit(f"{prog}: error: --url is the HTTP server; give --url or --grpc, not both")
    if not ns.temperature >= 0:
        raise SystemExit(f"{prog}: error: --temperature must be >= 0")
    if not 0 < ns.top_p <= 1:
        raise SystemExit(f"{prog}: error: --top-p must be in (0, 1]")
    if ns.grpc and (ns.temperature or ns.top_p != 1.0 or ns.ignore_eos or ns.api != "completions"):
        raise SystemExit(
            f"{prog}: error: --grpc decodes greedily to max_tokens or end-of-sequence (JetStream's proto "
            "has no sampling fields nor ignore_eos, and no chat): drop --temperature, --top-p, "
            "--ignore-eos and --api"
        )


def _bench(
    ns: argparse.Namespace,
    levels_asked: list[int],
    prog: str,
    url: str | None = None,
    grpc_address: str | None = None,
) -> int:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    most = max(levels_asked) * 4 if ns.requests is None else ns.requests
    prompts = dataset.load(ns.dataset, max(most, 64), ns.seed, ns.max_prompt_words, ns.max_output_tokens)
    if grpc_address is not None:
        run, target, model = _grpc_runner(ns, prompts, grpc_address, headers, prog)
    else:
        assert url is not None
        run, target, model = _http_runner(ns, prompts, url, headers, prog)
    levels = []
    for concurrency in levels_asked:
        requests = None if ns.duration else (ns.requests or 4 * concurrency)
        before = speculative_counts(url, headers) if url is not None else None
        results, wall = asyncio.run(run(concurrency, requests))
        levels.append(summarize(results, wall, concurrency))
        if before is not None and (spec := speculative_summary(before, speculative_counts(url, headers))):
            levels[-1]["speculative"] = spec
        print(json.dumps({k: v for k, v in levels[-1].items() if not k.endswith("_ms")}), flush=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    report = {
        "url": target,
        "model": model,
        "api": "grpc" if grpc_address is not None else ns.api,
        "sampling": {"temperature": ns.temperature, "top_p": ns.top_p},
        "dataset": ns.dataset or "synthetic",
        "args": {k: str(v) for k, v in vars(ns).items() if k != "api_key"},
        "levels": levels,
    }
    (ns.out / "serve-bench.json").write_text(json.dumps(report, indent=2))
    plots = plot(levels, ns.out, model)
    print(table(levels))
    print(f"wrote {ns.out / 'serve-bench.json'}, {', '.join(str(p) for p in plots)}")
    return 0


# A level's runner: (concurrency, requests or None for --duration) -> (results, wall seconds)
Runner = Callable[[int, int | None], Awaitable[tuple[list[Result], float]]]


def _http_runner(
    ns: argparse.Namespace, prompts: list[dataset.Prompt], url: str, headers: dict[str, str], prog: str
) -> tuple[Runner, str, str]:
    try:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        raise SystemExit(f"{prog}: error: --url {url}: cannot list models: {exc}") from None
    model = ns.model or models[0]["id"]
    sampling = {"temperature": ns.temperature, "top_p": ns.top_p}

    def run(concurrency: int, requests: int | None):
        return run_level(
            url, ns.api, prompts, concurrency, requests, ns.duration, model, ns.ignore_eos, headers, sampling
        )

    return run, url, model


def _grpc_runner(
    ns: argparse.Namespace, prompts: list[dataset.Prompt], address: str, headers: dict[str, str], prog: str
) -> tuple[Runner, str, str]:
    """Tokenize every prompt here (as JetStream's benchmark does), then stream token ids."""
    from loadtest import grpc_client
    from serving.errors import UserError

    try:
        tokenizer = grpc_client.load_tokenizer(ns.tokenizer)
    except UserError as exc:
        raise SystemExit(f"{prog}: error: --tokenizer: {exc}") from None
    if not asyncio.run(grpc_client.wait_live(address)):
        raise SystemExit(f"{prog}: error: --grpc {address}: HealthCheck did not say live within 30 s")
    prompt_ids = [tokenizer.encode_prompt(p.text) for p in prompts]
    metadata = tuple((k.lower(), v) for k, v in headers.items())
    model = ns.model or (Path(ns.tokenizer).name if ns.tokenizer else "default model")

    def run(concurrency: int, requests: int | None):
        return run_grpc_level(address, prompts, prompt_ids, concurrency, requests, ns.duration, metadata)

    return run, f"grpc://{address}", model


if __name__ == "__main__":  # `pathserve bench serve` runs this, naming itself in PATHSERVE_BENCH_PROG
    raise SystemExit(main(sys.argv[1:], prog=os.environ.get("PATHSERVE_BENCH_PROG", "pathserve bench serve")))
