"""The adapter registry's policy, without a device: device slots (max_loras) and host copies
(max_cpu_loras) least recently used first, held slots never taken, unload while in use, reload
from storage (when the plan's load is executed, never while acquiring)."""

from __future__ import annotations

import numpy as np
import pytest

from serving.lora.errors import AdapterError, UnknownAdapterError
from serving.lora.peft import LoraWeights
from serving.lora.registry import AdapterLoad, AdapterRegistry
from serving.orchestrator.prefix_cache import adapter_salt, block_keys


class _Registry(AdapterRegistry):
    """Records the slot of every load an acquire hands out (for the plan to write)."""

    def __init__(self, read, max_loras, max_cpu_loras):
        super().__init__(read, max_loras, max_cpu_loras)
        self.writes: list[int] = []

    def acquire(self, name, count=1):
        got = super().acquire(name, count)
        if got is not None and got.load is not None:
            self.writes.append(got.load.slot)
        return got


def _registry(max_loras=2, max_cpu_loras=3):
    reads = []

    def read(path):
        reads.append(path)
        return LoraWeights(1, {"wq": (np.zeros((1, 2, 1)), np.zeros((1, 1, 2)))}, 1.0)

    registry = _Registry(read, max_loras, max_cpu_loras)
    return registry, reads, registry.writes


def test_slots_are_taken_least_recently_used_first_and_never_while_held():
    registry, _, writes = _registry()
    for name in "abc":
        registry.load(name, f"/adapters/{name}")
    assert registry.acquire("a")[:2] == (1, 1) and registry.acquire("b")[:2] == (2, 2)
    assert registry.acquire("c") is None  # both slots held by running requests: c waits
    registry.release("a", 1)
    assert registry.acquire("c") == (1, 3, AdapterLoad(1, "c", 3, "/adapters/c"))  # a's slot, the only one free
    assert registry.acquire("b") == (2, 2, None) and writes == [1, 2, 1]  # resident: no write
    status = {i.name: i.status for i in registry.list()}
    assert status == {"a": "host", "b": "resident", "c": "resident"}


def test_host_copies_beyond_max_cpu_loras_are_read_from_storage_again():
    registry, reads, _ = _registry(max_loras=1, max_cpu_loras=1)
    registry.load("a", "/a")
    registry.load("b", "/b")  # a's host copy dropped: b is newer
    assert {i.name: i.status for i in registry.list()} == {"a": "storage", "b": "host"}
    slot, version, load = registry.acquire("a")
    assert (slot, version) == (1, 1) and reads == ["/a", "/b"]  # acquiring reads nothing
    assert registry.weights(load).rank == 1  # executing the plan's load does
    assert reads == ["/a", "/b", "/a"]
    assert registry.loads == 3
    assert registry.weights(load) is registry.weights(load) and registry.loads == 3  # the host copy again


def test_unload_in_use_keeps_the_slot_until_released_and_a_reload_is_a_new_version():
    registry, _, _ = _registry(max_loras=1)
    registry.load("a", "/a")
    assert registry.acquire("a", count=2)[:2] == (1, 1)
    registry.unload("a")
    with pytest.raises(UnknownAdapterError, match="`a`"):
        registry.check("a")
    registry.load("a", "/a2")
    assert registry.acquire("a") is None  # the old load's requests still hold the one slot
    registry.release("a", 1)
    registry.release("a", 1)
    assert registry.acquire("a")[:2] == (1, 2)
    with pytest.raises(AdapterError, match="already loaded"):
        registry.load("a", "/a3")
    with pytest.raises(UnknownAdapterError):
        registry.unload("nope")


def test_prefix_keys_differ_per_adapter_and_per_load():
    ids = list(range(32))
    base = block_keys(ids, 16)
    assert block_keys(ids, 16, adapter_salt(None, 0)) == base
    a1, a2, b1 = (block_keys(ids, 16, adapter_salt(n, v)) for n, v in (("a", 1), ("a", 2), ("b", 1)))
    assert len({base[0], a1[0], a2[0], b1[0]}) == 4


def test_stats_bound_the_per_adapter_labels():
    from serving.lora.registry import MAX_ADAPTER_LABELS

    registry, _, _ = _registry(max_loras=1, max_cpu_loras=1)
    for i in range(MAX_ADAPTER_LABELS + 5):
        registry.load(f"a{i}", f"/a{i}")
    for i in range(MAX_ADAPTER_LABELS + 5):
        acquired = registry.acquire(f"a{i}")
        registry.weights(acquired.load)  # the plan's write: a dropped host copy is read again
        registry.release(f"a{i}", i + 1)
    stats = registry.stats()
    assert len(stats.requests) == MAX_ADAPTER_LABELS + 1 and stats.requests["other"] == 5
    assert stats.loaded == MAX_ADAPTER_LABELS + 5 and stats.resident == 1 and stats.loads > stats.loaded


def test_config_keys():
    from serving.config import ConfigError, load_config

    assert not load_config(None, []).lora.enabled and load_config(None, []).engine.max_loras == 0
    cfg = load_config(None, ["lora_input_adapters_path=gs://b/adapters"])
    assert (cfg.lora.max_loras, cfg.lora.max_cpu_loras, cfg.engine.max_loras, cfg.server.max_loras) == (4, 4, 4, 4)
    cfg = load_config(None, ["max_loras=2", "max_cpu_loras=8", "max_lora_rank=64"])
    assert (cfg.lora.max_loras, cfg.lora.max_cpu_loras, cfg.engine.max_lora_rank) == (2, 8, 64)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        load_config(None, ["max_loras=4", "max_cpu_loras=2"])
