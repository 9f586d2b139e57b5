"""Hugging Face Llama checkpoints: a directory with config.json and *.safetensors."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.layout import ParamKey, build_params
from serving.checkpoints.safetensors_io import iter_tensors
from serving.models.config import ModelConfig, RopeScaling

_LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_TOP_NAMES = {
    "model.embed_tokens.weight": ("embed", False),
    "model.norm.weight": ("final_norm", False),
    "lm_head.weight": ("lm_head", True),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def model_config_from_hf(config: dict[str, Any], name: str) -> ModelConfig:
    """Map a transformers LlamaConfig dict onto a ModelConfig."""
    if config.get("model_type", "llama") != "llama":
        raise CheckpointError(
            f"config.json: model_type {config.get('model_type')!r} is not supported (llama)"
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise CheckpointError(f"config.json: {flag}=true is not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(f"config.json: rope_type {rope_type!r} is not supported (default, llama3)")
    try:
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position=int(rope["original_max_position_embeddings"]),
            )
        heads = int(config["num_attention_heads"])
        return ModelConfig(
            name=name,
            num_layers=int(config["num_hidden_layers"]),
            embed_dim=int(config["hidden_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            mlp_dim=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_position=int(config.get("max_position_embeddings", 2048)),
        )
    except KeyError as exc:
        raise CheckpointError(f"config.json: cannot read a Llama config: missing key {exc}") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json: cannot read a Llama config: {exc}") from None


def read_hf_config(path: Path) -> ModelConfig:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from None
    try:
        return model_config_from_hf(config, name=path.name)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}") from None


def param_key(name: str) -> tuple[ParamKey, bool] | None:
    """Pytree place and whether to transpose ([out, in] -> [in, out]); None for unused tensors."""
    if name in _TOP_NAMES:
        key, transpose = _TOP_NAMES[name]
        return ParamKey(key), transpose
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        key, transpose = _LAYER_NAMES[match.group(2)]
        return ParamKey(key, int(match.group(1))), transpose
    if name.endswith("rotary_emb.inv_freq"):
        return None
    raise CheckpointError(f"tensor {name!r} is not part of a Llama model")


def iter_safetensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) for every tensor of every *.safetensors file, one at a time."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for file in files:
        yield from iter_tensors(file)


def iter_hf_params(path: Path, cfg: ModelConfig) -> Iterator[tuple[ParamKey, np.ndarray, str]]:
    """(place, [in, out] tensor, name) for every weight of a safetensors directory, one at a time."""
    for name, tensor in iter_safetensors(path):
        place = param_key(name)
        if place is None or (place[0].name == "lm_head" and cfg.tie_embeddings):
            continue
        key, transpose = place
        yield key, (tensor.T if transpose else tensor), name


def load_hf_params(path: Path, cfg: ModelConfig, dtype: str = "float32") -> dict:
    """Read a safetensors directory into the params pytree."""
    return build_params(cfg, iter_hf_params(path, cfg), dtype)
