"""Warmup: compile, before the server says ready, every shape serving runs, so that no request
waits for XLA; then, on a background thread at the lowest CPU priority, the partial chunks after
cached positions (a prefix hit's rest), too many to compile before ready."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from serving.engine.api import PrefillRow
from serving.request import SamplingParams

if TYPE_CHECKING:
    from serving.engine.engine import Engine

log = logging.getLogger("serving.engine.engine")


def warmup(engine: Engine, params: dict) -> float:
    """Compile what serving runs: every whole-prefill bucket and insert; every prefill_slots shape of
    fresh prompts (rows x length within the per-call budget) and, for every row count whose full
    chunks fit the budget, full chunks at every history window (long prompts' middle chunks, several
    at once); a prefix block's save and load; generate for every slot bucket and attention window.
    Returns the seconds spent. Then starts `engine.background_warmup`: a thread that compiles the
    partial chunks after cached positions (a prefix hit's rest, a long prompt's last chunk: rows x
    length at every history window, minutes of compiling in all) at the lowest CPU priority, so
    that serving keeps the CPU; a call that comes before its shape is done compiles it then."""
    start = time.perf_counter()
    limits = engine.limits
    state = engine.init_decode_state()
    probe = SamplingParams(max_tokens=1)
    for bucket in limits.buckets:
        prefix, _ = engine.prefill(params, np.zeros((bucket,), np.int32), 1, probe)
        state = engine.insert(prefix, state, 0)
    state = engine.free_resource(state, 0)
    shapes, chunk = 0, limits.prefill_chunk_size

    def fits(rows: int, length: int) -> bool:  # one row always goes; several within the budget
        return rows == 1 or rows * length <= limits.prefill_batch_tokens

    for length in (b for b in limits.buckets if b <= chunk):
        for rows in (r for r in engine.row_buckets if fits(r, length)):
            batch = [PrefillRow(i, (1,) * length, 0, True, probe) for i in range(rows)]
            state, _ = engine.prefill_slots(params, state, batch)
            shapes += 1
    for window in engine.history_windows:
        at = min(window, limits.max_target_length - chunk)
        if at > 0 and engine.history_window(at) == window:
            for rows in (r for r in engine.row_buckets if fits(r, chunk)):  # long prompts' middle chunks
                batch = [PrefillRow(i, (1,) * chunk, at, True, probe) for i in range(rows)]
                state, _ = engine.prefill_slots(params, state, batch)
                shapes += 1
    if limits.prefix_block <= limits.max_target_length:  # a prefix block kept, then loaded back
        state = engine.load_blocks(state, 0, [engine.save_block(state, 0, 0)])
    for slot in range(limits.max_concurrent_decodes):
        state = engine.free_resource(state, slot)
    steps = engine.config.decode_steps_per_call
    for num_slots in limits.decode_buckets:
        for window in engine.windows:
            state, _ = engine._generate_fn(params, state, None, window=window, steps=steps, num_slots=num_slots)
    jax.block_until_ready(state)
    rest = [  # the shortest rests first: a prefix hit's is usually a short question
        (rows, length, window)
        for length in limits.buckets
        if length < chunk
        for window in engine.history_windows
        for rows in engine.row_buckets
        if fits(rows, length)
    ]
    engine.background_pending = len(rest)
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    engine.background_warmup = threading.Thread(
        target=_compile_continuing, args=(engine, params, spec, rest), name="background-warmup", daemon=True
    )
    engine.background_warmup.start()
    seconds = time.perf_counter() - start
    log.info(
        "warmup: compiled %d prefill buckets, insert, %d chunked prefill shapes and %d generate shapes "
        "(%d slot buckets x %d windows) in %.1f s",
        len(limits.buckets),
        shapes,
        len(limits.decode_buckets) * len(engine.windows),
        len(limits.decode_buckets),
        len(engine.windows),
        seconds,
    )
    return seconds


def _compile_continuing(engine: Engine, params: dict, spec, shapes: list[tuple[int, int, int]]) -> None:
    """Compile prefill_slots for each (rows, length, history window) of `shapes`: rows starting
    after cached positions that read that window. At the lowest CPU priority (Linux: this thread's
    nice value, which the threads it starts inherit)."""
    if sys.platform == "linux":
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    started, compiled = time.perf_counter(), 0
    limits, probe = engine.limits, SamplingParams(max_tokens=1)
    for left, (rows, length, window) in enumerate(shapes):
        at = min(window, limits.max_target_length - length)
        if at > 0 and engine.history_window(at) == window:
            batch = [PrefillRow(i, (1,) * length, at, True, probe) for i in range(rows)]
            try:
                compiled += engine.precompile_prefill_slots(params, spec, batch)
            except Exception:  # never the device loop's problem: that shape compiles at first use
                log.exception("background warmup: prefill_slots (%d rows x %d at window %d)", rows, length, window)
        engine.background_pending = len(shapes) - left - 1
    log.info(
        "background warmup: compiled %d prefill shapes after cached positions in %.1f s",
        compiled,
        time.perf_counter() - started,
    )
