"""One view over the checkpoint formats we read: Hugging Face, Meta and GGUF.

A `Source` knows its format, the model config, how to stream its weights into the params layout,
and which tokenizer files travel with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.gguf_file import GGUFFile, is_gguf_file, iter_gguf_params
from serving.checkpoints.hf import is_hf_dir, iter_hf_params, read_hf_config
from serving.checkpoints.layout import ParamKey
from serving.checkpoints.maxtext_restore import is_maxtext_checkpoint, iter_maxtext_params
from serving.checkpoints.meta import is_meta_dir, iter_meta_params, read_meta_config
from serving.models.config import ModelConfig

FORMATS = ("hf", "meta", "gguf", "maxtext")
Tensors = Iterator[tuple[ParamKey, np.ndarray, str]]


@dataclass(frozen=True)
class Source:
    format: str
    path: Path
    config: ModelConfig
    iter_params: Callable[[], Tensors]
    tokenizer_files: dict[str, bytes]  # file name -> contents, copied beside a converted checkpoint


def detect_format(path: Path) -> str:
    if is_hf_dir(path):
        return "hf"
    if is_meta_dir(path):
        return "meta"
    if is_gguf_file(path):
        return "gguf"
    if path.is_dir() and is_maxtext_checkpoint(str(path)):
        return "maxtext"
    if not path.exists():
        raise CheckpointError(f"source not found: {path}")
    raise CheckpointError(
        f"{path}: not a model source: not a Hugging Face directory (config.json), a Meta directory "
        "(params.json + consolidated.*.pth), a GGUF file or a MaxText checkpoint"
    )


def open_source(path: Path, fmt: str | None = None, config: ModelConfig | None = None) -> Source:
    """Open `path` as `fmt` (detected when None); `config` overrides the one the source carries."""
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise CheckpointError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if not path.exists():
        raise CheckpointError(f"source not found: {path}")
    if fmt == "hf":
        cfg = config or read_hf_config(path)
        files = {
            n: (path / n).read_bytes()
            for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "generation_config.json")
            if (path / n).is_file()
        }
        return Source(fmt, path, cfg, lambda: iter_hf_params(path, cfg), files)
    if fmt == "meta":
        cfg = config or read_meta_config(path)
        files = (
            {"tokenizer.model": (path / "tokenizer.model").read_bytes()}
            if (path / "tokenizer.model").is_file()
            else {}
        )
        return Source(fmt, path, cfg, lambda: iter_meta_params(path, cfg), files)
    if fmt == "maxtext":
        if config is None:
            raise CheckpointError(
                f"{path}: a MaxText checkpoint carries no model config: name its model with --model-config"
            )
        return Source(fmt, path, config, lambda: iter_maxtext_params(str(path), config, config.name), {})
    gguf = GGUFFile(path)
    cfg = config or gguf.model_config()
    return Source(
        fmt,
        path,
        cfg,
        lambda: iter_gguf_params(gguf, cfg),
        {"gguf_tokenizer.json": _gguf_tokenizer_json(gguf)},
    )


def _gguf_tokenizer_json(gguf: GGUFFile) -> bytes:
    """The GGUF tokenizer's metadata, kept as JSON so a converted checkpoint needs no GGUF file."""
    data = gguf.tokenizer_data()
    return json.dumps(data.__dict__).encode()
