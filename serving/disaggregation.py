"""Which devices prefill and which generate: MaxText's `inference_server` with JetStream's slices.

MaxText's `MaxtextInterleavedServer` (the default) runs one engine on every device, prefill and
generate interleaved. `ExperimentalMaxtextDisaggregatedServer` runs two: a prefill engine on the
first `prefill_slice`'s devices and a generate engine on the next `generate_slice`'s, as JetStream's
`ServerConfig(prefill_slices=..., generate_slices=...)` pops them in device order. The GKE guide's
`ExperimentalMaxtextDisaggregatedServer_<N>` names N devices on each side (two v6e-8 slices: `_8`).
Slices are JetStream's strings: `<type>-<chips>` or `<type>=<chips>` (`v5e-16`, `tpu=8`, `cpu=1`;
a v4 name counts cores, two per chip). Plain Python, no JAX.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from serving.errors import ConfigError

INTERLEAVED = "MaxtextInterleavedServer"
DISAGGREGATED = "ExperimentalMaxtextDisaggregatedServer"
_SUFFIXED = re.compile(rf"{DISAGGREGATED}_(\d+)")
D = TypeVar("D")


@dataclass(frozen=True)
class Disaggregation:
    """Devices of each side: prefill first, then generate (JetStream's order)."""

    prefill_devices: int
    generate_devices: int

    @property
    def devices(self) -> int:
        return self.prefill_devices + self.generate_devices

    def split(self, devices: Sequence[D]) -> tuple[list[D], list[D]]:
        """(prefill's devices, generate's devices); every device is on one side (JetStream's check)."""
        if len(devices) != self.devices:
            raise ConfigError(
                f"inference_server={DISAGGREGATED} puts {self.prefill_devices} devices on prefill and "
                f"{self.generate_devices} on generate, but there are {len(devices)} devices: "
                "prefill_slice and generate_slice must name them all"
            )
        return list(devices[: self.prefill_devices]), list(devices[self.prefill_devices :])


def slice_chips(spec: str, key: str) -> int:
    """The chips of a JetStream slice string (`v5e-16` -> 16, `tpu=8` -> 8, `v4-16` -> 8)."""
    kind, sep, count = spec.partition("-" if "-" in spec else "=")
    if not (sep and kind and count.isdigit() and int(count) > 0):
        raise ConfigError(f"{key}={spec!r}: expected <accelerator>-<chips> or <accelerator>=<chips> (e.g. v6e-8, cpu=1)")
    chips = int(count) // 2 if kind == "v4" else int(count)
    if chips < 1:
        raise ConfigError(f"{key}={spec!r} names no whole chip")
    return chips


def disaggregation(inference_server: str, prefill_slice: str, generate_slice: str) -> Disaggregation | None:
    """The device split `inference_server` asks for; None for the interleaved server."""
    if inference_server == INTERLEAVED:
        return None
    if inference_server == DISAGGREGATED:
        return Disaggregation(slice_chips(prefill_slice, "prefill_slice"), slice_chips(generate_slice, "generate_slice"))
    if (match := _SUFFIXED.fullmatch(inference_server)) and int(match[1]) > 0:
        return Disaggregation(int(match[1]), int(match[1]))
    raise ConfigError(
        f"inference_server={inference_server!r}: expected {INTERLEAVED}, {DISAGGREGATED} (with prefill_slice "
        f"and generate_slice), or {DISAGGREGATED}_<devices per side>"
    )
