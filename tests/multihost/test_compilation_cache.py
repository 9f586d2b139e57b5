"""Every process of a CPU multi-controller group keeps its own persistent compilation cache entries
(serving/runtime.py): JAX writes from process 0 only and keys entries by a topology fingerprint that
on CPU is each process's own, so a follower compiled every program at every start."""

from __future__ import annotations

from pathlib import Path

from tests.multihost.probe_pair import run_probe_pair

PROBE = Path(__file__).with_name("cache_probe.py")


def run_pair(cache: Path) -> list[dict]:
    return run_probe_pair(PROBE, str(cache))


def test_a_follower_loads_its_programs_from_the_cache_on_its_second_start(tmp_path):
    cache = tmp_path / "jax-cache"
    first = run_pair(cache)
    assert [r["hits"] for r in first] == [0, 0] and all(r["requests"] > 0 for r in first)
    assert first[0]["total"] == first[1]["total"] == 16 * 16 * 8  # every x[i] . x[j] is 8
    second = run_pair(cache)
    for before, after in zip(first, second, strict=True):
        # Every program either process compiled the first time is a hit the second time.
        assert after["hits"] == after["requests"] == before["requests"], (before, after)
