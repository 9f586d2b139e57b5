"""What a request asks for, and what comes back per token, in plain Python (no JAX): shared by the
engine, the orchestrator, the HTTP API and batch. Everything here pickles (a multi-host leader
sends it to every host inside the step plan)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

# At most this many alternatives per position (OpenAI's limit for top_logprobs and logprobs).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Grammar:
    """A structured-output constraint: `kind` "json" (any JSON object) or "json_schema" (`spec`,
    the schema as canonical JSON text). Compiled by serving.structured on the leader host."""

    kind: str
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. temperature 0 means greedy.

    `logprobs`: return each sampled token's logprob and that many best alternatives (None: none).
    `prompt_logprobs`: the same for every prompt token (OpenAI's echo); with it, max_tokens may be
    0 (score the prompt only). `n`: independent choices from one prefill, choice i seeded with
    `choice_seed(i)`. `grammar`: tokens it forbids are masked at every step. `speculative`: False
    opts out of speculative decoding (the output is the same either way, in distribution).
    `adapter`: a LoRA adapter's id (serving.lora).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int = 0
    stop_ids: tuple[int, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    grammar: Grammar | None = None
    speculative: bool = True  # False: this request never speculates (the server's method aside)
    # LoRA: the adapter the request names (None: the base model); the device loop fills in the
    # device slot it holds while running (0: none) and its load's version (for the prefix cache key).
    adapter: str | None = None
    lora_slot: int = 0
    lora_version: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def choice_seed(self, choice: int) -> int:
        """The seed of choice `choice` (0: the request's own), the same on every host and run."""
        if choice == 0:
            return self.seed
        digest = hashlib.blake2b(f"{self.seed}/{choice}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")


class TokenLogprob(NamedTuple):
    """One position's token with its logprob and the best alternatives (token, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
