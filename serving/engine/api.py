"""The engine contract, in JetStream's terms: what the orchestrator may ask of an engine.

An engine owns a fixed pool of `limits.max_concurrent_decodes` decode slots and a decode state it
never keeps itself: every call takes the state and returns the new one (the real engine donates
the old buffers). One thread calls an engine at a time (the orchestrator's device loop).

Beside JetStream's whole-prompt `prefill` + `insert`, an engine prefills prompts straight into
their slots in chunks (`prefill_slots`, several prompts per call), keeps its KV cache in pages of a
pool that each slot's block table names (`set_pages`: the scheduler decides them, so every host of a
slice holds the same tables; a prefix shared by two sequences is one set of pages in both tables),
and runs `generate` over the slots it is given only (a bucket's count: the decoding ones and
padding).

An engine is built whole: what it runs with comes through its constructor (a draft model for
speculative decoding, the verify shapes its warmup compiles), and what it starts itself (the
background warmup) it answers for; nothing is attached to it afterwards. LoRA adapters live in the
params (a stack of device slots): `write_adapter` writes one slot, as a plan's `AdapterLoad` asks.

Two engines implement it: `serving.engine.engine.Engine` (the model on a device mesh) and
`serving.engine.mock.MockEngine` (outputs computable by hand, for tests of everything above it).
Plain Python, no JAX: the types an engine uses for its prefixes and states are its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, TypeVar

from numpy.typing import ArrayLike

from serving.engine.limits import Limits
from serving.lora.peft import LoraWeights
from serving.request import SamplingParams, TokenLogprob

PrefixT = TypeVar("PrefixT")
StateT = TypeVar("StateT")
ParamsT = TypeVar("ParamsT", contravariant=True)


class ResultTokens(NamedTuple):
    """What one `generate` call produced, step by step ([steps, slots] each; device or host arrays)."""

    tokens: ArrayLike  # int32: the token each slot produced at each step
    valid: ArrayLike  # bool: the slot was active and `tokens` holds its next token
    done: ArrayLike  # bool: that token finished the slot (a stop id, max_tokens, max_target_length)
    # Only when some active slot asked for logprobs (else None): the logprob of `tokens` [steps,
    # slots] float32 and the MAX_LOGPROBS best alternatives, best first ([steps, slots, K] each).
    logprobs: ArrayLike | None = None
    top_ids: ArrayLike | None = None
    top_logprobs: ArrayLike | None = None


class PrefillOutputs(NamedTuple):
    """What a prefill sampled, on the host: one first token per choice (`sampling.n`), their
    logprobs and the prompt's when the request asked (else None)."""

    first_tokens: tuple[int, ...]
    first_logprobs: tuple[TokenLogprob, ...] | None = None
    # [true_length]: None for the first prompt token, then each token given the ones before it
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class PrefillRow(NamedTuple):
    """One row of a `prefill_slots` call: the next chunk of one prompt, written into its slot."""

    slot: int
    tokens: tuple[int, ...]  # this chunk of the prompt: 1..limits.prefill_chunk_size tokens, unpadded
    start: int  # the position of tokens[0]: the slot's cache already holds positions [0, start)
    final: bool  # the prompt's last chunk: sample the first token and make the slot active
    sampling: SamplingParams  # read by a final row
    # Tokens the sequence generated before it was preempted (serving.orchestrator.scheduler): its
    # prompt here is the original prompt and those tokens, and a final row samples the next one,
    # as a generate step would (PRNG index, counts, min_tokens, max_tokens). 0: a fresh prompt.
    generated: int = 0
    # A final row's whole prompt (cached positions and earlier chunks included) when its request
    # has a repetition penalty, which reads every prompt token; () otherwise, and when resumed.
    prompt_ids: tuple[int, ...] = ()
    # A final row's first-token mask under a grammar (int32 [words], bit i % 32 of word i // 32 for
    # token i, as generate's masks); None: every token allowed.
    mask: ArrayLike | None = None
    # The prompt's logprobs (OpenAI's echo, vLLM's prompt_logprobs): this chunk's positions score
    # the prompt token each predicts (`prefill_slots_scored`, the row alone in its call); the last
    # one's is `score_next`, the prompt token after the chunk (-1 at the final chunk: it predicts
    # the first generated token, which is not the prompt's).
    score: bool = False
    score_next: int = -1


class Proposer(Protocol):
    """Speculative decoding's draft model (serving.engine.draft.DraftModel)."""

    def propose(self, rows: Sequence[PrefillRow]) -> ArrayLike:
        """int32 [slots, k]: the draft's k tokens after each final row's sequence, having prefilled
        every row's chunk into its own cache (zeros for slots without a final row)."""
        ...

    @property
    def cost_in_steps(self) -> float:
        """What one turn's proposals cost, in the target's decode steps (the speculation gate
        counts it: serving.orchestrator.proposers)."""
        ...


class BackgroundCompiles(Protocol):
    """Compiles an engine runs on a thread of its own after its warmup
    (serving.engine.warmup.BackgroundWarmup), told by every device loop when it may start one."""

    @property
    def pending(self) -> int:
        """Shapes left to compile (0 once done or stopped)."""
        ...

    def idle(self) -> None:
        """The device loop has nothing to run: the next shape may start."""
        ...

    def busy(self) -> None:
        """The device loop runs requests: no new shape starts."""
        ...

    def stop(self) -> None:
        """Stop after the shape compiling now, and wait for it."""
        ...


class EngineAPI(Protocol[ParamsT, PrefixT, StateT]):
    """prefill -> insert -> generate ... -> (done or free_resource), per slot."""

    @property
    def limits(self) -> Limits:
        """Slots, the largest prefill bucket, the longest sequence; requests are checked against it."""
        ...

    @property
    def decode_steps_per_call(self) -> int:
        """How many tokens each active slot advances in one `generate` call."""
        ...

    @property
    def draft(self) -> Proposer | None:
        """The draft model that proposes for a plan's `draft_rows` (speculative_method=draft), given
        to the engine when it is built; None: the engine has none."""
        ...

    @property
    def background_warmup(self) -> BackgroundCompiles | None:
        """The compiles the engine's warmup left running in the background; None before a warmup,
        with enable_background_warmup off, or for an engine that has none (the mock)."""
        ...

    def init_decode_state(self) -> StateT:
        """A fresh decode state: every slot free, the KV cache's pool allocated; where the pool
        holds every slot's max_target_length, each slot's block table names its own pages, so
        prefill / insert / generate work without `set_pages` (JetStream's contract)."""
        ...

    def prefill(
        self,
        params: ParamsT,
        padded_tokens: Sequence[int],
        true_length: int,
        sampling: SamplingParams,
        mask: ArrayLike | None = None,
    ) -> tuple[PrefixT, int]:
        """Run one prompt, padded to a bucket of `limits` (`limits.pad`), from position 0.

        Returns the prompt's KV with its sampling state (the prefix) and its first sampled token
        (choice 0's, on the host). `mask`: int32 [ceil(vocab / 32)] bits of the tokens the first
        token may be (a grammar's; None: any). Raises GenerationError for a request `limits.check`
        refuses."""
        ...

    def receive(self, prefix: PrefixT) -> PrefixT:
        """Another engine's prefix placed on this engine's devices, for `insert` (a disaggregated
        server: the prefill engine's result moved to the generate engine; asynchronous)."""
        ...

    def prefill_outputs(self, prefix: PrefixT) -> PrefillOutputs:
        """The prefix's first token of every choice and the logprobs its request asked for (one
        host read; the executor asks only when a request has n > 1 or wants logprobs)."""
        ...

    def insert(self, prefix: PrefixT, decode_state: StateT, slot: int, choice: int = 0) -> StateT:
        """Write a prefix into `slot` as its choice `choice` (its own first token and seed); the slot
        is active unless that first token already finished it (a stop id, or max_tokens <= 1)."""
        ...

    def prefill_slots(
        self, params: ParamsT, decode_state: StateT, rows: Sequence[PrefillRow]
    ) -> tuple[StateT, tuple[int | None, ...], tuple[TokenLogprob | None, ...]]:
        """Prefill every row's chunk into its slot in one compiled call (rows padded to a shared
        length bucket, `limits.bucket_for` of the longest; at most `limits.max_prefill_batch` rows).

        A chunk attends to its slot's positions [0, start) and to itself, and its KV is written at
        [start, start + len(tokens)). A non-final row leaves its slot inactive; a final row samples
        the first token (with the PRNG key and rule of `prefill`, so the tokens are the same) and
        makes the slot active unless that token finished it. Returns the state and, per row, on the
        host: its first token (None for a non-final row) and that token's logprobs with the
        MAX_LOGPROBS best alternatives, as `prefill_outputs` gives them (None unless the row is
        final and its request wants logprobs). A call with no final row need not wait for the
        device (nothing is read back)."""
        ...

    def prefill_slots_scored(
        self, params: ParamsT, decode_state: StateT, row: PrefillRow
    ) -> tuple[StateT, int | None, TokenLogprob | None, tuple[TokenLogprob, ...]]:
        """`prefill_slots` of one row that scores the prompt (`row.score`: a request for the
        prompt's logprobs, its chunks each alone in a call): the state, the row's first token and
        its logprob (None unless final; the logprob None unless wanted), and the logprob of each
        prompt token its positions predict, in order (the chunk's tokens after its first, then
        `row.score_next` unless final), over the whole vocabulary with the top MAX_LOGPROBS and
        the rank, as `prefill_outputs`' prompt logprobs."""
        ...

    @property
    def page_bytes(self) -> int:
        """Device bytes of one page of the KV pool on each chip (for the metrics)."""
        ...

    def handoff(self, decode_state: StateT, slot: int, pages: Sequence[int]):
        """Slot `slot`'s state and the KV of `pages`, to be `accept`ed by another engine (a
        disaggregated server's prefill engine hands a prefilled prompt to its generate engine, and
        the generate engine a preempted sequence's state back, with no pages). Asynchronous."""
        ...

    def accept(self, decode_state: StateT, handoff, slot: int, pages: Sequence[int]) -> StateT:
        """The state with another engine's `handoff` written at `slot` and `pages` (the ids it
        was read from: both engines' pools are the same size and the scheduler's ids name the same
        page on both). The slot's state is the other engine's, active or not."""
        ...

    def gathered(self, tree):
        """A handoff or a prefix whole on each of this engine's devices, for another process
        group to pull (a disaggregated server on a multi-controller slice:
        serving.orchestrator.transfer). Asynchronous."""
        ...

    def set_pages(self, decode_state: StateT, pages) -> StateT:
        """The state with every slot's block table: int32 [slots, limits.max_pages] of page ids in
        [0, limits.num_pages) (0: the scratch page). Slot s's position t is at page
        pages[s, t // limits.page_size]; every later call reads and writes through these."""
        ...

    def generate(
        self,
        params: ParamsT,
        decode_state: StateT,
        max_position: int | None = None,
        masks: ArrayLike | None = None,
        num_slots: int | None = None,
        slots: Sequence[int] | None = None,
    ) -> tuple[StateT, ResultTokens]:
        """Advance every active slot by `decode_steps_per_call` tokens; a slot that finishes turns
        inactive at that step.

        `slots`: the slots computed, distinct, as many as a bucket of `limits.decode_buckets`, every
        active slot among them (`limits.decode_rows`); None: the first `num_slots` (a bucket; no
        slot at or past it is active; None: all). The results still have every slot's column.
        `max_position`: no active slot's position (prompt + tokens so far) exceeds it; the caller
        keeps these on the host so that the engine can read less of the cache without reading
        positions back from the device. None: the engine assumes the longest.
        `masks`: int32 [slots, ceil(vocab / 32)] bits of the tokens each slot may take next (grammars);
        with them the call advances one step, since the next mask depends on the token."""
        ...

    def verify(
        self,
        params: ParamsT,
        decode_state: StateT,
        proposals: ArrayLike,
        num_proposed: ArrayLike,
        max_position: int | None = None,
        num_slots: int | None = None,
        slots: Sequence[int] | None = None,
    ) -> tuple[StateT, ResultTokens]:
        """Speculative decoding's decode call (serving.engine.speculative): score every active
        slot's proposals (int32 [slots, k]; the first `num_proposed[slot]` of its row are real) in
        one call, keep the longest prefix the target accepts (greedy: its argmax; sampled: the
        rejection rule, so the output distribution is the target's) and one token of its own after
        it. Results have k + 1 steps, `valid` marking the 1..k + 1 tokens each slot emitted; a stop
        id, max_tokens or max_target_length ends a slot there as in `generate`. `slots` and
        `num_slots`: the slots computed, as `generate` takes them."""
        ...

    def write_adapter(self, params: ParamsT, slot: int, weights: LoraWeights) -> ParamsT:
        """The params to call with from now on: LoRA adapter `weights` in device slot `slot`
        (1..max_loras; slot 0 is the base model's zeros), the adapter arrays of the same shapes and
        placement (nothing recompiles). Every later call applies it to the rows whose sampling
        names that slot."""
        ...

    def free_resource(self, decode_state: StateT, slot: int) -> StateT:
        """Deactivate `slot` (its request was cancelled); it may be inserted into again."""
        ...
