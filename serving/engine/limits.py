"""What an engine can take, in plain Python (no JAX): the one place requests are checked against
its shapes, by the orchestrator at submit time, by the offline driver and by the engine itself.

Prompts are padded to power-of-two length buckets from MIN_BUCKET up to max_prefill_predict_length;
each bucket is one compiled prefill shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.errors import GenerationError
from serving.request import SamplingParams

MIN_BUCKET = 16
MAX_STOP_IDS = 8
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code


def prefill_buckets(max_prefill_length: int) -> list[int]:
    """Power-of-two prompt lengths from MIN_BUCKET up to (and including) the limit."""
    buckets, n = [], MIN_BUCKET
    while n < max_prefill_length:
        buckets.append(n)
        n *= 2
    return [*buckets, max_prefill_length]


def finishes_at_first_token(token: int, sampling: SamplingParams) -> bool:
    """Whether a request is done with its first token (a stop id, or max_tokens <= 1): its slot
    never becomes active (the engine's insert applies the same rule on the device)."""
    return token in sampling.stop_ids or sampling.max_tokens <= 1


@dataclass(frozen=True)
class Limits:
    """An engine's fixed shapes: decode slots, the longest prompt, the longest sequence."""

    max_concurrent_decodes: int  # decode slots
    max_prefill_length: int  # MaxText's max_prefill_predict_length: the largest prefill bucket
    max_target_length: int  # prompt + generated tokens of one sequence
    buckets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "buckets", tuple(prefill_buckets(self.max_prefill_length)))

    def bucket_for(self, length: int) -> int:
        """The padded length a prompt of `length` tokens is prefilled at."""
        if length <= 0:
            raise GenerationError("the prompt is empty", field="prompt")
        if length > self.max_prefill_length:
            raise GenerationError(
                f"the prompt has {length} tokens, more than max_prefill_predict_length={self.max_prefill_length}",
                field="prompt",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        return next(b for b in self.buckets if b >= length)

    def check(self, prompt_length: int, sampling: SamplingParams) -> None:
        """Raise GenerationError (naming the request field) for a request these shapes cannot serve."""
        self.bucket_for(prompt_length)
        if prompt_length + sampling.max_tokens > self.max_target_length:
            raise GenerationError(
                f"prompt ({prompt_length} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                f"max_target_length={self.max_target_length}",
                field="max_tokens",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        if sampling.n > self.max_concurrent_decodes:
            raise GenerationError(
                f"n={sampling.n} choices need as many decode slots; this server has {self.max_concurrent_decodes}",
                field="n",
            )
        if len(sampling.stop_ids) > MAX_STOP_IDS:
            raise GenerationError(f"at most {MAX_STOP_IDS} stop token ids per request")

    def pad(self, prompt_ids: list[int]) -> list[int]:
        """The prompt zero-padded to its bucket."""
        return [*prompt_ids, *([0] * (self.bucket_for(len(prompt_ids)) - len(prompt_ids)))]
