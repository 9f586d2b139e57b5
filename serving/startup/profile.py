"""The serving config as the command line gives it, and where each key came from.

Layers, lowest first: the serving profile (configs/serving/default.yml: slots, warmup, prefix
cache, chunked prefill, measured on CPU), the command's own defaults (one-shot commands: one slot,
no warmup), $PATHSERVE_CPU_KERNELS, a serving config file (--config), then `key=value` overrides.
The profile applies to any model, the default one or yours; `quantization` in it is the default
model's own choice (int8w, measured on SmolLM2), so another model keeps its checkpoint's or yours.
A MaxText config file replaces the profile: it and MaxText's defaults (ServingConfig's) mean what
they mean in MaxText.

Plain Python (no JAX): the CLI calls `given_config` before any work starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.config import (
    ConfigError,
    ServingConfig,
    config_dir,
    is_maxtext_file,
    load_config,
    parse_overrides,
    read_yaml,
)
from serving.startup.platform import detect_platform

PROFILE = Path("serving") / "default.yml"  # under config_dir()
# Each platform's keys over PROFILE's (serving.startup.platform): measured where they apply.
PLATFORM_PROFILES = {"tpu": Path("serving") / "tpu.yml"}
DEFAULT_MODEL_ONLY = ("quantization",)  # keys of the profile that only the default model takes

# Where a key's value came from, as the ready line says it.
FROM_DEFAULT = "default"
FROM_PROFILE = "serving profile"
FROM_COMMAND = "this command's default"
FROM_ENV = "environment"
FROM_OVERRIDE = "command line"


@dataclass(frozen=True)
class Given:
    """A validated config and, for each key set by something other than ServingConfig's defaults,
    where it came from (FROM_* or the config file's path)."""

    config: ServingConfig
    origins: Mapping[str, str] = field(default_factory=dict)

    def origin(self, key: str) -> str:
        return self.origins.get(key, FROM_DEFAULT)


def serving_profile(default_model: bool, platform: str | None = None) -> dict[str, Any]:
    """The profile's keys for the default model, or for any other model (without DEFAULT_MODEL_ONLY),
    on `platform` (default: the one detected): PROFILE's, with the platform's file over them."""
    profile = dict(read_yaml(config_dir() / PROFILE))
    platform = platform or detect_platform()
    if platform in PLATFORM_PROFILES:
        profile.update(read_yaml(config_dir() / PLATFORM_PROFILES[platform]))
    return profile if default_model else {k: v for k, v in profile.items() if k not in DEFAULT_MODEL_ONLY}


def given_config(
    config_file: str | None,
    overrides: Sequence[str],
    source: str | None,
    command_defaults: Mapping[str, Any] | None = None,
    env_defaults: Mapping[str, Any] | None = None,
) -> Given:
    """The config a command starts with (see the module docstring), validated once. `source`: the
    SOURCE argument (None with load_parameters_path, or for the default model)."""
    maxtext = bool(config_file) and is_maxtext_file(config_file)
    parsed = parse_overrides(overrides)
    file_keys = read_yaml(Path(config_file)) if config_file and not maxtext else {}
    given = {**file_keys, **parsed}
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if not maxtext:
        default_model = not (source or given.get("load_parameters_path"))
        try:
            platform = detect_platform()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        layers.append((FROM_PROFILE, serving_profile(default_model, platform)))
    layers += [(FROM_COMMAND, command_defaults or {}), (FROM_ENV, env_defaults or {})]
    origins = {key: origin for origin, values in layers for key in values}
    origins.update(dict.fromkeys(file_keys, str(config_file)))
    origins.update(dict.fromkeys(parsed, FROM_OVERRIDE))
    defaults = {key: value for _, values in layers for key, value in values.items()}
    defaults = fit_profile(defaults, given, origins)
    cfg = load_config(config_file, overrides, defaults=defaults)
    if maxtext:  # the file's chain set what the overrides did not
        origins.update({k: str(config_file) for k in cfg.model_fields_set if k not in origins})
    return Given(cfg, origins)


def fit_profile(defaults: dict[str, Any], given: Mapping[str, Any], origins: Mapping[str, str]) -> dict[str, Any]:
    """The profile's lengths fitted under lengths the user gave: its prefill length within a given
    max_target_length, its chunk within a given max_prefill_predict_length (a user's short
    sequences keep the profile's other figures instead of failing its consistency check). A
    given attention=paged (JAX's paged-attention kernel) is what runs: the profile's
    use_ragged_attention, which would take precedence over it, steps aside."""
    fitted = dict(defaults)
    if origins.get("use_ragged_attention") == FROM_PROFILE and given.get("attention") == "paged":
        fitted["use_ragged_attention"] = False
    for inner, outer in (("max_prefill_predict_length", "max_target_length"), ("prefill_chunk_size", "max_prefill_predict_length")):
        if origins.get(inner) == FROM_PROFILE and inner in fitted:
            limit = given.get(outer, fitted.get(outer))
            if isinstance(limit, int) and isinstance(fitted[inner], int) and fitted[inner] > limit:
                fitted[inner] = limit
    return fitted
