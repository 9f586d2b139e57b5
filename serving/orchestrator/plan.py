"""The device loop's decisions and their results as plain data: what the scheduler plans for one
turn (`StepPlan`), what the executor reads back (`StepOutcome`), and their parts.

A plan is pickled and broadcast to every host of a multi-controller slice, so it holds only plain
values (ints, tuples, token ids, `SamplingParams`, numpy masks): no engine objects, nothing that
differs between processes. A LoRA adapter's device write is one too (`AdapterLoad`: its slot, name,
load version and path, never its weights): each process gets the weights itself (process 0 from
its registry's host copy, a follower from the path, which every process reads alike), so a plan
stays small and no write needs a broadcast of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from serving.engine.api import PrefillRow
from serving.lora.registry import AdapterLoad
from serving.request import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class Waiting:
    """A request at the head of the admission queue."""

    request_id: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    choice_ids: tuple[int, ...] = ()  # request ids of choices 1..n-1 (sampling.n > 1)
    # under a grammar: one matcher per choice (serving.structured, all in the start state; each
    # `mask()` int32 [words] the next token's, `advance(token)`), held and advanced by the scheduler
    grammars: tuple = ()
    # its LoRA adapter's write into its device slot, when the adapter is not resident: in the plan
    # of the turn it is scheduled, before any request prefills (serving.lora.registry)
    adapter_load: AdapterLoad | None = None

    @property
    def num_slots(self) -> int:
        return 1 + len(self.choice_ids)

    @property
    def mask(self) -> np.ndarray | None:
        """The grammar's mask for the first token (None without a grammar)."""
        return self.grammars[0].mask() if self.grammars else None


@dataclass(frozen=True)
class StepPlan:
    """One turn of the device loop, executed in this order: frees (cancelled requests' slots) and
    preemptions (slots whose sequence gave up its pages and prefills again: made inactive), the
    LoRA adapters written into their device slots (`adapter_loads`: for the requests taken this
    turn, before any of them prefills), the block tables that changed (`page_tables`: slot -> its pages in order, the rest of its row
    scratch), one `prefill_slots` call (`rows`; a row that scores the prompt: alone, through
    `prefill_slots_scored`), one generate call.

    `decode_steps` is 0 (no generate call) or the engine's steps per call; the call is skipped when
    no slot is active after the prefills (`running` slots were active before them, and a slot whose
    first token finished it never becomes active). It computes the `slots` (a decode bucket's count:
    the running slots and the lowest others), and `max_position` bounds every active
    slot's position at that call. `masks` (int32 [slots, words],
    or None): the grammar masks of that call, which is then one step. With `proposals` the call
    verifies them (serving.engine.speculative) instead.
    """

    frees: tuple[int, ...] = ()
    preempted: tuple[int, ...] = ()
    page_tables: tuple[tuple[int, tuple[int, ...]], ...] = ()
    rows: tuple[PrefillRow, ...] = ()
    decode_steps: int = 0
    running: int = 0
    max_position: int = 0
    slots: tuple[int, ...] | None = None
    masks: np.ndarray | None = None
    # Speculative decoding: the decode call is the engine's `verify` of these proposals (int32
    # [slots, k], num_proposed [slots] of each row real), k + 1 decode steps; with a draft model,
    # proposals None and `draft_rows`, which the executor's draft turns into them first.
    proposals: np.ndarray | None = None
    num_proposed: np.ndarray | None = None
    draft_rows: tuple[PrefillRow, ...] = ()
    adapter_loads: tuple[AdapterLoad, ...] = ()
    # A disaggregated server: (slot, the pages holding its prompt) of each final row, moved from the
    # prefill engine to the generate engine once that row has run (serving.orchestrator.disaggregated)
    handoffs: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def num_slots(self) -> int | None:
        """How many slots the decode call computes (a decode bucket), None without one."""
        return None if self.slots is None else len(self.slots)

    @property
    def empty(self) -> bool:
        return not (
            self.frees or self.preempted or self.adapter_loads or self.page_tables or self.rows
            or self.decode_steps
        )

    @property
    def first_token_slots(self) -> tuple[int, ...]:
        """The slots that sample their first token this turn (the final rows'), in the order of
        `StepOutcome.first_tokens`."""
        return tuple(row.slot for row in self.rows if row.final)

    @property
    def first_token_samplings(self) -> tuple[SamplingParams, ...]:
        """The sampling of each slot of `first_token_slots`, in that order."""
        return tuple(row.sampling for row in self.rows if row.final)


@dataclass(frozen=True)
class StepOutcome:
    """What executing a plan produced, on the host."""

    first_tokens: tuple[int, ...] = ()  # one per slot of the plan's `first_token_slots`, in that order
    tokens: Sequence[Sequence[int]] = ()  # [steps][slots] of the generate call (empty: none ran)
    valid: Sequence[Sequence[bool]] = ()
    done: Sequence[Sequence[bool]] = ()
    first_logprobs: tuple[TokenLogprob | None, ...] = ()  # like first_tokens (None: not asked)
    logprobs: np.ndarray | None = None  # [steps, slots] float32, when the generate call made them
    top_ids: np.ndarray | None = None  # [steps, slots, K]
    top_logprobs: np.ndarray | None = None

    def token_logprob(self, step: int, slot: int) -> TokenLogprob:
        """The generate call's logprobs of `slot`'s token at `step`."""
        top = zip(self.top_ids[step, slot].tolist(), self.top_logprobs[step, slot].tolist(), strict=True)
        return TokenLogprob(int(self.tokens[step][slot]), float(self.logprobs[step, slot]), tuple(top))
