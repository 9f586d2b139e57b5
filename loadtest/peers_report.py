"""The peer benchmark's report (loadtest.peers): each cell's figures and pathserve / vLLM ratios,
the issue's targets met or not, a text table and a plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from loadtest.bench import summarize
from loadtest.client import Result

if TYPE_CHECKING:
    from loadtest.peers import Cell

PEERS = ("pathserve", "vllm")
NOCACHE = "pathserve-nocache"  # pathserve with prefix_cache=off, on the shared-system-prompt set
# Ratios are pathserve / vLLM: above 1 is better for throughput, below 1 is better for latency.
METRICS = (
    ("output_tokens_per_s", None),
    ("ttft_ms", "median"),
    ("ttft_ms", "p90"),
    ("ttft_ms", "p99"),
    ("tpot_ms", "median"),
    ("tpot_ms", "p90"),
    ("tpot_ms", "p99"),
)


def short_outputs(results: Sequence[Result], max_tokens: int) -> int:
    """Completed requests that did not generate all `max_tokens` (ignore_eos should prevent any)."""
    return sum(1 for r in results if r.ok and r.output_tokens != max_tokens)


def ratio(ours: float, theirs: float) -> float | None:
    return ours / theirs if theirs else None


def metric(summary: dict, name: str, stat: str | None) -> float:
    return summary[name] if stat is None else summary[name][stat]


def cell_report(cell: Cell, runs: dict[str, list[tuple[list[Result], float]]], max_tokens: int) -> dict:
    """One cell's figures: each peer's rounds pooled (results joined, wall times added), each
    round's throughput and TTFT median, and pathserve / vLLM ratios of every metric."""
    out: dict = {"set": cell.set, "sampling": cell.sampling, "concurrency": cell.concurrency}
    for peer, rounds in runs.items():
        pooled = summarize([r for results, _ in rounds for r in results], sum(w for _, w in rounds), cell.concurrency)
        pooled["not_full_length"] = short_outputs([r for results, _ in rounds for r in results], max_tokens)
        pooled["rounds"] = [
            {
                "output_tokens_per_s": (s := summarize(results, wall, cell.concurrency))["output_tokens_per_s"],
                "ttft_ms_median": s["ttft_ms"]["median"],
                "errors": s["errors"],
            }
            for results, wall in rounds
        ]
        out[peer] = pooled
    if all(peer in out for peer in PEERS):
        ours, theirs = out["pathserve"], out["vllm"]
        out["ratios"] = {
            (name if stat is None else f"{name}.{stat}"): (
                ratio(metric(ours, name, stat), metric(theirs, name, stat))
                if ours["completed"] and theirs["completed"]
                else None
            )
            for name, stat in METRICS
        }
    if NOCACHE in out and "pathserve" in out:  # the prefix cache's effect, same requests, same run
        on, off = out["pathserve"]["ttft_ms"]["median"], out[NOCACHE]["ttft_ms"]["median"]
        out["prefix_cache"] = {"ttft_ms_median_on": on, "ttft_ms_median_off": off, "ttft_lower_by": ratio(off, on)}
    return out


# Bytes each peer's decode step reads per matmul weight and per cached value: pathserve's serving
# profile (int8w weights, a float32 KV cache) and vLLM's CPU build (bfloat16 both).
STEP_BYTES = {"pathserve": (1, 4), "vllm": (2, 2)}


def matmul_params(cfg) -> int:
    """The weights a decode step reads whole: every layer's matmuls and the head (the embedding
    table again when tied); the token lookup reads a few rows, the norms are negligible."""
    e, d = cfg.embed_dim, cfg.head_dim
    per_layer = e * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * e * cfg.mlp_dim
    return cfg.num_layers * per_layer + cfg.vocab_size * e


def bandwidth_bound(cfg, peer: str, concurrency: int, context: int, bandwidth: float) -> float:
    """Output tokens/s if every decode step of `concurrency` sequences of `context` tokens only
    read its weights once and each sequence's KV cache at `bandwidth` bytes/s."""
    weight, value = STEP_BYTES[peer]
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * value * context * concurrency
    return concurrency * bandwidth / (matmul_params(cfg) * weight + kv)


def compute_bound(cfg, macs_per_s: float, prompt_per_output: float = 0.0) -> float:
    """Output tokens/s if serving were bound only by its matmuls' multiply-adds at `macs_per_s`, at
    any concurrency: an output token costs matmul_params(cfg), and `prompt_per_output` prompt tokens
    computed for each output token (a request's prompt over its output) cost the same less the head,
    which a prompt computes at its last position only (attention's multiply-adds, under 1% of these
    at short contexts, are left out)."""
    head = cfg.vocab_size * cfg.embed_dim
    return macs_per_s / (matmul_params(cfg) + prompt_per_output * (matmul_params(cfg) - head))


def add_roofline(
    report_cells: Sequence[dict],
    cfg,
    bandwidth: float,
    contexts: dict[str, int],
    rates: dict[str, float | None] | None = None,
    prompt_per_output: dict[str, float] | None = None,
) -> None:
    """Each cell's memory-bandwidth bound per peer and the fraction of it the peer reached
    (`roofline`: {peer: {bound_tokens_per_s, fraction}}); `contexts`: each set's median prompt
    tokens plus half the output, the cache a step reads on average. With a peer's multiply-add rate
    in `rates` (pathserve's int8w matmul, measure_int8_rate; vLLM's bfloat16 one on its cores,
    vllm_peer.measure_bf16_rate), that peer's compute bound too (`compute_bound_tokens_per_s`,
    `compute_fraction`), counting each set's prompt tokens computed per output token
    (`prompt_per_output`, default none), and which of the two applies (`applies`: the lower, memory
    or compute): one request is bound by reading the weights, 32 by multiplying."""
    for c in report_cells:
        c["roofline"] = {}
        for peer in PEERS:
            if peer in c:
                rate = c[peer]["output_tokens_per_s"]
                bound = bandwidth_bound(cfg, peer, c["concurrency"], contexts[c["set"]], bandwidth)
                roof = c["roofline"][peer] = {"bound_tokens_per_s": bound, "fraction": rate / bound, "applies": "memory"}
                if (rates or {}).get(peer):
                    compute = compute_bound(cfg, rates[peer], (prompt_per_output or {}).get(c["set"], 0.0))
                    roof.update(compute_bound_tokens_per_s=compute, compute_fraction=rate / compute)
                    roof["applies"] = "compute" if compute < bound else "memory"


def targets(report_cells: Sequence[dict], shape: str | None = None) -> list[dict]:
    """The issue's targets that this run measures, each with its figure and whether it is met
    (None when its cell was not run or a server completed nothing there). `shape`: a random
    model of that preset's shape was served (--shape), whose targets are its own."""
    by_key = {(c["set"], c["sampling"], c["concurrency"]): c for c in report_cells}

    def figure(cell: tuple[str, str, int], key: str) -> float | None:
        found = by_key.get(cell)
        return (found.get("ratios") or {}).get(key) if found else None

    def check(name: str, cell: tuple[str, str, int], key: str, bound: float, above: bool) -> dict:
        value = figure(cell, key)
        met = None if value is None else (value >= bound if above else value <= bound)
        return {"target": name, "cell": "/".join(map(str, cell)), "ratio": key, "value": value, "met": met}

    if shape is not None:
        at32 = by_key.get(("short", "greedy", 32), {}).get("roofline", {}).get("pathserve")
        fraction = None if at32 is None else at32["fraction"]
        return [
            check(f"{shape}, 32 concurrent short: output tok/s >= 2.0x vLLM", ("short", "greedy", 32),
                  "output_tokens_per_s", 2.0, True),
            {"target": f"{shape}, 32 concurrent short: >= 0.6 of the memory-bandwidth bound", "cell": "short/greedy/32",
             "value": fraction, "met": None if fraction is None else fraction >= 0.6},
            check(f"{shape}, one request alone: output tok/s >= 2.2x vLLM", ("short", "greedy", 1),
                  "output_tokens_per_s", 2.2, True),
            check(f"{shape}, 32 concurrent short: TTFT median <= vLLM's", ("short", "greedy", 32),
                  "ttft_ms.median", 1.0, False),
        ]
    out = [
        check("32 concurrent short: output tok/s >= 2.0x vLLM", ("short", "greedy", 32), "output_tokens_per_s", 2.0, True),
        check("32 concurrent short: TTFT median <= vLLM's", ("short", "greedy", 32), "ttft_ms.median", 1.0, False),
        check("one request alone: output tok/s >= 3x vLLM", ("short", "greedy", 1), "output_tokens_per_s", 3.0, True),
    ]
    for c in (1, 8, 32, 64):
        if ("long", "greedy", c) in by_key:
            out.append(check(f"long prompts, {c} concurrent: TTFT median <= vLLM's", ("long", "greedy", c), "ttft_ms.median", 1.0, False))
    long_cells = [c for c in report_cells if c["set"] == "long" and "pathserve" in c]
    if long_cells:
        refused = sum(c["pathserve"]["errors"] for c in long_cells)
        out.append({"target": "long prompts: no request refused", "value": refused, "met": refused == 0})
    name = "shared system prompt: TTFT median >= 3x lower with the prefix cache than without"
    compared = [c for c in report_cells if c["set"] == "system" and "prefix_cache" in c]
    if not compared:
        out.append({"target": name, "value": None, "met": None, "note": "run with --prefix-cache-off"})
    for c in compared:
        value = c["prefix_cache"]["ttft_lower_by"]
        cell = f"system/{c['sampling']}/{c['concurrency']}"
        out.append({"target": name, "cell": cell, "value": value, "met": None if value is None else value >= 3.0})
    return out


def table(report_cells: Sequence[dict]) -> str:
    head = (
        f"{'cell':<22} {'err ps/vl':>9} {'tok/s ps':>9} {'vllm':>7} {'ratio':>6} "
        f"{'TTFT50 ps':>10} {'vllm':>8} {'ratio':>6} {'TPOT50 ps':>10} {'vllm':>7} {'ratio':>6} {'of bound ps/vl':>14}"
    )
    rows = [head]

    def r(value: float | None) -> str:
        return f"{value:6.2f}" if value is not None else f"{'-':>6}"

    for c in report_cells:
        ps, vl, ratios = c.get("pathserve"), c.get("vllm"), c.get("ratios") or {}
        if ps is None or vl is None:
            continue
        rows.append(
            f"{c['set'] + '/' + c['sampling'] + '/c' + str(c['concurrency']):<22} "
            f"{str(ps['errors']) + '/' + str(vl['errors']):>9} "
            f"{ps['output_tokens_per_s']:9.1f} {vl['output_tokens_per_s']:7.1f} {r(ratios.get('output_tokens_per_s'))} "
            f"{ps['ttft_ms']['median']:10.1f} {vl['ttft_ms']['median']:8.1f} {r(ratios.get('ttft_ms.median'))} "
            f"{ps['tpot_ms']['median']:10.1f} {vl['tpot_ms']['median']:7.1f} {r(ratios.get('tpot_ms.median'))} "
            f"{_of_bound(c):>14}"
        )
    return "\n".join(rows)


def _of_bound(cell: dict) -> str:
    """Each peer's fraction of the bound that applies to it (add_roofline), m(emory) or c(ompute),
    as "40%m/25%m"."""
    roof = cell.get("roofline") or {}

    def one(r: dict) -> str:
        compute = r.get("applies") == "compute"
        return f"{r['compute_fraction' if compute else 'fraction']:.0%}{'c' if compute else 'm'}"

    return "/".join(one(roof[p]) if p in roof else "-" for p in PEERS)


def plot(report_cells: Sequence[dict], path: Path) -> Path:
    """One row per (set, sampling), columns: output tok/s, TTFT median and TPOT median against
    concurrency, pathserve and vLLM as two lines (p90 dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(c["set"], c["sampling"]) for c in report_cells})
    fig, axes = plt.subplots(len(groups), 3, figsize=(13, 3.2 * len(groups)), squeeze=False)
    for row, (name, sampling) in zip(axes, groups, strict=True):
        points = sorted((c for c in report_cells if (c["set"], c["sampling"]) == (name, sampling)), key=lambda c: c["concurrency"])
        xs = [c["concurrency"] for c in points]
        for peer, color in (("pathserve", "tab:blue"), ("vllm", "tab:orange"), (NOCACHE, "tab:green")):
            if not all(peer in c for c in points):
                continue
            row[0].plot(xs, [c[peer]["output_tokens_per_s"] for c in points], "o-", color=color, label=peer)
            for ax, key in ((row[1], "ttft_ms"), (row[2], "tpot_ms")):
                ax.plot(xs, [c[peer][key]["median"] for c in points], "o-", color=color, label=f"{peer} median")
                ax.plot(xs, [c[peer][key]["p90"] for c in points], "s--", color=color, alpha=0.6, label=f"{peer} p90")
        for ax, title in zip(row, ("output tokens/s", "TTFT (ms)", "TPOT (ms)"), strict=True):
            ax.set_title(f"{name} / {sampling}: {title}", fontsize=9)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        row[0].set_xlabel("concurrent requests")
    fig.suptitle("pathserve vs vLLM (CPU build), same weights, same requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
