"""Disaggregated prefill and decode's benchmark (not a test), on two CPU devices of one process
(`--xla_force_host_platform_device_count=2`), the default model (SmolLM2-135M-Instruct) on XLA's
ops, greedy with no stop id. Writes results/disagg-bench.json and disagg-bench.png.

- **transfer**: what moving a prefilled prompt costs: the prefill engine (device 0) prefills a
  prompt of N tokens into its pages, then its state and pages are handed to the generate engine
  (device 1: `handoff` + `accept`, `jax.device_put` between them), timed to completion, the median
  of several moves per length; reported as ms per 1k prompt tokens of KV (and its bytes).
- **transfer between processes**: the same moves between two processes of one device each (JAX's
  distributed runtime over loopback: the prefill engine in process 0, the generate engine in
  process 1, a multi-controller disaggregated server's two groups), by its `Link`
  (serving.orchestrator.transfer: the prefill side's gathered handoff pulled by
  `jax.experimental.transfer`, then `accept`), timed in process 1 from both meeting at a barrier.
- **itl**: the running streams' inter-token latency while long prompts arrive: `--streams` requests
  decoding `--stream-tokens` each, and every `--long-every` seconds a prompt of `--long-tokens`
  tokens. The interleaved engine on device 0 alone against the disaggregated pair (prefill on
  device 0, generate on device 1), through the orchestrator's threads, in alternating rounds of one
  process. On this machine the two devices share the same cores, so the isolation an accelerator's
  two slices give cannot show: a prefill still takes the cores decode needs. One untimed round of
  each shape first compiles the calls the workload makes.

    python -m loadtest.disagg_bench [--rounds 2] [--streams 8] [--long-tokens 512] [--lengths 128,512,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

TARGET = 2048
PREFILL = 1024
MOVES = 7  # timed moves per prompt length (the median is reported)


def _config(slots: int):
    from serving.config import ServingConfig

    return ServingConfig(
        per_device_batch_size=slots, max_prefill_predict_length=PREFILL, max_target_length=TARGET,
        cpu_kernels="off", enable_background_warmup=False,
    )


class Engines:
    """The interleaved engine on device 0, and the disaggregated pair on devices 0 and 1, of one
    loaded model (each placed on its own device)."""

    def __init__(self, slots: int):
        import jax

        from serving.checkpoints.model_source import default_model_path, load_model
        from serving.engine.engine import Engine
        from serving.runtime import make_mesh

        self.cfg = cfg = _config(slots)
        model = load_model(str(default_model_path()), cfg)
        devices = jax.devices()
        if len(devices) < 2:
            raise SystemExit("disagg_bench: two devices needed (XLA_FLAGS=--xla_force_host_platform_device_count=2)")

        def on(device, **kw):
            engine = Engine(model, cfg.engine, make_mesh(cfg.devices, [device]), **kw)
            return engine, engine.load_params()

        self.interleaved = on(devices[0])
        self.generate = on(devices[1])
        self.prefill = on(devices[0], mirror=self.generate[0].limits)
        self.tokenizer = model.tokenizer


def _slot_0_pages(limits, length: int):
    """(the pages holding a prompt of `length` tokens in slot 0, the block table naming them)."""
    import numpy as np

    pages = list(range(1, -(-length // limits.page_size) + 1))
    table = np.zeros((limits.max_concurrent_decodes, limits.max_pages), np.int32)
    table[0, : len(pages)] = pages
    return pages, table


def _prefilled(engine, params, state, length: int):
    """`state` with a prompt of `length` tokens prefilled into slot 0, in chunks."""
    from serving.engine.api import PrefillRow
    from serving.request import SamplingParams

    tokens, chunk = tuple(int(t) % 1000 + 10 for t in range(length)), engine.limits.prefill_chunk_size
    for start in range(0, length, chunk):
        piece = tokens[start : start + chunk]
        row = PrefillRow(0, piece, start, start + len(piece) == length, SamplingParams(max_tokens=8))
        state, *_ = engine.prefill_slots(params, state, [row])
    return state


def transfer(engines: Engines, lengths: list[int]) -> list[dict]:
    """ms per 1k prompt tokens of moving a prefilled prompt's state and pages between the devices."""
    import jax


    prefiller, prefill_params = engines.prefill
    generate, _ = engines.generate
    limits = generate.limits
    out = []
    for length in lengths:
        pages, table = _slot_0_pages(limits, length)
        p_state = _prefilled(prefiller, prefill_params, prefiller.set_pages(prefiller.init_decode_state(), table), length)
        g_state = generate.set_pages(generate.init_decode_state(), table)
        jax.block_until_ready(p_state)
        seconds = []
        for i in range(MOVES + 1):
            started = time.perf_counter()
            g_state = generate.accept(g_state, prefiller.handoff(p_state, 0, pages), 0, pages)
            jax.block_until_ready(g_state)
            if i:  # the first compiles
                seconds.append(time.perf_counter() - started)
        median = statistics.median(seconds)
        kv_bytes = len(pages) * generate.page_bytes
        out.append({
            "prompt_tokens": length, "pages": len(pages), "kv_bytes": kv_bytes, "median_ms": median * 1e3,
            "ms_per_1k_tokens": median * 1e3 * 1000 / length, "gb_per_s": kv_bytes / median / 1e9,
        })
        print(f"transfer: {length} tokens ({kv_bytes / 1e6:.1f} MB in {len(pages)} pages): {median * 1e3:.2f} ms, "
              f"{out[-1]['ms_per_1k_tokens']:.2f} ms per 1k tokens", flush=True)
    return out


def transfer_between_processes(lengths: list[int]) -> list[dict]:
    """The transfer measurement between two processes (see the module's docstring): runs this
    module twice as `--process-of-two I`, returns process 1's results."""
    import subprocess

    from loadtest.server import free_port

    coordinator = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "loadtest.disagg_bench", "--lengths", ",".join(map(str, lengths)),
               "--coordinator", f"127.0.0.1:{coordinator}", "--process-of-two"]
    procs = [subprocess.Popen([*command, str(i)], env=env, stdout=subprocess.PIPE, text=True) for i in (0, 1)]
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"disagg_bench: the two-process transfer failed: exit codes {[p.returncode for p in procs]}")
    out = json.loads(outputs[1].strip().splitlines()[-1])
    for row in out:
        print(f"transfer between processes: {row['prompt_tokens']} tokens ({row['kv_bytes'] / 1e6:.1f} MB): "
              f"{row['median_ms']:.2f} ms, {row['ms_per_1k_tokens']:.2f} ms per 1k tokens", flush=True)
    return out


def _process_of_two(index: int, coordinator: str, lengths: list[int]) -> None:
    """One of the two processes of `transfer_between_processes`; process 1 prints its results."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, 2, index)
    from jax._src import distributed

    from serving.checkpoints.model_source import default_model_path, load_model
    from serving.engine.engine import Engine, engine_limits
    from serving.orchestrator.transfer import Link, ProcessGroups
    from serving.runtime import make_mesh

    cfg = _config(4)
    model = load_model(str(default_model_path()), cfg)
    prefill_mesh, generate_mesh = (make_mesh(cfg.devices, [d]) for d in jax.devices())
    limits = engine_limits(model, cfg.engine, generate_mesh)
    if index == 0:
        engine = Engine(model, cfg.engine, prefill_mesh, mirror=limits)
    else:
        engine = Engine(model, cfg.engine, generate_mesh)
    params = engine.load_params()
    groups = ProcessGroups((0,), (1,), index)
    link, store = Link(groups, 600.0), distributed.global_state.client
    out = []
    for length in lengths:
        pages, table = _slot_0_pages(limits, length)
        state = engine.set_pages(engine.init_decode_state(), table)
        if index == 0:
            state = _prefilled(engine, params, state, length)
        jax.block_until_ready(state)
        seconds = []
        for i in range(MOVES + 1):
            store.wait_at_barrier(f"disagg-bench/{length}/{i}", 600_000)
            started = time.perf_counter()
            if index == 0:
                link.move(engine.gathered(engine.handoff(state, 0, pages)), (0,), (1,))
                continue
            state = engine.accept(state, link.move(None, (0,), (1,)), 0, pages)
            jax.block_until_ready(state)
            if i:  # the first compiles
                seconds.append(time.perf_counter() - started)
        if index == 1:
            median, kv_bytes = statistics.median(seconds), len(pages) * engine.page_bytes
            out.append({
                "prompt_tokens": length, "pages": len(pages), "kv_bytes": kv_bytes, "median_ms": median * 1e3,
                "ms_per_1k_tokens": median * 1e3 * 1000 / length, "gb_per_s": kv_bytes / median / 1e9,
            })
    store.wait_at_barrier("disagg-bench/done", 600_000)
    if index == 1:
        print(json.dumps(out), flush=True)


def itl_round(engines: Engines, shape: str, ns: argparse.Namespace) -> dict:
    """The streams' inter-token latency (and the long prompts' time to first token) under one shape."""
    from serving.orchestrator import Orchestrator
    from serving.orchestrator.disaggregated import DisaggregatedExecutor
    from serving.orchestrator.executor import Executor
    from serving.request import SamplingParams

    config = engines.cfg.orchestrator
    if shape == "interleaved":
        engine, params = engines.interleaved
        make_executor = Executor
    else:
        engine, params = engines.generate
        prefiller, prefill_params = engines.prefill
        config = config.__class__(**{**config.__dict__, "disaggregated": True})

        def make_executor(engine, params, adapter_weights):
            return DisaggregatedExecutor(prefiller, prefill_params, engine, params, adapter_weights)

    orch = Orchestrator(engine, params, engines.tokenizer, config, make_executor).start()
    try:
        streams = [
            orch.submit([100 + i, 200 + i, 300 + i], SamplingParams(max_tokens=ns.stream_tokens))
            for i in range(ns.streams)
        ]
        longs, stop = [], threading.Event()

        def arrive() -> None:
            i = 0
            while not stop.wait(ns.long_every):
                prompt = [(7 * i + j) % 5000 + 10 for j in range(ns.long_tokens)]
                longs.append(orch.submit(prompt, SamplingParams(max_tokens=4)))
                i += 1

        arrivals = threading.Thread(target=arrive, daemon=True)
        started = time.perf_counter()
        arrivals.start()
        done = [s.result() for s in streams]
        wall = time.perf_counter() - started
        stop.set()
        arrivals.join()
        finished = [h.result() for h in longs]
    finally:
        orch.stop(timeout=60)
    gaps = sorted(b - a for c in done for a, b in zip(c.token_times, c.token_times[1:], strict=False))
    ttfts = sorted(c.time_to_first_token for c in finished)
    return {
        "shape": shape,
        "long_prompts": len(finished),
        "stream_tokens_per_s": sum(len(c.token_ids) for c in done) / wall,
        "itl_ms": {"median": _pct(gaps, 50) * 1e3, "p99": _pct(gaps, 99) * 1e3, "max": gaps[-1] * 1e3},
        "long_ttft_ms": {"median": _pct(ttfts, 50) * 1e3, "p99": _pct(ttfts, 99) * 1e3} if ttfts else None,
    }


def _pct(sorted_values: list[float], pct: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(pct / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--long-tokens", type=int, default=512)
    parser.add_argument("--long-every", type=float, default=2.0, help="seconds between long prompts")
    parser.add_argument("--lengths", default="128,512,1024", help="prompt lengths of the transfer measurement")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--process-of-two", type=int, help=argparse.SUPPRESS)  # transfer_between_processes'
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None, prog: str = "python -m loadtest.disagg_bench") -> int:
    ns = build_parser(prog).parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # before JAX starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    lengths = [int(n) for n in ns.lengths.split(",")]
    if ns.process_of_two is not None:
        _process_of_two(ns.process_of_two, ns.coordinator, lengths)
        return 0
    if ns.rounds < 1 or ns.streams < 1 or not 0 < ns.long_tokens <= PREFILL or any(not 0 < n < TARGET for n in lengths):
        raise SystemExit(f"{prog}: error: --rounds, --streams >= 1; --long-tokens in 1..{PREFILL}; lengths in 1..{TARGET - 1}")
    engines = Engines(slots=ns.streams + 4)
    report = {"transfer": transfer(engines, lengths), "itl": []}
    report["transfer_processes"] = transfer_between_processes(lengths)
    for shape in ("interleaved", "disaggregated"):  # untimed: each shape's calls compile first
        print(f"warming up {shape} (untimed) ...", flush=True)
        itl_round(engines, shape, ns)
    for r in range(ns.rounds):
        for shape in (("interleaved", "disaggregated") if r % 2 == 0 else ("disaggregated", "interleaved")):
            report["itl"].append({"round": r, **itl_round(engines, shape, ns)})
            print(json.dumps(report["itl"][-1]), flush=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "disagg-bench.json").write_text(json.dumps({"args": vars(ns) | {"out": str(ns.out)}, **report}, indent=2))
    _plot(report, ns.out / "disagg-bench.png")
    for shape in ("interleaved", "disaggregated"):
        p99 = [r["itl_ms"]["p99"] for r in report["itl"] if r["shape"] == shape]
        print(f"{shape}: inter-token p99 {', '.join(f'{v:.1f}' for v in p99)} ms")
    print(f"wrote {ns.out / 'disagg-bench.json'}, {ns.out / 'disagg-bench.png'}")
    return 0


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    moves = report["transfer"]
    left.plot([m["prompt_tokens"] for m in moves], [m["median_ms"] for m in moves], "o-")
    left.set_xlabel("prompt tokens moved")
    left.set_ylabel("ms (handoff + accept)")
    left.set_title("moving a prefilled prompt between devices")
    for shape in ("interleaved", "disaggregated"):
        rounds = [r for r in report["itl"] if r["shape"] == shape]
        right.plot([r["round"] for r in rounds], [r["itl_ms"]["p99"] for r in rounds], "o-", label=f"{shape} p99")
        right.plot([r["round"] for r in rounds], [r["itl_ms"]["median"] for r in rounds], "x--", label=f"{shape} median")
    right.set_xlabel("round")
    right.set_ylabel("inter-token latency (ms)")
    right.set_title("streams while long prompts arrive")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
