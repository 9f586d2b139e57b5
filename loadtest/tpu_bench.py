"""`make bench-tpu`: the served path against the engine on one accelerator, over a unix socket
(a TPU VM has no TCP). For a model directory (random weights of a shape: loadtest.random_model):

1. `pathserve serve MODEL --uds SOCK` with no other argument (the platform's serving profile):
   seconds until /readyz says ready (a cold or warm compilation cache, as found), and until the
   background warmup is done (the measurement waits for it: a request would compile a shape);
   after the HTTP part, the same command once more: its ready time with the cache now warm;
2. HTTP over the socket: `concurrency` clients at once, each streaming-free completions of
   `max_tokens` tokens with ignore_eos, output tokens/s, and the device calls the batch took (the
   server's generate and prefill calls and their seconds, from /metrics);
3. the server stopped, the chip's measured limits (read bandwidth, bfloat16 and int8 matmul
   rates), then the engine alone (generate back to back) and the offline driver (the device loop's
   scheduler and executor, synchronously) on the same config, loadtest.tpu_probe's way; then
   prefill's FLOP/s (a whole max_prefill_predict_length prompt, a call of full chunks) as a
   fraction of the MXU's peak, and decode with a chunk beside every generate call at the largest
   batch against decode alone;
each rate with its ratio to the engine alone at the same batch, the engine's with its fraction of
the roofline those limits allow. JSON to OUT/tpu-bench.json as
each part finishes (a run cut short keeps what it measured).

    python -m loadtest.tpu_bench MODEL_DIR OUT_DIR [--batches 1,16,64,256] [--max-tokens 128]
        [--skip-engine | --engine-only] [key=value ...]

`--engine-only`: part 3 alone (a backend against another, say `use_ragged_attention=true`, in a
minute or two of a device call); `--skip-engine`: parts 1 and 2.

A batch above the slots (256 on the TPU profile's 128) queues the rest, over HTTP and in the
offline driver; the engine alone then decodes every slot.

Not a test: figures of the chip it runs on. Speaks HTTP to the server (no engine import) until the
server has stopped; the engine parts follow in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    env = {**os.environ, "PATHSERVE_LOG_LEVEL": os.environ.get("PATHSERVE_LOG_LEVEL", "INFO")}  # phases in the log
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


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


class RawConnection:
    """One keep-alive HTTP/1.1 connection over a unix socket that POSTs JSON and reads the answer
    (content-length or chunked): the load generator's own work a request is a write, a header
    parse and a JSON load. httpx's took ~1.7 ms of CPU a request on a 2-core host (against a
    server that answers at once), so a wave of 64 requests was ~110 ms of the bench's own time
    beside the chip's 660 ms of decoding: the bench, not the server, set part of the HTTP
    figure's pace. The server does the same work either way (it sees the same bytes)."""

    def __init__(self, uds: str):
        self.uds = uds
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """(status, body) of a POST of `payload` (JSON bytes); ConnectionError and
        asyncio.IncompleteReadError where the connection breaks (the next post opens a new one)."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_unix_connection(self.uds)
        assert self._reader is not None
        head = b"POST %s HTTP/1.1\r\nhost: pathserve\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        self._writer.write(head % (path.encode(), len(payload)) + payload)
        try:
            lines = (await self._reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
            status = int(lines[0].split()[1])
            headers = {k.strip().lower(): v.strip().lower() for k, _, v in (line.partition(b":") for line in lines[1:] if line)}
            if b"content-length" in headers:
                body = await self._reader.readexactly(int(headers[b"content-length"]))
            elif headers.get(b"transfer-encoding") == b"chunked":
                body = await self._chunked()
            else:
                raise ConnectionError(f"an answer of neither content-length nor chunks: {lines[0]!r}")
        except BaseException:
            await self.close()
            raise
        if headers.get(b"connection") == b"close":
            await self.close()
        return status, body

    async def _chunked(self) -> bytes:
        assert self._reader is not None
        parts = []
        while size := int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16):
            parts.append(await self._reader.readexactly(size + 2))
        await self._reader.readuntil(b"\r\n")  # the last chunk's (empty) trailer
        return b"".join(part[:-2] for part in parts)

    async def close(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


async def http_rate(uds: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """Output tokens/s of `requests` completions (`concurrency` at once, ignore_eos) over the socket:
    `concurrency` clients, each with its own connection (`RawConnection`), as that many users
    would have; the control requests (the model's name, /metrics, the first request) by httpx."""
    transport = httpx.AsyncHTTPTransport(uds=uds)
    async with httpx.AsyncClient(transport=transport, base_url="http://pathserve", timeout=600) as control:
        model = (await control.get("/v1/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        payload = json.dumps(body).encode()
        queue = list(range(requests))
        tokens = 0
        failed: list[str] = []  # transport failures (a dropped connection): counted, not retried
        spans: list[tuple[float, float]] = []  # each request's (sent, answered), seconds from the start

        async def worker(own: RawConnection) -> None:
            nonlocal tokens
            try:
                while queue:
                    queue.pop()
                    sent = time.perf_counter() - started
                    try:
                        status, answer = await own.post("/v1/completions", payload)
                    except (ConnectionError, asyncio.IncompleteReadError) as exc:
                        failed.append(f"{time.perf_counter() - started:.2f} s: {type(exc).__name__}: {exc}")
                        continue
                    if status != 200:
                        raise RuntimeError(f"/v1/completions answered {status}: {answer[:500]!r}")
                    tokens += json.loads(answer)["usage"]["completion_tokens"]
                    spans.append((sent, time.perf_counter() - started))
            finally:
                await own.close()

        (await control.post("/v1/completions", json={**body, "max_tokens": 2})).raise_for_status()  # its compiles first
        clients = [RawConnection(uds) for _ in range(concurrency)]
        before = _calls((await control.get("/metrics")).text)
        started, started_unix = time.perf_counter(), time.time()
        await asyncio.gather(*(worker(own) for own in clients))
        wall = time.perf_counter() - started
        after = _calls((await control.get("/metrics")).text)
    calls = {k: after[k] - before.get(k, 0.0) for k in after}
    point = {
        "concurrency": concurrency, "requests": requests, "output_tokens": tokens, "tokens_per_s": tokens / wall,
        "wall_s": wall, "device_calls": calls, "requests_spread": spread(spans, concurrency),
        "started_unix": started_unix,  # the server log's clock (PATHSERVE_LOG_LEVEL=DEBUG: its turns)
    }
    if failed:  # the rate above is of the requests that completed
        point["failed"] = {"count": len(failed), "first": failed[:3]}
    return point


def spread(spans: list[tuple[float, float]], concurrency: int) -> dict:
    """Where a closed loop's time went between the device's work: requests in waves of
    `concurrency` (each client sends its next as its last is answered), each wave's first and last
    send and first and last answer, in seconds from the start (a wave sent over 0.2 s is admitted
    in pieces; the time from a wave's last answer to the next wave's first send is the client's
    turn, the next wave's last send to its first answer the server's)."""
    sent = sorted(s for s, _ in spans)
    answered = sorted(a for _, a in spans)
    waves = []
    for i in range(0, len(sent), concurrency):
        waves.append({
            "sent": [round(sent[i], 4), round(sent[min(i + concurrency, len(sent)) - 1], 4)],
            "answered": [round(answered[i], 4), round(answered[min(i + concurrency, len(answered)) - 1], 4)],
        })
    return {"waves": waves}


def _calls(metrics: str) -> dict[str, float]:
    """The device loop's generate and prefill calls so far, and their seconds, from /metrics (how
    many calls a batch took, and how much of its wall time they were)."""
    out = {}
    for line in metrics.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(("pathserve_generate_step_seconds_", "pathserve_prefill_step_seconds_")) and name.endswith(("_count", "_sum")):
            out[name.removeprefix("pathserve_")] = float(value)
    return out


def stop_server(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def chip_rates(size: int, stream_bytes: int = 1 << 30) -> dict:
    """The device's measured limits, best of 5 each: HBM bandwidth (streaming `stream_bytes`),
    bfloat16 and int8 matmul rates (size^3: 8192 on a TPU, where the MXU runs near its peak)."""
    import jax
    import jax.numpy as jnp

    def best(fn, *args) -> float:
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(5):
            started = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - started)
        return min(times)

    # HBM bandwidth: the best of a float32 sum (reads it), x + 1 (reads and writes it) and 8 rows
    # times a bfloat16 matrix of that size (a decode step's read of its weights). The first two
    # read 510-553 GB/s on a v5e, below what a decode step's weight reads reach there (687 GB/s at
    # batch 1), hence the third; `roofline` takes the chip's published figures where its kind is known.
    x = jnp.ones((stream_bytes // 4,), jnp.float32)
    streams = {
        "sum": x.nbytes / best(jax.jit(jnp.sum), x), "add": 2 * x.nbytes / best(jax.jit(lambda u: u + 1), x),
    }
    del x
    cols = 1 << 13
    w = jnp.ones((stream_bytes // 2 // cols, cols), jnp.bfloat16)
    rows = jnp.ones((8, w.shape[0]), jnp.bfloat16)
    streams["matvec"] = w.nbytes / best(jax.jit(jnp.matmul), rows, w)
    del w, rows
    bandwidth = max(streams.values())
    a = jnp.ones((size, size), jnp.bfloat16)
    bf16 = 2 * size**3 / best(jax.jit(jnp.matmul), a, a)
    q = jnp.ones((size, size), jnp.int8)
    dot = jax.jit(lambda u, v: jax.lax.dot(u, v, preferred_element_type=jnp.int32))
    int8 = 2 * size**3 / best(dot, q, q)
    kind = jax.devices()[0].device_kind
    return {
        "device_kind": kind, "hbm_bytes_per_s": bandwidth, "hbm_by_probe": streams, "bf16_flop_per_s": bf16,
        "int8_op_per_s": int8, "matmul_size": size, "published": PUBLISHED.get(kind),
    }


# A chip's published limits by JAX's device_kind (Google Cloud's TPU pages): HBM bytes/s, bfloat16
# FLOP/s, int8 OP/s. The roofline's bound: what the chip can do, where the measured figures fall short.
PUBLISHED = {
    "TPU v5 lite": {"hbm_bytes_per_s": 819e9, "bf16_flop_per_s": 197e12, "int8_op_per_s": 394e12},
    "TPU v6 lite": {"hbm_bytes_per_s": 1640e9, "bf16_flop_per_s": 918e12, "int8_op_per_s": 1836e12},
}


def roofline(engine, params, chip: dict, batch: int, context: int) -> float:
    """Decode tok/s the chip's limits allow (each the better of measured and published) at `batch`
    sequences of `context` positions: every weight and each sequence's KV read once a step, 2
    multiply-adds a weight a token, on the MXU's int8 rate under W8A8 (quantization=int8), else
    its bfloat16 one."""
    import jax

    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    where, limits = engine.placement, engine.limits
    kv_per_position = where.cache_bytes_per_chip() / (limits.num_pages * limits.page_size)
    cfg = engine.model.config
    matmul_params = cfg.num_layers * (
        cfg.embed_dim * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        + cfg.num_heads * cfg.head_dim * cfg.embed_dim
        + 3 * cfg.embed_dim * cfg.mlp_dim
    ) + cfg.embed_dim * cfg.vocab_size
    limits = {key: max(chip[key], (chip.get("published") or {}).get(key, 0.0)) for key in PUBLISHED["TPU v5 lite"]}
    rate = limits["int8_op_per_s"] if engine.config.quantization.activations else limits["bf16_flop_per_s"]
    step = max((weights + batch * context * kv_per_position) / limits["hbm_bytes_per_s"], 2 * matmul_params * batch / rate)
    return batch / step


def engine_rates(model: str, overrides: list[str], batches: list[int], max_tokens: int, rate_size: int) -> dict:
    """The chip's limits, then the engine alone and the offline driver at each batch (brought up as
    serve brings it up), each with its fraction of the roofline."""
    from loadtest.tpu_probe import _bring_up, engine_alone, mixed_rate, offline, prefill_rates
    from serving.orchestrator.executor import Executor

    chip = chip_rates(rate_size)
    print(json.dumps(chip), file=sys.stderr, flush=True)
    started = time.perf_counter()
    engine, params, tokenizer = _bring_up(model, overrides)
    out = {
        "chip": chip, "bring_up_s": time.perf_counter() - started, "summary": engine.summary(),
        "slots": engine.max_concurrent_decodes,
    }
    prompt_ids = tokenizer.encode(PROMPT)
    executor = Executor(engine, params)
    for batch in batches:
        # more requests than slots (256 on the profile's 128): the engine alone decodes every slot,
        # the offline driver queues the rest, as a server would
        decoding = min(batch, engine.max_concurrent_decodes)
        engine_alone(engine, params, prompt_ids, decoding, 16, executor)  # compiles, if warmup did not
        offline(engine, params, executor, prompt_ids, batch, 16)
        alone = engine_alone(engine, params, prompt_ids, decoding, max_tokens, executor)
        driven = offline(engine, params, executor, prompt_ids, batch, max_tokens)
        bound = roofline(engine, params, chip, decoding, len(prompt_ids) + max_tokens // 2)
        out[f"b{batch}"] = {
            "engine_batch": decoding, "engine_tok_s": alone, "offline_tok_s": driven,
            "offline_over_engine": driven / alone, "roofline_tok_s": bound, "engine_of_roofline": alone / bound,
        }
        print(json.dumps({batch: out[f"b{batch}"]}), file=sys.stderr, flush=True)
    del executor  # its KV pool: the parts below make their own, one at a time
    # prefill on the MXU (issue 65: a 1,024-token prompt at >= 0.4 of the peak) and a step that
    # prefills beside its decodes (their tok/s >= 0.8x of decoding alone), at the largest batch
    peak = max(chip["bf16_flop_per_s"], (chip.get("published") or {}).get("bf16_flop_per_s", 0.0))
    prefill = prefill_rates(engine, params, prompt_ids)
    prefill["whole_of_peak"] = prefill["whole_flop_per_s"] / peak
    prefill["chunks_of_peak"] = prefill["chunks_flop_per_s"] / peak
    out["prefill"] = prefill
    out["mixed"] = mixed_rate(engine, params, prompt_ids, max(batches), max_tokens)
    print(json.dumps({"prefill": prefill, "mixed": out["mixed"]}), file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--skip-engine", action="store_true", help="the served path only")
    parser.add_argument("--engine-only", action="store_true", help="the chip's limits, the engine and the offline driver only")
    parser.add_argument("--rate-size", type=int, default=8192, help="the matmul's side for the MXU rates")
    parser.add_argument("overrides", nargs="*", help="key=value for both the server and the engine parts")
    ns = parser.parse_intermixed_args(argv)
    if ns.engine_only and ns.skip_engine:
        parser.error("--engine-only and --skip-engine leave nothing to measure")
    ns.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in ns.batches.split(",")]
    uds = str(ns.out / "serve.sock") if len(str(ns.out)) < 80 else f"/tmp/pathserve-bench-{os.getpid()}.sock"
    report: dict = {"model": ns.model, "overrides": ns.overrides, "max_tokens": ns.max_tokens, "http": {}}
    if not ns.engine_only:
        _served(ns, uds, batches, report)
    if not ns.skip_engine:
        report["engine"] = engine_rates(ns.model, ns.overrides, batches, ns.max_tokens, ns.rate_size)
        for batch in batches:
            http, alone = report["http"].get(f"b{batch}"), report["engine"].get(f"b{batch}")
            if http and alone:
                http["over_engine"] = http["tokens_per_s"] / alone["engine_tok_s"]
        _write(ns.out, report)
    print(json.dumps(report, indent=2))
    return 0


def _served(ns: argparse.Namespace, uds: str, batches: list[int], report: dict) -> None:
    """The served part: ready (cold or as the cache finds it), HTTP at each batch, ready again warm."""
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
    # the same command again: its compilation cache is warm now (the second bring-up)
    server = start_server(ns.model, uds, ns.overrides, ns.out / "serve-warm.log")
    try:
        report["ready_warm_s"], report["warmed_warm_s"] = wait_ready(server, uds, ns.ready_timeout)
        print(f"warm: ready in {report['ready_warm_s']:.1f} s, warmed in {report['warmed_warm_s']:.1f} s", file=sys.stderr, flush=True)
        _write(ns.out, report)
    finally:
        stop_server(server)


if __name__ == "__main__":
    raise SystemExit(main())
