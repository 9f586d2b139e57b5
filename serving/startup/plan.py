"""Start-up's one resolved value: flags, config files and the checkpoint's own description, resolved
once into a frozen `LaunchPlan` before anything is placed. Placement, restore, the engine and the
kernels read it; nothing writes back.

1. SOURCE: the argument, else `load_parameters_path`, else the default model (converted once).
2. The checkpoint's description: its model (metadata, config.json, a GGUF header; a MaxText
   checkpoint's from `model_name` and MaxText's architecture keys) and what it stores in int8.
3. Quantization, decided by serving.quantization_mode's one rule over the flags and (2).
4. Slots: a count the serving profile proposed is sized to the memory and the model
   (serving.startup.slots); a count the user gave stays. Where the profile's floating-point KV
   cache holds fewer of its slots than an int8 one would, the cache is int8.
5. Where each figure came from (serving.startup.profile's origins, plus the checkpoint and the
   memory), for the ready line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from serving.checkpoints.checkpoint import is_checkpoint
from serving.checkpoints.maxtext_restore import is_maxtext_checkpoint
from serving.checkpoints.model_source import (
    LoadedModel,
    checkpoint_quantization,
    default_checkpoint,
    describe_model,
    load_resolved,
)
from serving.config import EngineConfig, ServingConfig
from serving.engine.partitioning import Numerics
from serving.models.config import ModelConfig
from serving.quantization_mode import Quantization
from serving.startup.profile import FROM_DEFAULT, FROM_PROFILE
from serving.startup.slots import SizedSlots, kv_share, memory_per_chip, pool_layout_on, size_slots

FROM_CHECKPOINT = "the checkpoint"
# The figures the ready line says the origin of: (label, ServingConfig key).
FIGURES = (
    ("slots", "per_device_batch_size"),
    ("quantization", "quantization"),
    ("warmup", "enable_model_warmup"),
    ("prefix cache", "prefix_cache"),
    ("max_target_length", "max_target_length"),
    ("int8 kv cache", "quantize_kvcache"),
)


@dataclass(frozen=True)
class LaunchPlan:
    """What start-up resolved: the config as served, the source, the model, the weights' numerics."""

    config: ServingConfig  # quantization and checkpoint_is_quantized as decided, slots as sized
    source: str
    model: ModelConfig  # the checkpoint's own description
    quantization: Quantization
    checkpoint: bool = False  # a converted or MaxText checkpoint (Orbax): restorable onto shards
    origins: Mapping[str, str] = field(default_factory=dict)  # ServingConfig key -> where it came from

    @property
    def engine(self) -> EngineConfig:
        """The engine's config, carrying the quantization decided here (the checkpoint's own int8
        entries with it)."""
        return replace(self.config.engine, quantization=self.quantization)

    def numerics(self) -> Numerics:
        """The placement's numerics: the config's dtypes and rules, the int8 entries as decided."""
        return Numerics.of(self.config, int8=self.quantization.int8)

    def restored_as_stored(self) -> bool:
        """A checkpoint whose arrays are restored as they are stored (nothing quantized on load), so
        each can go straight onto its shards."""
        return self.checkpoint and not self.quantization.quantized_on_load

    def origins_line(self) -> str:
        """Where the ready line's figures came from, e.g. 'slots: serving profile, quantization: command line'."""
        return ", ".join(f"{label}: {self.origins.get(key, FROM_DEFAULT)}" for label, key in FIGURES)

    def load(self, shardings: Mapping | None = None) -> LoadedModel:
        """The weights and tokenizer, as resolved (`shardings`: see restore_shardings)."""
        return load_resolved(self.source, self.config, self.quantization, self.model, shardings)


def plan_launch(
    cfg: ServingConfig,
    source: str | None,
    devices: Sequence | None = None,
    origins: Mapping[str, str] | None = None,
) -> LaunchPlan:
    """Resolve `cfg` and SOURCE (see the module docstring). `devices`: those the engine will run on
    (the profile's slots are sized to their memory; None sizes nothing); `origins`: where each key
    of `cfg` came from (serving.startup.profile.Given)."""
    source = source or cfg.load_parameters_path or default_checkpoint()
    quantization = checkpoint_quantization(source, cfg)
    model = describe_model(source, cfg)
    origins = dict(origins or {})
    updates: dict = {"quantization": quantization.mode, "checkpoint_is_quantized": quantization.checkpoint_is_quantized}
    if quantization.stored and "quantization" not in cfg.model_fields_set:
        origins["quantization"] = FROM_CHECKPOINT
    if devices is not None and origins.get("per_device_batch_size") == FROM_PROFILE and cfg.runtime != "multicontroller":
        sized, why = size_profile_slots(cfg.model_copy(update=updates), model, quantization.int8, devices, origins)
        updates.update(sized)
        origins.update(why)
    checkpoint = is_checkpoint(source) or is_maxtext_checkpoint(source)
    frozen = MappingProxyType(origins)  # read, never written back
    return LaunchPlan(cfg.model_copy(update=updates), source, model, quantization, checkpoint, frozen)


def size_profile_slots(
    cfg: ServingConfig,
    model: ModelConfig,
    int8: tuple[str, ...] | None,
    devices: Sequence,
    origins: Mapping[str, str],
    memory: int | None = None,
) -> tuple[dict, dict]:
    """The profile's slot count sized to the memory per chip (`memory`, else what the devices
    report), its floating-point KV cache turned int8 where that holds more of them
    (`_profile_kv_may_quantize`): (the config's updates, their origins), both empty where the
    memory is unknown. `int8`: the decided int8 entries (None: the `quantization` flag's).
    serve's start-up and loadtest.tpu_plan size alike. Multi-controller processes keep the
    profile's count (each process must choose the same): the caller does not ask."""
    memory = memory_per_chip(devices) if memory is None else memory
    if memory is None:
        return {}, {}
    asked = max(1, int(cfg.per_device_batch_size))
    layout = pool_layout_on(devices, cfg.cpu_kernels, cfg.attention)

    def sized(quantize_kvcache: bool) -> SizedSlots:
        numerics = Numerics.of(cfg.model_copy(update={"quantize_kvcache": quantize_kvcache}), int8=int8, pool_layout=layout)
        return size_slots(model, numerics, cfg.parallelism(len(devices)), asked, cfg.max_target_length, memory, kv_share(devices))

    updates, why = {}, {}
    chosen = sized(cfg.quantize_kvcache)
    if chosen.per_device < asked and _profile_kv_may_quantize(cfg, origins):
        quantized = sized(True)
        if quantized.per_device > chosen.per_device:
            updates["quantize_kvcache"] = True
            why["quantize_kvcache"] = f"{FROM_PROFILE} ({cfg.dtype} holds {chosen.per_device} of {asked} slots)"
            chosen = quantized
    updates["per_device_batch_size"] = float(chosen.per_device)
    why["per_device_batch_size"] = f"{FROM_PROFILE} ({chosen.describe(asked * len(devices))})"
    return updates, why


def _profile_kv_may_quantize(cfg: ServingConfig, origins: Mapping[str, str]) -> bool:
    """Whether the KV cache's format is the profile's floating point, which start-up may turn int8
    where that holds more of the profile's slots (issue 64: "an int8 KV cache where it fits more
    sequences"). On a v5e the ragged kernel reads bfloat16 pages faster than int8 ones, whose
    unpacking and scales cost more than the bytes they save (configs/serving/tpu.yml), so a
    profile keeps floating point where it holds the slots. A format the user chose stays."""
    return not cfg.quantize_kvcache and origins.get("quantize_kvcache") == FROM_PROFILE
