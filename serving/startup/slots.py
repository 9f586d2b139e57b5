"""Decode slots sized to the memory and the model, for a slot count the serving profile proposes.

The profile's 64 slots were measured on SmolLM2-135M (47 MB of float32 KV cache per slot at 1024
positions); Llama 3.2 1B's slot holds 64 MiB, a 70B's several GB. So a profile's figure is the most
slots, and a model gets fewer when its cache would not fit: at most KV_SHARE of the memory a chip has
left after the weights (its placement's own bytes, serving.engine.partitioning). A count the user
gives is never changed: the memory check of serving.engine.memory still refuses one that does not fit.

Plain Python: the bytes come from the placement, the memory from the devices (or the host's
memory for CPU devices, which report none).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from serving.engine.memory import device_limit
from serving.engine.partitioning import MESH_AXES, Numerics, placement
from serving.models.config import ModelConfig

KV_SHARE = 0.5  # of a chip's memory left after the weights, what the KV cache may take
# On an accelerator (its memory the runtime's bytes_limit, for this process alone) the rest is the
# compiled programs' temporaries, which serve's memory plan checks before loading
# (serving.engine.compiled_memory; where the profile's slots do not fit beside them, serve sizes
# them down from the compiled footprint: serving.launch.slots_that_fit, a second compile). Llama
# 3.1 8B's shape, int8w, on a v5e, compiled for the chip on a CPU host (python -m
# loadtest.tpu_plan), with the TPU profile's prefill of up to 16 fresh chunks of 512 a call (2.97
# GB of temporaries, its largest): at 0.7, 44 slots of 2,048 and 17.11 GB of its 16.91; at 0.65,
# 41 slots and 16.7 GB. (With 4 chunks a call, 2.04 GB: 0.75 held 48 slots.)
ACCELERATOR_KV_SHARE = 0.65


@dataclass(frozen=True)
class SizedSlots:
    """The slots per device chosen, and the figures behind them."""

    per_device: int
    fit: int  # slots (in all) the memory holds
    memory_per_chip: int  # bytes
    kv_per_slot_per_chip: int  # bytes
    share: float = KV_SHARE  # of the memory after the weights, what the KV cache may take

    def describe(self, asked: int) -> str:
        gib = 1 << 30
        return (
            f"memory allows {self.fit} of {asked}: {self.kv_per_slot_per_chip / (1 << 20):.0f} MiB of KV cache "
            f"per slot, {self.share:.0%} of {self.memory_per_chip / gib:.1f} GiB per chip after the weights"
        )


def size_slots(
    model: ModelConfig,
    numerics: Numerics,
    parallelism: tuple[int, int, int],
    per_device: int,
    length: int,
    memory_per_chip: int,
    share: float = KV_SHARE,
) -> SizedSlots:
    """At most `per_device` slots per device, as many as `share` of `memory_per_chip` after the
    weights holds (at least one)."""
    axes = dict(zip(MESH_AXES, parallelism, strict=True))
    devices = parallelism[0] * parallelism[1] * parallelism[2]
    one = placement(model, numerics, axes, devices, length)  # one slot per device
    params = one.params_bytes_per_chip()
    kv_per_slot = max(1, one.cache_bytes_per_chip() // devices)
    room = max(0, int(share * (memory_per_chip - params)))
    fit = max(1, room // kv_per_slot)
    chosen = max(1, min(per_device, fit // devices))
    return SizedSlots(chosen, fit, memory_per_chip, kv_per_slot, share)


def memory_per_chip(devices: Sequence) -> int | None:
    """The smallest `bytes_limit` the devices report, or for CPU devices (which report none) the
    host's memory shared among them; None when neither is known."""
    limit = device_limit(devices)
    if limit is not None:
        return limit
    host = host_memory()
    return host // max(1, len(devices)) if host else None


def pool_layout_on(devices: Sequence, cpu_kernels: str, attention: str) -> str:
    """The KV pool's layout the engine will store on `devices` (serving.kernels.backend.select's
    choice, made here without JAX: "lanes" for XLA's ops on TPUs, else "tokens"), so that slots are
    sized from the bytes the engine will allocate."""
    on_tpus = bool(devices) and all(getattr(d, "platform", "") == "tpu" for d in devices)
    return "lanes" if on_tpus and cpu_kernels != "on" and attention != "paged" else "tokens"


def kv_share(devices: Sequence) -> float:
    """ACCELERATOR_KV_SHARE where every device is an accelerator, else KV_SHARE (CPUs share the
    host's memory with everything else on it)."""
    on_accelerators = devices and all(getattr(d, "platform", "cpu") != "cpu" for d in devices)
    return ACCELERATOR_KV_SHARE if on_accelerators else KV_SHARE


def host_memory() -> int | None:
    """The host's memory: physical memory, or the container's limit (cgroup v2) when lower; None
    when unknown. Not what is free now: the same machine sizes the same slots whatever else runs."""
    sizes = []
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sizes.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(OSError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            sizes.append(int(limit))
    return min(sizes) if sizes else None
