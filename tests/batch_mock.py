"""Helpers shared by the batch runner's unit tests: the mock engine behind an orchestrator, and the
records a run wrote (local files; no model, no JAX)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serving.config import ServingConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.orchestrator import Orchestrator

TOKENIZER = AsciiTokenizer()


@dataclass
class Started:
    """serving.batch.runner.Started for the mock engine."""

    orchestrator: Orchestrator
    model_name: str = "mock"

    def describe(self) -> str:
        return "the mock engine"


def start_mock(counter: list) -> Callable[[ServingConfig, str | None], Started]:
    """A `start` for run_batch that brings up the mock engine and appends SOURCE to `counter`."""

    def start(cfg: ServingConfig, source: str | None) -> Started:
        counter.append(source)
        engine = MockEngine(slots=2, max_target_length=cfg.max_target_length)
        return Started(Orchestrator(engine, {}, TOKENIZER, cfg.orchestrator).start())

    return start


def records(output: Path) -> dict[str, dict]:
    """The records under a local output, by custom_id."""
    out = {}
    for path in sorted(output.glob("results-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            out[record["custom_id"]] = record
    return out
