"""Export any model source we read (GGUF, Hugging Face, Meta) as a Hugging Face Llama directory:
config.json, generation_config.json, tokenizer.json, tokenizer_config.json and one model.safetensors.

Why: a peer server (vLLM's CPU build in `make bench-peers`) must serve the same weights as ours,
offline, and it reads Hugging Face safetensors, not the GGUF the default model ships as. Tensors are
streamed from the source one at a time (see `serving.checkpoints.sources`) in our [in, out] layout
and written back in Hugging Face's [out, in] layout with its tensor names; a GGUF's q/k rows are
already un-permuted by the GGUF reader, so the result is transformers' rotary half-split layout.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.hf import _LAYER_NAMES, _TOP_NAMES
from serving.checkpoints.layout import ParamKey
from serving.checkpoints.sources import open_source
from serving.models.config import ModelConfig

DTYPES = {"float32": (np.float32, "F32"), "bfloat16": (ml_dtypes.bfloat16, "BF16")}
# Our pytree place -> (Hugging Face name, whether it is stored transposed there)
_LAYER_HF = {key: (name, transpose) for name, (key, transpose) in _LAYER_NAMES.items()}
_TOP_HF = {key: (name, transpose) for name, (key, transpose) in _TOP_NAMES.items()}


def hf_name(key: ParamKey) -> tuple[str, bool]:
    """The Hugging Face tensor name of a pytree place, and whether it goes back to [out, in]."""
    if key.layer is None:
        if key.name not in _TOP_HF:
            raise CheckpointError(f"no Hugging Face name for {key.name!r}")
        return _TOP_HF[key.name]
    if key.name not in _LAYER_HF:
        raise CheckpointError(f"no Hugging Face name for layer tensor {key.name!r}")
    name, transpose = _LAYER_HF[key.name]
    return f"model.layers.{key.layer}.{name}", transpose


def hf_config(cfg: ModelConfig, bos_id: int | None, eos_id: int | None, dtype: str) -> dict:
    """A transformers LlamaConfig dict for `cfg` (what `serving.checkpoints.hf` reads back)."""
    rope: dict = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {
            "rope_type": "llama3",
            "rope_theta": cfg.rope_theta,
            "factor": cfg.rope_scaling.factor,
            "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_position,
        }
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling else None
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,  # older readers (vLLM's config loading) look here
        "rope_parameters": rope,  # newer transformers look here
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def write_safetensors(
    path: Path, tensors: Iterable[tuple[str, np.ndarray]], code: str, shapes: list[tuple[str, tuple[int, ...]]] | None = None
) -> int:
    """Write `tensors` (already in one dtype, whose safetensors code is `code`) to `path`; returns
    bytes written. The data goes to a side file first so that memory holds one tensor at a time;
    with `shapes` (every tensor's name and shape, in the order they come) the header is written
    first and the data after it as it comes: one write of the data, not two and a read (a
    random 8B model's 16 GB)."""
    if shapes is not None:
        return _write_known(path, tensors, code, shapes)
    header: dict[str, dict] = {}
    body = path.with_name(path.name + ".data")
    offset = 0
    with body.open("wb") as f:
        for name, tensor in tensors:
            raw = np.ascontiguousarray(tensor).tobytes()
            header[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
            f.write(raw)
            offset += len(raw)
    head = _header(header)
    with path.open("wb") as out, body.open("rb") as data:
        out.write(struct.pack("<Q", len(head)))
        out.write(head)
        while chunk := data.read(1 << 24):
            out.write(chunk)
    body.unlink()
    return 8 + len(head) + offset


def _header(entries: dict[str, dict]) -> bytes:
    head = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    return head + b" " * (-len(head) % 8)  # data starts 8-byte aligned


def _write_known(path: Path, tensors: Iterable[tuple[str, np.ndarray]], code: str, shapes: list) -> int:
    """`write_safetensors` of tensors whose names and shapes are known before they come."""
    dtype = next(np.dtype(d) for d, c in DTYPES.values() if c == code)
    header, offset = {}, 0
    for name, shape in shapes:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = _header(header)
    partial = path.with_name(path.name + ".partial")  # the file appears whole or not at all
    try:
        with partial.open("wb") as out:
            out.write(struct.pack("<Q", len(head)))
            out.write(head)
            for (name, shape), (got, tensor) in zip(shapes, tensors, strict=True):
                if got != name or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                    raise ValueError(
                        f"{path}: tensor {got} {tuple(tensor.shape)} {tensor.dtype} where {name} {tuple(shape)} {dtype} "
                        "was declared"
                    )
                out.write(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return 8 + len(head) + offset


def export_hf(source: Path, out: Path, dtype: str = "bfloat16", fmt: str | None = None) -> Path:
    """Write `source` (any format `open_source` reads; the default GGUF gets its own config) as a
    Hugging Face directory `out` in `dtype`; returns `out`."""
    from serving.checkpoints.model_source import _default_config, _is_default_model

    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    numpy_dtype, code = DTYPES[dtype]
    source = Path(source)
    opened = open_source(source, fmt, config=_default_config(source) if _is_default_model(source) else None)
    out.mkdir(parents=True, exist_ok=True)
    bos_id, eos_id = _write_tokenizer(opened.tokenizer_files, out)

    def tensors():
        for key, tensor, _ in opened.iter_params():
            name, transpose = hf_name(key)
            yield name, (tensor.T if transpose else tensor).astype(numpy_dtype)

    write_safetensors(out / "model.safetensors", tensors(), code)
    (out / "config.json").write_text(json.dumps(hf_config(opened.config, bos_id, eos_id, dtype), indent=2))
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    if not (out / "generation_config.json").exists():
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def _write_tokenizer(files: dict[str, bytes], out: Path) -> tuple[int | None, int | None]:
    """Put the source's tokenizer beside the weights as tokenizer.json + tokenizer_config.json (a
    GGUF's is rebuilt from its metadata); returns the (bos, eos) ids."""
    from serving.text.tokenizer import HFTokenizer, tokenizer_from_gguf

    if "gguf_tokenizer.json" in files:
        from serving.checkpoints.gguf_file import GGUFTokenizerData

        data = GGUFTokenizerData(**json.loads(files["gguf_tokenizer.json"]))
        tokenizer_from_gguf(data)._model.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": data.tokens[data.bos_id] if data.bos_id is not None else None,
            "eos_token": data.tokens[data.eos_id] if data.eos_id is not None else None,
            "add_bos_token": data.add_bos,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": data.chat_template,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        return data.bos_id, data.eos_id
    if "tokenizer.json" not in files:
        raise CheckpointError(f"the source has no tokenizer.json to export (it has: {', '.join(files) or 'none'})")
    for name, contents in files.items():
        (out / name).write_bytes(contents)
    tokenizer = HFTokenizer.from_dir(out)
    return tokenizer.bos_id, (tokenizer.eos_ids[0] if tokenizer.eos_ids else None)


def main(argv: list[str] | None = None) -> int:
    """`python -m serving.checkpoints.export_hf SOURCE OUT [--dtype bfloat16]`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m serving.checkpoints.export_hf", description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="GGUF file, Hugging Face or Meta directory")
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    ns = parser.parse_args(argv)
    try:
        export_hf(ns.source, ns.out, ns.dtype)
    except CheckpointError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    print(f"wrote {ns.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
