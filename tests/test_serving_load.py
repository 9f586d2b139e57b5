"""Serving under load with the real engine on a tiny model (issue 20): batched and chunked prefill,
the prefix cache and decode slot buckets change how a prompt gets into its slot and how many slots
a generate call computes, never a token. Every configuration below gives the plain loop's greedy
tokens (tests/reference.py), for prompts past max_prefill_predict_length too.

(The scheduler's decisions themselves are unit-tested on the mock engine: tests/unit.)
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from serving.checkpoints.model_source import load_model
from serving.config import OrchestratorConfig, ServingConfig
from serving.engine.engine import Engine
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams
from tests.conftest import DATA
from tests.reference import ReferenceDecoder

MAX_PREFILL = 64
MAX_TARGET = 128
SHARED = 40  # tokens of a prefix several prompts share (a system prompt)
LENGTHS = [3, 9, 17, 30, 47, 64, 65, 100, 108, 90, 5, 12, 33, 70, 40, 20]


def _prompts(tokenizer) -> list[list[int]]:
    """16 prompts of mixed lengths (three past MAX_PREFILL by a chunk or more); every third one
    starts with the same SHARED tokens."""
    ids = tokenizer.encode((DATA / "english.txt").read_text()) * 8  # long enough for every cut
    shared = ids[333 : 333 + SHARED]
    out = []
    for i, n in enumerate(LENGTHS):
        own = ids[i * 97 : i * 97 + n]
        out.append((shared + own)[: max(n, SHARED + 2)] if i % 3 == 0 else own)
    return out


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(str(tiny_model_dir), _config())


@pytest.fixture(scope="module")
def reference(model):
    """The plain loop (its own limits: whole prompts of any length that fits)."""
    return ReferenceDecoder(model, _config(max_prefill_predict_length=MAX_TARGET))


@pytest.fixture(scope="module")
def expected(model, reference):
    """The plain loop's greedy tokens for every prompt."""
    return [reference.generate(p, _sampling(i)).token_ids for i, p in enumerate(_prompts(model.tokenizer))]


def _config(**overrides) -> ServingConfig:
    values = dict(
        per_device_batch_size=8,
        max_prefill_predict_length=MAX_PREFILL,
        max_target_length=MAX_TARGET,
        decode_steps_per_call=2,
        prefix_block_size=16,
    )
    return ServingConfig(**{**values, **overrides})


def _sampling(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=6 + (i % 5) * 3)


class _Spy:
    """Records what the real engine was asked: how many slots each generate call computed,
    prefill_slots' rows and starts (no behaviour of its own)."""

    def __init__(self, engine: Engine):
        self.num_slots: list[int] = []
        self.rows: list[int] = []
        self.starts: list[int] = []
        generate, prefill_slots = engine.generate, engine.prefill_slots

        def spy_generate(*args, slots=None, **kwargs):
            self.num_slots.append(len(slots))
            return generate(*args, slots=slots, **kwargs)

        def spy_prefill_slots(params, state, rows):
            self.rows.append(len(rows))
            self.starts.extend(r.start for r in rows)
            return prefill_slots(params, state, rows)

        engine.generate, engine.prefill_slots = spy_generate, spy_prefill_slots


def _serve(model, cfg: ServingConfig, submit_all, warm: bool = False) -> tuple[list, _Spy, Orchestrator]:
    """Run `submit_all(orchestrator)` on a fresh engine of `cfg` (compiled first with `warm`, so
    that no compile holds the device loop while requests arrive)."""
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    if warm:
        engine.warmup(params)
    spy = _Spy(engine)
    orchestrator = Orchestrator(engine, params, model.tokenizer, cfg.orchestrator).start()
    try:
        results = submit_all(orchestrator)
    finally:
        orchestrator.stop(timeout=60)
    return results, spy, orchestrator


def _together(prompts):
    """Submit every prompt at once (in order) and wait for all."""

    def run(orchestrator):
        handles = [orchestrator.submit(p, _sampling(i)) for i, p in enumerate(prompts)]
        return [h.result().token_ids for h in handles]

    return run


@pytest.mark.parametrize(
    "overrides",
    [
        dict(prefill_chunk_size=64, max_prefill_batch=8, prefix_cache="off"),
        dict(prefill_chunk_size=16, max_prefill_batch=8, prefix_cache="on"),
        dict(prefill_chunk_size=32, max_prefill_batch=1, prefix_cache="on", quantize_kvcache=True,
             kv_quant_axis="heads_and_dkv"),
    ],
    ids=["chunk64-batched-nocache", "chunk16-batched-cache", "chunk32-one-row-cache-int8kv-per-token"],
)
def test_sixteen_mixed_requests_give_the_plain_loops_tokens(model, expected, overrides):
    cfg = _config(**overrides)
    prompts = _prompts(model.tokenizer)
    want = expected
    if cfg.quantize_kvcache:  # the reference reads the same int8 cache
        reference = ReferenceDecoder(model, _config(max_prefill_predict_length=MAX_TARGET, **overrides))
        want = [reference.generate(p, _sampling(i)).token_ids for i, p in enumerate(prompts)]
    results, spy, orchestrator = _serve(model, cfg, _together(prompts))
    assert results == want
    assert max(len(p) for p in prompts) > MAX_PREFILL  # served, not refused
    if cfg.max_prefill_batch > 1:
        assert max(spy.rows) > 1  # several prompts in one compiled call
    else:
        assert set(spy.rows) == {1}
    assert max(spy.starts) >= cfg.prefill_chunk_size  # a prompt went in over several chunks
    assert orchestrator.metrics.requests_finished.get("length", 0) == len(prompts)
    if cfg.prefix_cache == "on":
        assert orchestrator.metrics.prefix_cache_hits > 0


def test_decode_buckets_switch_mid_run_without_losing_a_token(model, reference):
    """One request alone decodes over 1 slot; then 8 at once fill slots 0..7 (bucket 8), and as
    sequences finish the calls compute fewer rows (4, then 2 or 1: the count decoding, wherever its
    slots lie). Every stream gets exactly the plain loop's tokens, in order, its deltas adding up to
    its text."""
    prompts = [p for p in _prompts(model.tokenizer) if len(p) <= 48][:9]
    budgets = [10, 40, 40, 30, 30, 20, 20, 8, 8]  # request 0 alone, then slot i gets budgets[i + 1]
    samplings = [SamplingParams(max_tokens=n) for n in budgets]
    want = [reference.generate(p, s).token_ids for p, s in zip(prompts, samplings, strict=True)]

    def run(orchestrator):
        def read(handle):
            deltas = list(handle.stream())
            return deltas, handle.completion

        first = read(orchestrator.submit(prompts[0], samplings[0]))
        handles = [orchestrator.submit(p, s) for p, s in zip(prompts[1:], samplings[1:], strict=True)]
        return [first, *(read(h) for h in handles)]

    results, spy, _ = _serve(model, _config(prefill_chunk_size=32), run, warm=True)
    for (deltas, completion), tokens in zip(results, want, strict=True):
        assert completion.token_ids == tokens
        assert "".join(d.text for d in deltas) == completion.text
    assert {1, 2, 4, 8} <= set(spy.num_slots)
    assert spy.num_slots[0] == 1 and spy.num_slots[-1] <= 2  # alone; then the two longest


def test_a_pool_of_twelve_pages_preempts_and_keeps_the_plain_loops_tokens(model, expected):
    """Twelve 16-position pages for 8 slots (one sequence of max_target_length takes 8): the
    sequences wait for pages, the newest are preempted and prefilled again with the tokens they
    already streamed, and cached prefix pages are reused or evicted as the pool needs them; every
    stream still gets the plain loop's tokens."""
    page_bytes = Engine(model, _config().engine).page_bytes
    cfg = _config(prefill_chunk_size=32, max_prefill_batch=2, kv_cache_bytes_per_chip=12 * page_bytes)
    results, _spy, orchestrator = _serve(model, cfg, _together(_prompts(model.tokenizer)))
    assert Engine(model, cfg.engine).limits.num_pages == 12
    assert results == expected
    metrics = orchestrator.metrics
    assert metrics.preemptions > 0 and metrics.prefix_cache_hits > 0
    assert metrics.kv_pages_used == 0  # every page back in the pool


def test_prompt_past_max_prefill_is_served_and_one_past_max_target_refused(model, expected):
    prompts = _prompts(model.tokenizer)
    cfg = _config(prefill_chunk_size=32)
    engine = Engine(model, cfg.engine)
    orchestrator = Orchestrator(engine, engine.load_params(), model.tokenizer, OrchestratorConfig()).start()
    try:
        long = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        assert orchestrator.submit(prompts[long], _sampling(long)).result().token_ids == expected[long]
        from serving.errors import GenerationError

        with pytest.raises(GenerationError, match="max_target_length") as refused:
            orchestrator.submit(list(range(3, 3 + MAX_TARGET - 5)), SamplingParams(max_tokens=10))
        assert refused.value.field == "max_tokens"
        # The prompt's logprobs come from its chunks, each scoring its positions: past
        # max_prefill_predict_length too, with tokens to generate or none.
        scored = orchestrator.submit(prompts[long], SamplingParams(max_tokens=4, prompt_logprobs=1)).result()
        assert scored.token_ids == expected[long][:4] and len(scored.prompt_logprobs) == len(prompts[long])
        alone = orchestrator.submit(prompts[long], SamplingParams(max_tokens=0, prompt_logprobs=1)).result()
        assert alone.token_ids == [] and [t.token for t in alone.prompt_logprobs[1:]] == [t.token for t in scored.prompt_logprobs[1:]]
    finally:
        orchestrator.stop(timeout=60)


def test_after_warmup_long_prompts_together_compile_no_prefill_shape(model):
    """Warmup compiles full chunks of every row count the budget allows at every history window:
    two long prompts going in side by side, one chunk each per call, read their slots' history
    through windows 128, 256 and 512 without a compile while they wait, and get the plain loop's
    tokens."""
    target = 512  # history windows 128, 256, 512
    cfg = _config(max_target_length=target, prefill_chunk_size=32, max_prefill_batch=2, prefix_cache="off")
    ids = model.tokenizer.encode((DATA / "english.txt").read_text()) * 8
    prompts = [ids[100:388], ids[500:788]]  # 288 tokens: 9 full chunks, the last from 256
    sampling = SamplingParams(max_tokens=5)
    plain = ReferenceDecoder(model, _config(max_prefill_predict_length=target, max_target_length=target))
    want = [plain.generate(p, sampling).token_ids for p in prompts]
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    engine.warmup(params)
    compiled = engine.chunks._prefill_slots_fn._cache_size(), engine.chunks._start_rows_fn._cache_size()
    spy = _Spy(engine)
    orchestrator = Orchestrator(engine, params, model.tokenizer, cfg.orchestrator).start()
    try:
        handles = [orchestrator.submit(p, sampling) for p in prompts]
        results = [h.result().token_ids for h in handles]
    finally:
        orchestrator.stop(timeout=60)
    assert results == want
    assert 2 in spy.rows and max(spy.starts) == 256
    assert (engine.chunks._prefill_slots_fn._cache_size(), engine.chunks._start_rows_fn._cache_size()) == compiled


def test_after_background_warmup_a_prefix_hits_rest_compiles_nothing(model):
    """The warmup's background thread compiles the partial chunks after cached positions: a prompt
    whose first blocks are cached (a system prompt another request brought) runs the rest of its
    prompt through that ahead-of-time executable, not a compile at first use, and gets the plain
    loop's tokens."""
    cfg = _config(prefill_chunk_size=32)
    ids = model.tokenizer.encode((DATA / "english.txt").read_text())
    shared = ids[200:240]
    prompts = [shared + ids[300:308], shared + ids[400:403]]  # the second: 32 cached, 11 to compute
    sampling = SamplingParams(max_tokens=5)
    plain = ReferenceDecoder(model, _config(max_prefill_predict_length=MAX_TARGET))
    want = [plain.generate(p, sampling).token_ids for p in prompts]
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    engine.warmup(params)
    assert engine.background_warmup.wait(timeout=600) and engine.background_warmup.pending == 0
    compiled = engine.chunks._prefill_slots_fn._cache_size(), engine.chunks._start_rows_fn._cache_size()
    spy = _Spy(engine)
    orchestrator = Orchestrator(engine, params, model.tokenizer, cfg.orchestrator).start()
    try:
        results = [orchestrator.submit(p, sampling).result().token_ids for p in prompts]
    finally:
        orchestrator.stop(timeout=60)
    assert results == want
    assert 32 in spy.starts and orchestrator.metrics.prefix_cache_hits == 2
    assert (engine.chunks._prefill_slots_fn._cache_size(), engine.chunks._start_rows_fn._cache_size()) == compiled


def test_a_process_that_exits_while_the_background_warmup_compiles_exits_cleanly(tiny_model_dir):
    """An offline run (or any CLI command) that ends before the background warmup does: at exit
    the warmup stops after the shape in hand instead of the interpreter finalizing under a compile."""
    script = f"""
import sys
from serving.checkpoints.model_source import load_model
from serving.config import ServingConfig
from serving.engine.engine import Engine
cfg = ServingConfig(per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=512,
                    prefill_chunk_size=32, prefix_block_size=16)
engine = Engine(load_model({str(tiny_model_dir)!r}, cfg), cfg.engine)
engine.warmup(engine.load_params())
assert engine.background_warmup.pending > 0, "nothing left to compile at exit"
print("exiting", flush=True)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "exiting" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]
