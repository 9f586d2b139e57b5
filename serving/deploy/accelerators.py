"""TPU slices: what each accelerator type offers and how a topology maps to chips and hosts.

Figures per chip from the Cloud TPU documentation (cloud.google.com/tpu/docs/v4, v5e, v5p, v6e):
HBM capacity, HBM bandwidth, bf16 peak; and `bytes_limit`, the HBM the runtime lets a program use
(`jax.Device.memory_stats()["bytes_limit"]`), which `deploy plan` checks a recipe against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serving.deploy.errors import DeployError


@dataclass(frozen=True)
class Accelerator:
    """One TPU generation as GKE and Pathways name it."""

    gke_name: str  # cloud.google.com/gke-tpu-accelerator
    pathways_name: str  # prefix of the resource manager's --instance_type
    machine_type: str  # GKE machine type of a 4-chip host (PathwaysJob workers[].type)
    hbm_bytes: float  # physical HBM per chip
    hbm_bandwidth: float  # bytes/s
    bf16_flops: float
    topology_dims: int  # 2 for v5e/v6e (AxB), 3 for v4/v5p (AxBxC)
    bytes_limit: int  # what the runtime reports per chip (see BYTES_LIMIT)
    chips_per_host: int = 4
    # The slice shapes GKE offers (cloud.google.com/gke-tpu-topology values); empty: not listed here
    # (the 3-D generations: checked by dimensions and hosts only).
    topologies: tuple[str, ...] = ()
    # More flags of the Pathways resource manager for this generation (the seed's, for v6e).
    resource_manager_flags: tuple[str, ...] = ()


GB, GIB = 1e9, 1 << 30
# Per-chip bytes_limit as JAX reports it (memory_stats()["bytes_limit"]):
BYTES_LIMIT = {
    # v6e (Trillium), 32 GiB HBM: 33,550,237,696 (31.25 GiB less 4 MiB), as vLLM's TPU usage
    # records show for v6e.
    "tpu-v6e-slice": 33_550_237_696,
    # v5e, 16 GiB HBM: 16,909,332,480 (15.75 GiB less 2 MiB), printed by memory_stats() on an
    # 8-chip slice in public Kaggle notebooks; the XLA compiler's "of 15.75G hbm" on a named v5e-8.
    "tpu-v5-lite-podslice": 16_909_332_480,
    # v5p, 95 GiB HBM: 102,803,439,616 (95.74 GiB), the total tpu-info's v5p fixture gives, and the
    # compiler's "of 95.74G hbm" in v5p logs (no memory_stats() print of it found).
    "tpu-v5p-slice": 102_803_439_616,
    # v4, 32 GiB HBM: 34,088,157,184 (31.75 GiB), memory_stats() in pytorch/xla PR #7086 (2024) and
    # tpu-info's v4 fixture; an older runtime (jax issue #1491, 2023) reported 33,014,415,360.
    "tpu-v4-podslice": 34_088_157_184,
}
# The v5e and v6e slice shapes GKE offers (its TPU topology pages; the pathways-job controller's
# table for ct6e-standard-4t): no node pool carries another, so a pod asking for one stays Pending.
GKE_2D_TOPOLOGIES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# A live `serve` checks each device's own bytes_limit before it places anything.
ACCELERATORS = {
    a.gke_name: a
    for a in (
        Accelerator(
            "tpu-v6e-slice", "tpuv6e", "ct6e-standard-4t", 32 * GIB, 1640 * GB, 918e12, 2,
            BYTES_LIMIT["tpu-v6e-slice"], topologies=GKE_2D_TOPOLOGIES,
            resource_manager_flags=(
                "--temporary_flags_for_debugging=temporary_flag_for_debugging_worker_expected_tpu_chip_config"
                "=megachip_tccontrol",
            ),
        ),
        Accelerator(
            "tpu-v5-lite-podslice", "tpuv5e", "ct5lp-hightpu-4t", 16 * GIB, 819 * GB, 197e12, 2,
            BYTES_LIMIT["tpu-v5-lite-podslice"], topologies=GKE_2D_TOPOLOGIES,
        ),
        Accelerator(
            "tpu-v5p-slice", "tpuv5", "ct5p-hightpu-4t", 95 * GIB, 2765 * GB, 459e12, 3,
            BYTES_LIMIT["tpu-v5p-slice"],
        ),
        Accelerator(
            "tpu-v4-podslice", "tpuv4", "ct4p-hightpu-4t", 32 * GIB, 1228 * GB, 275e12, 3,
            BYTES_LIMIT["tpu-v4-podslice"],
        ),
    )
}


@dataclass(frozen=True)
class Slice:
    """A slice of `accelerator` with `topology`: its chips and hosts."""

    accelerator: Accelerator
    topology: str
    chips: int
    hosts: int

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def machine_type(self) -> str:
        """GKE machine type of one host of this slice (ct6e-standard-4t, ...)."""
        return self.accelerator.machine_type.removesuffix("4t") + f"{self.chips_per_host}t"

    @property
    def instance_type(self) -> str:
        """Pathways resource manager --instance_type, e.g. tpuv6e:4x4."""
        return f"{self.accelerator.pathways_name}:{self.topology}"


def accelerator(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise DeployError(f"tpu.accelerator: unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]


# Topologies GKE offers with more than one host shape: v6e's 2x4 is one ct6e-standard-8t host, or
# two ct6e-standard-4t hosts of 4 chips (the GKE API only; the Cloud TPU v6e page's table).
HOST_CHOICES = {("tpu-v6e-slice", "2x4"): (8, 4)}


def tpu_slice(accelerator_name: str, topology: str, chips_per_host: int | None = None) -> Slice:
    """Parse and check a topology for an accelerator (v6e 4x4 -> 16 chips on 4 hosts); where GKE
    offers more than one host shape, `chips_per_host` picks one (None: the first)."""
    acc = accelerator(accelerator_name)
    parts = topology.split("x")
    if len(parts) != acc.topology_dims or not all(p.isdigit() and int(p) > 0 for p in parts):
        example = "4x4" if acc.topology_dims == 2 else "2x2x4"
        raise DeployError(
            f"tpu.topology: {topology!r} does not fit {accelerator_name}, which takes "
            f"{acc.topology_dims} dimensions like {example}"
        )
    if acc.topologies and topology not in acc.topologies:
        raise DeployError(
            f"tpu.topology: GKE offers no {topology} slice of {accelerator_name} (it offers {', '.join(acc.topologies)})"
        )
    chips = math.prod(int(p) for p in parts)
    if acc.topology_dims == 2 and chips == 8:
        hosts = 1  # v5e/v6e 2x4 is one 8-chip host
    elif chips <= acc.chips_per_host:
        hosts = 1
    elif chips % acc.chips_per_host:
        raise DeployError(f"tpu.topology: {topology!r} has {chips} chips, not a whole number of hosts")
    else:
        hosts = chips // acc.chips_per_host
    if chips_per_host is not None and chips_per_host != chips // hosts:
        offered = HOST_CHOICES.get((accelerator_name, topology), (chips // hosts,))
        if chips_per_host not in offered:
            raise DeployError(
                f"tpu.chips_per_host: {chips_per_host} does not fit {accelerator_name} {topology}, which GKE "
                f"offers with {' or '.join(map(str, offered))} chips per host"
            )
        hosts = chips // chips_per_host
    return Slice(acc, topology, chips, hosts)
