"""An engine's device memory as XLA lays it out, read before any weight is loaded: the largest
generate, chunked prefill and whole prefill it runs, lowered against abstract params and decode
state (shapes, dtypes and shardings only) and compiled; from each `memory_analysis()`, the
arguments (params and state, padded as the chip tiles them: a TPU pads a narrow minor axis to 128
lanes) and the temporaries plus the outputs not written in place. serve's memory plan
(serving.launch.check_memory) checks the sum: an estimate missed XLA's own copies (the 1B shape's
generate held 2.8 GB of temporaries on a v5e, ten times the estimate, before the lanes pool).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from serving.engine.api import PrefillRow
from serving.engine.sharding import param_shardings, replicated
from serving.request import SamplingParams

if TYPE_CHECKING:
    from serving.engine.engine import Engine


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


def _footprint(lowered) -> tuple[int, int]:
    """(argument bytes, temporaries + outputs not aliased to an argument) of a compiled program."""
    m = lowered.compile().memory_analysis()
    extra = m.temp_size_in_bytes + max(0, m.output_size_in_bytes - m.alias_size_in_bytes)
    return int(m.argument_size_in_bytes), int(extra)


def compiled_plan(engine: Engine, generate: bool = True, prefill: bool = True) -> CompiledPlan | None:
    """The largest programs an engine runs, compiled against abstract params and state: generate of
    every slot over the widest window (with `generate`), and (with `prefill`) the most full chunks a
    call takes after the longest history, the most short rests (a prefix hit's) over the widest
    window, and the longest whole prefill with and without the prompt's logprobs. None where the
    params cannot be abstract."""
    from serving.engine.chunked import _model_inputs
    from serving.engine.state import slot_sampling
    from serving.engine.warmup import rest_shapes, rest_start

    params = abstract_params(engine)
    if params is None:
        return None
    state, limits = abstract_state(engine), engine.limits
    lowered_programs: list[tuple[str, object, bool]] = []

    def add(name: str, lowered, holds_state: bool) -> None:
        lowered_programs.append((name, lowered, holds_state))

    if generate:
        bucket, window = limits.decode_buckets[-1], engine.windows[-1]
        rows = jax.ShapeDtypeStruct((bucket,), jnp.int32, sharding=replicated(engine.mesh))
        steps = engine.decode_steps_per_call
        add(
            f"generate of {bucket} slots over {window} positions",
            engine._generate_fn.lower(params, state, None, rows, window=window, steps=steps), True,
        )
    if prefill:
        probe = SamplingParams(max_tokens=1)
        chunk = limits.prefill_chunk_size
        count = max(r for r in engine.row_buckets if r == 1 or r * chunk <= limits.prefill_batch_tokens)
        calls = [(count, chunk, max(0, limits.max_target_length - chunk))]
        rests = [(r, n, rest_start(engine, n, w)) for r, n, w in rest_shapes(engine)]
        rests = [shape for shape in rests if shape[2] is not None]
        if rests:  # the most rows over the widest history
            calls.append(max(rests, key=lambda shape: (engine.history_window(shape[2]), shape[0] * shape[1])))
        for count, length, at in calls:
            inputs, shape = engine._slot_inputs([PrefillRow(i, (1,) * length, at, True, probe) for i in range(count)])
            add(
                f"prefill of {count} x {length} tokens after {at} positions",
                engine._prefill_slots_fn.lower(params, state.cache, state.pages, *_model_inputs(inputs), window=shape[2]),
                True,
            )
        longest = limits.buckets[-1]
        sampling = jax.tree.map(np.asarray, slot_sampling(probe))
        for scored in (False, True):
            add(
                f"whole prefill of {longest} tokens" + (" with the prompt's logprobs" if scored else ""),
                engine._prefill_fn.lower(
                    params, np.zeros((1, longest), np.int32), np.int32(1), sampling, np.zeros((1, 2), np.uint32),
                    None, choices=1, logprobs=False, prompt_logprobs=scored,
                ),
                False,
            )
    # lowered here, compiled at once on the host's cores (XLA's compiles release the GIL)
    with ThreadPoolExecutor(max_workers=max(1, min(len(lowered_programs), os.cpu_count() or 1))) as pool:
        footprints = list(pool.map(_footprint, [lowered for _, lowered, _ in lowered_programs]))
    resident, programs = 0, {}
    for (name, _, holds_state), (arguments, extra) in zip(lowered_programs, footprints, strict=True):
        if holds_state:
            resident = max(resident, arguments)
        programs[name] = extra
    if not resident:  # neither program holds the state: the placement's own bytes
        resident = engine.placement.params_bytes_per_chip() + engine.placement.cache_bytes_per_chip()
    return CompiledPlan(resident, programs)
