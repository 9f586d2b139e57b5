"""The served path's scheduling at a chip's call times, without the chip: `pathserve`'s HTTP server,
orchestrator and scheduler over the mock engine, whose generate and prefill calls take as long
as the chip's took (`make bench-tpu` measured them) on an emulated device queue (a generate call
is dispatched and the host goes on; reading its tokens, or a prefill's first tokens, waits for the
calls before it and its own), served over a unix socket to `make bench-tpu`'s own HTTP client. What separates HTTP from the engine alone that is not the device's
(how a burst is admitted, how many prefill and generate calls a batch takes, how full they are)
shows here as it does on the chip: with a v5e's times on XLA's attention (`--ladders xla-tpu
--generate 16=0.06,64=0.14,128=0.32 --prefill 0.17`) it made the same 8 prefill and 37 generate
calls as the chip at batch 64, and 0.775x of the engine against the chip's 0.765x; with the
ragged kernel's (the defaults) and prompt lengths from 128, 0.62-0.68x against the chip's 0.64x
(calls slept through then; on the device queue 0.68x; from 32, the ragged backend's now: 0.78x,
not yet on the chip). Its prefill time is the
padded tokens' share: the chip's own call times differ where the shapes do (a burst's 64 prefix
hits' rests in one call of 8,192 padded tokens was faster here, slower on the chip).

    python -m loadtest.served_sim OUT_DIR [--batches 64,256] [--generate 16=0.03,64=0.044,128=0.059]
        [--prefill 0.12] [--prefill-fixed 0.02] [--ladders tpu|xla-tpu|cpu] [--tokenizer DIR] [--request-cpu-ms 0]
        [key=value ...]

`--generate`: seconds of a generate call (the profile's decode steps) by its rows bucket;
`--prefill`: seconds of a prefill call of prefill_batch_tokens padded tokens (a call takes its
share, plus `--prefill-fixed`; a v5e's 1B calls with the ragged kernel: 0.161 and 0.0017);
`--ladders`: the prefill shapes' (lengths and rows) of the TPU profile's backend (`tpu`: the
ragged kernel's), of XLA's attention on a TPU, or of a CPU; `--tokenizer`: a model's tokenizer
(its host cost), else ASCII's; `--request-cpu-ms`: Python work added to each request (a TPU VM's
host took ~1 ms a request in, this 2-core one ~0.35); key=value: serving config keys (the TPU
profile's by default). Writes
OUT_DIR/served-sim.json: each batch's tokens/s, its ratio to the engine alone (a full bucket's
tokens over its call time), its device calls, and every call (when, which, rows) in
OUT_DIR/calls-b{N}.txt. Not a test, and no figure of a chip: a tool to try scheduling changes on.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TPU_PROFILE = Path(__file__).resolve().parents[1] / "configs" / "serving" / "tpu.yml"


def _times(text: str) -> dict[int, float]:
    return {int(rows): float(seconds) for rows, seconds in (pair.split("=") for pair in text.split(","))}


def _config(overrides: list[str]):
    """The TPU profile's serving config with `overrides` (key=value) over it."""
    import yaml

    from serving.config import ServingConfig

    keys = yaml.safe_load(TPU_PROFILE.read_text())
    keys.update({k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides)})  # as YAML, as the CLI reads them
    return ServingConfig(**keys)


class _Device:
    """A device's queue of calls: each runs after the ones before it, for its seconds, while the
    host goes on (as JAX dispatches to a TPU); reading a call's results waits for its end."""

    def __init__(self):
        self.free_at = time.perf_counter()

    def queue(self, seconds: float) -> float:
        """A call of `seconds` dispatched now: when it ends."""
        self.free_at = max(self.free_at, time.perf_counter()) + seconds
        return self.free_at

    @staticmethod
    def wait(until: float) -> None:
        time.sleep(max(0.0, until - time.perf_counter()))


class _OnDevice:
    """A result still on the device: `np.asarray` of it waits for the call's end."""

    def __init__(self, value, done: float):
        self.value, self.done = value, done

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        _Device.wait(self.done)
        return np.asarray(self.value, dtype)


def _slower_host(app, seconds: float):
    """`app` with `seconds` of Python work (the GIL held, as parsing and validating hold it) before
    each HTTP request: a host slower than this one (a TPU VM's took ~1 ms a request in, this
    2-core one ~0.35)."""

    async def slower(scope, receive, send):
        if scope["type"] == "http":
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                pass
        await app(scope, receive, send)

    return slower


def serve(
    uds: str, calls: str, generate: dict[int, float], prefill: float, ladders: str, overrides: list[str],
    tokenizer: str | None = None, prefill_fixed: float = 0.02, request_cpu_ms: float = 0.0,
) -> None:
    """The server process: the mock engine with those call times, until SIGTERM; `tokenizer`: a
    model's tokenizer directory (its encoding and decoding cost the host what they cost serving
    that model; the mock's tokens are ids below 95 either way), else the mock's ASCII one."""
    import uvicorn

    from serving.api.app import create_app
    from serving.api.state import ServerState
    from serving.cli.main import apply_log_level
    from serving.engine.mock import AsciiTokenizer, MockEngine
    from serving.orchestrator import Orchestrator

    apply_log_level(os.environ.get("PATHSERVE_LOG_LEVEL", ""))  # DEBUG: the loop's turns and gathers, as serve logs them
    cfg = _config(overrides)
    slots = int(cfg.per_device_batch_size)
    engine = MockEngine(
        slots=slots, max_prefill_length=cfg.max_prefill_predict_length, max_target_length=cfg.max_target_length,
        decode_steps_per_call=cfg.decode_steps_per_call, prefill_chunk_size=cfg.prefill_chunk_size,
        max_prefill_batch=cfg.max_prefill_batch, prefill_batch_tokens=cfg.prefill_batch_tokens,
        history_batch_tokens=cfg.history_batch_tokens, decode_buckets=tuple(cfg.decode_slot_buckets or ()),
        prefix_block=cfg.prefix_block_size,
    )
    if ladders != "cpu":  # a TPU backend's ladders (lengths from its min_prefill_bucket; rows grown by 4)
        from serving.kernels.ragged_paged import RaggedPagedOps
        from serving.models.ops import TpuXlaOps

        ops = RaggedPagedOps if ladders == "tpu" else TpuXlaOps
        engine.limits = dataclasses.replace(
            engine.limits, min_bucket=ops.min_prefill_bucket, bucket_growth=ops.shape_growth,
            length_growth=ops.length_growth,
        )
    with open(calls, "w", buffering=1) as log:
        started = time.perf_counter()
        mock_generate, mock_prefill = engine.generate, engine.prefill_slots
        device = _Device()

        def timed_generate(params, state, *args, **kwargs):
            at = time.perf_counter() - started
            rows = kwargs.get("num_slots") or len(kwargs.get("slots") or ()) or slots
            done = device.queue(generate.get(rows, max(generate.values())))
            state, result = mock_generate(params, state, *args, **kwargs)
            log.write(f"{at:.3f} generate rows={rows} valid={int(result.valid.sum())}\n")
            # dispatched, not waited for: its tokens are read when the device would have them
            return state, result._replace(**{
                name: _OnDevice(getattr(result, name), done) for name in ("tokens", "valid", "done")
            })

        def timed_prefill(params, state, rows):
            at, limits = time.perf_counter() - started, engine.limits
            padded = limits.padded_rows(len(rows)) * limits.bucket_for(max(len(r.tokens) for r in rows))
            device.wait(device.queue(prefill_fixed + prefill * padded / limits.prefill_batch_tokens))  # its first tokens read
            out = mock_prefill(params, state, rows)
            log.write(f"{at:.3f} prefill rows={len(rows)} start={max(r.start for r in rows)} padded={padded}\n")
            return out

        engine.generate, engine.prefill_slots = timed_generate, timed_prefill
        if tokenizer:
            from serving.text.tokenizer import load_tokenizer

            text = load_tokenizer(Path(tokenizer))
        else:
            text = AsciiTokenizer()
        orchestrator = Orchestrator(engine, {}, text, cfg.orchestrator)
        state = ServerState(config=cfg.server)
        state.set_ready(orchestrator.start(), "mock")
        app = create_app(state)
        if request_cpu_ms > 0:
            app = _slower_host(app, request_cpu_ms / 1000)
        uvicorn.Server(uvicorn.Config(app, uds=uds, log_level="warning")).run()
        orchestrator.stop(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--generate", default="16=0.03,64=0.044,128=0.059", help="rows=seconds of a generate call")
    parser.add_argument("--prefill", type=float, default=0.12, help="seconds of a full prefill call's padded tokens")
    parser.add_argument("--prefill-fixed", type=float, default=0.02, help="seconds every prefill call takes besides")
    parser.add_argument("--ladders", choices=("tpu", "xla-tpu", "cpu"), default="tpu")
    parser.add_argument("--tokenizer", help="a tokenizer directory (the host's cost of a real one), else ASCII's")
    parser.add_argument("--request-cpu-ms", type=float, default=0.0, help="Python work added to each request (a slower host)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the server process's own socket
    parser.add_argument("overrides", nargs="*", help="serving config keys, over the TPU profile's")
    ns = parser.parse_intermixed_args(argv)
    generate = _times(ns.generate)
    if ns.serve:
        serve(
            ns.serve, str(ns.out), generate, ns.prefill, ns.ladders, ns.overrides, ns.tokenizer, ns.prefill_fixed,
            ns.request_cpu_ms,
        )
        return 0
    from loadtest.tpu_bench import http_rate, stop_server, wait_ready

    ns.out.mkdir(parents=True, exist_ok=True)
    report: dict = {"generate_s": generate, "prefill_s": ns.prefill, "overrides": ns.overrides, "batches": {}}
    for batch in (int(b) for b in ns.batches.split(",")):
        uds = f"/tmp/pathserve-sim-{os.getpid()}.sock"
        calls = ns.out / f"calls-b{batch}.txt"
        command = [sys.executable, "-m", "loadtest.served_sim", str(calls), "--serve", uds, "--generate", ns.generate,
                   "--prefill", str(ns.prefill), "--prefill-fixed", str(ns.prefill_fixed), "--ladders", ns.ladders,
                   "--request-cpu-ms", str(ns.request_cpu_ms),
                   *ns.overrides,
                   *(["--tokenizer", ns.tokenizer] if ns.tokenizer else [])]
        server = subprocess.Popen(command, start_new_session=True)
        try:
            wait_ready(server, uds, 60)
            point = asyncio.run(http_rate(uds, batch, 2 * batch, ns.max_tokens))
        finally:
            stop_server(server)
            Path(uds).unlink(missing_ok=True)
        cfg = _config(ns.overrides)
        decoding = min(batch, int(cfg.per_device_batch_size))
        bucket = min((r for r in generate if r >= decoding), default=max(generate))
        alone = decoding * cfg.decode_steps_per_call / generate[bucket]  # the engine alone: full calls back to back
        point["engine_alone_tok_s"], point["over_engine"] = alone, point["tokens_per_s"] / alone
        report["batches"][f"b{batch}"] = point
        print(json.dumps({batch: point}), file=sys.stderr, flush=True)
    (ns.out / "served-sim.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
