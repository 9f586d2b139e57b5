"""GGUF files (llama.cpp's format), as the default SmolLM2 model ships: config, weights, tokenizer.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with the `gguf` package. llama.cpp's converter
permutes the rows of the q and k projections so that rotary pairs are interleaved; we undo that to
get back Hugging Face's half-split layout, which `serving.models.layers.apply_rope` uses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.layout import ParamKey, build_params
from serving.models.config import ModelConfig

_LAYER_NAMES = {
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "mlp_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}
_TOP_NAMES = {"token_embd": "embed", "output_norm": "final_norm", "output": "lm_head"}
_NAME_RE = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.weight")


@dataclass(frozen=True)
class GGUFTokenizerData:
    """The tokenizer as stored in GGUF metadata (`tokenizer.ggml.*`)."""

    model: str  # "gpt2" for byte-level BPE
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None


def is_gguf_file(path: Path) -> bool:
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"


class GGUFFile:
    """One opened GGUF file; tensors are read lazily, one at a time."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self.reader = GGUFReader(path)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read GGUF: {exc}") from None

    def field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def model_config(self, name: str | None = None) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch != "llama":
            raise CheckpointError(f"{self.path}: architecture {arch!r} is not supported (llama)")
        heads = int(self.field("llama.attention.head_count"))
        embed = int(self.field("llama.embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens") or []
        has_output = any(t.name == "output.weight" for t in self.reader.tensors)
        return ModelConfig(
            name=name or self.path.stem,
            num_layers=int(self.field("llama.block_count")),
            embed_dim=embed,
            num_heads=heads,
            num_kv_heads=int(self.field("llama.attention.head_count_kv", heads)),
            head_dim=int(self.field("llama.rope.dimension_count", embed // heads)),
            mlp_dim=int(self.field("llama.feed_forward_length")),
            vocab_size=int(self.field("llama.vocab_size", len(tokens))),
            rope_theta=float(self.field("llama.rope.freq_base", 10000.0)),
            norm_eps=float(self.field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings=not has_output,
            max_position=int(self.field("llama.context_length", 2048)),
        )

    def tokenizer_data(self) -> GGUFTokenizerData:
        return GGUFTokenizerData(
            model=self.field("tokenizer.ggml.model", ""),
            pre=self.field("tokenizer.ggml.pre", "default"),
            tokens=list(self.field("tokenizer.ggml.tokens", [])),
            token_types=list(self.field("tokenizer.ggml.token_type", [])),
            merges=list(self.field("tokenizer.ggml.merges", [])),
            bos_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_id=self.field("tokenizer.ggml.eos_token_id"),
            add_bos=bool(self.field("tokenizer.ggml.add_bos_token", False)),
            chat_template=self.field("tokenizer.chat_template"),
        )

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (name, float32 array in numpy [rows, cols] order) one tensor at a time."""
        for tensor in self.reader.tensors:
            if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                array = np.asarray(tensor.data, dtype=np.float32)
            else:
                array = dequantize(tensor.data, tensor.tensor_type)
            shape = tuple(int(n) for n in reversed(tensor.shape))
            yield tensor.name, array.reshape(shape)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleaving of a q or k projection [out, in]."""
    out = weight.shape[0]
    pairs = out // num_heads // 2
    return weight.reshape(num_heads, pairs, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_params(gguf: GGUFFile, cfg: ModelConfig) -> Iterator[tuple[ParamKey, np.ndarray, str]]:
    """(place, [in, out] float32 tensor, name) for every weight of a GGUF file, one at a time."""
    for name, tensor in gguf.iter_tensors():
        match = _NAME_RE.fullmatch(name)
        layer = int(match.group(1)) if match and match.group(1) is not None else None
        base = match.group(2) if match else None
        key_name = (_LAYER_NAMES if layer is not None else _TOP_NAMES).get(base or "")
        if key_name is None:
            if name.startswith("rope_freqs"):
                continue  # llama3 scaling factors; we compute them from the config
            raise CheckpointError(f"{gguf.path}: tensor {name!r} is not part of a Llama model")
        if key_name == "wq":
            tensor = unpermute_rotary_rows(tensor, cfg.num_heads)
        elif key_name == "wk":
            tensor = unpermute_rotary_rows(tensor, cfg.num_kv_heads)
        if key_name not in ("embed", "attn_norm", "mlp_norm", "final_norm"):
            tensor = tensor.T  # [out, in] -> [in, out]
        yield ParamKey(key_name, layer), tensor, name


def load_gguf_params(gguf: GGUFFile, cfg: ModelConfig, dtype: str = "float32") -> dict:
    """Read every weight of a GGUF file into the params pytree."""
    return build_params(cfg, iter_gguf_params(gguf, cfg), dtype)
