"""Decide, in plain Python: which waiting request goes into which slot, which prompt chunks to
prefill, which prefix blocks to reuse and keep, which slots to free, and what to decode. The device
loop asks for a `StepPlan` (serving.orchestrator.plan) each turn and hands it to the executor; on a
multi-host slice that plan is what the leader sends to every host.

Each turn:
a. the slots of cancelled requests are freed (running or still prefilling);
b. waiting requests take free slots, the lowest first (so the decode buckets stay small). A request
   that `prefills_whole` (n > 1 choices, logprobs, prompt logprobs, a grammar) is an `Admission`:
   one prefill, inserted into its n slots. Every other one becomes a prefilling slot; with the
   prefix cache on, the longest run of its prompt's blocks found cached is loaded into the slot
   first (leaving at least one prompt token to compute, whose logits give the first token). A
   request whose next uncached block another prefilling slot is about to compute and store (the
   same system prompt, sent by several clients at once) waits in its slot, computing nothing, until
   that block is stored or no longer coming; then it loads what is cached and goes on;
c. one `prefill_slots` call: the next chunk of each prefilling slot, oldest admission first, while
   the rows fit `max_prefill_batch` and rows x bucket of the longest chunk fits
   `prefill_batch_tokens` (the oldest always goes; chunks within the bucket already chosen before
   ones that would widen it); rows start all at 0 or all after it, as the first row does. A row
   that reaches its prompt's end is final: its slot decodes from this turn;
d. prefix cache: every block wholly computed and not cached yet is stored, evicting the least
   recently used blocks to stay within the budget;
e. one generate call over the smallest slot bucket holding every decoding slot; with a
   speculator (serving.orchestrator.proposers) that proposes tokens for some slot, a verify call
   of those proposals instead (no grammar running).

The scheduler keeps the host mirror of every slot's position, so that no decision (nor the
attention window the engine reads) needs a value read back from the device.

A request under a grammar brings its first token's mask; while any running slot has one, each
generate call is one step with every slot's mask in the plan (plain numpy, computed by the device
loop from the grammars' states), and a turn that admits such a request runs no generate call (its
next mask depends on the first token).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from serving.engine.api import PrefillRow
from serving.engine.limits import Limits, finishes_at_first_token, prefills_whole
from serving.orchestrator.plan import Admission, PrefixLoad, PrefixStore, StepOutcome, StepPlan, Waiting
from serving.orchestrator.prefix_cache import PrefixCache, adapter_salt, block_keys
from serving.orchestrator.proposers import Speculator
from serving.request import SamplingParams

__all__ = ["Admission", "PrefixLoad", "PrefixStore", "Scheduler", "StepOutcome", "StepPlan", "Waiting"]


@dataclass
class _Running:
    request_id: int
    position: int  # where the slot's next fed token is written: prompt + tokens generated - 1
    constrained: bool = False  # under a grammar: generate calls take masks


@dataclass
class _Prefilling:
    """A slot whose prompt enters chunk by chunk (not decoding yet)."""

    request_id: int
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    computed: int = 0  # prompt positions the slot holds: blocks loaded, then chunks written
    keys: tuple[bytes, ...] = ()  # the prompt's block keys (prefix cache on)
    checked: int = 0  # blocks below this one were loaded, stored, or found cached
    waits: bool = False  # for a block another prefilling slot will store (nothing loaded yet)


@dataclass
class Scheduler:
    """Slots and their requests, first come first served. `prefix_cache`: the index of kept
    prompt blocks (None: the prefix cache is off, no lookups nor stores)."""

    limits: Limits
    decode_steps_per_call: int
    prefix_cache: PrefixCache | None = None
    speculator: Speculator | None = None  # speculative decoding's proposals (None: off)
    running: dict[int, _Running] = field(default_factory=dict)  # slot -> its request, decoding
    prefilling: dict[int, _Prefilling] = field(default_factory=dict)  # slot -> its request, in admission order
    _free: list[int] = field(default_factory=list)  # a heap: the lowest free slot first

    def __post_init__(self) -> None:
        self._free = list(range(self.limits.max_concurrent_decodes))
        cache = self.prefix_cache
        if cache is not None and cache.block != self.limits.prefix_block:
            raise ValueError(f"prefix cache blocks of {cache.block} tokens, the engine's are {self.limits.prefix_block}")

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
        request takes `num_slots` of them)."""
        return len(self._free) + len(self._cancelled_slots(cancelled))

    def schedule(
        self,
        waiting: Sequence[Waiting],
        cancelled: Collection[int] = (),
        masks: Mapping[int, np.ndarray] | None = None,
    ) -> StepPlan:
        """The next turn: free the slots of `cancelled` request ids, admit every `waiting` request
        (at most `room(cancelled)` slots in all) into the lowest free slots in order, prefill the
        next chunks, then decode if anything runs. `masks`: request id -> int32 [words], the
        next-token mask of every running request under a grammar."""
        needed = sum(w.num_slots for w in waiting)
        if needed > self.room(cancelled):
            raise ValueError(f"{needed} slots asked for, {self.room(cancelled)} free")
        frees = self._cancelled_slots(cancelled)
        for slot in frees:
            self._release(slot)
        running_before = len(self.running)
        loads, admissions = [], []
        for slot, entry in self.prefilling.items():
            if entry.waits and (load := self._load(slot, entry)) is not None:
                loads.append(load)
        for request in waiting:
            if self.speculator is not None:
                for rid in (request.request_id, *request.choice_ids):
                    self.speculator.start(rid, request.prompt_ids, request.sampling)
            if prefills_whole(request.sampling):
                admissions.append(self._admit_whole(request))
            elif (load := self._admit_chunked(request)) is not None:
                loads.append(load)
        rows = self._rows()
        evictions, stores = self._advance(rows)
        steps, plan_masks = self.decode_steps_per_call if self.running else 0, None
        if any(r.constrained for r in self.running.values()):
            steps = 0 if any(a.sampling.grammar is not None for a in admissions) else 1
            plan_masks = self._masks(masks or {}) if steps else None
        num_slots = self.limits.decode_slots(max(self.running) + 1) if steps else None
        proposals = None
        if steps and plan_masks is None and self.speculator is not None:
            slots = {slot: r.request_id for slot, r in self.running.items()}
            proposals = self.speculator.propose(slots, self.limits.max_concurrent_decodes)
            if proposals is not None:
                steps = self.speculator.k + 1
        return StepPlan(
            frees=frees,
            loads=tuple(loads),
            admissions=tuple(admissions),
            rows=tuple(rows),
            evictions=evictions,
            stores=stores,
            decode_steps=steps,
            running=running_before,
            max_position=max((r.position for r in self.running.values()), default=0),
            num_slots=num_slots,
            masks=plan_masks,
            proposals=None if proposals is None else proposals.tokens,
            num_proposed=None if proposals is None else proposals.num_proposed,
            draft_rows=() if proposals is None else proposals.draft_rows,
        )

    def _cancelled_slots(self, cancelled: Collection[int]) -> tuple[int, ...]:
        held = [*self.running.items(), *self.prefilling.items()]
        return tuple(sorted(s for s, r in held if r.request_id in cancelled))

    def _admit_whole(self, request: Waiting) -> Admission:
        """Prefill + insert: the request's n slots decode from this turn."""
        slots = [heapq.heappop(self._free) for _ in range(request.num_slots)]
        constrained = request.sampling.grammar is not None
        for slot, rid in zip(slots, (request.request_id, *request.choice_ids), strict=True):
            self.running[slot] = _Running(rid, len(request.prompt_ids), constrained)
        return Admission(
            request.request_id,
            slots[0],
            tuple(self.limits.pad(list(request.prompt_ids))),
            len(request.prompt_ids),
            request.sampling,
            tuple(slots[1:]),
            request.mask,
        )

    def _admit_chunked(self, request: Waiting) -> PrefixLoad | None:
        """A prefilling slot; the load of its prompt's cached blocks, if any are."""
        if request.choice_ids or request.mask is not None:
            raise ValueError("a request with choices or a grammar takes the whole prefill")
        slot = heapq.heappop(self._free)
        entry = _Prefilling(request.request_id, request.prompt_ids, request.sampling)
        if self.prefix_cache is not None:
            salt = adapter_salt(request.sampling.adapter, request.sampling.lora_version)
            entry.keys = block_keys(request.prompt_ids, self.prefix_cache.block, salt)
        load = self._load(slot, entry)
        self.prefilling[slot] = entry
        return load

    def _load(self, slot: int, entry: _Prefilling) -> PrefixLoad | None:
        """Load the cached run of a fresh slot's reusable blocks, or have it wait (`entry.waits`)
        while the first block past that run is on its way: another prefilling slot holds it, not
        computed or not stored yet. Counted as hits and misses once, when it loads."""
        cache = self.prefix_cache
        if cache is None:
            return None
        reusable = entry.keys[: (len(entry.prompt_ids) - 1) // cache.block]  # one token is left to compute
        cached = next((i for i, key in enumerate(reusable) if key not in cache), len(reusable))
        entry.waits = cached < len(reusable) and self._coming(reusable[cached], cached)
        if entry.waits:
            return None
        found = cache.lookup(reusable)
        entry.computed, entry.checked = found * cache.block, found
        return PrefixLoad(slot, reusable[:found]) if found else None

    def _coming(self, key: bytes, index: int) -> bool:
        """Whether a prefilling slot (not waiting itself) will store block `index` under `key` (never
        past the budget's capacity: its chain would not fit)."""
        return index < self.prefix_cache.capacity and any(
            not e.waits and e.checked <= index < len(e.keys) and e.keys[index] == key for e in self.prefilling.values()
        )

    def _rows(self) -> list[PrefillRow]:
        """This turn's `prefill_slots` rows: the oldest prefilling slot's next chunk, then the next
        chunks of others (oldest first) within the call's row and padded-token budgets, all
        starting at 0 or all after it. Chunks that fit the length bucket of those already chosen
        go first, then the ones that would widen it: one longer chunk does not cut a call of short
        ones (a shared system prompt's questions) to fewer rows at the same padded cost."""
        limits = self.limits
        candidates: list[tuple[int, _Prefilling, tuple[int, ...]]] = []  # oldest first
        fresh = None
        for slot, entry in self.prefilling.items():
            if entry.waits:
                continue
            if fresh is None:
                fresh = entry.computed == 0
            elif (entry.computed == 0) != fresh:
                continue
            candidates.append((slot, entry, entry.prompt_ids[entry.computed : entry.computed + limits.prefill_chunk_size]))
        if not candidates:
            return []
        chosen, bucket = [0], limits.bucket_for(len(candidates[0][2]))  # the oldest always goes
        for widening in (False, True):
            for i, (_, _, chunk) in enumerate(candidates):
                if len(chosen) == limits.max_prefill_batch:
                    break
                need = limits.bucket_for(len(chunk))
                if i in chosen or (need > bucket and not widening):
                    continue
                if (len(chosen) + 1) * max(bucket, need) <= limits.prefill_batch_tokens:
                    chosen.append(i)
                    bucket = max(bucket, need)
        return [
            PrefillRow(slot, chunk, entry.computed, entry.computed + len(chunk) == len(entry.prompt_ids), entry.sampling)
            for slot, entry, chunk in (candidates[i] for i in sorted(chosen))
        ]

    def _advance(self, rows: Sequence[PrefillRow]) -> tuple[tuple[bytes, ...], tuple[PrefixStore, ...]]:
        """Record the rows as computed (a final row's slot decodes from now); returns the prefix
        cache's evictions and stores they bring."""
        evictions: list[bytes] = []
        stores: dict[bytes, PrefixStore] = {}
        for row in rows:
            entry = self.prefilling[row.slot]
            entry.computed += len(row.tokens)
            if self.prefix_cache is not None:
                self._plan_stores(row.slot, entry, evictions, stores)
            if row.final:
                del self.prefilling[row.slot]
                self.running[row.slot] = _Running(entry.request_id, entry.computed)
        return tuple(evictions), tuple(stores.values())

    def _plan_stores(
        self, slot: int, entry: _Prefilling, evictions: list[bytes], stores: dict[bytes, PrefixStore]
    ) -> None:
        """Store each block of `slot` now wholly computed and not cached; evicting a block stored
        earlier this turn drops that store instead (the executor evicts before it stores)."""
        cache = self.prefix_cache
        while entry.checked < len(entry.keys) and (entry.checked + 1) * cache.block <= entry.computed:
            key, start = entry.keys[entry.checked], entry.checked * cache.block
            entry.checked += 1
            if key in cache:
                continue
            evicted = cache.add(key, entry.keys[: entry.checked - 1])
            if evicted is None:
                entry.checked = len(entry.keys)  # the chain is cut: nothing after it could be found
                return
            for old in evicted:
                if stores.pop(old, None) is None:
                    evictions.append(old)
            stores[key] = PrefixStore(key, slot, start)

    def _masks(self, masks: Mapping[int, np.ndarray]) -> np.ndarray:
        """[slots, words]: each constrained slot's mask, every token allowed elsewhere."""
        if not masks:
            raise ValueError("slots under a grammar are running, but no masks were given")
        words = len(next(iter(masks.values())))
        out = np.full((self.limits.max_concurrent_decodes, words), -1, np.int32)
        for slot, r in self.running.items():
            if r.constrained:
                out[slot] = masks.get(r.request_id, -1)
        return out

    def update(self, plan: StepPlan, outcome: StepOutcome) -> list[tuple[int, int]]:
        """Record what the plan did; returns (request_id, slot) of every slot that finished."""
        finished = []
        if self.speculator is not None:
            self._record_tokens(plan, outcome)
        firsts = zip(plan.first_token_slots, plan.first_token_samplings, outcome.first_tokens, strict=True)
        for slot, sampling, first in firsts:
            if finishes_at_first_token(first, sampling):
                finished.append((self.running[slot].request_id, slot))
                self._release(slot)
        for step_valid, step_done in zip(outcome.valid, outcome.done, strict=True):
            for slot, running in list(self.running.items()):
                if step_valid[slot]:
                    running.position += 1
                if step_done[slot]:
                    finished.append((running.request_id, slot))
                    self._release(slot)
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

    def _release(self, slot: int) -> None:
        entry = self.running.pop(slot, None)
        if entry is None:
            entry = self.prefilling.pop(slot)
        if self.speculator is not None:
            self.speculator.finish(entry.request_id)
        heapq.heappush(self._free, slot)
