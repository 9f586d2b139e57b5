"""The adapters of a running server: the registry over the engine's params, with the adapters of
lora_input_adapters_path loaded at start-up."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from serving.checkpoints import storage
from serving.config import LoraConfig
from serving.lora.errors import AdapterError
from serving.lora.peft import CONFIG_FILE, LoraWeights, read_adapter
from serving.lora.registry import AdapterRegistry
from serving.lora.stack import write_slot
from serving.models.config import ModelConfig

log = logging.getLogger(__name__)


def make_registry(
    config: LoraConfig, model: ModelConfig, params: dict, write: Callable[[int, LoraWeights, str], None] | None = None
) -> AdapterRegistry:
    """A registry writing into params["lora"] (serving.lora.stack), with every adapter directory
    of config.lora_input_adapters_path loaded (named by its directory). `write`: instead of
    writing into `params` directly (a multi-host leader also tells its followers)."""
    registry = AdapterRegistry(
        read=partial(read_adapter, cfg=model, max_rank=config.max_lora_rank),
        write=write or (lambda slot, weights, path: write_slot(params, slot, weights)),
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


def write_from_storage(params: dict, slot: int, path: str, model: ModelConfig, max_rank: int) -> None:
    """A multi-host follower's copy of its leader's adapter write: read `path`, write slot `slot`."""
    write_slot(params, slot, read_adapter(path, model, max_rank))
