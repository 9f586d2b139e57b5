"""The peer benchmark's prefix-cache comparison (--prefix-cache-off): pathserve with the cache off
runs the shared-system-prompt cells in the same rotation, and the issue's 3x TTFT target is judged
from the two medians."""

from __future__ import annotations

import pytest

from loadtest import peers
from loadtest.client import Result


def results(n: int, ttft: float, e2e: float) -> list[Result]:
    return [Result(ok=True, output_tokens=64, prompt_tokens=400, ttft=ttft, e2e=e2e) for _ in range(n)]


def test_the_cache_off_server_runs_only_the_system_cells_in_the_rotation():
    cells = peers.cells(["short", "system"], ["greedy"], [1, 8])
    plan = peers.schedule(cells, rounds=2, system_peers=(peers.NOCACHE,))
    short = [p for _, c, p in plan if c.set == "short"]
    system = [(r, c, p) for r, c, p in plan if c.set == "system"]
    assert peers.NOCACHE not in short and len(short) == 2 * 2 * 2
    assert len(system) == 2 * 2 * 3
    groups = [system[i : i + 3] for i in range(0, len(system), 3)]
    assert all({p for _, _, p in g} == {"pathserve", "vllm", peers.NOCACHE} for g in groups)
    assert {g[0][2] for g in groups} == {"pathserve", peers.NOCACHE}  # the order reverses


def test_system_target_is_the_ratio_of_ttft_medians_without_and_with_the_cache():
    def system(off_ttft: float) -> dict:
        runs = {
            "pathserve": [(results(8, 0.2, 2.2), 2.2)],
            "vllm": [(results(8, 0.5, 3.0), 3.0)],
            peers.NOCACHE: [(results(8, off_ttft, 2.5), 2.5)],
        }
        return peers.cell_report(peers.Cell("system", "greedy", 8), runs, 64)

    met = system(0.8)
    assert met["prefix_cache"]["ttft_lower_by"] == pytest.approx(4.0)
    assert met["ratios"]["ttft_ms.median"] == pytest.approx(0.4)  # pathserve (cache on) / vLLM
    name = "shared system prompt: TTFT median >= 3x lower with the prefix cache than without"
    found = [t for t in peers.targets([met]) if t["target"] == name]
    assert found == [{"target": name, "cell": "system/greedy/8", "value": pytest.approx(4.0), "met": True}]
    missed = [t for t in peers.targets([system(0.4)]) if t["target"] == name]
    assert missed[0]["met"] is False and missed[0]["value"] == pytest.approx(2.0)
    without = [t for t in peers.targets([]) if t["target"] == name]
    assert without[0]["met"] is None and "--prefix-cache-off" in without[0]["note"]
