"""`make bench-sampling`: what the per-request logit processing (serving.engine.penalties: the
penalties, logit_bias, min_p, min_tokens, bad_words) costs the decode step.

On the int8 weights `pathserve serve` runs by default (SmolLM2-135M-Instruct), greedy decoding at
batch 1 and 32, alternating in each round:
- `without`: the processing taken out of the compiled step (penalties.process returns the logits,
  penalties.record the history: the step as it was before the parameters existed);
- `neutral`: today's step, every request at the neutral values (what a client sending
  `repetition_penalty: 1.0` and friends gets);
- `half_penalized`: presence 0.5, frequency 0.5 and repetition 1.2 on every other slot;
- `half_everything`: every other slot with the penalties, a logit_bias, min_p, min_tokens and
  bad_words.
Each as the median over rounds of its ratio to that round's `without` (the arms' order rotates
from round to round). Writes results/sampling-bench.json.
Not a test: ratios measured here, on a noisy machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import jax
import numpy as np

from loadtest.engine_bench import engine_decode_rate
from serving.checkpoints.model_source import default_model_path, load_model
from serving.config import ServingConfig
from serving.engine import penalties
from serving.engine.engine import Engine
from serving.engine.sampler import Sampler

PROMPT = "The history of the lighthouse is closely tied to the history of seafaring. Long before electric lamps,"
PENALIZED = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
EVERYTHING = dict(PENALIZED, logit_bias=((13, -5.0), (198, 2.0)), min_p=0.05, min_tokens=4, stop_ids=(2,), bad_words=((30, 31),))
ARMS: dict[str, Callable[[int], dict]] = {  # name -> a slot's SamplingParams fields
    "without": lambda slot: {},
    "neutral": lambda slot: {},
    "half_penalized": lambda slot: PENALIZED if slot % 2 == 0 else {},
    "half_everything": lambda slot: EVERYTHING if slot % 2 == 0 else {},
}


@contextlib.contextmanager
def without_processing() -> Iterator[None]:
    """The engine's step traced with no logit processing and no history kept (the `without` arm:
    every call of its engine runs inside this, so any retrace sees the same step)."""
    def unprocessed(logits, *args, **kwargs):
        return logits

    with (  # the sampler's processing, and speculative verify's (which calls penalties' own)
        mock.patch.object(Sampler, "process", staticmethod(unprocessed)),
        mock.patch.object(penalties, "process", unprocessed),
        mock.patch.object(penalties, "record", lambda history, *args, **kwargs: history),
    ):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per batch (the median ratio counts)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--model", default=None, help="a model source (default: the default model)")
    ns = parser.parse_args(argv)
    source = Path(ns.model) if ns.model else default_model_path()
    base = ServingConfig(
        max_prefill_predict_length=64, max_target_length=64 + ns.new_tokens + 8, quantization="int8w"
    )
    model = load_model(str(source), base)
    prompt_ids = model.tokenizer.encode(PROMPT)
    points = []
    for batch in [int(b) for b in ns.batches.split(",")]:
        cfg = base.model_copy(update={"per_device_batch_size": float(batch)}).engine
        # `without` gets an engine of its own (its compiled step differs); the others share today's
        today, bare = Engine(model, cfg), Engine(model, cfg)
        engines = {name: bare if name == "without" else today for name in ARMS}
        params = {id(today): today.load_params(), id(bare): bare.load_params()}
        rates: dict[str, list[float]] = {name: [] for name in ARMS}
        names = list(ARMS)
        for round_ in range(ns.rounds + 1):  # round 0 compiles and is not counted
            for name in names[round_ % len(names):] + names[: round_ % len(names)]:  # each round a new first
                engine, fields = engines[name], ARMS[name]
                with without_processing() if name == "without" else contextlib.nullcontext():
                    rate = engine_decode_rate(engine, params[id(engine)], prompt_ids, batch,
                                              ns.new_tokens if round_ else 4, fields)
                if round_:
                    rates[name].append(rate)
        point = {"batch": batch, "backend": today.ops.name, "rounds": rates}
        for name in ARMS:
            # The machine's speed moves over minutes: the median of each round's ratio to that
            # round's `without` is the figure; the best rates are given beside it.
            point[f"{name}_tok_s"] = max(rates[name])
            point[f"{name}_over_without"] = float(np.median(np.divide(rates[name], rates["without"])))
        points.append(point)
        print(json.dumps({k: v for k, v in point.items() if k != "rounds"}), flush=True)
    ns.out.mkdir(parents=True, exist_ok=True)
    report = {"model": source.name, "device": jax.devices()[0].device_kind, "weights": "int8w", "new_tokens": ns.new_tokens, "points": points}
    (ns.out / "sampling-bench.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
