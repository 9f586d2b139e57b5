"""What an engine can take, in plain Python (no JAX): the one place requests are checked against
its shapes, by the orchestrator at submit time, by the offline driver and by the engine itself.

Two ways into a slot:
- whole: one `prefill` of the prompt padded to a power-of-two length bucket from MIN_BUCKET up to
  max_prefill_predict_length (MaxText's meaning: the largest single prefill), then `insert`. Requests
  that need the prefill's own outputs take it: n > 1 choices, prompt logprobs.
- chunked: `prefill_slots` writes the prompt into its slot in chunks of at most
  `prefill_chunk_size` tokens, several prompts per compiled call; a prompt may then be as long as
  max_target_length - max_tokens. Every other request takes it: a final row gives its first token's
  logprobs, and carries a grammar's first mask and a repetition penalty's prompt tokens.

Decode runs over `decode_rows(active)`: generate is compiled for a few slot-count buckets, so that a
lone request does not pay for every slot, and it gathers the slots it decodes, so that sequences
scattered over the slots (the others free or prefilling) cost their count, not the highest slot.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass, field

from serving.errors import GenerationError
from serving.request import SamplingParams

MIN_BUCKET = 16
MAX_STOP_IDS = 16  # end-of-sequence ids and a request's stop_token_ids
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code


def prefill_buckets(
    max_prefill_length: int, extra: tuple[int, ...] = (), min_bucket: int = MIN_BUCKET, growth: int = 2
) -> list[int]:
    """Prompt lengths min_bucket x growth^i up to (and including) the limit, and `extra` lengths (a
    chunk size not on that ladder) below it. A backend that pays little for padding and much per
    compiled program (a TPU) takes a coarser ladder (serving.models.ops.XlaOps.shape_growth)."""
    buckets, n = set(), min_bucket
    while n < max_prefill_length:
        buckets.add(n)
        n *= growth
    return sorted({*buckets, max_prefill_length, *(e for e in extra if 0 < e < max_prefill_length)})


def slot_buckets(slots: int, buckets: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The slot counts generate is compiled for: `buckets` (empty: powers of two) below `slots`,
    and `slots` itself."""
    chosen, n = set(buckets), 1
    if not buckets:
        while n < slots:
            chosen.add(n)
            n *= 2
    return tuple(sorted({*(b for b in chosen if 0 < b < slots), slots}))


def finishes_at_first_token(token: int, sampling: SamplingParams) -> bool:
    """Whether a request is done with its first token (a stop id, or max_tokens <= 1): its slot
    never becomes active (the engine's insert applies the same rule on the device)."""
    return token in sampling.stop_ids or sampling.max_tokens <= 1


def row_buckets(max_rows: int, growth: int = 2) -> tuple[int, ...]:
    """Row counts a prefill_slots call is compiled for: powers of `growth` below `max_rows`, and it
    (a TPU's backend grows its shape ladders by 4: fewer programs, each padded more)."""
    rows, n = {max_rows}, 1
    while n < max_rows:
        rows.add(n)
        n *= growth
    return tuple(sorted(rows))


@dataclass(frozen=True)
class Limits:
    """An engine's fixed shapes: decode slots, prefill buckets and chunks, the longest sequence."""

    max_concurrent_decodes: int  # decode slots
    max_prefill_length: int  # MaxText's max_prefill_predict_length: the largest prefill bucket
    max_target_length: int  # prompt + generated tokens of one sequence
    prefill_chunk_size: int = 0  # the longest chunk of a chunked prefill (0: max_prefill_length)
    max_prefill_batch: int = 8  # prompts (rows) in one prefill_slots call
    prefill_batch_tokens: int = 0  # padded tokens (rows x bucket) of one call (0: max_prefill_length)
    # ... of a call whose rows start after cached positions (0: prefill_batch_tokens)
    history_batch_tokens: int = 0
    prefix_block: int = 64  # the KV cache's page: this many positions (and the prefix cache's unit)
    decode_buckets: tuple[int, ...] = ()  # slot counts generate is compiled for (empty: powers of two)
    # Pages in the KV cache's pool, the scratch page 0 included (0: enough for every slot to hold
    # max_target_length positions at once, as a cache of one row per slot would).
    num_pages: int = 0
    # the prefill length ladder (`prefill_buckets`) and the row counts' growth: the backend's
    # (serving.models.ops.XlaOps); `length_growth` 0: the lengths grow as the rows do
    min_bucket: int = MIN_BUCKET
    bucket_growth: int = 2
    length_growth: int = 0
    buckets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        chunk = self.prefill_chunk_size or self.max_prefill_length
        if not 0 < chunk <= self.max_prefill_length:
            raise ValueError(f"prefill_chunk_size={chunk} must be in 1..max_prefill_predict_length")
        object.__setattr__(self, "prefill_chunk_size", chunk)
        object.__setattr__(self, "prefill_batch_tokens", max(self.prefill_batch_tokens or self.max_prefill_length, 1))
        object.__setattr__(self, "history_batch_tokens", self.history_batch_tokens or self.prefill_batch_tokens)
        growth = self.length_growth or self.bucket_growth
        ladder = prefill_buckets(self.max_prefill_length, (chunk,), self.min_bucket, growth)
        object.__setattr__(self, "buckets", tuple(ladder))
        object.__setattr__(self, "decode_buckets", slot_buckets(self.max_concurrent_decodes, self.decode_buckets))
        if self.num_pages == 0:
            object.__setattr__(self, "num_pages", self.max_concurrent_decodes * self.max_pages + 1)
        if self.num_pages < self.max_pages + 1:
            raise ValueError(
                f"a KV cache of {self.num_pages} pages (page 0 is scratch) cannot hold one sequence of "
                f"max_target_length={self.max_target_length} positions: {self.max_pages + 1} pages at least"
            )

    @property
    def row_buckets(self) -> tuple[int, ...]:
        """The row counts a prefill_slots call is padded to (the ladder of the prefill lengths'
        growth, up to max_prefill_batch)."""
        return row_buckets(self.max_prefill_batch, self.bucket_growth)

    def padded_rows(self, rows: int) -> int:
        """The rows a prefill_slots call of `rows` computes: the smallest row bucket holding them."""
        return next(b for b in self.row_buckets if b >= rows)

    def batch_tokens(self, start: int) -> int:
        """The padded tokens (rows x bucket) a prefill_slots call may take whose rows start at
        `start` (all at 0, or all after cached positions: `history_batch_tokens`)."""
        return self.prefill_batch_tokens if start == 0 else self.history_batch_tokens

    @property
    def page_size(self) -> int:
        """Positions per page of the KV cache."""
        return self.prefix_block

    @property
    def max_pages(self) -> int:
        """Pages of a sequence of max_target_length positions: a block table's width."""
        return -(-self.max_target_length // self.prefix_block)

    def bucket_for(self, length: int) -> int:
        """The padded length a prompt (or chunk) of `length` tokens is prefilled at."""
        if length <= 0:
            raise GenerationError("the prompt is empty", field="prompt")
        if length > self.max_prefill_length:
            raise GenerationError(
                f"the prompt has {length} tokens, more than max_prefill_predict_length={self.max_prefill_length}",
                field="prompt",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        return next(b for b in self.buckets if b >= length)

    def decode_slots(self, used: int) -> int:
        """The smallest slot-count bucket of at least `used` slots."""
        return next(b for b in self.decode_buckets if b >= used)

    def decode_rows(self, active: Collection[int]) -> tuple[int, ...]:
        """The slots a decode call computes for the `active` ones, ascending: those and the lowest
        other slots, as many as the smallest bucket holding them. Each padding slot must be inactive
        on the device (it computes nothing)."""
        taken = set(active)
        others = (s for s in range(self.max_concurrent_decodes) if s not in taken)
        padding = itertools.islice(others, self.decode_slots(len(taken)) - len(taken))
        return tuple(sorted([*taken, *padding]))

    def check(self, prompt_length: int, sampling: SamplingParams) -> None:
        """Raise GenerationError (naming the request field) for a request these shapes cannot serve.
        Every request goes in chunks, so a prompt may be longer than max_prefill_predict_length."""
        if prompt_length <= 0:
            raise GenerationError("the prompt is empty", field="prompt")
        if prompt_length >= self.max_target_length:
            raise GenerationError(
                f"the prompt has {prompt_length} tokens; max_target_length={self.max_target_length} "
                "leaves no room for a generated token",
                field="prompt",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
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
            raise GenerationError(
                f"at most {MAX_STOP_IDS} stop token ids per request (the model's end-of-sequence ids "
                f"and stop_token_ids), got {len(sampling.stop_ids)}",
                field="stop_token_ids",
            )

    def pad(self, prompt_ids: list[int]) -> list[int]:
        """The prompt (or chunk) zero-padded to its bucket."""
        return [*prompt_ids, *([0] * (self.bucket_for(len(prompt_ids)) - len(prompt_ids)))]
