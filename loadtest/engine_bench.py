"""`make bench-engine`: offline decode throughput of the engine against Hugging Face transformers.

SmolLM2-135M-Instruct (the same dequantized GGUF weights on both sides), batch 1, 8 and 32, our
float32 and int8 weights against transformers float32 `generate`, alternating A/B in one run. The
machine's memory bandwidth and matmul FLOP/s are measured in the same rounds, for a roofline per
point: rate = min(bandwidth / bytes read per step, FLOP/s / FLOPs per step) x batch, with the best
bandwidth and FLOP/s measured in that point's rounds (this machine's speed moves over minutes).
On the int8 weights (what `pathserve serve` runs by default) sampled decoding is measured in the
same rounds as greedy: temperature=1 with top_p=0.95, and with top_k=50, each as a ratio to greedy.
Writes results/engine-bench.json and results/engine-bench.png. Not a test: numbers are ratios
against peers measured here, on a noisy machine.

`--grammar`: the cost of structured outputs instead. On the int8 weights, greedy decoding at
batch 1 and 16 with a JSON Schema grammar in every slot (as the device loop runs it: each step the
host computes every slot's mask, a one-step generate call applies them, the tokens advance the
matchers) against plain decoding (`decode_steps_per_call` steps per call) and against one-step
calls with every token allowed (what the one-step calls cost alone); results/grammar-bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from serving.checkpoints.model_source import default_model_path, load_model
from serving.config import ServingConfig
from serving.engine.engine import Engine
from serving.kernels.cpu_matmul import PackedWeight
from serving.request import SamplingParams

# float32 and int8 weights (through the CPU kernels where they run), int8 weights and per-token
# int8 activations (XLA's int8 dot), and both weights again through XLA's own dot for comparison.
WEIGHTS = ("float32", "int8", "w8a8", "float32-xla", "int8-xla")
PROMPT = (
    "The history of the lighthouse is closely tied to the history of seafaring. Long before electric lamps,"
)
SAMPLED_WEIGHTS = "int8"
SAMPLED = {  # name -> SamplingParams fields
    "temperature=1 top_p=0.95": dict(temperature=1.0, top_p=0.95),
    "temperature=1 top_k=50": dict(temperature=1.0, top_k=50),
}


class Machine:
    """Measures the machine's memory read bandwidth (a float32 reduction reading 1 GiB) and matmul
    FLOP/s (a float32 1024^3 matmul), best of 5 each time; arrays and programs made once."""

    def __init__(self) -> None:
        self.x = jnp.ones((1 << 28,), jnp.float32)
        self.a = jnp.ones((1024, 1024), jnp.float32)
        self.total, self.mm = jax.jit(jnp.sum), jax.jit(jnp.matmul)

    @staticmethod
    def _best(fn, *args) -> float:
        fn(*args).block_until_ready()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - start)
        return min(times)

    def measure(self) -> tuple[float, float]:
        """(bytes/s, FLOP/s) now."""
        return self.x.nbytes / self._best(self.total, self.x), 2 * 1024**3 / self._best(
            self.mm, self.a, self.a
        )


def engine_decode_rate(
    engine: Engine,
    params: dict,
    prompt_ids: list[int],
    batch: int,
    new_tokens: int,
    sampling_fields: dict | Callable[[int], dict] | None = None,
) -> float:
    """Decode tokens/s with `batch` slots busy: prefill + insert all, then time generate calls.
    Greedy unless `sampling_fields` (SamplingParams fields, or a slot's from a function of the
    slot) say otherwise; a seed per slot."""
    state = engine.init_decode_state()
    for slot in range(batch):
        fields = sampling_fields(slot) if callable(sampling_fields) else sampling_fields or {}
        sampling = SamplingParams(max_tokens=new_tokens + 1, seed=slot, **fields)
        prefix, _ = engine.prefill(params, engine.limits.pad(prompt_ids), len(prompt_ids), sampling)
        state = engine.insert(prefix, state, slot)
    jax.block_until_ready(state)
    produced, start = 0, time.perf_counter()
    while produced < batch * new_tokens:
        # every slot advances together: prompt + tokens so far bounds their positions (host side)
        max_position = len(prompt_ids) + produced // batch
        state, result = engine.generate(params, state, max_position=max_position)
        produced += int(np.asarray(result.valid).sum())
        if not np.asarray(state.active).any():
            break
    return produced / (time.perf_counter() - start)


GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "color", "tags"],
}


def grammar_decode_rate(
    engine: Engine, params: dict, prompt_ids: list[int], batch: int, new_tokens: int, compiler=None
) -> tuple[float, float]:
    """(tokens/s, host mask seconds per token) of greedy decoding with `batch` slots busy, one step
    per generate call with masks: every slot's grammar mask (GRAMMAR_SCHEMA, restarted when a
    slot completes it), or with compiler None every token allowed."""
    from serving.structured.grammar import schema_grammar

    grammar = compiler.compile(schema_grammar(GRAMMAR_SCHEMA)) if compiler is not None else None
    matchers = [compiler.matcher(grammar) for _ in range(batch)] if compiler is not None else []
    words = -(-engine.model.tokenizer.vocab_size // 32)
    open_mask = np.full((engine.max_concurrent_decodes, words), -1, np.int32)
    state = engine.init_decode_state()
    for slot in range(batch):
        sampling = SamplingParams(max_tokens=new_tokens + 2, seed=slot)  # no stop ids: keep going
        mask = matchers[slot].mask() if matchers else None
        prefix, first = engine.prefill(params, engine.limits.pad(prompt_ids), len(prompt_ids), sampling, mask)
        state = engine.insert(prefix, state, slot)
        if matchers:
            matchers[slot].advance(first)
    jax.block_until_ready(state)
    produced, masking, start = 0, 0.0, time.perf_counter()
    while produced < batch * new_tokens:
        started = time.perf_counter()
        masks = open_mask.copy()
        for slot, matcher in enumerate(matchers):
            if matcher.finished:
                matcher.reset()
            masks[slot] = matcher.mask()
        masking += time.perf_counter() - started
        state, result = engine.generate(params, state, max_position=len(prompt_ids) + produced // batch, masks=masks)
        tokens, valid = np.asarray(result.tokens)[0], np.asarray(result.valid)[0]
        started = time.perf_counter()
        for slot, matcher in enumerate(matchers):
            matcher.advance(int(tokens[slot]))
        masking += time.perf_counter() - started
        produced += int(valid.sum())
    return produced / (time.perf_counter() - start), masking / max(produced, 1)


def grammar_main(ns: argparse.Namespace, gguf: Path) -> int:
    """--grammar: tok/s with and without grammar masks at each batch (int8 weights, serve's)."""
    from serving.structured.grammar import GrammarCompiler

    base = ServingConfig(
        max_prefill_predict_length=64, max_target_length=64 + ns.new_tokens + 8, quantization="int8w"
    )
    model = load_model(str(gguf), base)
    prompt_ids = model.tokenizer.encode(PROMPT)
    compiler = GrammarCompiler(model.tokenizer)
    points = []
    for batch in [int(b) for b in ns.batches.split(",")]:
        engine = Engine(model, base.model_copy(update={"per_device_batch_size": float(batch)}).engine)
        params = engine.load_params()
        engine_decode_rate(engine, params, prompt_ids, batch, 8)  # compile
        grammar_decode_rate(engine, params, prompt_ids, batch, 4, compiler)
        plain, one_step, masked, mask_s = [], [], [], []
        for _ in range(ns.rounds):
            plain.append(engine_decode_rate(engine, params, prompt_ids, batch, ns.new_tokens))
            one_step.append(grammar_decode_rate(engine, params, prompt_ids, batch, ns.new_tokens)[0])
            rate, per_token = grammar_decode_rate(engine, params, prompt_ids, batch, ns.new_tokens, compiler)
            masked.append(rate)
            mask_s.append(per_token)
        point = {
            "batch": batch,
            "plain_tok_s": max(plain),
            "one_step_all_allowed_tok_s": max(one_step),
            "grammar_tok_s": max(masked),
            "host_mask_us_per_token": 1e6 * min(mask_s),
            "decode_steps_per_call": engine.decode_steps_per_call,
        }
        point["grammar_over_plain"] = point["grammar_tok_s"] / point["plain_tok_s"]
        points.append(point)
        print(json.dumps(point), flush=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    report = {"model": gguf.name, "weights": "int8", "new_tokens": ns.new_tokens, "points": points}
    (ns.out / "grammar-bench.json").write_text(json.dumps(report, indent=2))
    return 0


def transformers_rate(model, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    import torch

    ids = torch.tensor([prompt_ids] * batch)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    return batch * new_tokens / (time.perf_counter() - start)


def bytes_per_step(params: dict, cfg, batch: int, context: int) -> tuple[float, float]:
    """(bytes read, FLOPs) for one decode step at `batch` over a `context`-token cache."""
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * context * batch
    return weight_bytes + kv, 2.0 * cfg.num_params * batch


def packed_weight_bytes(packed: dict, params: dict) -> int:
    """Bytes of the weights a decode step reads as the engine holds them: every array but the
    embedding table when the head is a packed copy of it (the token lookup reads a few rows)."""
    total = sum(x.nbytes for x in jax.tree.leaves(packed))
    if "lm_head" in packed and "lm_head" not in params:
        total -= sum(x.nbytes for x in jax.tree.leaves(packed["embed"]))
    return int(total)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="A/B rounds per point (the best counts)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--weights", default=",".join(WEIGHTS), help="a subset of " + ",".join(WEIGHTS))
    parser.add_argument("--model", default=None, help="a model source (default: the default model)")
    parser.add_argument("--grammar", action="store_true", help="structured outputs' cost instead (batches 1,16)")
    ns = parser.parse_args(argv)
    if ns.grammar:
        if ns.batches == "1,8,32":
            ns.batches = "1,16"
        return grammar_main(ns, Path(ns.model) if ns.model else default_model_path())
    if unknown := set(ns.weights.split(",")) - set(WEIGHTS):
        parser.error(f"--weights: no such weights {sorted(unknown)}")
    batches = [int(b) for b in ns.batches.split(",")]
    gguf = Path(ns.model) if ns.model else default_model_path()
    reference = load_reference(gguf) if "float32" in ns.weights.split(",") else None
    machine = Machine()
    bandwidth, flops = machine.measure()
    print(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s, matmul {flops / 1e9:.0f} GFLOP/s")
    results = {
        "model": gguf.name,
        "device": jax.devices()[0].device_kind,
        "bandwidth_bytes_per_s": bandwidth,  # the best of every measurement in the run
        "matmul_flops": flops,
        "new_tokens": ns.new_tokens,
        "points": [],
        "sampled": [],  # SAMPLED on SAMPLED_WEIGHTS, next to that batch's greedy point
    }
    for weights in ns.weights.split(","):
        base = ServingConfig(
            max_prefill_predict_length=64,
            max_target_length=64 + ns.new_tokens + 8,
            # int8: weight-only (int8w); w8a8: MaxText's quantization=int8.
            quantization="" if weights.startswith("float32") else "int8" if weights == "w8a8" else "int8w",
            cpu_kernels="off" if weights.endswith("-xla") else "auto",
        )
        model = load_model(str(gguf), base)
        prompt_ids = model.tokenizer.encode(PROMPT)
        for batch in batches:
            # As many slots as sequences: every slot of an engine is computed at each step.
            engine = Engine(model, base.model_copy(update={"per_device_batch_size": float(batch)}).engine)
            params = engine.load_params()
            engine_decode_rate(engine, params, prompt_ids, batch, 8)  # compile
            ours, theirs, measured, sampled = [], [], [], {}
            for _ in range(ns.rounds):
                ours.append(engine_decode_rate(engine, params, prompt_ids, batch, ns.new_tokens))
                for name, fields in SAMPLED.items() if weights == SAMPLED_WEIGHTS else ():
                    rate = engine_decode_rate(engine, params, prompt_ids, batch, ns.new_tokens, fields)
                    sampled.setdefault(name, []).append(rate)
                if weights == "float32":
                    theirs.append(transformers_rate(reference, prompt_ids, batch, ns.new_tokens))
                measured.append(machine.measure())
            bandwidth, flops = max(m[0] for m in measured), max(m[1] for m in measured)
            results["bandwidth_bytes_per_s"] = max(results["bandwidth_bytes_per_s"], bandwidth)
            results["matmul_flops"] = max(results["matmul_flops"], flops)
            # The weights a step must read: the model's, not the packed copies (a tied head is one).
            step_bytes, step_flops = bytes_per_step(
                model.params, model.config, batch, len(prompt_ids) + ns.new_tokens // 2
            )
            roofline = min(bandwidth / step_bytes, flops / step_flops) * batch
            point = {
                "weights": weights,
                "backend": engine.ops.name,
                # some packed weights take an AMX kernel (int8: AMX-INT8; float32: AMX-BF16)
                "amx": any(
                    getattr(leaf, "amx", False)
                    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, PackedWeight))
                ),
                "batch": batch,
                # what a step reads of the weights as packed (a layout may hold fewer bytes than
                # the model's own: float32 in blocks); the roofline keeps the model's
                "packed_weight_bytes": packed_weight_bytes(params, model.params),
                "tokens_per_s": max(ours),
                "roofline_tokens_per_s": roofline,
                "bandwidth_bytes_per_s": bandwidth,
                "matmul_flops": flops,
            }
            point["fraction_of_roofline"] = point["tokens_per_s"] / roofline
            if theirs:
                point["transformers_tokens_per_s"] = max(theirs)
            results["points"].append(point)
            print(json.dumps(point))
            for name, rates in sampled.items():
                results["sampled"].append(
                    {
                        "weights": weights,
                        "batch": batch,
                        "sampling": name,
                        "tokens_per_s": max(rates),
                        "greedy_tokens_per_s": point["tokens_per_s"],
                        "ratio_vs_greedy": max(rates) / point["tokens_per_s"],
                    }
                )
                print(json.dumps(results["sampled"][-1]))
    baseline = {
        p["batch"]: p["transformers_tokens_per_s"]
        for p in results["points"]
        if "transformers_tokens_per_s" in p
    }
    for p in results["points"]:
        p["ratio_vs_transformers_f32"] = p["tokens_per_s"] / baseline.get(p["batch"], np.nan)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "engine-bench.json").write_text(json.dumps(results, indent=2))
    plot(results, ns.out / "engine-bench.png")
    print(
        f"{'weights':8} {'batch':>5} {'tok/s':>8} {'vs HF f32':>9} {'roofline':>9} {'of roof':>7}"
        f" {'GB/s':>5} {'GFLOP/s':>7} {'MB read':>7}"
    )
    for p in results["points"]:
        print(
            f"{p['weights']:8} {p['batch']:5d} {p['tokens_per_s']:8.1f} {p['ratio_vs_transformers_f32']:9.2f} "
            f"{p['roofline_tokens_per_s']:9.1f} {p['fraction_of_roofline']:7.0%}"
            f" {p['bandwidth_bytes_per_s'] / 1e9:5.1f} {p['matmul_flops'] / 1e9:7.0f}"
            f" {p['packed_weight_bytes'] / 1e6:7.0f}"
        )
    print(f"{'weights':8} {'batch':>5} {'sampling':24} {'tok/s':>8} {'greedy':>8} {'ratio':>6}")
    for p in results["sampled"]:
        print(
            f"{p['weights']:8} {p['batch']:5d} {p['sampling']:24} {p['tokens_per_s']:8.1f}"
            f" {p['greedy_tokens_per_s']:8.1f} {p['ratio_vs_greedy']:6.0%}"
        )
    return 0


def load_reference(source: Path):
    """transformers' float32 model of the same GGUF file (or Hugging Face directory), on every core."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    if source.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    ).eval()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for weights, style in (("float32-xla", "o--"), ("int8-xla", "s--")):
        pts = [p for p in results["points"] if p["weights"] == weights]
        xs, ys = [p["batch"] for p in pts], [p["tokens_per_s"] for p in pts]
        ax.plot(xs, ys, style, alpha=0.5, label=f"pathserve {weights} (no CPU kernels)")
    for weights, style in (("float32", "o-"), ("int8", "s-"), ("w8a8", "d-")):
        pts = [p for p in results["points"] if p["weights"] == weights]
        ax.plot(
            [p["batch"] for p in pts], [p["tokens_per_s"] for p in pts], style, label=f"pathserve {weights}"
        )
        ax.plot(
            [p["batch"] for p in pts],
            [p["roofline_tokens_per_s"] for p in pts],
            style[0] + ":",
            alpha=0.5,
            label=f"roofline {weights}",
        )
    hf = [p for p in results["points"] if "transformers_tokens_per_s" in p]
    ax.plot(
        [p["batch"] for p in hf],
        [p["transformers_tokens_per_s"] for p in hf],
        "^--",
        label="transformers float32",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch (concurrent sequences)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{results.get('model', 'SmolLM2-135M')} decode throughput ({results.get('device', 'CPU')})")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
