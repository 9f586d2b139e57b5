"""The paged-cache benchmark's workload (loadtest/paged_bench.py; the benchmark itself is not a
test): seeded, long-tailed, means near the issue's ~250 prompt and ~150 output tokens, every
request fitting max_target_length."""

from __future__ import annotations

from loadtest.paged_bench import TARGET, mixed_lengths


def test_the_mixed_workload_is_seeded_long_tailed_and_fits():
    lengths = mixed_lengths(2000)
    assert lengths == mixed_lengths(2000) and lengths != mixed_lengths(2000, seed=1)
    prompts, outputs = [p for p, _ in lengths], [o for _, o in lengths]
    assert 200 < sum(prompts) / len(prompts) < 280 and 120 < sum(outputs) / len(outputs) < 170
    assert all(p + o <= TARGET and p >= 8 and o >= 4 for p, o in lengths)
    assert max(prompts) > 3 * sorted(prompts)[len(prompts) // 2]  # a long tail past the median
