"""`make bench-tpu`: the served path against the engine on one accelerator, over a unix socket
(a TPU VM has no TCP). For a model directory (random weights of a shape: loadtest.random_model):

1. `pathserve serve MODEL --uds SOCK` with no other argument (the platform's serving profile):
   seconds until /readyz says ready (a cold or warm compilation cache, as found), and until the
   background warmup is done (the measurement waits for it: a request would compile a shape);
2. HTTP over the socket: `concurrency` clients at once, each streaming-free completions of
   `max_tokens` tokens with ignore_eos, output tokens/s;
3. the server stopped, the engine alone (generate back to back) and the offline driver (the device
   loop's scheduler and executor, synchronously) on the same config, loadtest.tpu_probe's way;
each rate with its ratio to the engine alone at the same batch. JSON to OUT/tpu-bench.json as
each part finishes (a run cut short keeps what it measured).

    python -m loadtest.tpu_bench MODEL_DIR OUT_DIR [--batches 1,16,64] [--max-tokens 128] [key=value ...]

Not a test: figures of the chip it runs on. Speaks HTTP to the server (no engine import) until the
server has stopped; the engine parts follow in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPT = "The history of the lighthouse is closely tied to the history of seafaring. " * 3


def _write(out: Path, report: dict) -> None:
    (out / "tpu-bench.json").write_text(json.dumps(report, indent=2))


def start_server(model: str, uds: str, overrides: list[str], log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "serving.cli", "serve", model, *overrides, "--uds", uds]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(server: subprocess.Popen, uds: str, timeout: float) -> tuple[float, float]:
    """(seconds from now until /readyz answers 200, until the background warmup has no shape left
    either: a request that comes before compiles its shape); RuntimeError if the server exits or
    the time runs out."""
    started, ready = time.perf_counter(), None
    client = httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://pathserve")
    while time.perf_counter() - started < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            if ready is None and client.get("/readyz", timeout=5).status_code == 200:
                ready = time.perf_counter() - started
            if ready is not None and "pathserve_warmup_shapes_pending 0.0" in client.get("/metrics", timeout=5).text:
                return ready, time.perf_counter() - started
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not ready after {timeout} s")


async def http_rate(uds: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """Output tokens/s of `requests` completions (`concurrency` at once, ignore_eos) over the socket."""
    transport = httpx.AsyncHTTPTransport(uds=uds)
    async with httpx.AsyncClient(transport=transport, base_url="http://pathserve", timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        queue = list(range(requests))
        tokens = 0

        async def worker() -> None:
            nonlocal tokens
            while queue:
                queue.pop()
                reply = await client.post("/v1/completions", json=body)
                reply.raise_for_status()
                tokens += reply.json()["usage"]["completion_tokens"]

        await client.post("/v1/completions", json={**body, "max_tokens": 2})  # one request's compiles first
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return {"concurrency": concurrency, "requests": requests, "output_tokens": tokens, "tokens_per_s": tokens / wall}


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def engine_rates(model: str, overrides: list[str], batches: list[int], max_tokens: int) -> dict:
    """The engine alone and the offline driver at each batch, brought up as serve brings it up."""
    from loadtest.tpu_probe import _bring_up, engine_alone, offline
    from serving.orchestrator.executor import Executor

    started = time.perf_counter()
    engine, params, tokenizer = _bring_up(model, overrides)
    out = {"bring_up_s": time.perf_counter() - started, "summary": engine.summary(), "slots": engine.max_concurrent_decodes}
    prompt_ids = tokenizer.encode(PROMPT)
    executor = Executor(engine, params)
    for batch in batches:
        engine_alone(engine, params, prompt_ids, batch, 16)  # compiles, if warmup did not
        offline(engine, params, executor, prompt_ids, batch, 16)
        alone = engine_alone(engine, params, prompt_ids, batch, max_tokens)
        driven = offline(engine, params, executor, prompt_ids, batch, max_tokens)
        out[f"b{batch}"] = {"engine_tok_s": alone, "offline_tok_s": driven, "offline_over_engine": driven / alone}
        print(json.dumps({batch: out[f"b{batch}"]}), file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--skip-engine", action="store_true", help="the served path only")
    parser.add_argument("overrides", nargs="*", help="key=value for both the server and the engine parts")
    ns = parser.parse_intermixed_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in ns.batches.split(",")]
    uds = str(ns.out / "serve.sock") if len(str(ns.out)) < 80 else f"/tmp/pathserve-bench-{os.getpid()}.sock"
    report: dict = {"model": ns.model, "overrides": ns.overrides, "max_tokens": ns.max_tokens, "http": {}}
    server = start_server(ns.model, uds, ns.overrides, ns.out / "serve.log")
    try:
        report["ready_s"], report["warmed_s"] = wait_ready(server, uds, ns.ready_timeout)
        print(f"ready in {report['ready_s']:.1f} s, warmed in {report['warmed_s']:.1f} s", file=sys.stderr, flush=True)
        _write(ns.out, report)
        for batch in batches:
            point = asyncio.run(http_rate(uds, batch, 2 * batch, ns.max_tokens))
            report["http"][f"b{batch}"] = point
            print(json.dumps(point), file=sys.stderr, flush=True)
            _write(ns.out, report)
    finally:
        stop_server(server)
    if not ns.skip_engine:
        report["engine"] = engine_rates(ns.model, ns.overrides, batches, ns.max_tokens)
        for batch in batches:
            http, alone = report["http"].get(f"b{batch}"), report["engine"].get(f"b{batch}")
            if http and alone:
                http["over_engine"] = http["tokens_per_s"] / alone["engine_tok_s"]
        _write(ns.out, report)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
