"""Assembling the params pytree (see serving.models.llama) one tensor at a time.

Loaders name each tensor by its place in the pytree (`ParamKey`) and hand it over in the
[in, out] orientation; the builder checks its shape against the config, writes it into a
preallocated stacked buffer and, at the end, checks that nothing is missing.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from serving.checkpoints.errors import CheckpointError
from serving.models.config import ModelConfig
from serving.models.params import LAYER_KEYS, param_shapes
from serving.models.quantization import QuantizedWeight, quantize_int8_numpy, scale_axis

NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
QUANTIZE_WORKERS = max(1, min(8, os.cpu_count() or 1))  # threads quantizing tensors as they are read


class ParamKey(NamedTuple):
    """Where a tensor goes: a top-level entry, or a per-layer entry with its layer index."""

    name: str
    layer: int | None = None


class ParamTracker:
    """Checks each incoming tensor against the config and remembers which places are filled."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.shapes = param_shapes(cfg)
        self._filled: set[ParamKey] = set()

    def check(self, key: ParamKey, tensor: np.ndarray, source_name: str) -> None:
        """Raise a CheckpointError naming `source_name` unless the tensor fits a free place."""
        if key.name not in self.shapes:
            raise CheckpointError(f"tensor {source_name!r}: no place for {key.name!r} in this model config")
        expected = self.shapes[key.name]
        if tuple(tensor.shape) != expected:
            raise CheckpointError(
                f"tensor {source_name!r}: shape {tuple(tensor.shape)} does not match the model config "
                f"{self.cfg.name!r}, which expects {expected}"
            )
        if (key.name in LAYER_KEYS) != (key.layer is not None):
            raise CheckpointError(f"tensor {source_name!r}: layer index does not fit {key.name!r}")
        if key.layer is not None and not 0 <= key.layer < self.cfg.num_layers:
            raise CheckpointError(
                f"tensor {source_name!r}: layer {key.layer} is beyond the config's {self.cfg.num_layers} layers"
            )
        if key in self._filled:
            raise CheckpointError(f"tensor {source_name!r}: given twice")
        self._filled.add(key)

    def missing(self) -> list[str]:
        """Entries not yet given, as readable names."""
        out = []
        for name in self.shapes:
            if name in LAYER_KEYS:
                out += [
                    f"layers/{name}[{i}]" for i in range(self.cfg.num_layers) if (name, i) not in self._filled
                ]
            elif ParamKey(name) not in self._filled:
                out.append(name)
        return out

    def check_complete(self) -> None:
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise CheckpointError(f"checkpoint is missing tensors for {self.cfg.name!r}: {shown}")


class ParamsBuilder:
    """Collects tensors into stacked numpy buffers, then hands out a params pytree of jax arrays.

    A tensor that comes as a transposed view of contiguous memory (a checkpoint's [out, in] weight
    read as [in, out]: Hugging Face's and Meta's linear layers) is stacked as stored, a plain copy,
    and transposed by XLA in `build` (on the device the arrays land on): numpy's strided copy of
    the view took ~6 of the ~8 s that Llama 3.2 1B's 2.5 GB of bfloat16 took to load.

    Entries named in `int8` are quantized as they come, one tensor (one layer's) at a time on
    the host's cores (serving.models.quantization.quantize_int8_numpy, per output channel: the
    same numbers as quantizing the stacked tensor), and only their int8 values and scales are
    kept and placed: a model whose float weights exceed the device (Llama 3.1 8B's 16 GB of
    bfloat16 on a 15.75 GiB v5e) loads in int8w without its float copy ever on the device."""

    def __init__(self, cfg: ModelConfig, dtype: str = "float32", int8: Iterable[str] = ()):
        self.cfg = cfg
        self.dtype = NUMPY_DTYPES[dtype]
        self.tracker = ParamTracker(cfg)
        self._buffers: dict[str, np.ndarray] = {}
        self._stored_transposed: set[str] = set()  # buffers holding [..., out, in]: transposed in build
        self._int8 = frozenset(int8)
        self._scales: dict[str, np.ndarray] = {}  # int8 entries' scales, beside their values in _buffers
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()

    def add(self, key: ParamKey, tensor: np.ndarray, source_name: str) -> None:
        """Place one tensor; `source_name` is the checkpoint's own name, used in errors."""
        self.tracker.check(key, tensor, source_name)
        if key.name in self._int8:
            self._add_int8(key, tensor)
            return
        if key.layer is None:
            self._buffers[key.name] = np.asarray(tensor, dtype=self.dtype)
            return
        buf = self._buffers.get(key.name)
        if buf is None:
            shape = (self.cfg.num_layers, *self.tracker.shapes[key.name])
            if _transposed_view(tensor):  # decided by a key's first tensor, for all its layers
                self._stored_transposed.add(key.name)
                shape = (*shape[:-2], shape[-1], shape[-2])
            buf = self._buffers[key.name] = np.empty(shape, self.dtype)
        buf[key.layer] = tensor.T if key.name in self._stored_transposed else tensor

    def _add_int8(self, key: ParamKey, tensor: np.ndarray) -> None:
        """Quantize `tensor` into its entry's int8 buffers on a worker thread (numpy's ufuncs release
        the GIL); at most a few tensors wait, so that host memory holds the int8 model and those."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=QUANTIZE_WORKERS, thread_name_prefix="quantize")
        if key.name not in self._buffers:
            shape = self.tracker.shapes[key.name]
            stacked = () if key.layer is None else (self.cfg.num_layers,)
            scales = list(shape)
            scales[scale_axis(key.name)] = 1
            self._buffers[key.name] = np.empty((*stacked, *shape), np.int8)
            self._scales[key.name] = np.empty((*stacked, *scales), np.float32)
        while len(self._pending) >= 2 * QUANTIZE_WORKERS:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(self._quantize_into, key, tensor))

    def _quantize_into(self, key: ParamKey, tensor: np.ndarray) -> None:
        values, scales = quantize_int8_numpy(tensor, scale_axis(key.name))
        at = () if key.layer is None else (key.layer,)
        self._buffers[key.name][at] = values
        self._scales[key.name][at] = scales

    def build(self) -> dict:
        """The params pytree; fails naming what is missing."""
        self.tracker.check_complete()
        while self._pending:
            self._pending.popleft().result()
        if self._pool is not None:
            self._pool.shutdown()
        params: dict = {"layers": {}}
        for name, buf in self._buffers.items():
            target = params["layers"] if name in LAYER_KEYS else params
            array = jnp.asarray(buf)
            if name in self._int8:
                target[name] = QuantizedWeight(values=array, scales=jnp.asarray(self._scales[name]))
            else:
                target[name] = _swap_last_two(array) if name in self._stored_transposed else array
        self._buffers.clear()
        self._scales.clear()
        return params


def _transposed_view(tensor: np.ndarray) -> bool:
    """A 2-D array whose transpose is C-contiguous (and it is not): `stored.T` of a [out, in] tensor."""
    return tensor.ndim == 2 and tensor.T.flags.c_contiguous and not tensor.flags.c_contiguous


@jax.jit
def _swap_last_two(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def build_params(
    cfg: ModelConfig, tensors: Iterable[tuple[ParamKey, np.ndarray, str]], dtype: str, int8: Iterable[str] = ()
) -> dict:
    """The params pytree from a stream of (place, [in, out] tensor, source name); the entries named
    in `int8` quantized as they come (ParamsBuilder)."""
    builder = ParamsBuilder(cfg, dtype, int8)
    for key, tensor, name in tensors:
        builder.add(key, tensor, name)
    return builder.build()
