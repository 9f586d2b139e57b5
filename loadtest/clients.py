"""Two benchmark clients against one `pathserve serve`: vLLM's own (`vllm bench serve --backend
openai`, from the venv `make bench-peers` installs) and `pathserve bench serve`, the same requests at
the same concurrency, in alternating rounds.

What it shows: every request of vLLM's client succeeds (it sends vLLM's sampling fields, such as
`repetition_penalty: 1.0`, with every request), and the output tokens per second each client
reports for the same work agree (issue 45's target: within 10%). Both read one ShareGPT-format
file written here: the same prompts, each asking for `--output-tokens` tokens with ignore_eos
(vLLM's `--sharegpt-output-len`; ours, every reply long enough that `--max-output-tokens` is the
budget). Two sets, each with the same temperature from both clients: `greedy` (vLLM's
`--temperature 0`, ours by default) and `sampled` (vLLM's client as it runs by default: it sends
no temperature since vLLM 0.11, so the server's default, OpenAI's 1, applies; ours with
`--temperature 1`). Writes results/clients.json and clients.png.

    python -m loadtest.clients [--url URL] [--concurrency 8] [--requests 64] [--rounds 4] [--sets greedy,sampled]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

from loadtest import bench, dataset


def write_dataset(path: Path, requests: int, output_tokens: int, seed: int) -> None:
    """`requests` conversations: a synthetic prompt, and a reply of enough words that a ShareGPT
    reader's budget (reply words x 1.3, clipped) is `output_tokens`."""
    prompts = dataset.synthetic(requests, seed, prompt_words=(60, 300), output_tokens=(output_tokens, output_tokens))
    reply = " ".join(["word"] * (output_tokens + 8))
    rows = [{"conversations": [{"from": "human", "value": p.text}, {"from": "gpt", "value": reply}]} for p in prompts]
    path.write_text(json.dumps(rows))


SETS = ("greedy", "sampled")


def median_ratios(rounds: list[dict]) -> dict[str, float]:
    """Each set's median over rounds of vLLM's client's tok/s over ours: what the target reads
    (one round of ~12 s moves by 10% and more with the machine's speed on two cores)."""
    by_set: dict[str, list[float]] = {}
    for got in rounds:
        by_set.setdefault(got["sampling"], []).append(got["ratio"])
    return {name: statistics.median(ratios) for name, ratios in by_set.items()}


def vllm_round(
    venv: Path, url: str, model: str, tokenizer: Path, data: Path, ns: argparse.Namespace, out: Path, sampling: str
) -> dict:
    """vLLM's client, one run; `sampling` greedy (--temperature 0) or sampled (its default: no
    temperature sent)."""
    from loadtest.vllm_peer import bench_serve_command

    name = f"vllm-{out.name}.json"
    command = bench_serve_command(venv, [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", model,
        "--tokenizer", str(tokenizer), "--dataset-name", "sharegpt", "--dataset-path", str(data),
        "--sharegpt-output-len", str(ns.output_tokens), "--num-prompts", str(ns.requests),
        "--max-concurrency", str(ns.concurrency), "--ignore-eos", "--seed", str(ns.seed),
        "--save-result", "--result-dir", str(out.parent), "--result-filename", name,
        *(["--temperature", "0"] if sampling == "greedy" else []),
    ])
    run = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    (out.parent / f"{name}.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({run.returncode}); see {out.parent / (name + '.log')}")
    result = json.loads((out.parent / name).read_text())
    return {
        "completed": result["completed"],
        "failed": result.get("failed", result["num_prompts"] - result["completed"]),
        "output_tokens": result["total_output_tokens"],
        "output_tokens_per_s": result["output_throughput"],
        "wall_s": result["duration"],
    }


def pathserve_round(url: str, data: Path, ns: argparse.Namespace, out: Path, sampling: str) -> dict:
    """`pathserve bench serve`, one run; `sampling` greedy (its default) or sampled (--temperature 1)."""
    out.mkdir(parents=True, exist_ok=True)
    bench.main([
        "--url", url, "--concurrency", str(ns.concurrency), "--requests", str(ns.requests), "--dataset", str(data),
        "--max-output-tokens", str(ns.output_tokens), "--ignore-eos", "--seed", str(ns.seed), "--out", str(out),
        "--temperature", "0" if sampling == "greedy" else "1",
    ])
    level = json.loads((out / "serve-bench.json").read_text())["levels"][0]
    return {
        "completed": level["completed"],
        "failed": level["errors"],
        "output_tokens": level["output_tokens"],
        "output_tokens_per_s": level["output_tokens_per_s"],
        "wall_s": level["wall_s"],
    }


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running pathserve server (default: start the default model here)")
    parser.add_argument("--model-dir", type=Path, help="a Hugging Face directory for vLLM's tokenizer (default: the default model's export)")
    parser.add_argument("--serve-arg", action="append", default=[], help="key=value for the server started here")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sets", default=",".join(SETS), help="greedy, sampled or both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-venv", type=Path, default=Path(".venv-vllm"))
    parser.add_argument("--out", type=Path, default=Path("results"))
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m loadtest.clients") -> int:
    import httpx

    from loadtest.peers import default_model_dir
    from loadtest.server import Server
    from loadtest.vllm_peer import is_installed

    ns = build_parser(prog).parse_args(argv)
    if min(ns.concurrency, ns.requests, ns.output_tokens, ns.rounds) < 1:
        raise SystemExit(f"{prog}: error: --concurrency, --requests, --output-tokens and --rounds must be >= 1")
    sets = ns.sets.split(",")
    if unknown := [s for s in sets if s not in SETS]:
        raise SystemExit(f"{prog}: error: --sets: {', '.join(unknown)} is not one of {', '.join(SETS)}")
    if not is_installed(ns.vllm_venv):
        raise SystemExit(f"{prog}: error: no vLLM in {ns.vllm_venv}: `make bench-peers` installs it")
    ns.out.mkdir(parents=True, exist_ok=True)
    data = ns.out / "clients-dataset.json"
    write_dataset(data, ns.requests, ns.output_tokens, ns.seed)
    tokenizer = ns.model_dir or default_model_dir()
    with ExitStack() as stack:
        url = ns.url
        if not url:
            server = stack.enter_context(Server(ns.serve_arg, ns.out / "clients-server.log"))
            print(f"starting pathserve at {server.url} (log: {server.log_path}) ...", flush=True)
            url = server.wait_ready().url
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        # untimed, each client once per set with every request of a round: the server's first calls
        # of each shape compile before either client is measured (prompt buckets, decode buckets,
        # and the prefix-cache hits a repeated prompt makes; a pass of a few requests left vLLM's
        # first timed round 25% slow)
        for sampling in sets:
            pathserve_round(url, data, ns, ns.out / "clients" / f"warmup-pathserve-{sampling}", sampling)
            vllm_round(ns.vllm_venv, url, model, tokenizer, data, ns, ns.out / "clients" / f"warmup-vllm-{sampling}",
                       sampling)
        rounds = []
        for r in range(ns.rounds):
            order = ("vllm", "pathserve") if r % 2 == 0 else ("pathserve", "vllm")
            for sampling in sets:
                got: dict = {"round": r, "sampling": sampling}
                for client in order:
                    out = ns.out / "clients" / f"{client}-{sampling}-round{r}"
                    got[client] = (
                        vllm_round(ns.vllm_venv, url, model, tokenizer, data, ns, out, sampling) if client == "vllm"
                        else pathserve_round(url, data, ns, out, sampling)
                    )
                    print(f"round {r} {sampling} {client}: {json.dumps(got[client])}", flush=True)
                got["ratio"] = got["vllm"]["output_tokens_per_s"] / got["pathserve"]["output_tokens_per_s"]
                rounds.append(got)
    report = {
        "url": url, "model": model, "concurrency": ns.concurrency, "requests": ns.requests,
        "output_tokens": ns.output_tokens, "rounds": rounds,
        "ratio": "vllm bench serve's output tok/s / pathserve bench serve's, same requests, same server",
        "median_ratio": median_ratios(rounds),
        "every_request_succeeded": all(r[c]["failed"] == 0 for r in rounds for c in ("vllm", "pathserve")),
    }
    (ns.out / "clients.json").write_text(json.dumps(report, indent=2))
    _plot(rounds, ns.out / "clients.png")
    for got in rounds:
        print(f"round {got['round']} {got['sampling']}: vllm {got['vllm']['output_tokens_per_s']:.1f} tok/s, "
              f"pathserve {got['pathserve']['output_tokens_per_s']:.1f} tok/s, ratio {got['ratio']:.3f}")
    for name, ratio in report["median_ratio"].items():
        print(f"{name}: median ratio {ratio:.3f} over {ns.rounds} rounds")
    print(f"wrote {ns.out / 'clients.json'}, {ns.out / 'clients.png'}")
    return 0


def _plot(rounds: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = range(len(rounds))
    for offset, client in ((-0.2, "vllm"), (0.2, "pathserve")):
        ax.bar([x + offset for x in xs], [r[client]["output_tokens_per_s"] for r in rounds], 0.4, label=f"{client} client")
    ax.set_xticks(list(xs), [f"{r['round']} {r['sampling']}" for r in rounds], fontsize=7)
    ax.set_ylabel("output tokens/s (as each client reports)")
    ax.set_title("one pathserve server, two benchmark clients, the same requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
