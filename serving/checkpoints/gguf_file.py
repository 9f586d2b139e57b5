"""GGUF files (llama.cpp's format), as the default SmolLM2 model ships: config, weights, tokenizer.

The header (metadata and tensor table) is parsed here, in one pass over the memory-mapped file:
the `gguf` package's reader builds a numpy view per element of every metadata array and takes ~3.5 s
on SmolLM2's 49,152-token vocabulary, each time the file is opened. Quantized tensors (Q4_1, Q8_0,
...) are dequantized with the `gguf` package. llama.cpp's converter permutes the rows of the q and k
projections so that rotary pairs are interleaved; we undo that to get back Hugging Face's
half-split layout, which `serving.models.layers.apply_rope` uses.

Format (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md), little-endian: magic `GGUF`,
version u32 (2 or 3), tensor count u64, metadata count u64; each metadata entry a string key, a u32
value type and the value (a string is a u64 length and UTF-8 bytes; an array a u32 element type,
a u64 count and the elements); each tensor a string name, u32 dimension count, u64 dimensions
(fastest first), u32 ggml type and u64 offset into the data section, which starts at the next
multiple of `general.alignment` (default 32) after the tensor table.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

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


# Metadata value types (GGUFValueType): struct formats of the scalars, numpy dtypes of their arrays.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"
}
_STRING, _ARRAY = 8, 9
_PLAIN_TENSORS = {  # ggml types read as plain numpy arrays; the rest are blocks of bytes
    GGMLQuantizationType.F32: "<f4",
    GGMLQuantizationType.F16: "<f2",
    GGMLQuantizationType.F64: "<f8",
    GGMLQuantizationType.I8: "<i1",
    GGMLQuantizationType.I16: "<i2",
    GGMLQuantizationType.I32: "<i4",
    GGMLQuantizationType.I64: "<i8",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: `dims` in ggml's order (fastest first), `data` its raw elements
    (a plain type's numpy array, or a quantized type's bytes, [rows..., bytes per row])."""

    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]
    data: np.ndarray


class _Header:
    """A cursor over the file's bytes that reads the header's values in order."""

    def __init__(self, buffer: np.ndarray, path: Path):
        self.buffer, self.view, self.path, self.at = buffer, memoryview(buffer), path, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.view, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        if self.at + length > len(self.view):
            raise ValueError(f"a string of {length} bytes at offset {self.at} runs past the end of the file")
        text = bytes(self.view[self.at : self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            element, count = self.scalar("<I"), self.scalar("<Q")
            if element == _STRING:
                return [self.string() for _ in range(count)]
            if element not in _ARRAY_DTYPES:
                raise ValueError(f"metadata array of value type {element} (not in the GGUF spec)")
            dtype = np.dtype(_ARRAY_DTYPES[element])
            values = np.frombuffer(self.buffer, dtype, count, self.at)
            self.at += count * dtype.itemsize
            return values.tolist()
        if kind not in _SCALAR_FORMATS:
            raise ValueError(f"metadata value type {kind} (not in the GGUF spec)")
        return self.scalar(_SCALAR_FORMATS[kind])


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """(metadata, tensors) of the GGUF file at `path`; tensor data stays memory-mapped.
    Raises ValueError (or OSError) for a file that is not GGUF v2/v3 or is cut short."""
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    header = _Header(buffer, path)
    try:
        if bytes(header.view[:4]) != b"GGUF":
            raise ValueError("no GGUF magic number")
        header.at = 4
        version = header.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (2 and 3 are read; a big-endian file reads as a huge one)")
        tensor_count, field_count = header.scalar("<Q"), header.scalar("<Q")
        fields = {}
        for _ in range(field_count):
            key = header.string()
            fields[key] = header.value(header.scalar("<I"))
        table = []
        for _ in range(tensor_count):
            name = header.string()
            dims = tuple(header.scalar("<Q") for _ in range(header.scalar("<I")))
            table.append((name, GGMLQuantizationType(header.scalar("<I")), dims, header.scalar("<Q")))
    except struct.error as exc:
        raise ValueError(f"the header is cut short ({exc})") from None
    alignment = int(fields.get("general.alignment", 32))
    start = -(-header.at // alignment) * alignment
    tensors = []
    for name, kind, dims, offset in table:
        shape = tuple(reversed(dims))
        count = int(np.prod(dims, dtype=np.int64))
        if kind in _PLAIN_TENSORS:
            dtype, elements = np.dtype(_PLAIN_TENSORS[kind]), count
        else:
            block, size = GGML_QUANT_SIZES[kind]
            dtype, elements, shape = np.dtype(np.uint8), count * size // block, quant_shape_to_byte_shape(shape, kind)
        if start + offset + elements * dtype.itemsize > len(buffer):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        data = np.frombuffer(buffer, dtype, elements, start + offset).reshape(shape)
        tensors.append(GGUFTensor(name, kind, dims, data))
    return fields, tensors


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
            self.fields, self.tensors = read_gguf(path)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: cannot read GGUF: {exc}") from None

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def model_config(self, name: str | None = None) -> ModelConfig:
        arch = self.field("general.architecture")
        if arch != "llama":
            raise CheckpointError(f"{self.path}: architecture {arch!r} is not supported (llama)")
        heads = int(self.field("llama.attention.head_count"))
        embed = int(self.field("llama.embedding_length"))
        tokens = self.field("tokenizer.ggml.tokens") or []
        has_output = any(t.name == "output.weight" for t in self.tensors)
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
        for tensor in self.tensors:
            if tensor.tensor_type in _PLAIN_TENSORS:
                array = np.asarray(tensor.data, dtype=np.float32)
            else:
                array = dequantize(tensor.data, tensor.tensor_type)
            yield tensor.name, array.reshape(tuple(reversed(tensor.dims)))


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
