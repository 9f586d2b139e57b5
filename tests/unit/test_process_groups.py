"""The process groups of a disaggregated server on a multi-controller slice
(serving.orchestrator.transfer.ProcessGroups): which processes prefill and which generate, which
sender each receiver pulls from, and the splits refused before anything loads."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from serving.disaggregation import disaggregation
from serving.errors import ConfigError
from serving.orchestrator.transfer import ProcessGroups


@dataclass(frozen=True)
class Device:  # what ProcessGroups reads of a jax device
    id: int
    process_index: int


def devices(per_process: int, processes: int) -> list[Device]:
    return [Device(p * 1000 + i, p) for p in range(processes) for i in range(per_process)]


def groups(server: str, per_process: int, processes: int, me: int = 0, **slices: str) -> ProcessGroups:
    split = disaggregation(server, slices.get("prefill", ""), slices.get("generate", ""))
    prefill, generate = split.split(devices(per_process, processes))
    return ProcessGroups.of(prefill, generate, me)


def test_the_guides_split_over_whole_processes():
    g = groups("ExperimentalMaxtextDisaggregatedServer_8", 4, 4, me=3)  # two v6e-8 slices of 2 hosts
    assert (g.prefill, g.generate, g.on_prefill, g.generate_lead) == ((0, 1), (2, 3), False, 2)
    # receiver j of a group pulls from sender j mod (senders)
    assert [g.source_for(r, g.prefill, g.generate) for r in g.generate] == [0, 1]
    assert [g.source_for(r, g.generate, g.prefill) for r in g.prefill] == [2, 3]


def test_unequal_groups_pair_round_robin():
    g = groups("ExperimentalMaxtextDisaggregatedServer", 1, 3, prefill="cpu-1", generate="cpu-2")
    assert (g.prefill, g.generate, g.on_prefill) == ((0,), (1, 2), True)
    assert [g.source_for(r, g.prefill, g.generate) for r in g.generate] == [0, 0]
    assert g.source_for(0, g.generate, g.prefill) == 1


def test_a_process_on_both_sides_is_refused():
    with pytest.raises(ConfigError, match="process 0 has devices on both sides"):
        groups("ExperimentalMaxtextDisaggregatedServer", 4, 2, prefill="cpu-2", generate="cpu-6")


def test_process_0_must_prefill():
    prefill, generate = devices(2, 2)[2:], devices(2, 2)[:2]
    with pytest.raises(ConfigError, match="process 0 serves requests and must be on the prefill side"):
        ProcessGroups.of(prefill, generate, 0)
