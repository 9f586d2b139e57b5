"""What a request asks for, and what comes back per token, in plain Python (no JAX): shared by the
engine, the orchestrator, the HTTP API and batch. Everything here pickles (a multi-host leader
sends it to every host inside the step plan)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import NamedTuple

# At most this many alternatives per position (OpenAI's limit for top_logprobs and logprobs).
MAX_LOGPROBS = 20
# The per-request tables the device keeps for every slot have fixed sizes (serving.engine.state):
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's own limit)
MAX_BAD_WORDS = 32  # bad_words token sequences (each word tokenized with and without a leading space)
MAX_BAD_WORD_TOKENS = 8  # tokens in one bad word's sequence
LOGIT_BIAS_LIMIT = 100.0  # |bias| (OpenAI's range, -100..100)


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

    Logit processing, applied on the device in this order before the sampler (vLLM's order and
    definitions; serving.engine.penalties): `bad_words` (token sequences: the last token of each
    is forbidden right after the others were generated), `min_tokens` (the stop ids are forbidden
    until that many tokens were generated), `logit_bias` ((token, bias) pairs added to the logits),
    then the penalties over the tokens generated so far: `repetition_penalty` (divides a positive
    logit, multiplies a negative one, for tokens of the prompt or the output), `frequency_penalty`
    (minus the penalty times the token's count) and `presence_penalty` (minus it once). `min_p`
    (after temperature): tokens less likely than min_p times the best token's probability are cut.

    Read by the stream assembler only (serving.orchestrator.streams): `include_stop_str_in_output`
    (a stop string or stop token's text stays in the text), `skip_special_tokens`,
    `spaces_between_special_tokens` (with special tokens shown, a space on each side of one).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

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
        self._check_processing()

    def _check_processing(self) -> None:
        """The logit-processing fields' ranges (vLLM's and OpenAI's), each error naming its field."""
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2**20:  # also rejects NaN
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias has {len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS}")
        for token, bias in self.logit_bias:
            if token < 0 or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias: {token}: {bias} must be a token id and a bias in [-100, 100]")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words makes {len(self.bad_words)} token sequences, at most {MAX_BAD_WORDS}")
        for word in self.bad_words:
            if not 0 < len(word) <= MAX_BAD_WORD_TOKENS or min(word) < 0:
                raise ValueError(f"bad_words: a word of {len(word)} tokens, each must have 1..{MAX_BAD_WORD_TOKENS}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty over generated (or prompt) tokens is set."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

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
    """One position's token with its logprob and the best alternatives (token, logprob), best first;
    `rank`: 1 + how many tokens are likelier (computed for the prompt's logprobs only; else None)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None
