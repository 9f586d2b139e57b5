"""The adapters' device arrays: `max_loras + 1` slots per matmul, slot 0 all zeros (the base
model), each adapter zero-padded to `max_lora_rank` (see serving.models.lora for the layout).

They live in the params pytree under "lora", so every compiled step that takes the params reads
them; writing a slot replaces those arrays with new ones of the same shape and placement (nothing
recompiles). Writes happen on the device loop's thread, between steps.

Placement follows the base weights' (`stack_shardings`): a's `in` dimension is split as its
matmul's input dimension is, b's `out` as its output (a w_down's a over the mlp axes, a wq's b over
the heads axes), so each chip holds the part of every adapter its shard of the weight multiplies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from serving.lora.layout import stack_shapes
from serving.lora.peft import LoraWeights
from serving.models.config import ModelConfig
from serving.models.lora import LoraBatch

KEY = "lora"


def init_stack(cfg: ModelConfig, max_loras: int, max_rank: int, dtype, sharding) -> dict:
    """All-zero stacked adapters, placed with `sharding` (one for all, or `stack_shardings`'s)."""
    stack = {
        name: (jnp.zeros(a, dtype), jnp.zeros(b, dtype)) for name, (a, b) in stack_shapes(cfg, max_loras, max_rank).items()
    }
    return jax.device_put(stack, sharding)


def stack_shardings(mesh, weight_specs: dict[str, tuple]) -> dict:
    """name -> (a's, b's) NamedSharding from each matmul weight's partitioning spec
    (weight_specs[name]: ([layers axes], [in axes], [out axes]), serving.engine.partitioning)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def partition_spec(spec: tuple) -> P:  # as serving.engine.sharding's (which imports this package)
        return P(*(None if not dim else dim[0] if len(dim) == 1 else tuple(dim) for dim in spec))

    out = {}
    for name, (layers, fan_in, fan_out) in weight_specs.items():
        a = partition_spec((layers, (), fan_in, ()))
        b = partition_spec((layers, (), (), fan_out))
        out[name] = (NamedSharding(mesh, a), NamedSharding(mesh, b))
    return out


@jax.jit
def _write(stack: dict, slot: jax.Array, new: dict) -> dict:
    return jax.tree.map(lambda whole, one: whole.at[:, slot].set(one.astype(whole.dtype)), stack, new)


def write_slot(params: dict, slot: int, weights: LoraWeights | None) -> None:
    """Put `weights` (None: zeros) into device slot `slot` of params["lora"], in place in the dict."""
    stack = params[KEY]
    new = {}
    for name, (a, b) in stack.items():
        layers, _, fan_in, rank = a.shape
        fan_out = b.shape[-1]
        pa, pb = np.zeros((layers, fan_in, rank), np.float32), np.zeros((layers, rank, fan_out), np.float32)
        if weights is not None and name in weights.matrices:
            wa, wb = weights.matrices[name]
            pa[:, :, : weights.rank], pb[:, : weights.rank, :] = wa, wb
        new[name] = (pa, pb)
    written = _write(stack, jnp.int32(slot), new)
    params[KEY] = jax.device_put(written, jax.tree.map(lambda x: x.sharding, stack))  # as placed


def lora_batch(params: dict, rows: jax.Array) -> LoraBatch | None:
    """The model's view of the adapters for rows' slots [batch] (None when serving has no adapters)."""
    if KEY not in params:
        return None
    return LoraBatch(params[KEY], rows)
