"""An engine whose outputs can be computed by hand, for tests of the orchestrator, the HTTP API,
batch and gRPC without a model, JAX or a compile (the fast test tier).

Its rule: a prompt's first token is `(last prompt token + 1) % vocab_size`, and every next token is
the previous one plus one (plus the request's seed when temperature > 0), modulo vocab_size. With
`AsciiTokenizer` (token i is the character chr(32 + i), vocab 95) the text is as easy: the prompt
"ab" continues "cdefg...". Stop
ids, max_tokens and max_target_length end a slot as they do in the real engine. The mock checks its
own contract: a decode state used after a call replaced it raises (the real engine donates it),
and `calls` records every call for tests to read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from serving.engine.api import ResultTokens
from serving.engine.limits import Limits, finishes_at_first_token
from serving.request import SamplingParams
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
    next_token: int  # the token fed at the first decode step (the first sampled token)
    length: int  # true prompt length
    sampling: SamplingParams


@dataclass
class _Slot:
    token: int
    position: int  # where `token` is written: prompt length + tokens generated before it
    generated: int
    sampling: SamplingParams


@dataclass
class MockState:
    slots: dict[int, _Slot] = field(default_factory=dict)  # active slots only
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
    ):
        self.limits = Limits(slots, max_prefill_length, max_target_length)
        self.vocab_size = vocab_size
        self.decode_steps_per_call = decode_steps_per_call
        self.step_seconds = step_seconds
        self.calls: list[tuple] = []

    @property
    def max_concurrent_decodes(self) -> int:
        return self.limits.max_concurrent_decodes

    def next_token(self, token: int, sampling: SamplingParams) -> int:
        """The rule: the token after `token` for a request sampled with `sampling`."""
        return (token + 1 + (sampling.seed if sampling.temperature > 0 else 0)) % self.vocab_size

    def expected(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
        """Every token the mock produces for a request alone (what a test compares with)."""
        tokens = [(prompt_ids[-1] + 1) % self.vocab_size]
        # the token before the last one was fed at this position
        while not self._finished(tokens[-1], len(tokens), len(prompt_ids) + len(tokens) - 2, sampling):
            tokens.append(self.next_token(tokens[-1], sampling))
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
        self.calls.append(("init_decode_state",))
        return MockState()

    def prefill(
        self, params: dict, padded_tokens: Sequence[int], true_length: int, sampling: SamplingParams
    ) -> tuple[MockPrefix, int]:
        self.limits.check(true_length, sampling)
        if len(padded_tokens) != self.limits.bucket_for(true_length):
            raise ValueError(f"prompt padded to {len(padded_tokens)}, not its bucket")
        self.calls.append(("prefill", tuple(padded_tokens[:true_length])))
        first = (int(padded_tokens[true_length - 1]) + 1) % self.vocab_size
        return MockPrefix(first, true_length, sampling), first

    def insert(self, prefix: MockPrefix, decode_state: MockState, slot: int) -> MockState:
        self._check(decode_state, slot)
        self.calls.append(("insert", slot))
        slots = dict(decode_state.slots)
        slots.pop(slot, None)
        if not finishes_at_first_token(prefix.next_token, prefix.sampling):
            slots[slot] = _Slot(prefix.next_token, prefix.length, 1, prefix.sampling)
        return self._replace(decode_state, slots)

    def generate(
        self, params: dict, decode_state: MockState, max_position: int | None = None
    ) -> tuple[MockState, ResultTokens]:
        self._check(decode_state)
        positions = [s.position for s in decode_state.slots.values()]
        if max_position is not None and positions and max(positions) > max_position:
            raise AssertionError(f"max_position={max_position} but a slot is at {max(positions)}")
        self.calls.append(("generate", max_position))
        if self.step_seconds:
            time.sleep(self.step_seconds)
        shape = (self.decode_steps_per_call, self.limits.max_concurrent_decodes)
        tokens, valid, done = np.zeros(shape, np.int32), np.zeros(shape, bool), np.zeros(shape, bool)
        slots = {i: _Slot(s.token, s.position, s.generated, s.sampling) for i, s in decode_state.slots.items()}
        for step in range(self.decode_steps_per_call):
            for index, s in list(slots.items()):
                s.token = self.next_token(s.token, s.sampling)
                s.generated += 1
                tokens[step, index], valid[step, index] = s.token, True
                done[step, index] = self._finished(s.token, s.generated, s.position, s.sampling)
                s.position += 1
                if done[step, index]:
                    del slots[index]
        return self._replace(decode_state, slots), ResultTokens(tokens, valid, done)

    def free_resource(self, decode_state: MockState, slot: int) -> MockState:
        self._check(decode_state, slot)
        self.calls.append(("free_resource", slot))
        return self._replace(decode_state, {i: s for i, s in decode_state.slots.items() if i != slot})

    # -- contract checks -----------------------------------------------------------------------

    def _check(self, state: MockState, slot: int | None = None) -> None:
        if state.replaced:
            raise AssertionError("a decode state was used after a call replaced it")
        if slot is not None and not 0 <= slot < self.limits.max_concurrent_decodes:
            raise AssertionError(f"slot {slot} out of range")

    @staticmethod
    def _replace(state: MockState, slots: dict[int, _Slot]) -> MockState:
        state.replaced = True
        return MockState(slots)
