"""Two servers on loopback, one loaded and one idle: what an endpoint picker scrapes of each
(the model-server protocol's names, serving.metric_names, parsed with prometheus_client's parser)
is enough to prefer the idle one."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import metric_names
from tests.conftest import TINY_QUEUE, TINY_SERVER_ARGS, TINY_SLOTS
from tests.server_process import ServerProcess, wait_for

LONG = 1500  # tokens per loading request: they stay in their slots for the whole observation


@pytest.fixture(scope="module")
def busy_server(tiny_model_dir):
    """A second server: the picker's choice needs two, and loading the session's shared one would
    slow every test after this one. The same tiny random model and shape, warmup off (it only
    needs to be ready, not to say "starting" first)."""
    args = [a for a in TINY_SERVER_ARGS if not a.startswith("enable_model_warmup=")]
    process = ServerProcess.pathserve(str(tiny_model_dir), *args, "enable_model_warmup=false").wait_ready()
    yield process
    process.stop()


def signals(server: ServerProcess) -> dict[str, object]:
    """The endpoint picker's view of one server."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def gauge(name: str) -> float:
        family = families[name]
        assert family.type == "gauge", name
        return family.samples[0].value

    # The LoRA info gauge only where adapters are configured (max_loras > 0): neither server has any.
    lora = families[metric_names.LORA_INFO].samples if metric_names.LORA_INFO in families else []
    (cache,) = families[metric_names.CACHE_CONFIG_INFO].samples
    return {
        "waiting": gauge(metric_names.QUEUED_REQUESTS),
        "running": gauge(metric_names.RUNNING_REQUESTS),
        "kv": gauge(metric_names.KV_CACHE_USAGE),
        "lora": [sample.labels for sample in lora],
        "cache": cache.labels,
    }


def _load(server: ServerProcess, count: int, stop: threading.Event) -> list[threading.Thread]:
    """`count` streamed completions of LONG tokens, each dropped (cancelled) once `stop` is set."""

    def one() -> None:  # sent again when it ends (or is refused), so the load holds until `stop`
        body = {"prompt": "the picker", "max_tokens": LONG, "ignore_eos": True, "stream": True}
        while not stop.is_set():
            try:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
                    for _ in response.iter_lines():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                pass

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_the_loaded_servers_signals_make_a_picker_prefer_the_idle_one(tiny_server, busy_server):
    idle = tiny_server
    assert wait_for(lambda: signals(idle)["running"] == 0 and signals(idle)["waiting"] == 0, timeout=60)
    stop = threading.Event()
    threads = _load(busy_server, TINY_SLOTS + TINY_QUEUE, stop)
    try:
        # Every slot decoding and the rest queued: the queued ones wait for a LONG request to end.
        # (KV use is counted after each device turn: 0 until the first prefills have run.)
        # Two reads in a row, both under the full load (a loading request that ends between them
        # is sent again, and the reads are taken again: on a fast machine 1,500 tokens end soon).
        reads: list = []

        def loaded() -> bool:
            reads[:] = [signals(busy_server), signals(busy_server)]
            full = all(r["waiting"] == TINY_QUEUE and r["running"] == TINY_SLOTS and r["kv"] > 0 for r in reads)
            return full and reads[0]["kv"] <= reads[1]["kv"]  # no request ended and refilled between them

        assert wait_for(loaded, timeout=120), reads
        first, second = reads
        calm = signals(idle)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert first["running"] == second["running"] == TINY_SLOTS and second["waiting"] == TINY_QUEUE
    assert 0 < first["kv"] <= second["kv"] <= 1  # the decoding sequences grow
    assert (calm["waiting"], calm["running"], calm["kv"]) == (0, 0, 0)
    # A queue-then-KV scorer (the picker's queue and kv-cache-utilization scorers) picks the idle one.
    servers = {"idle": calm, "busy": second}
    assert min(servers, key=lambda s: (servers[s]["waiting"], servers[s]["kv"])) == "idle"
    assert calm["lora"] == second["lora"] == []  # no adapters configured: no LoRA info (the picker skips it)
    assert int(calm["cache"]["block_size"]) > 0 and int(calm["cache"]["num_gpu_blocks"]) > 0
