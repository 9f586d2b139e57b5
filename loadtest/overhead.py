"""`pathserve bench overhead`: what the HTTP layer costs. The offline engine (`pathserve bench
offline --rounds-from-stdin`, loaded once in its own process) and the HTTP server, both up, run the
same prompts with the same config, greedy and with exactly `--max-tokens` each, in alternating
rounds (offline, HTTP, offline, HTTP, ...) at each of `--batches` (concurrent streams; the offline
engine runs that many requests at a time), so that the machine's drift falls on both alike; the
report is, per batch, the ratio of HTTP output tokens/s (streamed) to offline output tokens/s, best
round against best round. Writes results/serve-overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from loadtest import dataset
from loadtest.bench import run_level, summarize
from loadtest.server import Server


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("args", nargs="*", metavar="[SOURCE] [key=value ...]", help="as for pathserve serve")
    parser.add_argument("--batches", default="1,32", help="concurrent streams per point (comma-separated)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating offline / HTTP rounds per batch")
    parser.add_argument("--requests", type=int, default=64, help="requests per round at the largest batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-prompt-words", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"))
    return parser


def main(argv: list[str] | None = None, prog: str = "pathserve bench overhead") -> int:
    ns = build_parser(prog).parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    batches = sorted({int(b) for b in ns.batches.split(",")})
    prompts = dataset.synthetic(
        ns.requests,
        ns.seed,
        prompt_words=(ns.max_prompt_words // 2, ns.max_prompt_words),
        output_tokens=(ns.max_tokens, ns.max_tokens),
    )
    # The default model's serving defaults, with slots for the largest batch; later key=value win.
    args = [
        "quantization=int8w",
        "enable_model_warmup=true",
        "max_prefill_predict_length=256",
        "max_target_length=512",
        *ns.args,
        f"per_device_batch_size={max(batches)}",
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"prompt": p.text} for p in prompts], f)
    command = [sys.executable, "-m", "serving.cli", "bench", "offline", "--prompts", f.name]
    command += ["--max-tokens", str(ns.max_tokens), "--rounds-from-stdin", *args]
    log = (ns.out / "serve-overhead-offline.log").open("w")
    offline = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    fixed = [dataset.Prompt(p.text, ns.max_tokens) for p in prompts]
    points = []
    try:
        print("offline engine and HTTP server: loading both ...", flush=True)
        _expect(offline, "ready")
        with Server(args, ns.out / "serve-overhead-server.log") as server:
            server.wait_ready()
            model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            asyncio.run(run_level(server.url, "completions", fixed[: max(batches)], max(batches), max(batches), None, model, True, {}))
            for batch in batches:
                count = max(batch, ns.requests * batch // max(batches))  # fewer requests at small batches
                point = {"batch": batch, "requests": count, "offline": [], "http": []}
                for round_ in range(ns.rounds):
                    offline.stdin.write(f"{batch} {count}\n")
                    offline.stdin.flush()
                    point["offline"].append(_expect(offline, "tokens_per_s"))
                    results, wall = asyncio.run(
                        run_level(server.url, "completions", fixed[:count], batch, count, None, model, True, {})
                    )
                    point["http"].append(summarize(results, wall, batch))
                    print(
                        f"batch {batch} round {round_ + 1}: offline {point['offline'][-1]['tokens_per_s']:.1f} tok/s, "
                        f"HTTP {point['http'][-1]['output_tokens_per_s']:.1f} tok/s",
                        flush=True,
                    )
                best_offline = max(r["tokens_per_s"] for r in point["offline"])
                best_http = max(r["output_tokens_per_s"] for r in point["http"])
                point["ratio"] = best_http / best_offline
                points.append(point)
    finally:
        Path(f.name).unlink(missing_ok=True)  # also when the offline engine failed to load
        offline.stdin.close()
        offline.wait(timeout=60)
        log.close()
    report = {"args": args, "max_tokens": ns.max_tokens, "rounds": ns.rounds, "points": points}
    (ns.out / "serve-overhead.json").write_text(json.dumps(report, indent=2))
    errors = sum(r["errors"] for p in points for r in p["http"])
    for p in points:
        print(f"batch {p['batch']}: HTTP/offline = {p['ratio']:.2f} (best of {ns.rounds} alternating rounds each)")
    return 0 if errors == 0 else 1


def _expect(process: subprocess.Popen, key: str) -> dict:
    """The offline process's next JSON line, which must hold `key`."""
    line = process.stdout.readline()
    if not line:
        raise SystemExit(f"the offline engine stopped (exit {process.wait()}); see serve-overhead-offline.log")
    reply = json.loads(line)
    if key not in reply:
        raise SystemExit(f"the offline engine answered {line!r}")
    return reply


if __name__ == "__main__":  # `pathserve bench overhead` runs this, naming itself in PATHSERVE_BENCH_PROG
    raise SystemExit(main(sys.argv[1:], prog=os.environ.get("PATHSERVE_BENCH_PROG", "pathserve bench overhead")))
