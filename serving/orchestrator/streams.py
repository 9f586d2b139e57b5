"""Per-request streams: the device loop puts token ids on a request's queue; whoever reads
`RequestHandle.stream()` (a thread) or `astream()` (asyncio) gets text deltas, detokenized off the
device thread, never splitting a UTF-8 character, with stop strings held back and cut.

As vLLM's detokenizer: a stop string ends the text before it, or after it with
`include_stop_str_in_output`, and is looked for only once more than `min_tokens` tokens came; the
stop token that ended a request (an end-of-sequence or a stop_token_ids token) adds no text unless
`include_stop_str_in_output`; special tokens are left out unless `skip_special_tokens` is false,
when `spaces_between_special_tokens` puts a space between each and its neighbours. A token
that comes with its logprobs (a `TokenLogprob`) travels with them into its delta; a request with
n > 1 choices is n requests (one stream each) admitted together, and one request in the metrics:
counted when the reader of its last choice takes its end (`ChoiceGroup`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from serving.orchestrator.metrics import SUCCESS_REASONS, EngineMetrics
from serving.request import SamplingParams, TokenLogprob
from serving.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from serving.orchestrator.orchestrator import Orchestrator

@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked


@dataclass
class Completion:
    """The final record of a request."""

    text: str
    token_ids: list[int]
    finish_reason: str  # stop, length or cancelled; or serving.errors' ENGINE_FAILED, ADAPTER_UNLOADED
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float
    token_times: list[float]  # seconds since submission, one per completion token
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # one per prompt token (echo)
    choice: int = 0  # which of the request's n choices
    cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed


@dataclass(frozen=True)
class PromptLogprobs:
    """The stream item carrying the prompt's logprobs (before any token)."""

    logprobs: tuple[TokenLogprob | None, ...]


END = object()


class LoopQueue:
    """Items put by the device thread, awaited on an asyncio event loop (no thread per reader)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is reading any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def put_many(self, items: list) -> None:
        """`put` of each item, in order, in one hand-over to the loop (one wake-up of its thread,
        not one per token of a generate call)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._put_all, items)

    def _put_all(self, items: list) -> None:
        for item in items:
            self._queue.put_nowait(item)

    async def get_ready(self) -> list:
        """The next item and every other one already there (a generate call's tokens arrive
        together: one delta, one wake-up of the reader, for all of them)."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items


class Answer:
    """A front-end's answer to one API request, written after its requests' last tokens are read
    (Orchestrator.answer_scope): until then they count as being answered."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.written = False


class ChoiceGroup:
    """The n choices of one request (each a `Request` with a reader of its own): the request ends,
    for the metrics, when its last choice does."""

    def __init__(self, n: int = 1):
        self._left = n
        self._completions: list[Completion] = []
        self._lock = threading.Lock()

    def end(self, completion: Completion) -> list[Completion] | None:
        """Record a choice's end: every choice's record, in choice order, when it was the last; else None."""
        with self._lock:
            self._completions.append(completion)
            self._left -= 1
            return sorted(self._completions, key=lambda c: c.choice) if self._left == 0 else None


# The answer being made in this context (an HTTP route's, set by its gate): the requests submitted
# in it are answered when it is written, not when their readers take their last token.
ANSWER: contextvars.ContextVar[Answer | None] = contextvars.ContextVar("pathserve_answer", default=None)


@dataclass
class Request:
    """A submitted request as the device loop and its reader share it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    stop_strings: tuple[str, ...]
    # ints, then (END, reason); a SimpleQueue for thread readers, a LoopQueue for asyncio readers
    tokens: queue.SimpleQueue | LoopQueue = field(default_factory=queue.SimpleQueue)
    submitted: float = field(default_factory=time.perf_counter)
    dequeued: float = 0.0  # when the device loop took it from the queue into its slots (perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    request_id: int = field(default_factory=itertools.count().__next__)
    last_token: int | None = None  # the newest token put on the stream (the device loop's)
    choice: int = 0  # of sampling.n; the choices of one request are queued one after another
    grammar: Any = None  # a serving.structured matcher (the scheduler holds and advances it)
    ended: bool = False  # its end is on the stream (the device loop's): no token may follow
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (the device loop's, before any token)
    answer: Answer | None = None  # the front-end's answer it goes into (None: its reader answers)
    group: ChoiceGroup = field(default_factory=ChoiceGroup)  # its request's choices, shared by them

    def put(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Hand a token (with its logprobs, if asked) to the reader (device loop only)."""
        self.last_token = token
        self.tokens.put(token if logprob is None else logprob)

    def put_many(self, items: list) -> None:
        """Hand a generate call's tokens (ints, or TokenLogprobs where logprobs were asked) to the
        reader at once (device loop only)."""
        if not items:
            return
        last = items[-1]
        self.last_token = last if isinstance(last, int) else last.token
        if isinstance(self.tokens, LoopQueue):
            self.tokens.put_many(items)
        else:
            for item in items:
                self.tokens.put(item)


class _Assembler:
    """Turns a request's token items into text deltas: UTF-8 safe, stop strings held back and cut."""

    def __init__(self, request: Request, tokenizer: Tokenizer):
        self.request = request
        sampling = request.sampling
        self.decoder = tokenizer.incremental_decoder(sampling.skip_special_tokens)
        self.tokenizer = tokenizer
        self.spaced = not sampling.skip_special_tokens and sampling.spaces_between_special_tokens
        self.after_special = False  # the last token shown was a special token (for `spaced`)
        self.text = ""
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if request.sampling.wants_logprobs else None
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self.times: list[float] = []
        self.emitted = 0  # characters of `text` already handed out
        self.emitted_ids = 0
        self.hold = max((len(s) for s in request.stop_strings), default=1) - 1
        self.reason = ""

    def feed(self, items: list) -> Delta | None:
        """The one delta these items make available (if any): the deltas they would make one by
        one, joined, so that each still ends on a whole character; sets `reason` when the request
        ended (items after a stop string are dropped)."""
        deltas = []
        for item in items:
            if self.reason:
                break
            if (delta := self._take(item)) is not None:
                deltas.append(delta)
        if len(deltas) < 2:
            return deltas[0] if deltas else None
        logprobs = None if deltas[0].logprobs is None else [lp for d in deltas for lp in d.logprobs]
        return Delta("".join(d.text for d in deltas), [i for d in deltas for i in d.token_ids], logprobs)

    def _take(self, item) -> Delta | None:
        """The delta one item makes available (if any)."""
        request = self.request
        if isinstance(item, tuple) and item[0] is END:
            self.reason = item[1]
            self.text += self.decoder.flush()
            return self._delta(len(self.text))
        if isinstance(item, PromptLogprobs):
            self.prompt_logprobs = item.logprobs
            return None
        if isinstance(item, TokenLogprob):
            if self.logprobs is not None:
                self.logprobs.append(item)
            item = item.token
        self.ids.append(item)
        self.times.append(time.perf_counter() - request.submitted)
        self.text += self._text_of(item)
        sampling = request.sampling
        stop = _find_stop(self.text, request.stop_strings, self.emitted) if len(self.ids) > sampling.min_tokens else None
        if stop is not None:
            at, length = stop
            self.text = self.text[: at + length if sampling.include_stop_str_in_output else at]
            self.reason = "stop"
            return self._delta(len(self.text))
        return self._delta(len(self.text) - self.hold if request.stop_strings else len(self.text))

    def _text_of(self, token: int) -> str:
        """The text a token adds: none for the stop token that ends the request (unless
        include_stop_str_in_output); with `spaced`, a space between a special token and its
        neighbours."""
        sampling = self.request.sampling
        if token in sampling.stop_ids and not sampling.include_stop_str_in_output:
            return ""  # the device stops at it (min_tokens masks it before)
        text = self.decoder.push(token)
        if not self.spaced or not text:
            return text
        special = self.tokenizer.is_special(token)
        space = " " if (special or self.after_special) and self.text else ""
        self.after_special = special
        return space + text

    def _delta(self, safe: int) -> Delta | None:
        if safe <= self.emitted:
            return None  # nothing new to show yet; its tokens travel with the next delta
        logprobs = None if self.logprobs is None else self.logprobs[self.emitted_ids :]
        delta = Delta(self.text[self.emitted : safe], self.ids[self.emitted_ids :], logprobs)
        self.emitted, self.emitted_ids = safe, len(self.ids)
        return delta

    def completion(self) -> Completion:
        return Completion(
            text=self.text,
            token_ids=self.ids,
            finish_reason=self.reason,
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=len(self.ids),
            time_to_first_token=self.times[0] if self.times else 0.0,
            token_times=self.times,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            choice=self.request.choice,
            cached_tokens=self.request.cached_tokens,
        )


class RequestHandle:
    """A submitted request: iterate `stream()` (threads) or `astream()` (asyncio, when submitted
    with `loop=`) for text deltas; `completion` afterwards."""

    def __init__(self, request: Request, tokenizer: Tokenizer, orchestrator: Orchestrator):
        self._request = request
        self._orchestrator = orchestrator
        self._assembler = _Assembler(request, tokenizer)
        self.completion: Completion | None = None

    @property
    def prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        """The prompt's logprobs once they arrived (they come before the first token)."""
        return self._assembler.prompt_logprobs

    @property
    def choice(self) -> int:
        return self._request.choice

    def cancel(self) -> None:
        """Stop generating (the client went away); the slot is freed at the next step."""
        self._request.cancelled.set()
        self._orchestrator.wake()

    def stream(self) -> Iterator[Delta]:
        """Text deltas as tokens arrive (the tokens already there in one delta); never splits a
        UTF-8 character; honours stop strings."""
        tokens = self._request.tokens
        if not isinstance(tokens, queue.SimpleQueue):
            raise TypeError("this request was submitted for asyncio: read it with astream()")
        while not self._assembler.reason:
            items = [tokens.get()]
            while not tokens.empty():
                items.append(tokens.get_nowait())
            delta = self._assembler.feed(items)
            if delta is not None:
                yield delta
        self._finish()

    async def astream(self) -> AsyncIterator[Delta]:
        """`stream()` for asyncio readers. Leaving early (the client went away) cancels the request."""
        tokens = self._request.tokens
        if not isinstance(tokens, LoopQueue):
            raise TypeError("this request was not submitted with loop=: read it with stream()")
        try:
            while not self._assembler.reason:
                delta = self._assembler.feed(await tokens.get_ready())
                if delta is not None:
                    yield delta
        finally:
            if not self._assembler.reason:
                self._assembler.reason = "cancelled"
            self._finish()

    def result(self) -> Completion:
        """Drain the stream and return the final record."""
        for _ in self.stream():
            pass
        if self.completion is None:
            raise RuntimeError("the stream ended without a final record")
        return self.completion

    def _finish(self) -> None:
        if self.completion is not None:
            return
        answer = self._request.answer
        if answer is None or answer.written:
            self._orchestrator.answered(self._request)
        if self._assembler.reason in ("stop", "cancelled") and not self._request.cancelled.is_set():
            self.cancel()  # a stop string or a reader that left: free the slot
        self.completion = self._assembler.completion()
        metrics = self._orchestrator.metrics
        metrics.choice_finished(self.completion.completion_tokens)
        choices = self._request.group.end(self.completion)
        if choices is not None:
            _request_finished(metrics, choices, time.perf_counter() - self._request.submitted)


def _request_finished(metrics: EngineMetrics, choices: list[Completion], seconds: float) -> None:
    """A request into the metrics once, when its last choice ended (`seconds` after its submission).
    Its finish reason: the first of its choices' that is not stop or length (cancelled, or an error:
    the request did not succeed), else its first choice's. Its time per output token: its choices'
    mean, each after its first token."""
    reasons = [c.finish_reason for c in choices]
    per_token = [
        (c.token_times[-1] - c.token_times[0]) / (len(c.token_times) - 1) for c in choices if len(c.token_times) > 1
    ]
    metrics.request_finished(
        next((r for r in reasons if r not in SUCCESS_REASONS), reasons[0]),
        choices[0].prompt_tokens,
        sum(c.completion_tokens for c in choices),
        seconds,
        sum(per_token) / len(per_token) if per_token else None,
    )


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, int] | None:
    """The first stop string in `text` that ends past `start`: (where it starts, its length)."""
    found = [(i, len(s)) for s in stops if (i := text.find(s, max(0, start - len(s)))) >= 0]
    return min(found) if found else None
