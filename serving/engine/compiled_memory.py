"""The compiled programs' temporaries, read from XLA before any weight is loaded: the largest
generate, chunked prefill and whole prefill an engine runs, lowered against abstract params and
decode state (shapes, dtypes and shardings only) and compiled, each `memory_analysis()`'s
temp_size_in_bytes. What serve's memory plan adds to the params and the KV cache
(serving.engine.memory.check_compiled): an estimate missed XLA's own copies (the 1B shape's
generate held 2.8 GB of temporaries on a v5e, ten times the estimate, before the lanes pool).
"""

from __future__ import annotations

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


def _temp(lowered) -> int:
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def program_temporaries(engine: Engine) -> dict[str, int] | None:
    """Temp bytes of each of the largest programs, by name; None where params cannot be abstract."""
    from serving.engine.chunked import _model_inputs

    params = abstract_params(engine)
    if params is None:
        return None
    state, limits = abstract_state(engine), engine.limits
    out = {}
    bucket, window = limits.decode_buckets[-1], engine.windows[-1]
    rows = jax.ShapeDtypeStruct((bucket,), jnp.int32, sharding=replicated(engine.mesh))
    steps = engine.decode_steps_per_call
    out[f"generate of {bucket} slots over {window} positions"] = _temp(
        engine._generate_fn.lower(params, state, None, rows, window=window, steps=steps)
    )
    chunk, probe = limits.prefill_chunk_size, SamplingParams(max_tokens=1)
    count = max(r for r in engine.row_buckets if r == 1 or r * chunk <= limits.prefill_batch_tokens)
    at = max(0, limits.max_target_length - chunk)
    inputs, shape = engine._slot_inputs([PrefillRow(i, (1,) * chunk, at, True, probe) for i in range(count)])
    out[f"prefill of {count} chunks of {chunk} after {at} positions"] = _temp(
        engine._prefill_slots_fn.lower(params, state.cache, state.pages, *_model_inputs(inputs), window=shape[2])
    )
    longest = limits.buckets[-1]
    from serving.engine.state import slot_sampling

    out[f"whole prefill of {longest} tokens"] = _temp(
        engine._prefill_fn.lower(
            params, np.zeros((1, longest), np.int32), np.int32(1), jax.tree.map(np.asarray, slot_sampling(probe)),
            np.zeros((1, 2), np.uint32), None, choices=1, logprobs=False, prompt_logprobs=False,
        )
    )
    return out
