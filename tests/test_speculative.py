"""Speculative decoding on the tiny random model: `verify` emits exactly plain greedy decoding's
tokens whatever the proposals (right ones all accepted, wrong ones none), and the rejection rule
gives sampled requests the plain sampler's distribution (chi-square over 20k draws)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from serving.checkpoints.model_source import load_model
from serving.config import ServingConfig
from serving.engine.engine import Engine
from serving.engine.sampling import sample
from serving.engine.speculative import Verifier, verify_tokens
from serving.engine.state import SlotSampling
from serving.models import prefill
from serving.request import SamplingParams
from tests.backends import kernels_run_here
from tests.conftest import DATA, tiny_engine

TEXT = (DATA / "english.txt").read_text()
K = 3


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_engine(tiny_model_dir, decode_steps_per_call=1)


def _start(engine, params, prompts, sampling):
    state = engine.init_decode_state()
    firsts = []
    for slot, prompt in enumerate(prompts):
        prefix, first = engine.prefill(params, engine.limits.pad(prompt), len(prompt), sampling)
        state = engine.insert(prefix, state, slot)
        firsts.append(first)
    return state, firsts


def _plain(engine, params, prompts, sampling, count):
    state, firsts = _start(engine, params, prompts, sampling)
    tokens = [[f] for f in firsts]
    for _ in range(count):
        state, result = engine.generate(params, state)
        for slot in range(len(prompts)):
            if np.asarray(result.valid)[0, slot]:
                tokens[slot].append(int(np.asarray(result.tokens)[0, slot]))
    return tokens


def test_verify_emits_greedy_tokens_whatever_the_proposals(tiny):
    _check_greedy(*tiny, modes=("right", "wrong", "mixed", "partial"))


def test_verify_on_the_cpu_kernels_counts_only_the_real_proposals(tiny_model_dir):
    """Where the kernels run, a verify row computes its token and its real proposals only (the
    matmuls skip the rest, serving.models.ops.XlaOps.counting): slots proposing K, none and 2
    tokens still emit plain decoding's greedy tokens. W8A8 weights: their handlers (VNNI or AVX2)
    take the counts on every CPU, where int8w weights go to the AMX kernel where there is one."""
    available, why = kernels_run_here()
    if not available:
        pytest.skip(f"the CPU kernels do not run here: {why}")
    cfg = ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=128, decode_steps_per_call=1,
        quantization="int8", cpu_kernels="on",
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    assert engine.ops.name == "cpu-kernels"
    _check_greedy(model, engine, engine.load_params(), modes=("partial", "mixed"))


def test_verify_with_an_int8_kv_cache_emits_greedy_tokens(tiny_model_dir):
    cfg = ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=128, decode_steps_per_call=1,
        cpu_kernels="off", quantize_kvcache=True,
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    _check_greedy(model, engine, engine.load_params(), modes=("mixed",))


def test_verify_with_penalties_emits_plain_decodings_greedy_tokens(tiny):
    """The penalised distribution is the target: a proposal counts in the penalties of the positions
    after it, as the tokens plain decoding generated there do."""
    model, engine, params = tiny
    ids = model.tokenizer.encode(TEXT)
    sampling = SamplingParams(
        max_tokens=14, repetition_penalty=1.5, frequency_penalty=0.9, presence_penalty=0.4,
        logit_bias=((ids[2], 2.0),), bad_words=((ids[1],), (ids[3], ids[4])),
    )
    _check_greedy(model, engine, params, modes=("right", "mixed"), sampling=sampling)


def _check_greedy(model, engine, params, modes, sampling=SamplingParams(max_tokens=14)):  # noqa: B008
    ids = model.tokenizer.encode(TEXT)
    prompts = [ids[:7], ids[10:30], ids[40:45]]
    expected = _plain(engine, params, prompts, sampling, 13)
    rng = np.random.default_rng(0)
    for mode in modes:
        state, firsts = _start(engine, params, prompts, sampling)
        tokens = [[f] for f in firsts]
        accepted_total = 0
        for _ in range(20):
            proposals = np.zeros((engine.max_concurrent_decodes, K), np.int32)
            num = np.zeros((engine.max_concurrent_decodes,), np.int32)
            for slot in range(len(prompts)):
                n = len(tokens[slot])
                truth = expected[slot][n : n + K]
                if mode == "wrong" or (mode == "mixed" and slot == 1):
                    truth = [(t + 1 + int(rng.integers(5))) % 300 for t in truth]
                if mode == "partial":  # slot 1 proposes nothing, slot 2 two tokens
                    truth = truth[: (K, 0, 2)[slot]]
                proposals[slot, : len(truth)], num[slot] = truth, len(truth)
            max_position = max(len(p) + len(t) for p, t in zip(prompts, tokens, strict=True))
            state, result = engine.verify(params, state, proposals, num, max_position=max_position)
            valid, out = np.asarray(result.valid), np.asarray(result.tokens)
            for slot in range(len(prompts)):
                emitted = [int(t) for t, v in zip(out[:, slot], valid[:, slot], strict=True) if v]
                accepted_total += max(0, len(emitted) - 1)
                tokens[slot] += emitted
            if not np.asarray(state.active)[: len(prompts)].any():
                break
        assert tokens == expected, mode
        if mode == "right":
            assert accepted_total >= 3 * 9  # most calls emit k + 1 tokens
        if mode == "wrong":
            assert accepted_total == 0


def test_verify_stops_at_a_stop_id_and_max_tokens(tiny):
    model, engine, params = tiny
    prompt = model.tokenizer.encode(TEXT)[:9]
    plain = _plain(engine, params, [prompt], SamplingParams(max_tokens=10), 9)[0]
    stop = plain[3]
    sampling = SamplingParams(max_tokens=10, stop_ids=(stop,))
    state, firsts = _start(engine, params, [prompt], sampling)
    proposals = np.zeros((engine.max_concurrent_decodes, K), np.int32)
    proposals[0] = plain[1:4]
    num = np.array([K, 0, 0, 0], np.int32)
    state, result = engine.verify(params, state, proposals, num, max_position=len(prompt))
    valid, done = np.asarray(result.valid)[:, 0], np.asarray(result.done)[:, 0]
    emitted = [int(t) for t, v in zip(np.asarray(result.tokens)[:, 0], valid, strict=True) if v]
    first_stop = plain.index(stop)
    assert [firsts[0], *emitted] == plain[: first_stop + 1]
    assert done[len(emitted) - 1] and not bool(np.asarray(state.active)[0])

    state, firsts = _start(engine, params, [prompt], SamplingParams(max_tokens=3))
    state, result = engine.verify(params, state, proposals, num, max_position=len(prompt))
    assert int(np.asarray(result.valid)[:, 0].sum()) == 2 and not bool(np.asarray(state.active)[0])


# -- the sampled rule: 20k draws of the first two tokens, one compiled vectorized computation ------


def _first_two_distribution(logits_after, first_logits, proposals, sampling, draws, speculative):
    """Counts of (t1, t2) over `draws` draws. first_logits [vocab]: after the context;
    logits_after [vocab, vocab]: after the context and each t1; proposals [2] (a point mass)."""
    vocab = first_logits.shape[0]
    seed = 8 if speculative else 7  # independent samples
    keys = jax.random.split(jax.random.PRNGKey(seed), draws * 4).reshape(draws, 4, 2)
    drawn = ("temperature", "top_k", "top_p", "min_p")
    rows = sampling._replace(**{f: jnp.broadcast_to(getattr(sampling, f), (draws,)) for f in drawn})
    params = [getattr(rows, f) for f in drawn]

    def plain():
        t1 = sample(jnp.broadcast_to(first_logits, (draws, vocab)), keys[:, 0], *params)
        t2 = sample(logits_after[t1], keys[:, 1], *params)
        return t1, t2

    def spec():
        # one verify call: position 0 after the context, 1 after proposal d1, 2 after d1 d2
        d1, d2 = proposals
        third = logits_after[d2]  # stands in for logits after d1 d2: only its first draw matters here
        stacked = jnp.stack([first_logits, logits_after[d1], third])
        logits = jnp.broadcast_to(stacked, (draws, 3, vocab))
        props = jnp.broadcast_to(jnp.asarray(proposals, jnp.int32), (draws, 2))
        tokens, accepted = verify_tokens(logits, props, jnp.full((draws,), 2, jnp.int32), keys[:, :3], rows)
        # rejected at once: the second token comes from the next call, after the first one
        again = sample(logits_after[tokens[:, 0]], keys[:, 3], *params)
        return tokens[:, 0], jnp.where(accepted >= 1, tokens[:, 1], again)

    t1, t2 = jax.jit(spec if speculative else plain)()
    counts = np.zeros((vocab, vocab), np.int64)
    np.add.at(counts, (np.asarray(t1), np.asarray(t2)), 1)
    return counts


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    """Another random tiny model with the same tokenizer: a draft that is mostly wrong."""
    from tests.conftest import make_hf_llama, make_hf_tokenizer

    directory = tmp_path_factory.mktemp("tiny-draft")
    make_hf_llama(directory, vocab=320, rope_scaling=True, seed=1)
    make_hf_tokenizer(directory, vocab=300)
    return load_model(str(directory), ServingConfig(cpu_kernels="off"))


def _draft_greedy(draft, context, count):
    """The draft model's greedy continuation of `context` (what DraftModel proposes)."""
    tokens = list(context)
    for _ in range(count):
        logits, _ = prefill(draft.params, jnp.asarray([tokens]), jnp.asarray([len(tokens)]), draft.config)
        tokens.append(int(jnp.argmax(logits[0, -1, :300])))
    return tokens[len(context) :]


@pytest.mark.parametrize("top", [dict(), dict(top_k=20, top_p=0.9, min_p=0.05)])
def test_sampled_speculation_draws_the_plain_distribution(tiny, random_draft, top):
    model = tiny[0]
    context = model.tokenizer.encode(TEXT)[:12]
    vocab = 300
    # the model's logits after the context, and after the context plus each possible first token
    seq = jnp.asarray([[*context, t] for t in range(vocab)])
    logits, _ = prefill(model.params, seq, jnp.full((vocab,), len(context) + 1), model.config)
    first_logits = logits[0, len(context) - 1, :vocab]
    logits_after = logits[:, len(context), :vocab]
    temperature = 1.5  # a flat distribution: many cells, a sharper test
    sampling = SlotSampling(*(None for _ in SlotSampling._fields))._replace(
        temperature=jnp.float32(temperature), top_k=jnp.int32(top.get("top_k", 0)),
        top_p=jnp.float32(top.get("top_p", 1.0)), min_p=jnp.float32(top.get("min_p", 0.0)),
    )
    # n-gram-like proposals: the likely first token, then a likely second one; and unlikely ones
    best = int(jnp.argmax(first_logits))
    cases = {
        "ngram, likely": [best, int(jnp.argmax(logits_after[best]))],
        "ngram, unlikely": [int(jnp.argmin(first_logits)), 5],
        "draft model": _draft_greedy(random_draft, context, 2),
    }
    for proposals in cases.values():
        draws = 20_000
        plain = _first_two_distribution(logits_after, first_logits, proposals, sampling, draws, False)
        spec = _first_two_distribution(logits_after, first_logits, proposals, sampling, draws, True)
        # cells with enough mass in both, the rest pooled
        big = (plain + spec) >= 20
        table = np.stack([np.append(plain[big], plain[~big].sum()), np.append(spec[big], spec[~big].sum())])
        table = table[:, table.sum(axis=0) > 0]
        _, pvalue, _, _ = stats.chi2_contingency(table)
        assert pvalue > 1e-3, (proposals, pvalue)


def test_warmup_compiles_the_verify_calls(tiny):
    model, plain, params = tiny
    engine = Engine(model, plain.config, verifier=Verifier((K, 2)))  # the same placement: the same params
    state = engine.warm_verify(params, engine.init_decode_state())
    compiled = engine._verify_fn._cache_size()
    prompt = model.tokenizer.encode(TEXT)[:9]
    prefix, _ = engine.prefill(params, engine.limits.pad(prompt), len(prompt), SamplingParams(max_tokens=8))
    state = engine.insert(prefix, state, 1)
    proposals = np.zeros((engine.max_concurrent_decodes, K), np.int32)
    num = np.array([0, K, 0, 0], np.int32)
    for num_slots in (1, 2):
        state, _ = engine.verify(params, state, proposals, num if num_slots == 2 else num * 0,
                                 max_position=len(prompt), num_slots=num_slots)
    assert engine._verify_fn._cache_size() == compiled  # nothing compiled at the call
    assert plain.warm_verify(params, state) is state  # an engine built without verify shapes warms none


def test_the_engine_verifies_with_the_verifier_it_is_given(tiny):
    """The verifier is a part passed in (serving.engine.speculative.Verifier): one whose rule
    accepts nothing emits one token a call, plain decoding's, whatever is proposed; a bad warmup
    shape is refused where the part is made."""
    import jax.numpy as jnp

    class Rejecting(Verifier):
        def step(self, forward, sampler, full, proposals, num_proposed, rows, max_target_length):
            return super().step(forward, sampler, full, proposals, jnp.zeros_like(num_proposed), rows,
                                max_target_length)

    model, plain, params = tiny
    engine = Engine(model, plain.config, verifier=Rejecting())
    prompt = model.tokenizer.encode(TEXT)[:9]
    greedy = SamplingParams(max_tokens=8)
    want = _plain(plain, params, [prompt], greedy, 2 + K)[0]  # plain decoding's tokens
    state, got = _start(engine, params, [prompt], greedy)
    got = list(got)
    proposals = np.zeros((engine.max_concurrent_decodes, K), np.int32)
    for _ in range(2):
        proposals[0] = want[len(got) : len(got) + K]  # the right ones: a plain verifier keeps them all
        state, result = engine.verify(params, state, proposals, np.full((engine.max_concurrent_decodes,), K),
                                      max_position=len(prompt) + len(got), num_slots=1)
        valid = np.asarray(result.valid)[:, 0]
        assert valid.sum() == 1  # every proposal rejected: one token a call
        got.append(int(np.asarray(result.tokens)[valid.argmax(), 0]))
    assert got == want[:3]
    with pytest.raises(ValueError, match="at least 1"):
        Verifier((0, 2))


def test_the_verifier_a_servers_settings_ask_for():
    """speculative_max_slots=0 is speculation off (no verify shape to warm up; it once made the
    server refuse to start), as is speculative_method=none; otherwise (k, the slots) as set."""
    from serving.config import ServingConfig

    on = ServingConfig(speculative_method="ngram", num_speculative_tokens=3, speculative_max_slots=2)
    assert Verifier.of(on).warmup == (3, 2)
    assert Verifier.of(ServingConfig(speculative_method="ngram", speculative_max_slots=0)).warmup is None
    assert Verifier.of(ServingConfig()).warmup is None


def test_sampled_verify_without_proposals_draws_plain_decodings_tokens(tiny):
    """A slot with nothing proposed gets the token plain decoding draws there: the same key, the
    same sampler (and with proposals, valid tokens from the kept set)."""
    model, engine, params = tiny
    prompts = [model.tokenizer.encode(TEXT)[:9], model.tokenizer.encode(TEXT)[20:26]]
    sampling = SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=5)
    expected = _plain(engine, params, prompts, sampling, 7)
    state, firsts = _start(engine, params, prompts, sampling)
    tokens = [[f] for f in firsts]
    none = np.zeros((engine.max_concurrent_decodes,), np.int32)
    proposals = np.zeros((engine.max_concurrent_decodes, K), np.int32)
    for _ in range(7):
        state, result = engine.verify(params, state, proposals, none, max_position=40)
        for slot in range(2):
            assert np.asarray(result.valid)[1:, slot].sum() == 0
            tokens[slot].append(int(np.asarray(result.tokens)[0, slot]))
    assert tokens == expected
    # with proposals: runs, emits 1..k+1 tokens per slot
    state, firsts = _start(engine, params, prompts, sampling)
    proposals[:2] = [expected[0][1:4], expected[1][1:4]]
    state, result = engine.verify(params, state, proposals, np.array([K, K, 0, 0], np.int32), max_position=40)
    emitted = np.asarray(result.valid)[:, :2].sum(axis=0)
    assert ((emitted >= 1) & (emitted <= K + 1)).all()
