"""Meta's native Llama checkpoints: params.json plus consolidated.NN.pth model-parallel shards.

Each shard holds a slice of every parallel weight: column-parallel ones (wq, wk, wv, w1, w3, output,
and Llama 3's vocab-parallel tok_embeddings) are split along rows, row-parallel ones (wo, w2) along
columns; norms are replicated. Meta keeps q and k rows interleaved for its complex rotary
embedding, like GGUF; we undo that to get Hugging Face's half-split layout.
Reading .pth files needs torch (`pip install torch`); tensors are memory-mapped, one at a time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.gguf_file import unpermute_rotary_rows
from serving.checkpoints.layout import ParamKey
from serving.models.config import ModelConfig, RopeScaling

# Meta name -> (pytree place, axis along which shards are concatenated, or None if replicated)
_LAYER_NAMES = {
    "attention.wq.weight": ("wq", 0),
    "attention.wk.weight": ("wk", 0),
    "attention.wv.weight": ("wv", 0),
    "attention.wo.weight": ("wo", 1),
    "feed_forward.w1.weight": ("w_gate", 0),
    "feed_forward.w3.weight": ("w_up", 0),
    "feed_forward.w2.weight": ("w_down", 1),
    "attention_norm.weight": ("attn_norm", None),
    "ffn_norm.weight": ("mlp_norm", None),
}
_TOP_NAMES = {
    "tok_embeddings.weight": ("embed", 0),
    "norm.weight": ("final_norm", None),
    "output.weight": ("lm_head", 0),
}
_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_VECTORS = {"attn_norm", "mlp_norm", "final_norm", "embed"}  # stored as is, not transposed


def is_meta_dir(path: Path) -> bool:
    return path.is_dir() and (path / "params.json").is_file() and any(path.glob("consolidated.*.pth"))


def shard_files(path: Path) -> list[Path]:
    files = sorted(path.glob("consolidated.*.pth"))
    if not files:
        raise CheckpointError(f"{path}: no consolidated.*.pth files")
    return files


def _torch():
    try:
        import torch
    except ImportError:
        raise CheckpointError("reading Meta .pth checkpoints needs torch: pip install torch") from None
    return torch


def _open_shards(path: Path) -> list[dict[str, Any]]:
    torch = _torch()
    shards = []
    for file in shard_files(path):
        try:
            shards.append(torch.load(file, map_location="cpu", mmap=True, weights_only=True))
        except Exception as exc:  # torch raises many types for a damaged zip or pickle
            raise CheckpointError(f"{file}: cannot read the .pth shard: {exc}") from None
    return shards


def read_meta_config(path: Path, name: str | None = None) -> ModelConfig:
    """ModelConfig from params.json (the MLP width is read from the w1 shards)."""
    try:
        params = json.loads((path / "params.json").read_text())
        dim, heads = int(params["dim"]), int(params["n_heads"])
        shards = _open_shards(path)
        mlp = sum(int(s["layers.0.feed_forward.w1.weight"].shape[0]) for s in shards)
        vocab = int(params.get("vocab_size", -1))
        if vocab <= 0:
            vocab = sum(int(s["tok_embeddings.weight"].shape[0]) for s in shards)
        scaled = bool(params.get("use_scaled_rope", False))
        scaling = None
        if scaled:
            scaling = RopeScaling(
                factor=float(params.get("rope_scaling_factor", 8.0)),
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position=8192,
            )
        return ModelConfig(
            name=name or path.name,
            num_layers=int(params["n_layers"]),
            embed_dim=dim,
            num_heads=heads,
            num_kv_heads=int(params.get("n_kv_heads") or heads),
            head_dim=dim // heads,
            mlp_dim=mlp,
            vocab_size=vocab,
            rope_theta=float(params.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            norm_eps=float(params.get("norm_eps", 1e-5)),
            tie_embeddings=not any("output.weight" in s for s in shards),
            max_position=131072 if scaled else 8192,
        )
    except (OSError, json.JSONDecodeError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read a Meta Llama config (params.json): {exc}") from None


def _place(name: str) -> tuple[ParamKey, int | None] | None:
    if name in _TOP_NAMES:
        key, axis = _TOP_NAMES[name]
        return ParamKey(key), axis
    match = _LAYER_RE.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        key, axis = _LAYER_NAMES[match.group(2)]
        return ParamKey(key, int(match.group(1))), axis
    if name == "rope.freqs":
        return None
    raise CheckpointError(f"tensor {name!r} is not part of a Meta Llama checkpoint")


def iter_meta_params(path: Path, cfg: ModelConfig) -> Iterator[tuple[ParamKey, np.ndarray, str]]:
    """(place, [in, out] float32 tensor, name), shards concatenated, one tensor at a time."""
    shards = _open_shards(path)
    for name in shards[0]:
        place = _place(name)
        if place is None:
            continue
        key, axis = place
        try:
            parts = [s[name].float().numpy() for s in shards]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is missing from some shards of {path}") from None
        tensor = parts[0] if axis is None else np.concatenate(parts, axis=axis)
        if key.name == "wq":
            tensor = unpermute_rotary_rows(tensor, cfg.num_heads)
        elif key.name == "wk":
            tensor = unpermute_rotary_rows(tensor, cfg.num_kv_heads)
        yield key, (tensor if key.name in _VECTORS else tensor.T), name
