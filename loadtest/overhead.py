"""`pathserve bench overhead`: what the HTTP layer costs. The offline engine (`pathserve bench
offline`, in its own process) and then the HTTP server run the same prompts with the same config
at the same batch, greedy and with exactly `--max-tokens` each; the report is the ratio of HTTP
output tokens/s (streamed, `--batch` concurrent clients) to offline output tokens/s.
Writes results/serve-overhead.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
    parser.add_argument("--batch", type=int, default=32, help="decode slots = concurrent HTTP streams")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-words", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"))
    return parser


def main(argv: list[str] | None = None, prog: str = "pathserve bench overhead") -> int:
    ns = build_parser(prog).parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    prompts = dataset.synthetic(
        ns.requests,
        ns.seed,
        prompt_words=(ns.max_prompt_words // 2, ns.max_prompt_words),
        output_tokens=(ns.max_tokens, ns.max_tokens),
    )
    # The default model's serving defaults, at the benchmark's batch; later key=value win.
    args = [
        "quantization=int8w",
        "enable_model_warmup=true",
        "max_prefill_predict_length=256",
        "max_target_length=512",
        *ns.args,
        f"per_device_batch_size={ns.batch}",
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"prompt": p.text} for p in prompts], f)
    print(
        f"offline engine: {len(prompts)} prompts x {ns.max_tokens} tokens at batch {ns.batch} ...", flush=True
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "serving.cli",
            "bench",
            "offline",
            "--prompts",
            f.name,
            "--max-tokens",
            str(ns.max_tokens),
            *args,
        ],
        capture_output=True,
        text=True,
    )
    Path(f.name).unlink()
    if run.returncode != 0:
        raise SystemExit(f"{prog}: the offline run failed:\n{run.stderr[-3000:]}")
    offline = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(offline), flush=True)
    print(f"HTTP server: the same prompts, {ns.batch} concurrent streams ...", flush=True)
    with Server(args, ns.out / "serve-overhead-server.log") as server:
        server.wait_ready()
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        fixed = [dataset.Prompt(p.text, ns.max_tokens) for p in prompts]
        asyncio.run(
            run_level(server.url, "completions", fixed[: ns.batch], ns.batch, ns.batch, None, model, True, {})
        )
        results, wall = asyncio.run(
            run_level(server.url, "completions", fixed, ns.batch, len(fixed), None, model, True, {})
        )
    http = summarize(results, wall, ns.batch)
    ratio = http["output_tokens_per_s"] / offline["tokens_per_s"]
    report = {"args": args, "max_tokens": ns.max_tokens, "offline": offline, "http": http, "ratio": ratio}
    (ns.out / "serve-overhead.json").write_text(json.dumps(report, indent=2))
    print(
        f"batch {ns.batch}: offline {offline['tokens_per_s']:.1f} tok/s, HTTP {http['output_tokens_per_s']:.1f} tok/s "
        f"({http['errors']} errors): HTTP/offline = {ratio:.2f}"
    )
    return 0 if http["errors"] == 0 else 1
