"""An engine whose outputs can be computed by hand, for tests of the orchestrator, the HTTP API,
batch and gRPC without a model, JAX or a compile (the fast test tier).

Its rule: a prompt's first token is `(last prompt token + 1) % vocab_size`, and every next token is
the previous one plus one (plus the choice's seed when temperature > 0), modulo vocab_size. With
`AsciiTokenizer` (token i is the character chr(32 + i), vocab 95) the text is as easy: the prompt
"ab" continues "cdefg...". Stop
ids, max_tokens and max_target_length end a slot as they do in the real engine. Choice i of a
request with n > 1 draws with `sampling.choice_seed(i)`. A grammar mask makes a token it forbids
become the smallest allowed token above it (cyclically). Logprobs, when asked: token t has
logprob -(t % 5) / 4, and its alternatives are t + 1, t + 2, ... with logprob one less each.
(A prompt token's logprob follows the same rule.)

Chunked prefill and the paged KV cache follow the same rule, through a pool of pages that holds
token ids: every write goes through the slot's block table (`set_pages`) into the page it names,
and a chunk reads the prompt before it from the pages its table names, so a final row's first token
(the one `prefill` gives, or after a preemption the next one) comes from what the pages hold. A
shared prefix is read from the pages another sequence wrote; a page reused for something else
gives other tokens, and the tests that compare tokens see it.

The mock checks its own contract (AssertionError): a decode state used after a call replaced it
(the real engine donates it), a chunk that reads a position no write reached, a write into the
scratch page (a position the scheduler gave no page), a call of more rows or padded tokens than the
limits allow, rows that mix first chunks with later ones, a generate call whose `slots` are no
bucket's count or leave out an active slot. `calls` records every
call for tests to read.

LoRA adapters change no token: `write_adapter` records the slot and the adapter's rank, and
`params["lora"]` (slot -> weights) says which adapter each slot holds. Like the real engine it is
built whole: a test's draft model or background warmup comes through the constructor.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from serving.engine.api import BackgroundCompiles, PrefillOutputs, PrefillRow, Proposer, ResultTokens
from serving.engine.limits import Limits, finishes_at_first_token
from serving.lora.peft import LoraWeights
from serving.models.paging import dedicated_pages
from serving.request import MAX_LOGPROBS, SamplingParams, TokenLogprob
from serving.text.tokenizer import Tokenizer


class AsciiTokenizer(Tokenizer):
    """Token i <-> the printable ASCII character chr(32 + i): 95 tokens, no specials, no BOS."""

    bos_id = None
    eos_ids = ()
    add_bos = False
    chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )

    @property
    def vocab_size(self) -> int:
        return 95

    def encode(self, text: str) -> list[int]:
        if any(not 32 <= ord(c) < 127 for c in text):
            raise ValueError(f"AsciiTokenizer takes printable ASCII only, got {text!r}")
        return [ord(c) - 32 for c in text]

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([32 + token_id])

    def is_special(self, token_id: int) -> bool:
        return False


@dataclass(frozen=True)
class MockPrefix:
    next_tokens: tuple[int, ...]  # per choice: the token fed at the first decode step
    length: int  # true prompt length
    sampling: SamplingParams
    prompt_ids: tuple[int, ...] = ()


@dataclass
class MockHandoff:
    slot: _Slot | None  # the slot's sequence (None: inactive)
    pages: dict[int, dict[int, int]]  # page -> offset -> token, as the handing engine's pool held them


def mock_logprob(token: int, vocab_size: int = 95) -> TokenLogprob:
    """The mock's logprobs for `token` (the rule in the module docstring)."""
    base = -(token % 5) / 4
    top = tuple(((token + i) % vocab_size, base - i) for i in range(min(MAX_LOGPROBS, vocab_size)))
    return TokenLogprob(token, base, top)


def allowed(token: int, mask, vocab_size: int) -> int:
    """`token` if `mask` (int32 [words] bits) allows it, else the next allowed token, cyclically."""
    if mask is None:
        return token
    for i in range(vocab_size):
        t = (token + i) % vocab_size
        if (int(mask[t // 32]) >> (t % 32)) & 1:
            return t
    raise AssertionError("a mask that allows no token")


@dataclass
class _Slot:
    token: int
    position: int  # where `token` is written: prompt length + tokens generated before it
    generated: int
    sampling: SamplingParams
    choice: int = 0


@dataclass
class MockState:
    slots: dict[int, _Slot] = field(default_factory=dict)  # active slots only
    tables: dict[int, tuple[int, ...]] = field(default_factory=dict)  # slot -> its block table
    pool: dict[int, dict[int, int]] = field(default_factory=dict)  # page -> offset -> the token written there
    replaced: bool = False


class MockEngine:
    """`serving.engine.api.EngineAPI` with hand-computable tokens; `step_seconds` of sleep per
    generate call stand in for device time."""

    def __init__(
        self,
        slots: int = 4,
        max_prefill_length: int = 64,
        max_target_length: int = 256,
        vocab_size: int = 95,
        decode_steps_per_call: int = 2,
        step_seconds: float = 0.0,
        *,
        prefill_chunk_size: int = 0,
        max_prefill_batch: int = 8,
        prefill_batch_tokens: int = 0,
        history_batch_tokens: int = 0,
        prefix_block: int = 64,
        decode_buckets: tuple[int, ...] = (),
        block_bytes: int = 1000,
        num_pages: int = 0,
        draft: Proposer | None = None,
        background_warmup: BackgroundCompiles | None = None,
    ):
        self.limits = Limits(
            slots,
            max_prefill_length,
            max_target_length,
            prefill_chunk_size=prefill_chunk_size,
            max_prefill_batch=max_prefill_batch,
            prefill_batch_tokens=prefill_batch_tokens,
            history_batch_tokens=history_batch_tokens,
            prefix_block=prefix_block,
            decode_buckets=decode_buckets,
            num_pages=num_pages,
        )
        self.block_bytes = block_bytes
        self.vocab_size = vocab_size
        self.decode_steps_per_call = decode_steps_per_call
        self.step_seconds = step_seconds
        self.draft = draft
        self.background_warmup = background_warmup
        self.calls: list[tuple] = []

    @property
    def max_concurrent_decodes(self) -> int:
        return self.limits.max_concurrent_decodes

    def next_token(self, token: int, sampling: SamplingParams, choice: int = 0) -> int:
        """The rule: the token after `token` for choice `choice` of a request sampled with `sampling`."""
        seed = sampling.choice_seed(choice) if sampling.temperature > 0 else 0
        return (token + 1 + seed) % self.vocab_size

    def expected(self, prompt_ids: Sequence[int], sampling: SamplingParams, choice: int = 0) -> list[int]:
        """Every token the mock produces for a request alone (what a test compares with)."""
        if sampling.max_tokens == 0:
            return []
        tokens = [(prompt_ids[-1] + 1) % self.vocab_size]
        # the token before the last one was fed at this position
        while not self._finished(tokens[-1], len(tokens), len(prompt_ids) + len(tokens) - 2, sampling):
            tokens.append(self.next_token(tokens[-1], sampling, choice))
        return tokens

    def _finished(self, token: int, generated: int, fed_at: int, sampling: SamplingParams) -> bool:
        """Whether `token`, produced from the token at position `fed_at`, ends its slot."""
        return (
            token in sampling.stop_ids
            or generated >= sampling.max_tokens
            or fed_at + 1 >= self.limits.max_target_length
        )

    # -- the contract --------------------------------------------------------------------------

    def init_decode_state(self) -> MockState:
        """Each slot owns its own pages where the pool holds every slot's full length (as the
        engine's), else every table entry is scratch until `set_pages`."""
        self.calls.append(("init_decode_state",))
        limits, state = self.limits, MockState()
        if limits.num_pages >= limits.max_concurrent_decodes * limits.max_pages + 1:
            tables = dedicated_pages(limits.max_concurrent_decodes, limits.max_target_length, limits.page_size)
            state.tables = {slot: tuple(int(p) for p in row) for slot, row in enumerate(tables)}
        return state

    def prefill(
        self,
        params: dict,
        padded_tokens: Sequence[int],
        true_length: int,
        sampling: SamplingParams,
        mask=None,
    ) -> tuple[MockPrefix, int]:
        self.limits.check(true_length, sampling)
        if len(padded_tokens) != self.limits.bucket_for(true_length):
            raise ValueError(f"prompt padded to {len(padded_tokens)}, not its bucket")
        self.calls.append(("prefill", tuple(padded_tokens[:true_length])))
        first = allowed((int(padded_tokens[true_length - 1]) + 1) % self.vocab_size, mask, self.vocab_size)
        prompt = tuple(int(t) for t in padded_tokens[:true_length])
        return MockPrefix((first,) * sampling.n, true_length, sampling, prompt), first

    def handoff(self, decode_state: MockState, slot: int, pages: Sequence[int]) -> MockHandoff:
        self._check(decode_state, slot)
        self.calls.append(("handoff", slot, tuple(pages)))
        written = {p: dict(decode_state.pool.get(p, {})) for p in pages}
        return MockHandoff(decode_state.slots.get(slot), written)

    def accept(self, decode_state: MockState, handoff: MockHandoff, slot: int, pages: Sequence[int]) -> MockState:
        self._check(decode_state, slot)
        if tuple(pages) != tuple(handoff.pages):
            raise AssertionError(f"pages {tuple(pages)} accepted, {tuple(handoff.pages)} handed off")
        self.calls.append(("accept", slot, tuple(pages)))
        slots = dict(decode_state.slots)
        slots.pop(slot, None)
        if handoff.slot is not None:
            slots[slot] = replace(handoff.slot)
        state = self._replace(decode_state, slots)
        for page, written in handoff.pages.items():
            state.pool[page] = dict(written)
        return state

    def gathered(self, tree):
        """Mock handoffs and prefixes are host data, whole already."""
        self.calls.append(("gathered", type(tree).__name__))
        return tree

    def receive(self, prefix: MockPrefix) -> MockPrefix:
        """A mock prefix is host data: every mock engine can read it as it is."""
        self.calls.append(("receive", prefix.length))
        return prefix

    def prefill_outputs(self, prefix: MockPrefix) -> PrefillOutputs:
        sampling = prefix.sampling
        first = None
        if sampling.wants_logprobs:
            first = tuple(mock_logprob(t, self.vocab_size) for t in prefix.next_tokens)
        prompt = None
        if sampling.prompt_logprobs is not None:
            prompt = (None, *(mock_logprob(t, self.vocab_size) for t in prefix.prompt_ids[1:]))
        return PrefillOutputs(prefix.next_tokens, first, prompt)

    def insert(self, prefix: MockPrefix, decode_state: MockState, slot: int, choice: int = 0) -> MockState:
        self._check(decode_state, slot)
        self.calls.append(("insert", slot))
        slots = dict(decode_state.slots)
        slots.pop(slot, None)
        token = prefix.next_tokens[choice]
        if not finishes_at_first_token(token, prefix.sampling):
            slots[slot] = _Slot(token, prefix.length, 1, prefix.sampling, choice)
        state = self._replace(decode_state, slots)
        for position, t in enumerate(prefix.prompt_ids):
            self._write(state, slot, position, t)
        return state

    def set_pages(self, decode_state: MockState, pages) -> MockState:
        self._check(decode_state)
        pages = np.asarray(pages)
        if pages.shape != (self.limits.max_concurrent_decodes, self.limits.max_pages):
            raise AssertionError(f"block tables of shape {pages.shape}")
        if pages.min() < 0 or pages.max() >= self.limits.num_pages:
            raise AssertionError(f"a block table names a page outside the pool of {self.limits.num_pages}")
        self.calls.append(("set_pages",))
        state = self._replace(decode_state, decode_state.slots)
        state.tables = {slot: tuple(int(p) for p in row) for slot, row in enumerate(pages)}
        return state

    def pages_of(self, decode_state: MockState, slot: int) -> tuple[int, ...]:
        """The pages `slot`'s table names (its scratch entries left out)."""
        return tuple(p for p in decode_state.tables.get(slot, ()) if p)

    def _page(self, state: MockState, slot: int, position: int) -> int:
        table = state.tables.get(slot, ())
        column = position // self.limits.page_size
        return table[column] if column < len(table) else 0

    def _write(self, state: MockState, slot: int, position: int, token: int) -> None:
        page = self._page(state, slot, position)
        if page == 0:
            raise AssertionError(f"slot {slot} writes position {position}, for which it holds no page")
        state.pool.setdefault(page, {})[position % self.limits.page_size] = token

    def _read(self, state: MockState, slot: int, length: int) -> tuple[int, ...]:
        """The tokens at `slot`'s positions [0, length), as its pages hold them."""
        out = []
        for position in range(length):
            page = self._page(state, slot, position)
            token = state.pool.get(page, {}).get(position % self.limits.page_size) if page else None
            if token is None:
                raise AssertionError(f"slot {slot} reads position {position}, which no write reached")
            out.append(token)
        return tuple(out)

    def prefill_slots(
        self, params: dict, decode_state: MockState, rows: Sequence[PrefillRow]
    ) -> tuple[MockState, tuple[int | None, ...], tuple[TokenLogprob | None, ...]]:
        self._check(decode_state)
        self._check_rows(decode_state, rows)
        self.calls.append(("prefill_slots", tuple((r.slot, r.start, len(r.tokens), r.final) for r in rows)))
        state = MockState(dict(decode_state.slots), decode_state.tables, decode_state.pool)
        firsts: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        for row in rows:
            prompt = self._read(state, row.slot, row.start) + tuple(int(t) for t in row.tokens)
            for position in range(row.start, len(prompt)):
                self._write(state, row.slot, position, prompt[position])
            if not row.final:
                firsts.append(None)
                logprobs.append(None)
                continue
            if row.generated:  # a preempted sequence's next token, as generate would give it
                first = self.next_token(prompt[-1], row.sampling)
            else:
                self.limits.check(len(prompt), row.sampling)
                first = (prompt[-1] + 1) % self.vocab_size
            first = allowed(first, row.mask, self.vocab_size)
            generated = row.generated + 1
            if not (first in row.sampling.stop_ids or generated >= row.sampling.max_tokens):
                state.slots[row.slot] = _Slot(first, len(prompt), generated, row.sampling)
            firsts.append(first)
            logprobs.append(mock_logprob(first, self.vocab_size) if row.sampling.wants_logprobs else None)
        decode_state.replaced = True  # only once the call went through: a refused call keeps its state
        return state, tuple(firsts), tuple(logprobs)

    def prefill_slots_scored(
        self, params: dict, decode_state: MockState, row: PrefillRow
    ) -> tuple[MockState, int | None, TokenLogprob | None, tuple[TokenLogprob, ...]]:
        """`prefill_slots` of one scoring row, and each prompt token its positions predict scored
        as `prefill_outputs` scores a whole prompt's (`mock_logprob` of the token)."""
        if not row.score:
            raise AssertionError("prefill_slots_scored takes a row that scores the prompt")
        self.calls.append(("prefill_slots_scored", (row.slot, row.start, len(row.tokens), row.final)))
        state, firsts, logprobs = self.prefill_slots(params, decode_state, [row])
        self.calls.pop()  # the call is this one, not prefill_slots
        predicted = [*row.tokens[1:], *([] if row.final else [row.score_next])]
        return state, firsts[0], logprobs[0], tuple(mock_logprob(t, self.vocab_size) for t in predicted)

    def _check_rows(self, state: MockState, rows: Sequence[PrefillRow]) -> None:
        limits = self.limits
        if not 0 < len(rows) <= limits.max_prefill_batch:
            raise AssertionError(f"{len(rows)} rows in a prefill_slots call (1..{limits.max_prefill_batch})")
        if len({r.slot for r in rows}) != len(rows):
            raise AssertionError("two rows of one prefill_slots call write the same slot")
        if len({r.start == 0 for r in rows}) != 1:
            raise AssertionError("a prefill_slots call mixes first chunks with later ones")
        for row in rows:
            self._check(state, row.slot)
            if row.slot in state.slots:
                raise AssertionError(f"a chunk prefilled into slot {row.slot}, which is decoding")
            if not 0 < len(row.tokens) <= limits.prefill_chunk_size:
                raise AssertionError(f"a chunk of {len(row.tokens)} tokens (1..{limits.prefill_chunk_size})")
        padded = len(rows) * limits.bucket_for(max(len(r.tokens) for r in rows))
        budget = limits.batch_tokens(rows[0].start)
        if len(rows) > 1 and padded > budget:
            raise AssertionError(f"{padded} padded tokens in a prefill_slots call ({budget})")

    @property
    def page_bytes(self) -> int:
        return self.block_bytes

    def generate(
        self,
        params: dict,
        decode_state: MockState,
        max_position: int | None = None,
        masks=None,
        num_slots: int | None = None,
        slots: Sequence[int] | None = None,
    ) -> tuple[MockState, ResultTokens]:
        self._check(decode_state)
        positions = [s.position for s in decode_state.slots.values()]
        if max_position is not None and positions and max(positions) > max_position:
            raise AssertionError(f"max_position={max_position} but a slot is at {max(positions)}")
        num_slots = self._check_decode_slots(decode_state, num_slots, slots)
        call = ("generate", max_position, num_slots)
        self.calls.append(call if masks is None else (*call, "masked"))
        if self.step_seconds:
            time.sleep(self.step_seconds)
        steps = 1 if masks is not None else self.decode_steps_per_call
        shape = (steps, self.limits.max_concurrent_decodes)
        tokens, valid, done = np.zeros(shape, np.int32), np.zeros(shape, bool), np.zeros(shape, bool)
        k = min(MAX_LOGPROBS, self.vocab_size)
        logprobs = np.zeros(shape, np.float32)
        top_ids, top = np.zeros((*shape, k), np.int32), np.zeros((*shape, k), np.float32)
        slots = {
            i: _Slot(s.token, s.position, s.generated, s.sampling, s.choice)
            for i, s in decode_state.slots.items()
        }
        state = self._replace(decode_state, slots)
        for step in range(steps):
            for index, s in list(slots.items()):
                self._write(state, index, s.position, s.token)  # the fed token, where the engine writes it
                token = self.next_token(s.token, s.sampling, s.choice)
                s.token = allowed(token, None if masks is None else masks[index], self.vocab_size)
                s.generated += 1
                tokens[step, index], valid[step, index] = s.token, True
                lp = mock_logprob(s.token, self.vocab_size)
                logprobs[step, index] = lp.logprob
                top_ids[step, index] = [t for t, _ in lp.top]
                top[step, index] = [v for _, v in lp.top]
                done[step, index] = self._finished(s.token, s.generated, s.position, s.sampling)
                s.position += 1
                if done[step, index]:
                    del slots[index]
        result = ResultTokens(tokens, valid, done, logprobs, top_ids, top)
        return state, result

    def _check_decode_slots(self, decode_state: MockState, num_slots: int | None, slots: Sequence[int] | None) -> int | None:
        """The real engine's contract for a decode call's slots (`generate`): a bucket's count of
        distinct slots holding every active one (or the first `num_slots`); returns their count."""
        if slots is not None:
            total = self.limits.max_concurrent_decodes
            if (
                len(set(slots)) != len(slots)
                or not all(0 <= slot < total for slot in slots)
                or (num_slots is not None and num_slots != len(slots))
            ):
                raise AssertionError(f"slots={tuple(slots)} (num_slots={num_slots}) are not distinct slots of one bucket")
            missing = set(decode_state.slots) - set(slots)
            if missing:
                raise AssertionError(f"slots={tuple(slots)} leave out active slots {sorted(missing)}")
            num_slots = len(slots)
        elif num_slots is not None and any(slot >= num_slots for slot in decode_state.slots):
            raise AssertionError(f"num_slots={num_slots} but slot {max(decode_state.slots)} is active")
        if num_slots is not None and num_slots not in self.limits.decode_buckets:
            raise AssertionError(f"{num_slots} slots is not one of {self.limits.decode_buckets}")
        return num_slots

    def verify(
        self, params: dict, decode_state: MockState, proposals, num_proposed, max_position: int | None = None,
        num_slots: int | None = None,
        slots: Sequence[int] | None = None,
    ) -> tuple[MockState, ResultTokens]:
        """Speculative decoding's call (serving.engine.speculative): each active slot keeps its
        proposals while they are the rule's next tokens, then the rule's own token; k + 1 steps."""
        self._check(decode_state)
        num_slots = self._check_decode_slots(decode_state, num_slots, slots)
        proposals = np.asarray(proposals)
        self.calls.append(("verify", max_position, num_slots, tuple(int(n) for n in num_proposed)))
        if self.step_seconds:
            time.sleep(self.step_seconds)
        steps, total = proposals.shape[1] + 1, self.limits.max_concurrent_decodes
        tokens, valid, done = np.zeros((steps, total), np.int32), np.zeros((steps, total), bool), np.zeros((steps, total), bool)
        slots = {i: _Slot(s.token, s.position, s.generated, s.sampling, s.choice) for i, s in decode_state.slots.items()}
        state = self._replace(decode_state, slots)
        for index, s in list(slots.items()):
            for step in range(steps):
                self._write(state, index, s.position, s.token)
                token = self.next_token(s.token, s.sampling, s.choice)
                s.token, s.generated = token, s.generated + 1
                tokens[step, index], valid[step, index] = token, True
                done[step, index] = self._finished(token, s.generated, s.position, s.sampling)
                s.position += 1
                if done[step, index]:
                    del slots[index]
                    break
                if step >= num_proposed[index] or proposals[index, step] != token:
                    break  # the first wrong proposal: the rule's token stands in for it
        result = ResultTokens(tokens, valid, done)
        return state, result

    def write_adapter(self, params: dict, slot: int, weights: LoraWeights) -> dict:
        if slot < 1:
            raise AssertionError(f"an adapter written into slot {slot} (slot 0 is the base model's)")
        self.calls.append(("write_adapter", slot, weights.rank))
        params.setdefault("lora", {})[slot] = weights
        return params

    def free_resource(self, decode_state: MockState, slot: int) -> MockState:
        self._check(decode_state, slot)
        self.calls.append(("free_resource", slot))
        slots = {i: s for i, s in decode_state.slots.items() if i != slot}
        return self._replace(decode_state, slots)

    # -- contract checks -----------------------------------------------------------------------

    def _check(self, state: MockState, slot: int | None = None) -> None:
        if state.replaced:
            raise AssertionError("a decode state was used after a call replaced it")
        if slot is not None and not 0 <= slot < self.limits.max_concurrent_decodes:
            raise AssertionError(f"slot {slot} out of range")

    @staticmethod
    def _replace(state: MockState, slots: dict[int, _Slot]) -> MockState:
        """A new state with `slots`; the tables and the pool carry over (the device keeps them)."""
        state.replaced = True
        return MockState(slots, state.tables, state.pool)
