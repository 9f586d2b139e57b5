"""An engine's device memory as XLA lays it out, read before any weight is loaded: the largest
generate and chunked prefill (a scored chunk too) it runs, lowered against abstract params and decode
state (shapes, dtypes and shardings only) and compiled; from each `memory_analysis()`, the
arguments (params and state, padded as the chip tiles them: a TPU pads a narrow minor axis to 128
lanes) and the temporaries plus the outputs not written in place. serve's memory plan
(serving.launch.check_memory) checks the sum: an estimate missed XLA's own copies (the 1B shape's
generate held 2.8 GB of temporaries on a v5e, ten times the estimate, before the lanes pool).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import numpy as np

from serving.engine.api import PrefillRow
from serving.engine.sharding import param_shardings
from serving.request import SamplingParams

if TYPE_CHECKING:
    from serving.engine.engine import Engine

log = logging.getLogger(__name__)


def abstract_params(engine: Engine) -> dict | None:
    """The params as `load_params` places them, as ShapeDtypeStructs; None where placing changes
    them in ways only running it shows (the CPU kernels' packing, LoRA stacks, unstacked layers)."""
    if engine.ops.name == "cpu-kernels" or engine.config.max_loras or not engine.config.scan_layers:
        return None
    shardings = param_shardings(engine.model.params, engine.mesh, engine.placement)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), engine.model.params, shardings
    )


def abstract_state(engine: Engine):
    """The decode state `init_decode_state` makes, as ShapeDtypeStructs placed as the engine places it."""
    shapes = jax.eval_shape(engine.init_decode_state)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, engine._state_shardings()
    )


@dataclass(frozen=True)
class CompiledPlan:
    """An engine's device bytes per chip as XLA lays them out (TPU tiles pad narrow axes)."""

    resident: int  # params and decode state: the largest program's arguments
    programs: dict[str, int]  # name -> its temporaries and the outputs it does not write in place

    @property
    def largest(self) -> str:
        return max(self.programs, key=self.programs.get)

    @property
    def total(self) -> int:
        return self.resident + self.programs[self.largest]


def _footprint(compiled) -> tuple[int, int]:
    """(argument bytes, temporaries + outputs not aliased to an argument) of a compiled program."""
    m = compiled.memory_analysis()
    extra = m.temp_size_in_bytes + max(0, m.output_size_in_bytes - m.alias_size_in_bytes)
    return int(m.argument_size_in_bytes), int(extra)


def compiled_plan(engine: Engine, generate: bool = True, prefill: bool = True, warm: bool = False) -> CompiledPlan | None:
    """The largest programs an engine runs, compiled against abstract params and state: generate of
    every slot over the widest window (with `generate`), and (with `prefill`) the most full chunks a
    call takes after the longest history (and from position 0, where that budget is larger), the
    most short rests (a prefix hit's) over the widest
    window, and a full chunk that scores the prompt (the prompt's logprobs) after the longest
    history. The generate and
    chunk executables are the engine's from here on (serving.engine.warmup finds them compiled).
    With `warm`, every other program warmup compiles (serving.engine.warmup.compile_jobs) compiles
    in the same pool, before the weights are placed: one batch of compiles on the host's cores
    instead of two in turn. None where the params cannot be abstract."""
    from serving.engine.warmup import compile_jobs, rest_shapes, rest_start, run_jobs

    params = abstract_params(engine)
    if params is None:
        return None
    state, limits = abstract_state(engine), engine.limits
    planned: list[tuple[str, bool]] = []  # (name, holds the decode state), in the order of `jobs`
    jobs: list = []

    def add(name: str, holds_state: bool, fn, *args) -> None:
        planned.append((name, holds_state))
        jobs.append((fn, args))

    if generate:
        bucket, window = limits.decode_buckets[-1], engine.windows[-1]
        add(f"generate of {bucket} slots over {window} positions", True, engine.precompile_generate, params, state, bucket, window)
    if prefill:
        probe = SamplingParams(max_tokens=1)
        chunk = limits.prefill_chunk_size
        after = max(0, limits.max_target_length - chunk)

        def most(start: int) -> int:  # the most rows of full chunks a call starting there takes
            return max(r for r in engine.row_buckets if r == 1 or r * chunk <= limits.batch_tokens(start))

        calls = [(most(after), chunk, after)]
        if after and most(0) > most(after):  # fresh prompts may take a larger budget
            calls.append((most(0), chunk, 0))
        rests = [(r, n, rest_start(engine, n, w)) for r, n, w in rest_shapes(engine, fresh_too=True)]
        rests = [shape for shape in rests if shape[2] is not None]
        if rests:  # the most rows over the widest history
            calls.append(max(rests, key=lambda shape: (engine.history_window(shape[2]), shape[0] * shape[1])))
        for count, length, at in calls:
            rows = [PrefillRow(i, (1,) * length, at, True, probe) for i in range(count)]
            add(f"prefill of {count} x {length} tokens after {at} positions", True, _slots_executable, engine, params, state, rows)
        # the prompt's logprobs: a full chunk alone, every position's logits scored, after the longest history
        scored = PrefillRow(0, (1,) * chunk, after, False, probe, score=True, score_next=1)
        add(f"a scored chunk of {chunk} tokens after {after} positions", True, _scored_executable, engine, params, state, scored)
    extra = compile_jobs(engine, params, state, generate, prefill) if warm else []
    done = run_jobs([*jobs, *extra], os.cpu_count() or 1)
    if extra:
        store = engine.executables
        log.info(
            "memory plan: %d programs and %d of warmup's compiled (or found compiled), %.1f s of compiling, the longest %.1f s; %s",
            len(jobs), len(extra), sum(t for t, _ in done), max(t for t, _ in done),
            store.summary() if store is not None else "no executable store",
        )
    resident, programs = 0, {}
    for (name, holds_state), (_, compiled) in zip(planned, done[: len(jobs)], strict=True):
        arguments, extra_bytes = _footprint(compiled)
        if holds_state:
            resident = max(resident, arguments)
        programs[name] = extra_bytes
    if not resident:  # neither program holds the state: the placement's own bytes
        resident = engine.placement.params_bytes_per_chip() + engine.placement.cache_bytes_per_chip()
    return CompiledPlan(resident, programs)


def _slots_executable(engine: Engine, params, state, rows):
    """The prefill_slots executable `rows` run (compiled once, kept by the engine)."""
    compiled, _ = engine.compile_prefill_slots(params, state, rows)
    if compiled is None:  # the jit compiled that shape itself: compile one to read (not kept)
        from serving.engine.chunked import _model_inputs

        inputs, shape = engine.chunks._slot_inputs(rows)
        compiled = engine.chunks._prefill_slots_fn.lower(params, state.cache, state.pages, *_model_inputs(inputs), window=shape[2]).compile()
    return compiled


def _scored_executable(engine: Engine, params, state, row):
    """The executable of a chunk that scores the prompt (`Engine.prefill_slots_scored`'s model call)."""
    return engine.compile_scored_chunk(params, state, row)
