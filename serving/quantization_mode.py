"""What `quantization` means, decided in one function (`decide_quantization`) from the flags and
the checkpoint's own description: which params entries are held in int8, whether each int8 matmul
also quantizes its activations, and which entries the checkpoint already stores in int8.

Plain Python (no JAX): the config's validation (flags alone), start-up's resolution
(serving.startup.plan) and loading (serving.checkpoints.model_source) call it; placement, restore,
the engine and the kernels read its answer, a `Quantization`.

MaxText's meaning: "int8" is AQT's dynamic-range int8 on both sides of each layer matmul (W8A8);
"int8w" is ours, weight-only int8 (every matmul weight and the embedding).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from serving.errors import ConfigError
from serving.models.params import int8_entries

MODES = ("", "int8", "int8w")


@dataclass(frozen=True)
class Quantization:
    """The decided numerics of the weights."""

    mode: str = ""  # one of MODES
    stored: tuple[str, ...] = ()  # params entries the checkpoint stores in int8 (empty: float or no checkpoint)

    @property
    def int8(self) -> tuple[str, ...]:
        """Entries held in int8 once loaded: those stored so, and those `mode` quantizes on load."""
        return tuple(sorted({*self.stored, *int8_entries(self.mode)}))

    @property
    def activations(self) -> bool:
        """W8A8: each int8 matmul quantizes its input per token (quantization=int8)."""
        return self.mode == "int8"

    @property
    def checkpoint_is_quantized(self) -> bool:
        return bool(self.stored)

    @property
    def quantized_on_load(self) -> tuple[str, ...]:
        """Entries quantized from float while loading (each needs its whole tensor on the host)."""
        return tuple(sorted(set(int8_entries(self.mode)) - set(self.stored)))


def decide_quantization(
    asked: str,
    checkpoint_is_quantized: bool = False,
    given: Collection[str] = ("quantization", "checkpoint_is_quantized"),
    stored: tuple[str, ...] | None = None,
    implied: str = "int8w",
    source: str = "",
) -> Quantization:
    """The one rule for what `quantization` means.

    `asked`, `checkpoint_is_quantized`: the flags; `given`: which of them the user set (on the
    command line, in a config file, in the serving profile) rather than left to their defaults.
    `stored`: the entries the checkpoint at `source` stores in int8 (empty: a float checkpoint;
    None: a source that is not one, as a Hugging Face directory; no `source`: the flags alone). `implied`:
    the mode an int8 checkpoint is served with when `quantization` is not given (ours: int8w, as
    converted; MaxText's: int8, W8A8, as MaxText serves it). A flag that contradicts the
    checkpoint is refused, naming both (ConfigError)."""
    if asked not in MODES:
        raise ConfigError(f"quantization: {asked!r} is not one of {MODES}")
    if checkpoint_is_quantized and not asked:
        raise ConfigError("checkpoint_is_quantized=true requires quantization=int8 (or int8w)")
    if not stored:
        if checkpoint_is_quantized and source:
            held = "holds float weights" if stored is not None else "is not an int8 checkpoint"
            raise ConfigError(f"checkpoint_is_quantized=true, but {source} {held}")
        return Quantization(asked)
    if "quantization" in given and not asked:
        raise ConfigError(f"quantization='' contradicts {source}, whose weights are int8 (quantization=int8 or int8w)")
    if "checkpoint_is_quantized" in given and not checkpoint_is_quantized:
        raise ConfigError(
            f"checkpoint_is_quantized=False contradicts {source}, whose weights are int8 (checkpoint_is_quantized=true)"
        )
    return Quantization(asked if "quantization" in given else implied, tuple(sorted(stored)))
