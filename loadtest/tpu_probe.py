"""Where a served token's time goes on an accelerator: the engine alone against the offline driver
(the device loop's scheduler and executor, run synchronously) on the same engine, with the host's
time split by function (cProfile) and the device's by op (a jax.profiler trace, perfetto JSON).

    python -m loadtest.tpu_probe MODEL_DIR OUT_DIR [key=value ...]

Writes OUT_DIR/probe.json (rates, per-call timings), OUT_DIR/host-profile-b{N}.txt (cProfile's
top functions of the offline run), OUT_DIR/device-ops-b{N}-{offline,engine}.json (the device's time by
op, the longest first) and OUT_DIR/trace-b{N}.tar.gz (the engine's device trace). Not a
test: a diagnostic for the chip (issue 64's "where the 30 ms a token went").
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import sys
import time
from pathlib import Path


def _bring_up(model: str, overrides: list[str]):
    from serving.launch import bring_up
    from serving.startup.profile import given_config

    given = given_config(None, overrides, model)
    up = bring_up(given.config, model, given.origins)
    return up.engine, up.params, up.model.tokenizer


def engine_alone(engine, params, prompt_ids: list[int], batch: int, new_tokens: int, executor=None) -> float:
    """Decode tokens/s with `batch` slots busy, generate called back to back (no host read but the
    valid counts), as loadtest.engine_bench measures it. `executor`: an idle one on the same engine,
    whose decode state is let go meanwhile and made anew after: one KV pool in HBM at a time (the
    TPU profile's fills the chip; a second beside it does not fit)."""
    if executor is None:
        return _engine_alone(engine, params, prompt_ids, batch, new_tokens)
    executor.state = None
    try:
        return _engine_alone(engine, params, prompt_ids, batch, new_tokens)
    finally:
        executor.state = engine.init_decode_state()


def _engine_alone(engine, params, prompt_ids: list[int], batch: int, new_tokens: int) -> float:
    import jax
    import numpy as np

    from serving.request import SamplingParams

    state = engine.init_decode_state()
    for slot in range(batch):
        prefix, _ = engine.prefill(
            params, engine.limits.pad(prompt_ids), len(prompt_ids), SamplingParams(max_tokens=new_tokens + 1, seed=slot)
        )
        state = engine.insert(prefix, state, slot)
    jax.block_until_ready(state)
    rows = next(b for b in engine.limits.decode_buckets if b >= batch)
    produced, start = 0, time.perf_counter()
    while produced < batch * new_tokens:
        state, result = engine.generate(
            params, state, max_position=len(prompt_ids) + produced // batch, slots=list(range(rows))
        )
        produced += int(np.asarray(result.valid).sum())
    return produced / (time.perf_counter() - start)


def _best(fn, repeats: int = 3) -> float:
    """The best of `repeats` timed calls of fn (after one untimed: compiles)."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - started)
    return min(times)


def prefill_flops(cfg, tokens: int, context: int) -> float:
    """A prefill's FLOPs: 2 a weight a token (the layers' matmuls and the lm head's) plus causal
    attention, 2 x 2 x heads x head_dim a query-key pair, over `context` positions a row of
    `tokens` (each token sees about half)."""
    matmul_params = cfg.num_layers * (
        cfg.embed_dim * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.embed_dim
        + 3 * cfg.embed_dim * cfg.mlp_dim
    ) + cfg.embed_dim * cfg.vocab_size
    return 2 * matmul_params * tokens + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * context


def prefill_rates(engine, params, prompt_ids: list[int]) -> dict:
    """Prefill on the MXU: a whole prefill of max_prefill_predict_length tokens (one prompt), and
    one prefill_slots call of fresh full chunks filling its budget (rows x prefill_chunk_size
    within prefill_batch_tokens), each its seconds (best of 3) and FLOP/s; the caller divides by
    the chip's peak."""
    from serving.engine.api import PrefillRow
    from serving.request import SamplingParams

    limits, cfg = engine.limits, engine.model.config
    length = limits.max_prefill_length
    tokens = (prompt_ids * (length // len(prompt_ids) + 1))[:length]
    sampling = SamplingParams(max_tokens=2)
    whole = _best(lambda: engine.prefill(params, limits.pad(tokens), length, sampling)[0].first_tokens)
    chunk = limits.prefill_chunk_size
    rows = max(1, min(limits.max_prefill_batch, limits.prefill_batch_tokens // chunk, engine.max_concurrent_decodes))
    state = engine.init_decode_state()

    def chunks():
        nonlocal state
        row = [PrefillRow(i, tuple(tokens[:chunk]), 0, False, sampling) for i in range(rows)]
        state, _, _ = engine.prefill_slots(params, state, row)
        return state.cache.k

    batched = _best(chunks)
    del state
    return {
        "whole_tokens": length, "whole_s": whole, "whole_flop_per_s": prefill_flops(cfg, length, length) / whole,
        "chunk_rows": rows, "chunk_tokens": chunk, "chunks_s": batched,
        "chunks_flop_per_s": rows * prefill_flops(cfg, chunk, chunk) / batched,
    }


def mixed_rate(engine, params, prompt_ids: list[int], batch: int, new_tokens: int) -> dict:
    """Decode tok/s of `batch` sequences with a fresh prefill chunk (prefill_chunk_size tokens,
    into a slot that never decodes) run beside every generate call, against the same decode alone:
    what a step that also prefills leaves the decodes."""
    import numpy as np

    from serving.engine.api import PrefillRow
    from serving.request import SamplingParams

    batch = min(batch, engine.max_concurrent_decodes - 1)  # one slot for the chunks
    alone = engine_alone(engine, params, prompt_ids, batch, new_tokens)
    state = engine.init_decode_state()
    for slot in range(batch):
        prefix, _ = engine.prefill(
            params, engine.limits.pad(prompt_ids), len(prompt_ids), SamplingParams(max_tokens=new_tokens + 1, seed=slot)
        )
        state = engine.insert(prefix, state, slot)
    chunk = engine.limits.prefill_chunk_size
    row = [PrefillRow(batch, tuple((prompt_ids * (chunk // len(prompt_ids) + 1))[:chunk]), 0, False, SamplingParams())]
    rows = next(b for b in engine.limits.decode_buckets if b >= batch)
    produced, calls, start = 0, 0, time.perf_counter()
    while produced < batch * new_tokens:
        state, result = engine.generate(params, state, max_position=len(prompt_ids) + produced // batch, slots=list(range(rows)))
        state, _, _ = engine.prefill_slots(params, state, row)
        produced += int(np.asarray(result.valid).sum())
        calls += 1
    mixed = produced / (time.perf_counter() - start)
    return {"batch": batch, "chunk_tokens": chunk, "calls": calls, "alone_tok_s": alone, "mixed_tok_s": mixed,
            "mixed_over_alone": mixed / alone}


def offline(engine, params, executor, prompt_ids, batch, new_tokens) -> float:
    from serving.orchestrator.offline import run_to_completion
    from serving.request import SamplingParams

    requests = [(list(prompt_ids), SamplingParams(max_tokens=new_tokens, seed=i)) for i in range(batch)]
    start = time.perf_counter()
    done = run_to_completion(engine, params, requests, executor=executor)
    return sum(len(r.token_ids) for r in done) / (time.perf_counter() - start)


def compiled_generate(engine, params, batch: int, window: int | None = None):
    """The generate program of `batch` rows (its bucket) at `window`, compiled: (memory analysis
    dict, how many copies in its HLO write a buffer of the KV pool's shape)."""
    import jax

    state = engine.init_decode_state()
    rows = engine.call_rows(next(b for b in engine.limits.decode_buckets if b >= batch), None)
    window = window or engine.windows[-1]
    compiled = engine._generate_fn.lower(
        params, state, None, rows, window=window, steps=engine.decode_steps_per_call
    ).compile()
    pool = ",".join(str(d) for d in state.cache.k.shape)
    text = compiled.as_text()
    copies = sum(1 for line in text.splitlines() if " copy(" in line and f"[{pool}]" in line.split(" copy(")[0])
    mem = compiled.memory_analysis()
    fields = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes")
    del state
    jax.clear_caches()
    return {f: getattr(mem, f, None) for f in fields}, copies


# What load_model reads of a config (serving.checkpoints.model_source): configs that differ in one of
# these load the weights apart (a sweep of quantization=int8w beside bfloat16 compares the two).
LOAD_KEYS = ("quantization", "checkpoint_is_quantized", "weight_dtype", "tokenizer_path", "model_name")


def sweep(
    model: str, configs: list[str], batches: list[int], new_tokens: int, out: Path, trace: int = 0, prompt_tokens: int = 0,
    prefill: bool = False, mixed: int = 0,
) -> None:
    """Each config (key=value overrides, space-separated) on the weights loaded as it says (configs
    that load alike share one load: `LOAD_KEYS`): the engine alone at each batch, its generate
    program's temporaries and pool-sized copies; with `trace`, a device trace of the engine alone
    at that batch, by op (OUT/device-ops-{config index}.json). The
    prompt: a sentence four times (~70 tokens), or `prompt_tokens` of it repeated (each sequence
    then decodes from that position: the KV read a step grows with it). `prefill`: each config's
    prefill rates (`prefill_rates`); `mixed`: its decode rate at that batch with a chunk beside
    every generate call (`mixed_rate`)."""
    import gc

    import jax

    from serving.checkpoints.model_source import load_model
    from serving.engine.engine import Engine
    from serving.startup.profile import given_config

    loads: dict[tuple, object] = {}  # one load per distinct way of loading the weights

    def loaded_for(cfg):
        key = tuple(getattr(cfg, name) for name in LOAD_KEYS)
        if key not in loads:
            loads.clear()  # one model's weights on the host at a time
            gc.collect()
            loads[key] = load_model(model, cfg)
        return loads[key]

    tokenizer = loaded_for(given_config(None, configs[0].split(), model).config).tokenizer
    sentence = tokenizer.encode("The history of the lighthouse is closely tied to the history of seafaring.")
    prompt_ids = (sentence * (prompt_tokens // len(sentence) + 1))[:prompt_tokens] if prompt_tokens else sentence * 4
    results = []
    for overrides in configs:
        cfg = given_config(None, overrides.split(), model).config
        started = time.perf_counter()
        engine = Engine(loaded_for(cfg), cfg.engine)
        params = engine.load_params()
        row = {
            "overrides": overrides, **engine.summary(), "slots": engine.max_concurrent_decodes,
            "prompt_tokens": len(prompt_ids), "new_tokens": new_tokens,
        }
        try:
            slots = engine.max_concurrent_decodes
            row["memory"], row["pool_copies"] = compiled_generate(engine, params, min(max(batches), slots))
            for batch in (min(b, slots) for b in batches):
                engine_alone(engine, params, prompt_ids, batch, 8)  # compile
                row[f"b{batch}_tok_s"] = engine_alone(engine, params, prompt_ids, batch, new_tokens)
            if prefill:
                row["prefill"] = prefill_rates(engine, params, prompt_ids)
            if mixed:
                row["mixed"] = mixed_rate(engine, params, prompt_ids, mixed, new_tokens)
            if trace:
                trace_dir = out / f"trace-{len(results)}"
                engine_alone(engine, params, prompt_ids, trace, 8)
                with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
                    engine_alone(engine, params, prompt_ids, trace, 16)
                ops = device_ops(trace_dir)
                (out / f"device-ops-{len(results)}.json").write_text(json.dumps(ops, indent=1))
                shutil.rmtree(trace_dir)
        except Exception as exc:  # one config's failure (out of memory, say) is a result too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        row["seconds"] = time.perf_counter() - started
        print(json.dumps(row), file=sys.stderr, flush=True)
        results.append(row)
        del engine, params
        gc.collect()
    (out / "sweep.json").write_text(json.dumps(results, indent=2))


def device_ops(trace_dir: Path, top: int = 40, timeline: int = 400) -> dict:
    """A device trace's time by op: the perfetto JSON `jax.profiler.trace` wrote under `trace_dir`,
    its events on device processes (a TPU's "/device:TPU:0") summed by thread ("XLA Ops", "XLA
    Modules", ...) and name, the `top` longest of each thread, in milliseconds; and the device's
    timeline of programs ("timeline": each "XLA Modules" event's start from the first one's, its
    length and name, the first `timeline` of them; "span_ms" from the first start to the last end
    against "busy_ms" summed: where the device sat idle between calls)."""
    import gzip
    from collections import Counter, defaultdict

    found = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("perfetto_trace.json.gz"))
    if not found:
        return {"error": f"no trace JSON under {trace_dir}"}
    events = json.loads(gzip.decompress(found[0].read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    totals: dict[str, Counter] = defaultdict(Counter)
    counts: dict[str, Counter] = defaultdict(Counter)
    modules: list[tuple[float, float, str]] = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        process = processes.get(e["pid"], "")
        if "/device:" not in process or "CPU" in process:
            continue
        thread = threads.get((e["pid"], e.get("tid")), str(e.get("tid")))
        totals[thread][e["name"]] += e["dur"] / 1e3
        counts[thread][e["name"]] += 1
        if thread == "XLA Modules":
            modules.append((float(e["ts"]) / 1e3, e["dur"] / 1e3, e["name"]))
    report: dict = {
        thread: {
            "total_ms": sum(by_name.values()),
            "top": [(name, round(ms, 3), counts[thread][name]) for name, ms in by_name.most_common(top)],
        }
        for thread, by_name in totals.items()
    }
    if modules:
        modules.sort()
        first = modules[0][0]
        report["span_ms"] = max(start + ms for start, ms, _ in modules) - first
        report["busy_ms"] = sum(ms for _, ms, _ in modules)
        report["timeline"] = [(round(start - first, 3), round(ms, 3), name) for start, ms, name in modules[:timeline]]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sweep", action="append", default=[], help="a config (overrides) to sweep")
    parser.add_argument("--trace", type=int, default=0, help="with --sweep: a device trace of each config at this batch")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="with --sweep: each prompt's length (default ~70)")
    parser.add_argument("--prefill", action="store_true", help="with --sweep: prefill's rates (a whole prompt, a call of chunks)")
    parser.add_argument("--mixed", type=int, default=0, help="with --sweep: decode tok/s at this batch with a chunk beside each call")
    parser.add_argument("overrides", nargs="*")
    ns = parser.parse_intermixed_args(argv)
    if ns.sweep:
        ns.out.mkdir(parents=True, exist_ok=True)
        sweep(
            ns.model, ns.sweep, [int(b) for b in ns.batches.split(",")], ns.new_tokens, ns.out, ns.trace,
            ns.prompt_tokens, ns.prefill, ns.mixed,
        )
        return 0
    import jax

    from serving.orchestrator.executor import Executor

    ns.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    engine, params, tokenizer = _bring_up(ns.model, ns.overrides)
    report = {"bring_up_s": time.perf_counter() - started, "config": {k: str(v) for k, v in vars(engine.config).items()}, "points": []}
    print("bring-up", report["bring_up_s"], engine.summary(), file=sys.stderr, flush=True)
    prompt_ids = tokenizer.encode("The history of the lighthouse is closely tied to the history of seafaring.") * 4
    executor = Executor(engine, params)
    for batch in (int(b) for b in ns.batches.split(",")):
        point = {"batch": batch}
        t = time.perf_counter()
        engine_alone(engine, params, prompt_ids, batch, 16, executor)  # compile
        offline(engine, params, executor, prompt_ids, batch, ns.new_tokens)
        point["compile_s"] = time.perf_counter() - t
        point["engine_tok_s"] = engine_alone(engine, params, prompt_ids, batch, ns.new_tokens, executor)
        point["offline_tok_s"] = offline(engine, params, executor, prompt_ids, batch, ns.new_tokens)
        profiler = cProfile.Profile()
        profiler.enable()
        point["offline_profiled_tok_s"] = offline(engine, params, executor, prompt_ids, batch, ns.new_tokens)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
        (ns.out / f"host-profile-b{batch}.txt").write_text(text.getvalue())
        trace_dir = ns.out / f"trace-b{batch}"
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            offline(engine, params, executor, prompt_ids, batch, ns.new_tokens)
        (ns.out / f"device-ops-b{batch}-offline.json").write_text(json.dumps(device_ops(trace_dir), indent=1))
        shutil.rmtree(trace_dir)
        # the engine alone: generate calls back to back (where a decode step's device time goes)
        with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
            engine_alone(engine, params, prompt_ids, batch, 32, executor)
        (ns.out / f"device-ops-b{batch}-engine.json").write_text(json.dumps(device_ops(trace_dir), indent=1))
        # one file: a device machine returns a few files of a shallow tree, not a profile's own
        shutil.make_archive(str(trace_dir), "gztar", trace_dir)
        shutil.rmtree(trace_dir)
        point["ratio"] = point["offline_tok_s"] / point["engine_tok_s"]
        report["points"].append(point)
        print(json.dumps(point), file=sys.stderr, flush=True)
    (ns.out / "probe.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
