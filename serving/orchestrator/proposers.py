"""Speculative decoding's host side: what each running request proposes, and when to propose.

The scheduler asks a `Speculator` each turn for every decoding slot's proposals (up to
`num_speculative_tokens` token ids); with any, the turn's decode call is the engine's `verify`
(serving.engine.speculative) instead of `generate`. The speculator keeps every request's tokens
(prompt, then each emitted token, from the outcomes the scheduler records) and decides:

- the proposals: n-gram lookup (vLLM's `ngram`): the longest suffix of prompt + output, of
  prompt_lookup_max down to prompt_lookup_min tokens, that occurred earlier; the tokens that
  followed its latest earlier occurrence are proposed. No match: no proposals. Or a draft model
  (serving.engine.draft, run by the executor): the speculator keeps how much of each sequence the
  draft's cache holds and plans the rows that bring it up to date; the draft proposes k tokens.
- the policy: nothing is proposed while more slots decode than `speculative_max_slots` (decode is
  compute-bound there and verifying k + 1 positions per slot costs more than it saves), nor when
  the tokens the call is expected to emit (each proposing slot 1 + its recent acceptance x its
  proposals, the others 1) fall short of `speculative_cost_ratio` (a verify call's cost in decode
  steps, measured) plus a draft model's proposals' cost, times a decode step's (one per slot), for a
  request that opted out (`SamplingParams.speculative=False`), under a grammar (its next masks
  depend on each token), nor for a request whose recent acceptance (an exponential average of
  accepted / proposed) fell below `speculative_min_acceptance`: it rests `SPECULATION_PAUSE`
  turns, then tries again, resting twice as long each time it fails again (open-ended text
  rarely repeats itself: the n-gram lookup's few matches there are mostly wrong).

Plain Python, deterministic: a multi-host leader decides the proposals and its plan carries them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from serving.config import SpeculativeConfig
from serving.engine.api import PrefillRow
from serving.request import SamplingParams

ACCEPTANCE_DECAY = 0.5  # weight of the past in a request's acceptance average
INITIAL_ACCEPTANCE = 0.5  # a fresh request's (and a rested one's) average: two misses pause it
SPECULATION_PAUSE = 8  # turns a request with low acceptance first rests; doubled at each pause in a row
MAX_SPECULATION_PAUSE = 256


def ngram_proposal(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of max_n down to min_n tokens (vLLM's prompt lookup); () when none occurred."""
    ids = np.asarray(tokens, np.int64)
    length = len(ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = ids[length - n :]
        # starts i < length - n of earlier windows ids[i : i + n], each followed by a token
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)
        hits = np.flatnonzero(np.all(windows == suffix, axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(int(t) for t in ids[start : start + k])
    return ()


@dataclass(frozen=True)
class Proposals:
    """One turn's proposals, for the plan: `tokens` int32 [slots, k] (n-gram), or, with a draft
    model, None and the `draft_rows` that let the executor's draft propose them; `num_proposed`
    [slots]: how many of each slot's k are real (0: the slot does not speculate)."""

    num_proposed: np.ndarray
    tokens: np.ndarray | None = None
    draft_rows: tuple[PrefillRow, ...] = ()


@dataclass
class SpeculationStats:
    """Counters for the metrics (per method, since the server runs one)."""

    proposed: int = 0  # proposal tokens verified
    accepted: int = 0  # of them accepted (and emitted)
    rounds: int = 0  # slot-calls that verified at least one proposal


@dataclass
class _Sequence:
    tokens: list[int]
    sampling: SamplingParams
    acceptance: float = INITIAL_ACCEPTANCE
    resting: int = 0  # turns left without proposals
    pause: int = SPECULATION_PAUSE  # the next rest's length
    current: bool = False  # the last emitted token is known (not sampled in this turn's prefill)
    prompt_length: int = 0
    draft_valid: int = 0  # tokens the draft model's cache holds (from position 0)
    proposed_at: int = 0  # len(tokens) when it last proposed


@dataclass
class Speculator:
    """Proposals and policy (module docstring). `chunk`: the longest prefill row a draft model
    takes (the engine's prefill_chunk_size)."""

    config: SpeculativeConfig
    chunk: int = 256
    # A draft model's proposals' cost in the target's decode steps (DraftModel.cost_in_steps: its
    # k forward passes, each its weights' share of the target's); 0 for the n-gram lookup, which
    # costs the device nothing.
    draft_cost: float = 0.0
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    _sequences: dict[int, _Sequence] = field(default_factory=dict)  # request id -> its tokens

    @property
    def k(self) -> int:
        return self.config.num_speculative_tokens

    def start(self, request_id: int, prompt_ids: Sequence[int], sampling: SamplingParams) -> None:
        """A request took a slot (its first token comes with the turn's outcome)."""
        self._sequences[request_id] = _Sequence(list(prompt_ids), sampling, prompt_length=len(prompt_ids))

    def finish(self, request_id: int) -> None:
        self._sequences.pop(request_id, None)

    def emitted(self, request_id: int, tokens: Sequence[int]) -> None:
        """The request's new tokens, in order."""
        sequence = self._sequences.get(request_id)
        if sequence is not None and tokens:
            sequence.tokens.extend(tokens)
            sequence.current = True

    def propose(self, slots: Mapping[int, int], num_slots: int) -> Proposals | None:
        """Proposals for the decoding `slots` (slot -> request id; arrays of `num_slots` rows), or
        None when no slot proposes (the turn runs plain generate)."""
        if self.config.speculative_method == "none" or len(slots) > self.config.speculative_max_slots:
            return None
        draft = self.config.speculative_method == "draft"
        tokens = None if draft else np.zeros((num_slots, self.k), np.int32)
        counts = np.zeros((num_slots,), np.int32)
        rows: list[PrefillRow] = []
        for slot, request_id in slots.items():
            sequence = self._sequences.get(request_id)
            if sequence is None or not self._may_propose(sequence):
                continue
            # no more than the tokens the request has left after the verify call's own
            left = sequence.sampling.max_tokens - (len(sequence.tokens) - sequence.prompt_length) - 1
            if left <= 0:
                continue
            sequence.proposed_at = len(sequence.tokens)
            if draft:
                rows += self._draft_rows(slot, sequence)
                counts[slot] = min(self.k, left)
                continue
            proposal = self._lookup(sequence.tokens)[:left]
            tokens[slot, : len(proposal)], counts[slot] = proposal, len(proposal)
        if not counts.any() or not self._pays(slots, counts):
            return None
        return Proposals(counts, tokens, tuple(rows))

    def _pays(self, slots: Mapping[int, int], counts: np.ndarray) -> bool:
        """Whether a verify call, with the draft's proposals before it, is expected to emit at
        least (`speculative_cost_ratio` + `draft_cost`) times the tokens a decode step does (one
        per slot): each proposing slot is expected to emit 1 + its recent acceptance x its
        proposals, every other slot 1 (where plain decoding would have given it a token per step
        at 1 / that cost)."""
        expected = 0.0
        for slot, request_id in slots.items():
            sequence = self._sequences.get(request_id)
            acceptance = sequence.acceptance if sequence is not None else 0.0
            expected += 1 + acceptance * int(counts[slot])
        return expected >= (self.config.speculative_cost_ratio + self.draft_cost) * len(slots)

    def _draft_rows(self, slot: int, sequence: _Sequence) -> list[PrefillRow]:
        """The chunks of the sequence the draft's cache lacks; the last samples its first proposal."""
        greedy = SamplingParams(max_tokens=self.k)  # the draft slot stops after its k proposals
        missing, start = sequence.tokens[sequence.draft_valid :], sequence.draft_valid
        rows = []
        for offset in range(0, len(missing), self.chunk):
            piece = tuple(missing[offset : offset + self.chunk])
            rows.append(PrefillRow(slot, piece, start + offset, offset + self.chunk >= len(missing), greedy))
        return rows

    def _may_propose(self, sequence: _Sequence) -> bool:
        sampling = sequence.sampling
        if not (sequence.current and sampling.speculative and sampling.grammar is None):
            return False
        if sequence.resting:
            sequence.resting -= 1
            if not sequence.resting:
                sequence.acceptance = INITIAL_ACCEPTANCE
            return False
        return True

    def _lookup(self, tokens: Sequence[int]) -> tuple[int, ...]:
        c = self.config
        return ngram_proposal(tokens, self.k, c.prompt_lookup_min, c.prompt_lookup_max)

    def verified(self, request_id: int, proposed: int, emitted: int) -> None:
        """A verify call emitted `emitted` tokens for a request that proposed `proposed`."""
        if not proposed:
            return
        accepted = min(max(emitted - 1, 0), proposed)
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        self.stats.rounds += 1
        sequence = self._sequences.get(request_id)
        if sequence is None:
            return
        # the draft fed its proposals but the last; those accepted stay valid in its cache
        sequence.draft_valid = sequence.proposed_at + min(accepted, self.k - 1)
        sequence.acceptance = ACCEPTANCE_DECAY * sequence.acceptance + (1 - ACCEPTANCE_DECAY) * accepted / proposed
        if sequence.acceptance < self.config.speculative_min_acceptance:
            sequence.resting, sequence.pause = sequence.pause, min(2 * sequence.pause, MAX_SPECULATION_PAUSE)
        elif accepted:
            sequence.pause = SPECULATION_PAUSE
