"""MaxText config files, read as MaxText reads them: `base_config` chains, `key=value` overrides,
model files by `model_name`, and `logical_axis_rules` with MaxText's merge rule.

A JetStream-on-Pathways user starts the engine with a MaxText config file first and MaxText flags
after it; `pathserve serve` takes the same arguments. What MaxText does (configs/pyconfig.py):

- A file's `base_config` is looked up beside the file, then under the configs root; the chain is
  merged key by key, the child's value replacing its parent's, lists included: a recipe's own
  `logical_axis_rules` replace base.yml's whole list.
- `key=value` overrides are YAML-typed. Rules given as an override merge with the file's by rule
  name (a named rule replaces every rule of that name), unless `override_logical_axis_rules=true`,
  when they replace the list.
- `model_name` picks a model file; a key it sets may be overridden only with
  `override_model_config=true`. Without a model file the model is the architecture keys' values.
- A key MaxText does not know is an error.

pathserve ships its own files for the inference recipes under configs/maxtext/ (see its base.yml);
a path that is not a file on disk resolves there by its part after `configs/`, so the JetStream
guide's old path (MaxText/configs/v5e/inference/...) and today's (src/maxtext/configs/inference/...)
both work. Keys MaxText knows that have no effect on serving are accepted and logged once.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from serving.errors import ConfigError

log = logging.getLogger(__name__)

BASE_CONFIG = "base_config"
RULES = "logical_axis_rules"
SUFFIXES = (".yml", ".yaml")

# MaxText's architecture keys and the ModelConfig field each describes.
MODEL_KEYS = {
    "base_num_decoder_layers": "num_layers",
    "base_emb_dim": "embed_dim",
    "base_num_query_heads": "num_heads",
    "base_num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "base_mlp_dim": "mlp_dim",
    "vocab_size": "vocab_size",
    "rope_max_timescale": "rope_theta",
    "normalization_layer_epsilon": "norm_eps",
    "logits_via_embedding": "tie_embeddings",
}


class MaxTextConfigError(ConfigError):
    """A MaxText config that cannot be used; the message names the file or key."""


def maxtext_dir() -> Path:
    """pathserve's MaxText config files: configs/maxtext/ (under $PATHSERVE_CONFIG_DIR when set,
    as serving.config.config_dir; the shipped ones are looked in after it)."""
    env = os.environ.get("PATHSERVE_CONFIG_DIR")
    return Path(env) / "maxtext" if env else _shipped_dir()


def _shipped_dir() -> Path:
    """The repository's configs/maxtext/ (the default rules and the key list live there)."""
    return Path(__file__).resolve().parent.parent / "configs" / "maxtext"


def is_config_file(arg: str) -> bool:
    """Whether a positional argument names a MaxText config file (a .yml / .yaml path)."""
    return arg.endswith(SUFFIXES) and "://" not in arg


def resolve_config_path(arg: str) -> Path:
    """The file `arg` names: itself if it exists, else pathserve's copy of the MaxText file of that
    path (its part after the last `configs/`)."""
    path = Path(arg).expanduser()
    if path.is_file():
        return path
    rel = arg.rsplit("configs/", 1)[-1] if "configs/" in arg else arg
    if not Path(rel).is_absolute():
        for root in dict.fromkeys((maxtext_dir(), _shipped_dir())):
            if (root / rel).is_file():
                return root / rel
    raise MaxTextConfigError(
        f"config file not found: {arg} (nor is it one of the MaxText files pathserve ships: "
        f"{', '.join(shipped_configs())})"
    )


def shipped_configs() -> list[str]:
    """The MaxText config files pathserve ships, relative to configs/maxtext/."""
    root = _shipped_dir()
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.yml"))


def _read(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise MaxTextConfigError(f"{path}: cannot read as YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise MaxTextConfigError(f"{path}: expected a mapping of MaxText keys, got {type(data).__name__}")
    return data


def load_chain(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file merged over its `base_config` chain (the child's keys replace the parent's)."""
    if path.resolve() in _seen:
        raise MaxTextConfigError(f"{path}: base_config loops: {' -> '.join(map(str, (*_seen, path)))}")
    data = _read(path)
    parent = data.pop(BASE_CONFIG, None)
    if parent is None:
        return data
    base = _find_base(str(parent), path)
    return {**load_chain(base, (*_seen, path.resolve())), **data}


def _find_base(name: str, child: Path) -> Path:
    """MaxText's lookup: absolute as is; else beside the child, then under the configs root."""
    candidates = [Path(name)] if Path(name).is_absolute() else [child.parent / name]
    if not Path(name).is_absolute():
        candidates += [maxtext_dir() / name, _shipped_dir() / name]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise MaxTextConfigError(
        f"{child}: base_config {name!r} not found (looked in {', '.join(str(c.parent) for c in candidates)})"
    )


def merge_rules(base: list, new: list) -> list:
    """MaxText's merge: every rule of a name `new` gives is replaced by `new`'s rules of it."""
    names = {rule[0] for rule in new}
    return [rule for rule in base if rule[0] not in names] + list(new)


Rules = tuple[tuple[str, tuple[str, ...]], ...]


def normalize_rules(rules: Sequence) -> Rules:
    """MaxText's rule list ([name, [axes]] or [name, axis] pairs) as a tuple of (name, axes)."""
    out = []
    for rule in rules:
        name, axes = rule
        out.append((str(name), (axes,) if isinstance(axes, str) else tuple(str(a) for a in axes)))
    return tuple(out)


@functools.cache
def base_rules() -> Rules:
    """base.yml's logical_axis_rules (the default placement when no recipe gives its own)."""
    return normalize_rules(_read(_shipped_dir() / "base.yml")[RULES])


@functools.cache
def maxtext_keys() -> frozenset[str]:
    """Every flag name MaxText's configs accept (configs/maxtext/maxtext_keys.txt)."""
    lines = (_shipped_dir() / "maxtext_keys.txt").read_text().splitlines()
    return frozenset(line.strip() for line in lines if line.strip() and not line.startswith("#"))


# MaxText keys that change what a model computes (or what a server does with it) and that pathserve
# does not implement: accepted at MaxText's default (base.yml's value: a recipe carries them), and
# refused naming them at any other value, where MaxText would serve something pathserve would not.
RESULT_KEYS: dict[str, tuple[Any, str]] = {
    "decoder_block": ("llama2", "pathserve serves Llama-family decoder blocks only (llama2)"),
    "mlp_activations": (["silu", "linear"], "pathserve's MLP is SwiGLU (silu, linear)"),
    "rope_use_scale": (True, "pathserve applies its presets' rope scaling as given"),
    "kv_quant_dtype": ("int8", "pathserve's quantized KV cache is int8 (quantize_kvcache=true)"),
    "sliding_window_size": (0, "pathserve attends to every cached position (no sliding window)"),
    "attn_logits_soft_cap": (0.0, "pathserve has no attention logit soft-capping"),
    "final_logits_soft_cap": (0.0, "pathserve has no final logit soft-capping"),
    "use_post_attn_norm": (False, "pathserve's Llama blocks have no post-attention norm"),
    "use_post_ffw_norm": (False, "pathserve's Llama blocks have no post-MLP norm"),
    "add_bos": (True, "the tokenizer adds the beginning-of-sequence token by its own rule (gRPC's has_bos says a prompt has one)"),
    "return_log_prob": (False, "logprobs are asked per request on the HTTP APIs (logprobs, top_logprobs)"),
    "save_quantized_params_path": ("", "write a quantized checkpoint with `pathserve convert` instead"),
    "load_full_state_path": ("", "a training state: give its parameters' checkpoint as load_parameters_path"),
}
# MaxText's mesh axes pathserve does not build: 1 only (and, for a DCN axis, -1: the slices left,
# one here), since any other value is a mesh pathserve would plan differently.
UNBUILT_AXIS = re.compile(r"^(ici|dcn)_\w+_parallelism$")


def _refuse_without_effect(key: str, value: Any, source: str) -> None:
    """A MaxText key pathserve does not implement, at a value that would change what is served."""
    if key in RESULT_KEYS:
        neutral, why = RESULT_KEYS[key]
        same = [str(v) for v in value] == [str(v) for v in neutral] if isinstance(neutral, list) else value == neutral
        if not same:
            raise MaxTextConfigError(f"{source}: {key}={value!r} is not supported ({why}); leave it at {neutral!r}")
    elif UNBUILT_AXIS.match(key) and value not in ((1, -1) if key.startswith("dcn_") else (1,)):
        raise MaxTextConfigError(
            f"{source}: {key}={value!r}: pathserve's mesh has only the ici_fsdp_parallelism, "
            "ici_autoregressive_parallelism and ici_tensor_parallelism axes; leave it at 1"
        )


def split_keys(values: Mapping[str, Any], honored: Iterable[str], source: str) -> dict[str, Any]:
    """`values` less the MaxText keys that have no effect on serving (logged once, by name); a key
    neither pathserve nor MaxText knows is an error naming it, and so is a MaxText key pathserve
    does not implement at a value that would change what is served (RESULT_KEYS, the mesh axes
    pathserve does not build)."""
    honored = set(honored)
    kept, ignored = {}, []
    for key, value in values.items():
        if key in honored:
            kept[key] = value
        elif key in maxtext_keys():
            _refuse_without_effect(key, value, source)
            ignored.append(key)
        else:
            close = difflib.get_close_matches(str(key), honored | maxtext_keys(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise MaxTextConfigError(f"{source}: unknown config key {key!r}{hint}")
    if ignored:
        log.warning("%s: MaxText keys with no effect on serving: %s", source, ", ".join(sorted(ignored)))
    return kept


def load(
    arg: str, overrides: Mapping[str, Any], preset_keys: Callable[[str], dict[str, Any] | None]
) -> dict[str, Any]:
    """The values a MaxText config file and its overrides give, as MaxText resolves them (model
    keys and rules included; keys with no effect on serving still in, for `split_keys`).
    `preset_keys(model_name)`: the model file's architecture keys, None for a model without one."""
    path = resolve_config_path(arg)
    chain = load_chain(path)
    overrides = dict(overrides)
    if BASE_CONFIG in overrides:
        raise MaxTextConfigError("base_config: give the config file as the first argument, not as an override")
    values = {**chain, **overrides}
    model_name = str(values.get("model_name", "default")).replace("-Instruct", "")
    preset = preset_keys(model_name)
    if preset is None and model_name != "default" and not values.get("override_model_config"):
        # MaxText reads configs/models/NAME.yml; pathserve has no such model, and base.yml's
        # description (MaxText's "default" model) would stand in for it unseen
        raise MaxTextConfigError(
            f"model_name: {model_name!r} has no pathserve preset (pathserve serves Llama-family models: "
            "configs/models/ holds the presets); describe a Llama-family model with "
            "override_model_config=true and the base_* keys"
        )
    if preset is not None:
        twice = sorted(set(preset) & set(overrides))
        if twice and not values.get("override_model_config"):
            raise MaxTextConfigError(
                f"{', '.join(twice)}: set by model {model_name!r} and on the command line; "
                "add override_model_config=true to override the model's keys"
            )
        # The preset's architecture is served as such: only keys overridden on top of it count.
        values = {k: v for k, v in values.items() if k not in MODEL_KEYS or k in overrides}
        values["model_name"] = model_name
    rules = chain.get(RULES, [])
    if RULES in overrides:
        rules = overrides[RULES] if values.get("override_logical_axis_rules") else merge_rules(rules, overrides[RULES])
    if rules:
        values[RULES] = rules
    # MaxText's profiler flags mean pathserve's profiler_port.
    if values.get("enable_jax_profiler") and "profiler_port" not in values:
        values["profiler_port"] = int(values.get("jax_profiler_port", 9999))
    return values
