"""Hugging Face PEFT LoRA adapters: a directory (local or gs://) with adapter_config.json and
adapter_model.safetensors, read into our layout.

PEFT stores, per targeted Linear, lora_A [rank, in] and lora_B [out, rank] (torch's [out, in]
layout), named `base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight`. We
keep a [layers, in, rank] and b [layers, rank, out] per matmul of ours (serving.models.params), the
scaling folded into b: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora. Our q/k weights
are HF's transposed with no row permutation (serving.checkpoints.hf: rotary is half-split as in
HF's Llama), so q_proj / k_proj's lora_B need none either. Layers an adapter does not target get
zeros (no delta).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass

import numpy as np

from serving.checkpoints import storage
from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.safetensors_io import _DTYPES
from serving.lora.errors import AdapterError
from serving.models.config import ModelConfig
from serving.models.params import LAYER_MATMULS, param_shapes

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's module names -> our matmuls
TARGETS = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
}
_TENSOR_RE = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")


@dataclass(frozen=True)
class LoraWeights:
    """One adapter on the host: matmul name -> (a [layers, in, rank], b [layers, rank, out]) float32,
    scaling folded into b."""

    rank: int
    matrices: dict[str, tuple[np.ndarray, np.ndarray]]
    scaling: float

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.matrices.values())


def read_adapter(path: str, cfg: ModelConfig, max_rank: int) -> LoraWeights:
    """The PEFT adapter at `path` for a base model of `cfg`; AdapterError names the file, key or
    tensor that does not fit."""
    try:
        config = json.loads(storage.read_bytes(storage.join(path, CONFIG_FILE)))
        blob = storage.read_bytes(storage.join(path, WEIGHTS_FILE))
    except CheckpointError as exc:
        raise AdapterError(f"LoRA adapter {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise AdapterError(f"LoRA adapter {path}: {CONFIG_FILE}: {exc}") from None
    rank, scaling, targets = _read_config(config, path, max_rank)
    tensors = _parse_safetensors(blob, storage.join(path, WEIGHTS_FILE))
    return LoraWeights(rank, _matrices(tensors, cfg, rank, scaling, targets, path), scaling)


def _read_config(config: dict, path: str, max_rank: int) -> tuple[int, float, set[str]]:
    """(rank, scaling, targeted PEFT module names); refuses what we do not serve."""
    where = f"LoRA adapter {path}: {CONFIG_FILE}"
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, plain in (("bias", "none"), ("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(key, plain) not in (plain, None):
            raise AdapterError(f"{where}: {key}={config[key]!r} is not supported ({plain!r} only)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise AdapterError(f"{where}: {key} is not supported")
    try:
        rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"{where}: cannot read r / lora_alpha: {exc}") from None
    if not 0 < rank <= max_rank:
        raise AdapterError(f"{where}: r={rank} is more than max_lora_rank={max_rank}" if rank > 0 else f"{where}: r={rank}")
    targets = config.get("target_modules") or []
    targets = {targets} if isinstance(targets, str) else set(targets)
    unknown = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in TARGETS)
    if unknown:
        raise AdapterError(f"{where}: target_modules {unknown} are not Llama projections ({', '.join(TARGETS)})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scaling, {t.rsplit(".", 1)[-1] for t in targets}


def _parse_safetensors(blob: bytes, where: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file held in memory (adapters are small)."""
    try:
        (length,) = struct.unpack("<Q", blob[:8])
        header = json.loads(blob[8 : 8 + length])
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{where}: corrupt safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    tensors = {}
    for name, entry in header.items():
        if entry["dtype"] not in _DTYPES:
            raise AdapterError(f"{where}: tensor {name!r} has unsupported dtype {entry['dtype']}")
        begin, end = (8 + length + o for o in entry["data_offsets"])
        if end > len(blob):
            raise AdapterError(f"{where}: truncated: tensor {name!r} ends at byte {end}, the file has {len(blob)}")
        raw = np.frombuffer(blob[begin:end], dtype=_DTYPES[entry["dtype"]])
        tensors[name] = raw.reshape(entry["shape"]).astype(np.float32)
    return tensors


def _matrices(
    tensors: dict[str, np.ndarray], cfg: ModelConfig, rank: int, scaling: float, targets: set[str], path: str
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    shapes = param_shapes(cfg)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_RE.fullmatch(name)
        if match is None or match.group(2) not in TARGETS:
            raise AdapterError(f"LoRA adapter {path}: tensor {name!r} is not a LoRA matrix of a Llama projection")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        if targets and module not in targets:
            raise AdapterError(f"LoRA adapter {path}: tensor {name!r}: {module} is not in target_modules")
        if layer >= cfg.num_layers:
            raise AdapterError(f"LoRA adapter {path}: tensor {name!r}: the base model has {cfg.num_layers} layers")
        ours = TARGETS[module]
        fan_in, fan_out = shapes[ours]
        expected = (rank, fan_in) if side == "A" else (fan_out, rank)
        if tensor.shape != expected:
            raise AdapterError(
                f"LoRA adapter {path}: tensor {name!r} has shape {list(tensor.shape)}, "
                f"the base model and r={rank} need {list(expected)}"
            )
        if ours not in out:
            out[ours] = (
                np.zeros((cfg.num_layers, fan_in, rank), np.float32),
                np.zeros((cfg.num_layers, rank, fan_out), np.float32),
            )
        a, b = out[ours]
        if side == "A":
            a[layer] = tensor.T
        else:
            b[layer] = tensor.T * np.float32(scaling)
    if not out:
        raise AdapterError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA matrices")
    return {name: out[name] for name in LAYER_MATMULS if name in out}
