"""Which LoRA adapters the server knows, which are in host memory and which hold a device slot.

Plain Python over one callable, so the policy is tested without a device: `read(path) ->
LoraWeights` (storage -> host, validated against the base model). The registry never writes the
device: a slot it gives an adapter comes with an `AdapterLoad`, plain data (the slot, the adapter's
name, load version and path) that the device loop puts into its next `StepPlan`, and the executor
writes the adapter there before the plan's prefills (serving.orchestrator.executor).

1. `load(name, path)` (any thread: start-up, the HTTP and gRPC fronts) reads the adapter into host
   memory and makes it known. `unload(name)` forgets it at once for new requests; requests running
   with it keep its device slot until they finish.
2. `acquire(name, count)` (the device loop, admitting a request of `count` choices, under the
   orchestrator's submitters' lock: so it reads nothing and writes nothing, it only decides) gives
   the adapter's device slot: its own if resident, else a free slot, else the least recently used
   slot no running request holds, with the `AdapterLoad` that writes it there. None when every slot
   is held: the request waits (it is never refused for that). `release(name)` when each choice
   finishes.
3. `weights(load)` (the device loop, executing the plan; no lock held while it reads) is the
   adapter's host copy, read from storage again when the host LRU dropped it.
4. Host copies: at most `max_cpu_loras`, least recently used dropped first (its path is kept).

Every load gets a new `version`: the prefix cache keys KV by (adapter, version), so an adapter
unloaded and loaded again under the same name never reuses the old one's KV.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from serving.lora.errors import AdapterError, UnknownAdapterError
from serving.lora.peft import LoraWeights


@dataclass
class Adapter:
    """One adapter's record (mutated under the registry's lock)."""

    name: str
    path: str
    version: int
    weights: LoraWeights | None  # the host copy (None: dropped by the host LRU)
    load_seconds: float  # the last read from storage
    nbytes: int
    slot: int = 0  # device slot, 0: not resident
    refs: int = 0  # running requests (choices) that hold its slot
    unloaded: bool = False
    last_access: float = field(default_factory=time.time)
    requests: int = 0  # requests admitted with it


@dataclass(frozen=True)
class AdapterLoad:
    """Write adapter `name` (its load `version`, stored at `path`) into device slot `slot`: a device
    write the plan carries (serving.orchestrator.plan), so that on a multi-host slice every process
    executes it at the same point of the same plan. Names, not weights: each process reads the
    weights itself (process 0 from its host copy, the others from `path`, which every process reads
    alike: gs:// or a shared path), and a plan stays a few hundred bytes."""

    slot: int
    name: str
    version: int
    path: str


class Acquired(NamedTuple):
    """An adapter's device slot for a request; `load` when the adapter is not there yet."""

    slot: int
    version: int
    load: AdapterLoad | None = None


# Per-adapter request counts in /metrics: the most requested this many by name, the rest as one
# "other" (a label per adapter ever loaded would grow without bound).
MAX_ADAPTER_LABELS = 32


@dataclass(frozen=True)
class AdapterStats:
    """What /metrics shows of the adapters."""

    loaded: int  # adapters known (served by name)
    resident: int  # holding a device slot
    max_loras: int
    loads: int  # reads from storage
    load_seconds: float  # their total time
    requests: dict[str, int]  # adapter (at most MAX_ADAPTER_LABELS, then "other") -> requests admitted
    resident_names: tuple[str, ...] = ()  # the adapters holding a device slot, by name


@dataclass(frozen=True)
class AdapterInfo:
    """A snapshot for listings (/v1/models, JetStream's `models`) and metrics."""

    name: str
    path: str
    status: str  # "resident" (on the device), "host" (in host memory) or "storage"
    slot: int
    nbytes: int  # device / host bytes of its matrices (float32 on the host)
    load_seconds: float
    last_access: float
    requests: int
    running: int


class AdapterRegistry:
    def __init__(
        self,
        read: Callable[[str], LoraWeights],
        max_loras: int,
        max_cpu_loras: int,
    ):
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self._read = read
        self.max_loras, self.max_cpu_loras = max_loras, max(max_cpu_loras, max_loras)
        self._lock = threading.Lock()
        self._counts_lock = threading.Lock()  # `load` reads outside `_lock`
        self._adapters: dict[str, Adapter] = {}
        self._slots: list[Adapter | None] = [None] * (max_loras + 1)  # [0] stays None: the base model
        self._version = 0
        self.loads = 0  # reads from storage (start-up, load, reload after the host LRU)
        self.load_seconds_total = 0.0

    # -- any thread ----------------------------------------------------------------------------

    def load(self, name: str, path: str) -> AdapterInfo:
        """Read the adapter at `path` and know it as `name`; AdapterError if the name is taken or
        the adapter does not fit the base model."""
        if not name:
            raise AdapterError("a LoRA adapter needs a name")
        with self._lock:
            if name in self._adapters:
                raise AdapterError(f"LoRA adapter {name!r} is already loaded (from {self._adapters[name].path})")
        weights, seconds = self._timed_read(path)
        with self._lock:
            if name in self._adapters:
                raise AdapterError(f"LoRA adapter {name!r} is already loaded (from {self._adapters[name].path})")
            self._version += 1
            adapter = Adapter(name, path, self._version, weights, seconds, weights.nbytes)
            self._adapters[name] = adapter
            self._trim_host()
            return self._info(adapter)

    def unload(self, name: str) -> None:
        """Forget `name` (UnknownAdapterError if unknown); its running requests finish with it."""
        with self._lock:
            adapter = self._adapters.pop(name, None)
            if adapter is None:
                raise UnknownAdapterError(name)
            adapter.unloaded, adapter.weights = True, None
            if adapter.refs == 0 and adapter.slot:
                self._slots[adapter.slot], adapter.slot = None, 0

    def check(self, name: str) -> None:
        """UnknownAdapterError unless `name` is loaded."""
        with self._lock:
            if name not in self._adapters:
                raise UnknownAdapterError(name)

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(a) for a in self._adapters.values()]

    def stats(self) -> AdapterStats:
        with self._lock:
            counts = sorted(((a.requests, a.name) for a in self._adapters.values()), reverse=True)
            requests = {name: n for n, name in counts[:MAX_ADAPTER_LABELS]}
            if len(counts) > MAX_ADAPTER_LABELS:
                requests["other"] = sum(n for n, _ in counts[MAX_ADAPTER_LABELS:])
            return AdapterStats(
                loaded=len(self._adapters),
                resident=sum(a is not None for a in self._slots),
                max_loras=self.max_loras,
                loads=self.loads,
                load_seconds=self.load_seconds_total,
                requests=requests,
                resident_names=tuple(sorted(a.name for a in self._slots if a is not None and not a.unloaded)),
            )

    # -- the device loop -----------------------------------------------------------------------

    def acquire(self, name: str, count: int = 1) -> Acquired | None:
        """`name`'s device slot and version for `count` more running requests, with the
        `AdapterLoad` that writes it there when it is not resident; None when every slot is held by
        running requests. UnknownAdapterError if it was unloaded meanwhile. Reads and writes
        nothing: the caller holds a lock that submitters take."""
        with self._lock:
            adapter = self._adapters.get(name)
            if adapter is None:
                raise UnknownAdapterError(name)
            load = None
            if not adapter.slot:
                slot = self._free_slot()
                if slot is None:
                    return None
                previous = self._slots[slot]
                if previous is not None:
                    previous.slot = 0
                self._slots[slot], adapter.slot = adapter, slot
                load = AdapterLoad(slot, adapter.name, adapter.version, adapter.path)
            adapter.refs += count
            adapter.requests += 1
            adapter.last_access = time.time()
            return Acquired(adapter.slot, adapter.version, load)

    def weights(self, load: AdapterLoad) -> LoraWeights:
        """The weights `load` writes: the adapter's host copy, read from storage first (no lock
        held) when the host LRU dropped it or it was unloaded since."""
        with self._lock:
            adapter = self._slots[load.slot]
            if adapter is None or (adapter.name, adapter.version) != (load.name, load.version):
                adapter = None  # released and unloaded already: nothing runs with it
            elif adapter.weights is not None:
                return adapter.weights
        weights, seconds = self._timed_read(load.path)
        with self._lock:
            if adapter is not None and not adapter.unloaded:
                adapter.weights, adapter.load_seconds = weights, seconds
                self._trim_host()
        return weights

    def release(self, name: str, version: int) -> None:
        """One running request (choice) of `name`'s load `version` finished."""
        with self._lock:
            adapter = next((a for a in self._slots if a is not None and a.name == name and a.version == version), None)
            if adapter is None:
                return
            adapter.refs -= 1
            if adapter.unloaded and adapter.refs == 0:
                self._slots[adapter.slot], adapter.slot = None, 0

    # -- under the lock ------------------------------------------------------------------------

    def _free_slot(self) -> int | None:
        """A slot with no adapter, else the least recently used one no running request holds."""
        free = [i for i in range(1, len(self._slots)) if self._slots[i] is None]
        if free:
            return free[0]
        idle = [i for i in range(1, len(self._slots)) if self._slots[i].refs == 0]
        return min(idle, key=lambda i: self._slots[i].last_access) if idle else None

    def _trim_host(self) -> None:
        held = sorted((a for a in self._adapters.values() if a.weights is not None), key=lambda a: a.last_access)
        for adapter in held[: max(0, len(held) - self.max_cpu_loras)]:
            adapter.weights = None

    def _timed_read(self, path: str) -> tuple[LoraWeights, float]:
        started = time.perf_counter()
        weights = self._read(path)
        seconds = time.perf_counter() - started
        with self._counts_lock:
            self.loads += 1
            self.load_seconds_total += seconds
        return weights, seconds

    def _info(self, a: Adapter) -> AdapterInfo:
        status = "resident" if a.slot else "host" if a.weights is not None else "storage"
        return AdapterInfo(a.name, a.path, status, a.slot, a.nbytes, a.load_seconds, a.last_access, a.requests, a.refs)
