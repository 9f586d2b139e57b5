"""The pathserve checkpoint: an Orbax params tree, its metadata and its tokenizer, in one place.

    CKPT/pathserve.json   model config, quantization, dtype, layout, source, tokenizer files,
                          a sha256 per stored tensor (per layer for stacked tensors), a sha256 of
                          every other file, and its own (serving.checkpoints.verify)
    CKPT/tokenizer/       tokenizer.json / tokenizer.model / gguf_tokenizer.json, copied in
    CKPT/params/          Orbax PyTree checkpoint (see orbax_io)

Layout of params/: with scan_layers, per-layer weights are stacked on a leading layers axis under
`layers/NAME` (the runtime's layout); without, each layer has its own `layers_I/NAME`. An int8
weight is a pair `NAME/values` (int8 [in, out]) and `NAME/scales` (float32 [1, out]); the int8
embedding's scales are per row ([vocab, 1]).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.layout import NUMPY_DTYPES, ParamKey
from serving.checkpoints.orbax_io import LeafPath, leaf_name
from serving.checkpoints.storage import exists, join, read_bytes
from serving.models.config import ModelConfig
from serving.models.params import LAYER_KEYS, param_shapes
from serving.models.quantization import QUANTIZED, scale_axis

FORMAT_VERSION = 1
METADATA_FILE = "pathserve.json"
PARAMS_DIR = "params"
TOKENIZER_DIR = "tokenizer"


@dataclass
class CheckpointMetadata:
    model_config: dict[str, Any]
    quantization: str  # "" or "int8"
    dtype: str  # float32 or bfloat16 (of the non-int8 tensors)
    scan_layers: bool
    source_format: str
    source_path: str
    tokenizer_files: list[str]
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)  # leaf name -> shape, dtype, sha256
    format_version: int = FORMAT_VERSION
    # Every other file of the checkpoint (path within it -> sha256 of its bytes), and this file's
    # own sha256 (of its text with this field zeroed). Empty in checkpoints converted before them.
    files: dict[str, str] = field(default_factory=dict)
    metadata_sha256: str = ""

    @property
    def config(self) -> ModelConfig:
        return ModelConfig.model_validate(self.model_config)

    def to_json(self) -> str:
        """The metadata file's text, sealed with its own sha256 (`metadata_sha256`)."""
        unsealed = json.dumps({**asdict(self), "metadata_sha256": UNSEALED}, indent=1)
        return unsealed.replace(_seal(UNSEALED), _seal(hashlib.sha256(unsealed.encode()).hexdigest()))

    @classmethod
    def from_json(cls, text: str, where: str) -> CheckpointMetadata:
        try:
            data = json.loads(text)
            if data.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format_version {data.get('format_version')} (expected {FORMAT_VERSION})")
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{where}: not a pathserve checkpoint metadata file: {exc}") from None


UNSEALED = "0" * 64


def _seal(digest: str) -> str:
    return f'"metadata_sha256": "{digest}"'


def seal_matches(text: str, digest: str) -> bool:
    """Whether `text` (a metadata file) is what was sealed with `digest`."""
    if _seal(digest) not in text:
        return False
    unsealed = text.replace(_seal(digest), _seal(UNSEALED))
    return hashlib.sha256(unsealed.encode()).hexdigest() == digest


def is_checkpoint(path: str) -> bool:
    return exists(join(path, METADATA_FILE))


def read_metadata(path: str) -> CheckpointMetadata:
    where = join(path, METADATA_FILE)
    return CheckpointMetadata.from_json(read_bytes(where).decode(), where)


def sha256(array: np.ndarray) -> str:
    """Hash of the array's C-order bytes (without copying a contiguous array)."""
    return hashlib.sha256(np.ascontiguousarray(array).reshape(-1).view(np.uint8)).hexdigest()


def _quantized(name: str, quantization: str) -> bool:
    return quantization == "int8" and name in QUANTIZED


def leaf_paths(name: str, layer: int | None, quantization: str, scan_layers: bool) -> list[LeafPath]:
    """The stored leaves of one pytree entry (two for an int8 weight)."""
    if layer is None:
        base: LeafPath = (name,)
    else:
        base = ("layers", name) if scan_layers else (f"layers_{layer}", name)
    return [(*base, "values"), (*base, "scales")] if _quantized(name, quantization) else [base]


def leaves(cfg: ModelConfig, quantization: str, dtype: str, scan_layers: bool) -> dict[LeafPath, tuple]:
    """Every stored leaf: path -> (shape, numpy dtype, stacked)."""
    float_dtype = np.dtype(NUMPY_DTYPES[dtype])
    out: dict[LeafPath, tuple] = {}
    for name, shape in param_shapes(cfg).items():
        layers = [None] if name not in LAYER_KEYS else ([0] if scan_layers else range(cfg.num_layers))
        for layer in layers:
            stacked = scan_layers and layer is not None
            lead = (cfg.num_layers,) if stacked else ()
            paths = leaf_paths(name, layer, quantization, scan_layers)
            if len(paths) == 2:
                out[paths[0]] = ((*lead, *shape), np.dtype(np.int8), stacked)
                scale_shape = (shape[0], 1) if scale_axis(name) == -1 else (1, shape[-1])
                out[paths[1]] = ((*lead, *scale_shape), np.dtype(np.float32), stacked)
            else:
                out[paths[0]] = ((*lead, *shape), float_dtype, stacked)
    return out


def stored_slices(
    key: ParamKey, tensor: np.ndarray, quantization: str, dtype: str, scan_layers: bool
) -> Iterator[tuple[LeafPath, int | None, np.ndarray]]:
    """What one source tensor becomes on disk: (leaf, layer within a stacked leaf, array)."""
    from serving.models.quantization import quantize_int8_numpy

    layer = key.layer if (scan_layers and key.layer is not None) else None
    paths = leaf_paths(key.name, key.layer, quantization, scan_layers)
    if len(paths) == 2:
        values, scales = quantize_int8_numpy(tensor, scale_axis(key.name))
        yield paths[0], layer, values
        yield paths[1], layer, scales
    else:
        yield paths[0], layer, np.asarray(tensor, dtype=NUMPY_DTYPES[dtype])


def slice_label(path: LeafPath, layer: int | None) -> str:
    return leaf_name(path) + ("" if layer is None else f"[{layer}]")
