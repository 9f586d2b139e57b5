"""Decide, in plain Python: which waiting request goes into which slot, which prompt chunks to
prefill, which pages of the KV cache each sequence holds, which slots to free, and what to decode.
The device loop asks for a `StepPlan` (serving.orchestrator.plan) each turn and hands it to the
executor; on a multi-host slice that plan is what the leader sends to every host.

The scheduler owns the KV cache's memory (serving.orchestrator.pages): a sequence holds pages as
it grows, and every plan carries the block tables it changed. Each turn:
a. the slots of cancelled requests are freed (running or still prefilling), and their pages;
b. waiting requests take free slots, the lowest first. n > 1 choices are n prefilling slots,
   each its choice's seed: with the prefix cache the first computes the prompt's pages and the
   others find them cached (waiting for those on their way); without it each computes its own.
   Every request becomes prefilling slots; with the prefix cache on, the longest run of its
   prompt's full pages found cached goes into its table as they are (shared, not copied), leaving
   at least one prompt token to compute, whose logits give the first token (a request for the
   prompt's logprobs reads no cached page: every position is scored). A request whose next
   uncached page another prefilling slot is about to compute (the same system prompt, sent by
   several clients at once) waits in its slot, computing nothing, until that page is registered or
   no longer coming; then it looks up again and goes on;
c. every running sequence takes the pages its next decode call writes, oldest first; when none
   are free, the newest sequence holding pages (running or prefilling) is preempted: its pages
   are freed and it prefills again from the start, its prompt now the prompt and the tokens it
   already streamed, and its final chunk samples its next token (so its stream neither repeats
   nor loses one). A sequence that would preempt only itself waits;
d. one `prefill_slots` call: the next chunk of each prefilling slot holding its pages, oldest
   admission first. A prompt takes the pages of its whole prompt (and its first decode call) when
   it starts, if they are free (leaving free the pages the running sequences grow into over their
   next GROWTH_HORIZON positions), so a prompt once started never waits half computed, holding
   pages; a newer prompt whose pages are free starts before an older one whose are not, until that
   one has waited STARVED_TURNS. The rows fit `max_prefill_batch` and rows x bucket of the longest
   chunk fits `prefill_batch_tokens` (the oldest always goes; chunks within the bucket already chosen
   before ones that would widen it); rows start all at 0 or all after it, as the first row does;
   a chunk that scores the prompt (its request wants the prompt's logprobs) goes alone. A
   row that reaches its prompt's end is final: its slot decodes from this turn. Each full prompt
   page it completes is registered under its key;
e. one generate call over the decoding slots, padded to the smallest slot bucket holding their
   count (`Limits.decode_rows`); with a
   speculator (serving.orchestrator.proposers) that proposes tokens for some slot, a verify call
   of those proposals instead (no grammar running).

The scheduler keeps the host mirror of every slot's position, so that no decision (nor the
attention window the engine reads) needs a value read back from the device.

A request under a grammar brings one matcher per choice (serving.structured), which its records
hold: its final prompt row (or its admission, n > 1) carries the first token's mask; while any
running slot has one, each generate call is one step with every slot's mask in the plan (plain
numpy, from the matchers, which `update` advances with each token), and a turn whose prefill
samples such a request's first token runs no generate call (its next mask depends on that token).
Preempted, it keeps its matcher, and its final row carries the mask of the token it resumes at.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from serving.engine.api import PrefillRow
from serving.engine.limits import Limits
from serving.orchestrator.pages import PagePool
from serving.orchestrator.plan import StepOutcome, StepPlan, Waiting
from serving.orchestrator.prefix_cache import adapter_salt, block_keys
from serving.orchestrator.proposers import Speculator
from serving.request import SamplingParams

__all__ = ["Scheduler", "StepOutcome", "StepPlan", "Waiting"]

log = logging.getLogger(__name__)

# Positions of growth past the next decode call that the running sequences' pages are kept free
# for: prompts (and new requests) take only the rest. One page per running sequence (what it was)
# kept ~1 page in 6 of the mixed benchmark's pool unused; this horizon holds what 8 calls of 2
# steps write. loadtest.paged_bench's mixed requests, scheduled on the mock engine (64-position
# pages, prompts then taking a chunk's pages at a time): most sequences decoding at once 39 -> 46,
# mean 17.7 -> 18.3, 1 preemption (of a prompt not yet computed); a horizon of 8: 47, 7 preemptions
# recomputing 2% more prompt tokens. Since prompts take their whole prompt's pages, in pages of 32:
# 50 at most, 4 preemptions (8: 50, 10).
GROWTH_HORIZON = 16

# Turns a prompt may wait for its pages while newer (shorter) prompts whose pages are free start
# before it; past them, no newer prompt starts until it has. The mixed
# benchmark's longest wait without this bound was ~120 turns; 64 leaves its most sequences
# decoding at once unchanged.
STARVED_TURNS = 64


BURST_DEFERRALS = 4  # turns in a row a burst's prefill may hold its first sequences' decoding back

@dataclass
class _Running:
    request_id: int
    position: int  # where the slot's next fed token is written: prompt + tokens generated - 1
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    grammar: Any = None  # under a grammar: its matcher (serving.structured), advanced by `update`
    tokens: list[int] = field(default_factory=list)  # generated so far (kept for a preemption)
    unread: int = 0  # tokens of a call in flight (async scheduling: `project`), not in `tokens` yet

    @property
    def constrained(self) -> bool:
        """Under a grammar: its generate calls take masks, one step each."""
        return self.grammar is not None

    @property
    def finishing(self) -> bool:
        """Its call in flight reaches max_tokens: it ends there whatever the tokens are, so the
        next plan does not decode it (the device has stopped it)."""
        return self.unread > 0 and len(self.tokens) + self.unread >= self.sampling.max_tokens


@dataclass
class _Prefilling:
    """A slot whose prompt enters chunk by chunk (not decoding yet)."""

    request_id: int
    prompt_ids: tuple[int, ...]  # after a preemption: the prompt and the tokens generated
    sampling: SamplingParams
    computed: int = 0  # prompt positions the slot holds: cached pages found, then chunks written
    keys: tuple[bytes, ...] = ()  # the block key of each full page of the prompt (prefix cache on)
    checked: int = 0  # full pages below this one were found cached or registered
    waits: bool = False  # for a page another prefilling slot will register (nothing found yet)
    turns_waited: int = 0  # turns it could not start: its pages not free, or behind a starved prompt
    generated: tuple[int, ...] = ()  # tokens it had generated when it was preempted
    original: int = 0  # the request's own prompt length
    grammar: Any = None  # under a grammar: its matcher, whose mask its final row carries

    @property
    def scores(self) -> bool:
        """Its request wants the prompt's logprobs, not yet delivered: every position is computed
        (no cached page read) and scored, each chunk alone in its call."""
        return self.sampling.prompt_logprobs is not None and not self.generated


@dataclass
class Scheduler:
    """Slots, pages and their requests, first come first served. `prefix_caching`: full prompt
    pages are registered and looked up (off: no sharing)."""

    limits: Limits
    decode_steps_per_call: int
    prefix_caching: bool = False
    speculator: Speculator | None = None  # speculative decoding's proposals (None: off)
    # A disaggregated server (serving.orchestrator.disaggregated): each final row's prompt pages are
    # handed from the prefill engine to the generate engine (`StepPlan.handoffs`)
    handoffs: bool = False
    # A burst's prompts prefill before any of it decodes: while a turn prefills and more prompts wait
    # for the next, and the burst (sequences with only their first token, prompts whose rest fits
    # a chunk) is at least as many as the sequences that decoded before it, the turn runs no
    # generate call (at most BURST_DEFERRALS turns in a row; `_defers`). Its sequences then decode
    # in step and end in the same call, where a burst whose rows took several prefill calls decoded
    # in groups a call apart, each group's last calls short of rows (TPU profile: on with
    # admission_wait_ms; the orchestrator passes it).
    burst_first: bool = False
    running: dict[int, _Running] = field(default_factory=dict)  # slot -> its request, decoding
    prefilling: dict[int, _Prefilling] = field(default_factory=dict)  # slot -> its request, in admission order
    preemptions: int = 0  # sequences preempted so far
    _free: list[int] = field(default_factory=list)  # a heap: the lowest free slot first
    pool: PagePool = field(init=False)
    tables: dict[int, list[int]] = field(default_factory=dict)  # slot -> the pages it holds, in order
    _changed: set[int] = field(default_factory=set)  # slots whose table changed this turn
    _order: dict[int, int] = field(default_factory=dict)  # slot -> when its sequence took pages (newest last)
    _clock: itertools.count = field(default_factory=itertools.count)
    _decoding: tuple[int, ...] = ()  # the slots the last plan decodes
    _deferred: int = 0  # turns in a row that ran no generate call for a burst (`burst_first`)
    # request id -> its prompt's tokens found in the prefix cache when it was admitted (OpenAI's
    # usage.prompt_tokens_details.cached_tokens), until the orchestrator takes them (`take_cached`)
    _cached: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._free = list(range(self.limits.max_concurrent_decodes))
        self.pool = PagePool(self.limits.num_pages)

    @property
    def page_size(self) -> int:
        return self.limits.page_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Slots held by a request (decoding or prefilling)."""
        return len(self.running) + len(self.prefilling)

    def slot_of(self, request_id: int) -> int | None:
        held = [*self.running.items(), *self.prefilling.items()]
        return next((s for s, r in held if r.request_id == request_id), None)

    def room(self, cancelled: Collection[int] = ()) -> int:
        """How many slots the next `schedule` can fill, once `cancelled` are freed (a waiting
        request takes `num_slots` of them): none while the pool has no page beyond what the running
        sequences grow into soon (`_headroom`: a request admitted then would hold a slot without a
        page), unless nothing runs."""
        cancelled_slots = self._cancelled_slots(cancelled)
        if self.running and not cancelled_slots and self.pool.num_free <= self._headroom():
            return 0
        return len(self._free) + len(cancelled_slots)

    def schedule(self, waiting: Sequence[Waiting], cancelled: Collection[int] = ()) -> StepPlan:
        """The next turn: free the slots of `cancelled` request ids, admit every `waiting` request
        (at most `room(cancelled)` slots in all) into the lowest free slots in order, grow the
        running sequences' pages (preempting the newest when none are free), prefill the next
        chunks, then decode if anything runs (a running request under a grammar: one step, with
        every slot's next-token mask from its matcher). The waiting requests' adapter loads go into
        the plan (written before anything prefills)."""
        needed = sum(w.num_slots for w in waiting)
        if needed > self.room(cancelled):
            raise ValueError(f"{needed} slots asked for, {self.room(cancelled)} free")
        self._changed = set()
        frees = self._cancelled_slots(cancelled)
        for slot in frees:
            self._release(slot)
        for request in waiting:
            if self.speculator is not None:
                for rid in (request.request_id, *request.choice_ids):
                    self.speculator.start(rid, request.prompt_ids, request.sampling)
            for choice in self._choices(request):
                self._admit_chunked(choice)
        running_before = len(self.running)
        preempted: list[int] = []
        for slot, entry in self.prefilling.items():
            if entry.waits:
                self._load(slot, entry)
        self._grow_running(preempted)
        rows = self._rows()
        self._advance(rows)
        running_before -= sum(1 for slot in preempted if slot not in self.running)
        # a sequence its call in flight ends (max_tokens) decodes no more: with every other one
        # ending too, no generate call at all (async scheduling would run one for nothing)
        decoding = {slot: r for slot, r in self.running.items() if not r.finishing}
        if self._defers(rows, decoding):
            decoding = {}
        self._decoding = tuple(decoding)
        steps, plan_masks = self.decode_steps_per_call if decoding else 0, None
        if any(r.constrained for r in self.running.values()):
            starting = [row.sampling for row in rows if row.final]
            steps = 0 if any(s.grammar is not None for s in starting) else 1
            plan_masks = self._masks() if steps else None
        decode_rows = self.limits.decode_rows(decoding) if steps else None
        proposals = None
        if steps and plan_masks is None and self.speculator is not None:
            slots = {slot: r.request_id for slot, r in self.running.items()}
            proposals = self.speculator.propose(slots, self.limits.max_concurrent_decodes)
            if proposals is not None:
                steps = self.speculator.k + 1
        tables = tuple((slot, tuple(self.tables.get(slot, ()))) for slot in sorted(self._changed))
        handoffs = ()
        if self.handoffs:
            handoffs = tuple(
                (row.slot, tuple(self.tables[row.slot][: self._pages_for(row.start + len(row.tokens))]))
                for row in rows
                if row.final
            )
        return StepPlan(
            frees=frees,
            preempted=tuple(preempted),
            adapter_loads=tuple(w.adapter_load for w in waiting if w.adapter_load is not None),
            page_tables=tables,
            rows=tuple(rows),
            decode_steps=steps,
            running=max(running_before, 0),
            max_position=max((r.position for r in decoding.values()), default=0),
            slots=decode_rows,
            masks=plan_masks,
            proposals=None if proposals is None else proposals.tokens,
            num_proposed=None if proposals is None else proposals.num_proposed,
            draft_rows=() if proposals is None else proposals.draft_rows,
            handoffs=handoffs,
        )

    # -- pages -----------------------------------------------------------------------------------

    @property
    def _ahead(self) -> int:
        """Positions one decode call may write past a sequence's position."""
        k = self.speculator.k + 1 if self.speculator is not None else 0
        return max(self.decode_steps_per_call, k)

    def _pages_for(self, positions: int) -> int:
        return -(-min(positions, self.limits.max_target_length) // self.page_size)

    def _grow(self, slot: int, positions: int, keep: int = 0) -> bool:
        """Give `slot` the pages that hold its positions [0, positions); False (taking none) when
        fewer than those and `keep` more are free."""
        table = self.tables.setdefault(slot, [])
        more = self._pages_for(positions) - len(table)
        if more <= 0:
            return True
        if self.pool.num_free - more < keep:
            return False
        pages = self.pool.take(more)
        if pages is None:
            return False
        if not table:
            self._order[slot] = next(self._clock)
        table.extend(pages)
        self._changed.add(slot)
        return True

    def _drop_pages(self, slot: int) -> None:
        table = self.tables.pop(slot, [])
        self._order.pop(slot, None)
        if table:
            self.pool.release(table)
            self._changed.add(slot)

    def _grow_running(self, preempted: list[int]) -> None:
        """Every running sequence's pages for its next decode call, oldest first; preempt the
        newest holders while some cannot grow."""
        for slot in sorted(self.running, key=lambda s: self._order.get(s, -1)):
            entry = self.running.get(slot)
            if entry is None:  # preempted meanwhile
                continue
            while not self._grow(slot, entry.position + self._ahead):
                victim = self._victim(exclude=slot)
                if victim is None:
                    self._preempt(slot, preempted)  # it cannot run this turn; it starts over later
                    break
                self._preempt(victim, preempted)

    def _headroom(self) -> int:
        """Pages the running sequences grow into over their next calls (`GROWTH_HORIZON` positions
        past the next call's, but not past a sequence's last position): kept free of new prompts,
        so that admitting one does not preempt a running sequence a few calls later."""
        total = 0
        for slot, entry in self.running.items():
            last = len(entry.prompt_ids) + entry.sampling.max_tokens  # no position reaches it
            reach = min(entry.position + self._ahead + GROWTH_HORIZON, max(last, entry.position + self._ahead))
            total += max(0, self._pages_for(reach) - len(self.tables.get(slot, ())))
        return total

    def _victim(self, exclude: int) -> int | None:
        """The newest sequence holding pages that may be preempted."""
        held = [s for s in self._order if s != exclude and self.tables.get(s)]
        return max(held, key=lambda s: self._order[s], default=None)

    def _preempt(self, slot: int, preempted: list[int]) -> None:
        """Free `slot`'s pages; its sequence prefills again from the start (prompt and generated
        tokens), keeping its slot and its device-side token history."""
        self.preemptions += 1
        self._drop_pages(slot)
        if slot in self.running:
            entry = self.running.pop(slot)
            generated = tuple(entry.tokens)
            original = len(entry.prompt_ids)
            # a preempted sequence goes before the prompts that came after it: first in order, and
            # starved from its first turn without pages (no newer prompt starts before it)
            redo = _Prefilling(
                entry.request_id, (*entry.prompt_ids, *generated), entry.sampling, generated=generated,
                original=original, turns_waited=STARVED_TURNS, grammar=entry.grammar,
            )
            self._keys_of(redo)
            self.prefilling = {slot: redo, **self.prefilling}
            preempted.append(slot)
        else:
            entry = self.prefilling[slot]
            entry.computed, entry.checked, entry.waits = 0, 0, False
            if not entry.generated:  # it computes its whole prompt now: none of it read from the cache
                self._cached[entry.request_id] = 0

    # -- prompts -----------------------------------------------------------------------------------

    @staticmethod
    def _choices(request: Waiting) -> list[Waiting]:
        """A request of n > 1 choices as n requests of one, each its choice's seed, id and matcher:
        with the prefix cache the first computes the prompt, the others find its pages cached
        (waiting for those it is about to compute) and compute the last, partial page and their own
        first token; without it each computes the whole prompt."""
        if not request.choice_ids:
            return [request]
        sampling = request.sampling
        return [
            Waiting(
                rid, request.prompt_ids, replace(sampling, n=1, seed=sampling.choice_seed(choice)),
                grammars=request.grammars[choice : choice + 1],
            )
            for choice, rid in enumerate((request.request_id, *request.choice_ids))
        ]

    def _admit_chunked(self, request: Waiting) -> None:
        """A prefilling slot, with its prompt's cached pages, if any are."""
        if request.choice_ids:
            raise ValueError("a request with choices is admitted as one request a choice (_choices)")
        slot = heapq.heappop(self._free)
        entry = _Prefilling(
            request.request_id, request.prompt_ids, request.sampling, original=len(request.prompt_ids),
            grammar=request.grammars[0] if request.grammars else None,
        )
        self._keys_of(entry)
        self.prefilling[slot] = entry
        self._load(slot, entry)

    def _keys_of(self, entry: _Prefilling) -> None:
        if self.prefix_caching:
            salt = adapter_salt(entry.sampling.adapter, entry.sampling.lora_version)
            entry.keys = block_keys(entry.prompt_ids, self.page_size, salt)

    def _load(self, slot: int, entry: _Prefilling) -> None:
        """Put the cached run of a fresh slot's reusable pages into its table, or have it wait
        (`entry.waits`) while the first page past that run is on its way: another prefilling slot
        holds it, not computed or not registered yet. Counted as hits and misses once, when it
        loads."""
        if not self.prefix_caching or entry.computed or entry.scores:  # a scored prompt computes every position
            return
        reusable = entry.keys[: (len(entry.prompt_ids) - 1) // self.page_size]  # one token is left to compute
        cached = next((i for i, key in enumerate(reusable) if not self.pool.contains(key)), len(reusable))
        entry.waits = cached < len(reusable) and self._coming(reusable[cached], cached)
        if entry.waits:
            return
        found = self.pool.lookup(reusable)
        if found:
            self.tables[slot] = found
            self._order[slot] = next(self._clock)
            self._changed.add(slot)
        entry.computed, entry.checked = len(found) * self.page_size, len(found)
        if not entry.generated:  # the request's own prompt (not one a preemption made)
            self._cached[entry.request_id] = entry.computed

    def take_cached(self) -> dict[int, int]:
        """Request id -> prompt tokens read from the prefix cache, of the requests whose cached
        pages were looked up since the last call (each request once; a request for the prompt's
        logprobs reads none and is not in it)."""
        taken, self._cached = self._cached, {}
        return taken

    def _coming(self, key: bytes, index: int) -> bool:
        """Whether a prefilling slot (not waiting itself) will register page `index` under `key`."""
        return any(
            not e.waits and e.checked <= index < len(e.keys) and e.keys[index] == key for e in self.prefilling.values()
        )

    def _rows(self) -> list[PrefillRow]:
        """This turn's `prefill_slots` rows: the oldest prefilling slot's next chunk, then the next
        chunks of others (oldest first) within the call's row and padded-token budgets (a call
        after cached positions: `history_batch_tokens`), all starting at 0 or all after it, each
        holding its whole prompt's pages. Chunks that fit the
        length bucket of those already chosen go first, then the ones that would widen it: one
        longer chunk does not cut a call of short ones (a shared system prompt's questions) to
        fewer rows at the same padded cost."""
        limits = self.limits
        candidates: list[tuple[int, _Prefilling, tuple[int, ...]]] = []  # oldest first
        fresh = None
        # The pages the running sequences grow into soon stay free (`_headroom`): prompts do not
        # take them (which would preempt the running ones, or the prompt itself).
        headroom = self._headroom()
        starved = False  # a prompt has waited STARVED_TURNS for its pages: no newer prompt starts
        for slot, entry in self.prefilling.items():
            if entry.waits:
                continue
            chunk = entry.prompt_ids[entry.computed : entry.computed + limits.prefill_chunk_size]
            whole = len(entry.prompt_ids) + self._ahead
            started = len(self.tables.get(slot, ())) >= self._pages_for(whole)
            if not started and (starved or not self._grow(slot, whole, keep=headroom)):
                entry.turns_waited += 1  # its pages are not free, or it is behind a starved prompt
                starved = starved or entry.turns_waited > STARVED_TURNS
                continue
            # A prompt that took its pages goes on next turn if this call's rows start elsewhere
            # (taking them now, while free, measured more sequences at once than waiting for a row)
            if fresh is None:
                fresh = entry.computed == 0
            elif (entry.computed == 0) != fresh:
                continue
            candidates.append((slot, entry, chunk))
        if not candidates:
            self._unstick()
            return []
        chosen, bucket = [0], limits.bucket_for(len(candidates[0][2]))  # the oldest always goes
        budget = limits.batch_tokens(candidates[0][1].computed)  # all start at 0, or all after it
        for widening in (False, True):
            for i, (_, entry, chunk) in enumerate(candidates):
                if len(chosen) == limits.max_prefill_batch or candidates[0][1].scores:  # a scored chunk goes alone
                    break
                need = limits.bucket_for(len(chunk))
                if i in chosen or entry.scores or (need > bucket and not widening):
                    continue
                # the padded call (rows to their bucket) within the budget: the shape warmup compiled
                if limits.padded_rows(len(chosen) + 1) * max(bucket, need) <= budget:
                    chosen.append(i)
                    bucket = max(bucket, need)
        return [
            self._row(slot, entry, chunk) for slot, entry, chunk in (candidates[i] for i in sorted(chosen))
        ]

    @staticmethod
    def _row(slot: int, entry: _Prefilling, chunk: tuple[int, ...]) -> PrefillRow:
        """A prefilling entry's next chunk as a row; a fresh prompt's final row under a repetition
        penalty carries the whole prompt (the penalty reads every prompt token, cached ones too),
        and a final row under a grammar its matcher's mask for the token it samples."""
        final = entry.computed + len(chunk) == len(entry.prompt_ids)
        carries = final and not entry.generated and entry.sampling.repetition_penalty != 1
        after = entry.computed + len(chunk)
        return PrefillRow(
            slot, chunk, entry.computed, final, entry.sampling, len(entry.generated),
            prompt_ids=entry.prompt_ids if carries else (),
            mask=entry.grammar.mask() if final and entry.grammar is not None else None,
            score=entry.scores, score_next=entry.prompt_ids[after] if entry.scores and not final else -1,
        )

    def _unstick(self) -> None:
        """Nothing decodes and no prompt could start: the oldest prompt's pages are not free while
        newer prompts hold cached prefix pages and wait (their own pages not free, or behind the
        oldest once it is starved). Preempt the newest holder but the oldest prompt (its pages go
        back to the pool, still cached), so that the oldest can start next turn."""
        if self.running or not self.prefilling:
            return
        oldest = next((s for s, e in self.prefilling.items() if not e.waits), None)
        holders = [s for s in self.prefilling if s != oldest and self.tables.get(s)]
        if holders:
            self._preempt(max(holders, key=lambda s: self._order[s]), [])

    def _advance(self, rows: Sequence[PrefillRow]) -> None:
        """Record the rows as computed (a final row's slot decodes from now), registering each
        full prompt page they complete."""
        for row in rows:
            entry = self.prefilling[row.slot]
            entry.computed += len(row.tokens)
            if self.prefix_caching:
                table = self.tables[row.slot]
                while entry.checked < len(entry.keys) and (entry.checked + 1) * self.page_size <= entry.computed:
                    self.pool.register(table[entry.checked], entry.keys[entry.checked])
                    entry.checked += 1
            if row.final:
                del self.prefilling[row.slot]
                self.running[row.slot] = _Running(
                    entry.request_id, entry.computed, entry.prompt_ids[: entry.original], entry.sampling,
                    tokens=list(entry.generated), grammar=entry.grammar,
                )

    def _masks(self) -> np.ndarray:
        """[slots, words]: each constrained slot's next-token mask from its matcher, every token
        allowed elsewhere."""
        masks = {slot: r.grammar.mask() for slot, r in self.running.items() if r.constrained}
        words = len(next(iter(masks.values())))
        out = np.full((self.limits.max_concurrent_decodes, words), -1, np.int32)
        for slot, mask in masks.items():
            out[slot] = mask
        return out

    # -- running one call ahead ------------------------------------------------------------------

    @property
    def young(self) -> bool:
        """Every sequence held has at most its first token: a burst is still coming in."""
        return all(len(r.tokens) + r.unread <= 1 for r in self.running.values())

    def _defers(self, rows: Sequence[PrefillRow], decoding: dict[int, _Running]) -> bool:
        """Whether this turn runs no generate call so that a burst prefills first (`burst_first`):
        it prefills, more prompts wait for a later call, and the burst (the sequences with only
        their first token, and the prompts whose rest fits one chunk, not waiting for pages) is at
        least as many as the sequences that decoded before it, which wait one prefill call a turn
        for it; none under a grammar, no speculator, BURST_DEFERRALS turns at most. (A wave of
        closed-loop clients, each sending its next request as its last one ends, arrives over tens
        of milliseconds: its first request admitted alone and decoding must not split the rest into
        groups a generate call apart. A long prompt going through its chunks is no burst: the
        sequences decoding beside it are not held back for it.)"""
        older = sum(1 for r in decoding.values() if len(r.tokens) + r.unread > 1)
        chunk = self.limits.prefill_chunk_size
        coming = sum(1 for e in self.prefilling.values() if not e.waits and len(e.prompt_ids) - e.computed <= chunk)
        burst = len(decoding) - older + coming
        defer = (
            self.burst_first and bool(rows) and bool(decoding) and bool(self.prefilling) and burst >= older
            and not any(r.constrained for r in decoding.values())
            and self.speculator is None and self._deferred < BURST_DEFERRALS
        )
        self._deferred = self._deferred + 1 if defer else 0
        return defer

    def runs_ahead(self) -> bool:
        """Whether the next plan may be made while this one's generate call is still on the device
        (`project`ed, its tokens not read): no decision of the next turn may need those tokens. So
        no speculator (proposals), no running slot under a grammar (its mask), and a free page for
        every page the running sequences take for their next call (no preemption: a preempted
        sequence's new prompt is its tokens so far). Requests it would admit do not change the
        answer (each goes in chunks, taking pages as it starts, within the headroom the running
        ones keep). The device runs the calls in order, so a slot that finished in the call
        in flight only decodes nothing in the next (its rows invalid, dropped by `update`)."""
        if self.speculator is not None:
            return False
        if any(r.constrained for r in self.running.values()):
            return False
        need = sum(
            max(0, self._pages_for(r.position + self._ahead) - len(self.tables.get(slot, ())))
            for slot, r in self.running.items()
        )
        return need <= self.pool.num_free

    def project(self, plan: StepPlan) -> dict[int, int]:
        """The plan (the last one scheduled) has its generate call in flight: each slot it decodes
        moves past its decode steps as if each step were valid, and counts them (and a first token
        its plan sampled) as unread, so that the next plan (its pages, its window, who still
        decodes) can be made before the tokens are read; `update` with the returned slot -> request
        id puts back what a slot did not decode."""
        firsts = set(plan.first_token_slots)
        projected = {}
        for slot in self._decoding:
            entry = self.running[slot]
            entry.position += plan.decode_steps
            entry.unread += plan.decode_steps + (slot in firsts)
            projected[slot] = entry.request_id
        return projected

    # -- results -----------------------------------------------------------------------------------

    def update(
        self, plan: StepPlan, outcome: StepOutcome, projected: Mapping[int, int] | None = None
    ) -> list[tuple[int, int]]:
        """Record what the plan did; returns (request_id, slot) of every slot that finished.
        `projected`: what `project` returned for this plan (its positions moved already; the plans
        made since may have freed a slot of it, even given it to another request: such a slot's
        tokens are not its request's any more and are dropped)."""
        finished = []
        if self.speculator is not None:
            self._record_tokens(plan, outcome)

        def mine(slot: int) -> _Running | None:
            entry = self.running.get(slot)
            if projected is not None and (entry is None or projected.get(slot) != entry.request_id):
                return None
            return entry

        for slot, first in zip(plan.first_token_slots, outcome.first_tokens, strict=True):
            running = mine(slot) if projected is not None else self.running[slot]
            if running is None:
                continue
            running.tokens.append(first)
            _advance_grammar(running, first)
            if first in running.sampling.stop_ids or len(running.tokens) >= running.sampling.max_tokens:
                finished.append((running.request_id, slot))
                self._release(slot)
        decoded: dict[int, int] = {}
        for step_tokens, step_valid, step_done in zip(outcome.tokens, outcome.valid, outcome.done, strict=True):
            for slot in list(self.running):
                running = mine(slot)
                if running is None:
                    continue
                if step_valid[slot]:
                    decoded[slot] = decoded.get(slot, 0) + 1
                    running.tokens.append(step_tokens[slot])
                    _advance_grammar(running, step_tokens[slot])
                if step_done[slot]:
                    finished.append((running.request_id, slot))
                    self._release(slot)
        for slot, count in decoded.items():
            if projected is None and slot in self.running:
                self.running[slot].position += count
        if projected is not None:  # the steps a slot did not decode (it is still running: none did)
            firsts = set(plan.first_token_slots)
            for slot in projected:
                if (running := mine(slot)) is not None:
                    running.position -= plan.decode_steps - decoded.get(slot, 0)
                    running.unread -= plan.decode_steps + (slot in firsts)
        return finished

    def _record_tokens(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Every running request's new tokens (and its proposals' fate) into the speculator."""
        speculator = self.speculator
        for slot, first in zip(plan.first_token_slots, outcome.first_tokens, strict=True):
            speculator.emitted(self.running[slot].request_id, [first])
        for slot, running in self.running.items():
            emitted = [step[slot] for step, valid in zip(outcome.tokens, outcome.valid, strict=True) if valid[slot]]
            speculator.emitted(running.request_id, emitted)
            if plan.num_proposed is not None:
                speculator.verified(running.request_id, int(plan.num_proposed[slot]), len(emitted))

    def kv_tokens_used(self) -> int:
        """Cache positions holding live sequences (for the metrics; no device read)."""
        return sum(r.position for r in self.running.values()) + sum(p.computed for p in self.prefilling.values())

    def _cancelled_slots(self, cancelled: Collection[int]) -> tuple[int, ...]:
        held = [*self.running.items(), *self.prefilling.items()]
        return tuple(sorted(s for s, r in held if r.request_id in cancelled))

    def _release(self, slot: int) -> None:
        entry = self.running.pop(slot, None)
        if entry is None:
            entry = self.prefilling.pop(slot, None)
        self._drop_pages(slot)
        if entry is not None and self.speculator is not None:
            self.speculator.finish(entry.request_id)
        heapq.heappush(self._free, slot)


def _advance_grammar(running: _Running, token: int) -> None:
    """A constrained request's matcher past `token` (the device sampled it under the mask; a refusal
    is logged, the stream goes on)."""
    if running.grammar is not None and not running.grammar.advance(token):
        log.warning("request %d: its grammar refused token %d", running.request_id, token)
