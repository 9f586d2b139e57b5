"""LoRA adapters through the orchestrator on the mock engine: a request's adapter is written into
its device slot by the plan, before the request prefills, and reading it from storage (a host copy
the LRU dropped) holds no lock that `submit` or the readiness probe takes."""

from __future__ import annotations

import threading

import httpx
import numpy as np

from serving.api.state import ServerState
from serving.config import ServingConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.lora.peft import LoraWeights
from serving.lora.registry import AdapterRegistry
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams
from tests.unit.test_api import _Running

TOKENIZER = AsciiTokenizer()
WAIT_S = 30  # a bound for what must not block at all; reached only when it does


def _weights(rank: int) -> LoraWeights:
    return LoraWeights(rank, {"wq": (np.zeros((1, 2, rank)), np.zeros((1, rank, 2)))}, 1.0)


def _serve(registry: AdapterRegistry, slots: int = 2) -> Orchestrator:
    cfg = ServingConfig(max_queued_requests=4, max_prefill_predict_length=64, max_target_length=256)
    return Orchestrator(MockEngine(slots=slots), {}, TOKENIZER, cfg.orchestrator, adapters=registry)


def _in_thread(call) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    return thread


def test_a_slow_adapter_read_delays_neither_submit_nor_the_readiness_probes():
    """Adapter "a"'s host copy is dropped (max_cpu_loras=1, "b" loaded after it), so admitting a
    request for it reads it from storage again, from a store that blocks until the test lets it.
    While that read is blocked, other requests are submitted, `full()` answers, and /healthcheck
    and /readyz say 200; once it returns, every request gets its tokens."""
    reading, release = threading.Event(), threading.Event()
    slow = {"on": False}

    def read(path: str) -> LoraWeights:
        if slow["on"] and path == "/store/a":
            reading.set()
            if not release.wait(WAIT_S):
                raise TimeoutError("the test never released the slow read")
        return _weights(2 if path == "/store/a" else 1)

    registry = AdapterRegistry(read, max_loras=1, max_cpu_loras=1)
    registry.load("a", "/store/a")
    registry.load("b", "/store/b")  # a's host copy dropped
    slow["on"] = True
    orchestrator = _serve(registry).start()
    engine = orchestrator.engine
    state = ServerState(config=ServingConfig().server)
    state.set_ready(orchestrator, "mock")
    running = _Running(state)
    try:
        adapted = orchestrator.submit([5, 6, 7], SamplingParams(max_tokens=3, adapter="a"))
        assert reading.wait(WAIT_S), "the adapter was never read from the store"
        others, answers = [], {}

        def submit_and_probe() -> None:
            others.append(orchestrator.submit([10, 11], SamplingParams(max_tokens=4)))
            others.append(orchestrator.submit([20], SamplingParams(max_tokens=2)))
            answers["full"] = orchestrator.full()
            for probe in ("/healthcheck", "/readyz"):
                answers[probe] = httpx.get(f"{running.url}{probe}", timeout=WAIT_S).status_code

        assert not _in_thread(submit_and_probe).is_alive(), "submit or a probe waited for the adapter's read"
        assert not release.is_set() and answers == {"full": False, "/healthcheck": 200, "/readyz": 200}
        release.set()
        assert adapted.result().token_ids == engine.expected([5, 6, 7], SamplingParams(max_tokens=3))
        assert [h.result().token_ids for h in others] == [[12, 13, 14, 15], [21, 22]]
    finally:
        release.set()
        running.stop()
        orchestrator.stop(timeout=10)
    writes = [c for c in engine.calls if c[0] == "write_adapter"]
    assert writes == [("write_adapter", 1, 2)] and registry.loads == 3


def test_the_plan_writes_an_adapter_into_its_slot_before_its_request_prefills_and_only_when_absent():
    """One device slot, adapters a (rank 1) and b (rank 2) in turn: a is written, then found
    resident, b replaces it, a comes back; each write is an engine call of the device loop, before
    the prefill of the request that needs it."""
    registry = AdapterRegistry(lambda path: _weights(1 if path == "/a" else 2), max_loras=1, max_cpu_loras=2)
    registry.load("a", "/a")
    registry.load("b", "/b")
    orchestrator = _serve(registry).start()
    engine = orchestrator.engine
    try:
        for name in ("a", "a", "b", "a"):
            before = len(engine.calls)
            sampling = SamplingParams(max_tokens=2, adapter=name)
            assert orchestrator.submit([1, 2], sampling).result().token_ids == [3, 4]
            kinds = [c[0] for c in engine.calls[before:]]
            if "write_adapter" in kinds:
                assert kinds.index("write_adapter") < min(kinds.index(k) for k in ("prefill", "prefill_slots") if k in kinds)
    finally:
        orchestrator.stop(timeout=10)
    assert [c for c in engine.calls if c[0] == "write_adapter"] == [("write_adapter", 1, r) for r in (1, 2, 1)]
    assert orchestrator.params["lora"][1].rank == 1  # the slot holds a again
