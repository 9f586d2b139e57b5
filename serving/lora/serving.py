"""The adapters of a running server: the registry, with the adapters of lora_input_adapters_path
loaded at start-up, and where each process's device loop gets the weights of an `AdapterLoad` its
plan carries (process 0: the registry's host copies; a multi-host follower: storage)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from serving.checkpoints import storage
from serving.config import LoraConfig
from serving.lora.errors import AdapterError
from serving.lora.peft import CONFIG_FILE, LoraWeights, read_adapter
from serving.lora.registry import AdapterLoad, AdapterRegistry
from serving.models.config import ModelConfig

log = logging.getLogger(__name__)


def make_registry(config: LoraConfig, model: ModelConfig) -> AdapterRegistry:
    """A registry reading adapters for `model`, with every adapter directory of
    config.lora_input_adapters_path loaded (named by its directory)."""
    registry = AdapterRegistry(
        read=partial(read_adapter, cfg=model, max_rank=config.max_lora_rank),
        max_loras=config.max_loras,
        max_cpu_loras=config.max_cpu_loras,
    )
    root = config.lora_input_adapters_path
    if root:
        names = [n for n in storage.list_names(root) if storage.exists(storage.join(root, n, CONFIG_FILE))]
        if not names:
            raise AdapterError(f"lora_input_adapters_path={root}: no adapter directories (with {CONFIG_FILE}) in it")
        for name in names:
            info = registry.load(name, storage.join(root, name))
            log.info("LoRA adapter %s from %s (%.2f s)", name, info.path, info.load_seconds)
    return registry


def storage_reader(config: LoraConfig, model: ModelConfig) -> Callable[[AdapterLoad], LoraWeights]:
    """A multi-host follower's weights for its leader's adapter loads: each read from its path
    (the follower keeps no host copies; process 0 reads its registry's)."""

    def read(load: AdapterLoad) -> LoraWeights:
        return read_adapter(load.path, model, config.max_lora_rank)

    return read
