"""The two-client benchmark's shared request file (loadtest/clients.py): ShareGPT's format, which
both vLLM's client (`--dataset-name sharegpt --sharegpt-output-len N`) and `pathserve bench serve`
(`--dataset`, `--max-output-tokens N`) read, so both send the same prompts for N tokens each."""

from __future__ import annotations

import json

from loadtest import dataset
from loadtest.clients import write_dataset


def test_every_request_asks_our_reader_for_the_same_output_tokens(tmp_path):
    path = tmp_path / "clients.json"
    write_dataset(path, 24, 64, seed=3)
    rows = json.loads(path.read_text())
    assert len(rows) == 24 and all(r["conversations"][0]["from"] == "human" for r in rows)
    prompts = dataset.load(str(path), 24, 3, max_output_tokens=64)
    assert len(prompts) == 24 and {p.max_tokens for p in prompts} == {64}
    assert sorted(p.text for p in prompts) == sorted(r["conversations"][0]["value"] for r in rows)


def test_the_report_reads_each_sets_median_ratio():
    from loadtest.clients import median_ratios

    rounds = [{"sampling": s, "ratio": r} for s, r in
              (("greedy", 0.75), ("sampled", 1.2), ("greedy", 1.05), ("sampled", 0.96), ("greedy", 0.99))]
    assert median_ratios(rounds) == {"greedy": 0.99, "sampled": 1.08}
