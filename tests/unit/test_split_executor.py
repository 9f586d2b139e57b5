"""A disaggregated server's two process groups (serving.orchestrator.split.SplitExecutor), each
side's executor on a mock engine, in two threads of this process: the orchestrator drives the
prefill side (process 0) and every plan also goes to the generate side (process 1), as the lockstep
broadcasts it; what crosses between them goes through a link of queues with the `Link`'s contract
(serving.orchestrator.transfer; the real one, over `jax.experimental.transfer`, runs in
tests/multihost/test_disaggregated_groups.py). Tokens equal the mock's rule; each engine makes
only its side's calls; each prompt is moved once to the slot the scheduler chose; a preempted
sequence's state goes back; a cancelled prompt's slot is freed on both sides."""

from __future__ import annotations

import queue
import threading
from collections import defaultdict

import pytest

from serving.config import OrchestratorConfig
from serving.engine.mock import MockEngine
from serving.orchestrator import Orchestrator
from serving.orchestrator.split import SplitExecutor
from serving.orchestrator.transfer import ProcessGroups
from serving.request import SamplingParams
from tests.unit.test_disaggregation import TOKENIZER, _calls, _requests


class QueueLink:
    """Two processes' links in one: a move's tree goes into a queue keyed by (move, receiver)."""

    def __init__(self, groups: ProcessGroups, hub: defaultdict):
        self.groups, self.hub = groups, hub
        self.moves, self.bytes_received = 0, 0

    def move(self, tree, senders, receivers):
        move, me = self.moves, self.groups.me
        self.moves += 1
        if me in senders:
            for receiver in receivers:
                self.hub[(move, receiver)].put(tree)
            return None
        return self.hub[(move, me)].get(timeout=10) if me in receivers else None

    def tell(self, value, sender, receiver):
        return self.move(value, (sender,), (receiver,))

    def meet(self) -> None:  # the threads meet at the queues already: one side waits for the other's moves
        pass


class Broadcasting:
    """Process 0's executor: each plan to the generate side's thread too, then run here."""

    def __init__(self, executor: SplitExecutor, plans: queue.Queue):
        self.executor, self.plans = executor, plans

    timings = property(lambda self: self.executor.timings)
    background_warmup = property(lambda self: self.executor.background_warmup)

    def run(self, plan, on_first_token=None):
        self.plans.put(plan)
        return self.executor.run(plan, on_first_token=on_first_token)

    def idle(self) -> None:
        self.executor.idle()

    def close(self) -> None:
        self.executor.close()
        self.plans.put(None)


class Pair:
    def __init__(self, slots: int = 4, cache: str = "on", **engine):
        engine = {"slots": slots, "max_prefill_length": 64, "max_target_length": 512, "prefix_block": 16, **engine}
        self.prefill, self.generate = MockEngine(**engine), MockEngine(**engine)
        hub: defaultdict = defaultdict(queue.Queue)
        self.generate_side = SplitExecutor(self.generate, {}, QueueLink(ProcessGroups((0,), (1,), 1), hub))
        self.plans: queue.Queue = queue.Queue()
        self.prefill_side: SplitExecutor | None = None
        self.errors: list[BaseException] = []

        def make_executor(engine, params, adapter_weights):
            self.prefill_side = SplitExecutor(engine, params, QueueLink(ProcessGroups((0,), (1,), 0), hub))
            return Broadcasting(self.prefill_side, self.plans)

        config = OrchestratorConfig(max_queued_requests=64, prefix_cache=cache, disaggregated=True)
        self.orchestrator = Orchestrator(self.prefill, {}, TOKENIZER, config, make_executor)
        self.follower = threading.Thread(target=self._follow, daemon=True)

    def _follow(self) -> None:
        try:
            while (plan := self.plans.get()) is not None:
                self.generate_side.run(plan)
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)

    def start(self) -> Pair:
        self.follower.start()
        self.orchestrator.start()
        return self

    def stop(self) -> None:
        self.orchestrator.stop(timeout=10)
        self.follower.join(timeout=10)
        assert not self.follower.is_alive() and not self.errors, self.errors


@pytest.mark.parametrize("cache", ["on", "off"])
def test_each_side_makes_its_own_calls_and_the_tokens_are_the_rule(cache):
    pair = Pair(cache=cache, prefill_chunk_size=32)
    requests = _requests()
    handles = [pair.orchestrator.submit(p, s) for p, s in requests]  # 12 requests, 4 slots
    pair.start()
    try:
        got = [h.result().token_ids for h in handles]
    finally:
        pair.stop()
    prefill, generate = pair.prefill, pair.generate
    assert got == [generate.expected(p, s) for p, s in requests]
    assert _calls(prefill, "prefill_slots") and not _calls(generate, "prefill_slots")
    assert not _calls(prefill, "prefill") and not _calls(generate, "prefill")  # no whole prompt: every one in chunks
    assert _calls(prefill, "prefill_slots_scored") and not _calls(generate, "prefill_slots_scored")  # a scored prompt
    assert _calls(generate, "generate") and not _calls(prefill, "generate")
    # each chunked prompt moved once, from the slot it prefilled in to the same slot, with its pages
    handed, accepted = _calls(prefill, "handoff"), _calls(generate, "accept")
    assert len(handed) == len(accepted) == len(requests)
    assert [c[1:] for c in handed] == [c[1:] for c in accepted]
    assert not _calls(generate, "receive")  # no whole prefix to move
    assert pair.prefill_side.link.moves == pair.generate_side.link.moves  # every process counts each move
    if cache == "on":  # the shared system prompt's pages were read from the prefill side's pool
        assert any(start > 0 for call in _calls(prefill, "prefill_slots") for _, start, _, _ in call[1])


def test_a_preempted_sequence_goes_back_to_the_prefill_side_and_is_moved_again():
    pair = Pair(slots=2, max_prefill_length=16, max_target_length=64, prefix_block=4, num_pages=17)
    requests = [([5 + i] * 8, SamplingParams(max_tokens=50)) for i in range(2)]
    handles = [pair.orchestrator.submit(p, s) for p, s in requests]
    pair.start()
    try:
        streams = [[t for delta in h.stream() for t in delta.token_ids] for h in handles]
    finally:
        pair.stop()
    prefill, generate = pair.prefill, pair.generate
    assert streams == [generate.expected(p, s) for p, s in requests]
    assert pair.orchestrator.metrics.preemptions > 0
    back = [c for c in _calls(generate, "handoff") if c[2] == ()]  # state only, no pages
    assert back and len(back) == len([c for c in _calls(prefill, "accept") if c[2] == ()])
    assert len(_calls(prefill, "handoff")) == len(requests) + len(back)  # each recompute moved again


def test_a_cancelled_prompt_frees_its_slot_on_both_sides():
    pair = Pair(slots=1, step_seconds=0.01).start()
    try:
        long = pair.orchestrator.submit([1, 2, 3], SamplingParams(max_tokens=400))
        next(iter(long.stream()))  # decoding on the generate side
        long.cancel()
        short = pair.orchestrator.submit([4, 5], SamplingParams(max_tokens=3))  # the one slot again
        assert short.result().token_ids == pair.generate.expected([4, 5], SamplingParams(max_tokens=3))
    finally:
        pair.stop()
    # the prefill side frees a slot at each handoff too: one more free there is the cancellation's
    handoffs = len(_calls(pair.prefill, "handoff"))
    assert pair.prefill.calls.count(("free_resource", 0)) > handoffs
    assert ("free_resource", 0) in pair.generate.calls
