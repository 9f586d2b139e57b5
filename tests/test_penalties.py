"""Logit processing on the device (serving.engine.penalties) against numpy references of vLLM's
definitions, on the tiny model's logits, for a batch mixing every parameter with a neutral row.

The engine's logprobs are log_softmax of the processed logits (after temperature), so comparing
them, position by position, with the reference applied to the model's own logits of the same
sequence checks every penalty's value, not only which token won. One engine for the module.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from serving.engine.api import PrefillRow
from serving.engine.sampler import Sampler
from serving.models import prefill
from serving.request import SamplingParams
from tests.conftest import DATA, tiny_engine

TEXT = (DATA / "english.txt").read_text()
VOCAB = 300  # the tokenizer's: the decodable vocabulary
ATOL = 2e-3  # engine decode vs one prefill over the sequence, XLA or the CPU kernels


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_engine(tiny_model_dir, decode_steps_per_call=2)


def reference_logits(raw: np.ndarray, prompt: list[int], generated: list[int], s: SamplingParams) -> np.ndarray:
    """vLLM's processing of one row's logits [vocab], float64: bad words (the last token of a word
    whose other tokens were just generated), min_tokens (stop ids while fewer were generated),
    logit bias, then repetition (prompt and output), frequency and presence (output) penalties."""
    logits = raw.astype(np.float64).copy()
    for word in s.bad_words:
        before = list(word[:-1])
        if len(before) <= len(generated) and generated[len(generated) - len(before) :] == before:
            logits[word[-1]] = -np.inf
    if len(generated) < s.min_tokens:
        logits[list(s.stop_ids)] = -np.inf
    for token, bias in s.logit_bias:
        logits[token] += bias
    counts = np.bincount(np.asarray(generated, np.int64), minlength=len(logits))
    seen = counts > 0
    in_prompt = np.zeros(len(logits), bool)
    in_prompt[prompt] = True
    repetition = np.where(in_prompt | seen, s.repetition_penalty, 1.0)
    logits = np.where(logits > 0, logits / repetition, logits * repetition)
    return logits - s.frequency_penalty * counts - s.presence_penalty * seen


def _log_softmax(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    return x - (finite.max() + np.log(np.exp(finite - finite.max()).sum()))


def _model_logits(model, tokens: list[int]) -> np.ndarray:
    """[len(tokens), VOCAB]: the model's logits after each prefix of `tokens` (one prefill)."""
    logits, _ = prefill(model.params, jnp.asarray([tokens]), jnp.asarray([len(tokens)]), model.config)
    return np.asarray(logits[0, :, :VOCAB])


def _decode(engine, params, prompts, samplings, steps=8):
    """Whole prefill + insert into slots 0.., then generate: each slot's tokens and their logprobs."""
    state = engine.init_decode_state()
    tokens, logprobs = [], []
    for slot, (prompt, s) in enumerate(zip(prompts, samplings, strict=True)):
        prefix, first = engine.prefill(params, engine.limits.pad(prompt), len(prompt), s)
        state = engine.insert(prefix, state, slot)
        tokens.append([first])
        logprobs.append([engine.prefill_outputs(prefix).first_logprobs[0]])
    for _ in range(steps):
        state, result = engine.generate(params, state)
        valid = np.asarray(result.valid)
        for step in range(valid.shape[0]):
            for slot in range(len(prompts)):
                if valid[step, slot]:
                    tokens[slot].append(int(np.asarray(result.tokens)[step, slot]))
                    ids, top = np.asarray(result.top_ids)[step, slot], np.asarray(result.top_logprobs)[step, slot]
                    logprobs[slot].append((float(np.asarray(result.logprobs)[step, slot]), ids, top))
    return tokens, logprobs


def test_a_mixed_batch_matches_vllms_definitions(tiny):
    model, engine, params = tiny
    ids = model.tokenizer.encode(TEXT)
    prompts = [ids[:9], ids[20:34], ids[40:47], ids[60:70]]
    neutral = SamplingParams(max_tokens=12, logprobs=20)
    plain, _ = _decode(engine, params, prompts[3:], [neutral])
    g = plain[0]
    samplings = [
        neutral,
        SamplingParams(
            max_tokens=12, logprobs=20, repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.5,
            logit_bias=((ids[3], 4.0), (ids[5], -3.0)),
        ),
        SamplingParams(
            max_tokens=12, logprobs=20, temperature=0.8, seed=3, min_p=0.1, repetition_penalty=0.7,
            frequency_penalty=-0.6, presence_penalty=-0.4,
        ),
        SamplingParams(  # bans g1 after g0 and g2 anywhere; ends at one of g's tokens, not before 6
            max_tokens=12, logprobs=20, bad_words=((g[0], g[1]), (g[2],)), min_tokens=6,
            stop_ids=tuple(dict.fromkeys(g[3:]))[:8],
        ),
    ]
    tokens, logprobs = _decode(engine, params, prompts, samplings)
    for prompt, s, out, lps in zip(prompts, samplings, tokens, logprobs, strict=True):
        raw = _model_logits(model, [*prompt, *out])[len(prompt) - 1 :]
        for t, token in enumerate(out):
            processed = reference_logits(raw[t], prompt, out[:t], s)
            scaled = processed / (s.temperature or 1.0)
            ref = _log_softmax(scaled)
            lp = lps[t]
            chosen, top_ids, top = (lp.logprob, [i for i, _ in lp.top], [v for _, v in lp.top]) if t == 0 else lp
            np.testing.assert_allclose(chosen, ref[token], atol=ATOL)
            finite = np.isfinite(np.asarray(top))
            np.testing.assert_allclose(np.asarray(top)[finite], ref[np.asarray(top_ids)[finite]], atol=ATOL)
            np.testing.assert_allclose(np.sort(np.asarray(top)[finite])[::-1], np.sort(ref)[::-1][: finite.sum()], atol=ATOL)
            if s.temperature == 0:
                assert ref[token] >= ref.max() - ATOL, (s, t)
            else:  # within min_p of the best token's probability
                assert ref[token] >= ref.max() + np.log(s.min_p) - ATOL
    bad = tokens[3]
    assert g[2] not in bad and all(bad[i : i + 2] != [g[0], g[1]] for i in range(len(bad)))
    stops = [i for i, x in enumerate(bad) if x in samplings[3].stop_ids]
    assert stops in ([], [len(bad) - 1]) and len(bad) >= 6  # min_tokens: no stop id before 6 tokens
    assert len(bad) == 12 or stops  # and a stop id, once allowed, ends it
    assert tokens[1] != plain or tokens[2] != plain  # the penalties changed something


def test_the_chunked_path_applies_bias_bad_words_and_min_tokens(tiny):
    model, engine, params = tiny
    prompt = tuple(model.tokenizer.encode(TEXT)[:11])
    t = prompt[4]
    rows = [
        SamplingParams(max_tokens=6, logit_bias=((t, 100.0),)),
        SamplingParams(max_tokens=6, logit_bias=((t, 100.0),), bad_words=((t,),)),
        SamplingParams(max_tokens=6, logit_bias=((t, 100.0),), min_tokens=3, stop_ids=(t,)),
        SamplingParams(max_tokens=6, logit_bias=((t, 3.0),), frequency_penalty=2.0, presence_penalty=1.0),
    ]
    state = engine.init_decode_state()
    state, firsts, _ = engine.prefill_slots(params, state, [PrefillRow(i, prompt, 0, True, s) for i, s in enumerate(rows)])
    tokens = [[f] for f in firsts]
    for _ in range(3):
        state, result = engine.generate(params, state)
        valid, out = np.asarray(result.valid), np.asarray(result.tokens)
        for step in range(valid.shape[0]):
            for slot in range(4):
                if valid[step, slot]:
                    tokens[slot].append(int(out[step, slot]))
    assert tokens[0] == [t] * 6
    assert t not in tokens[1] and len(tokens[1]) == 6
    assert tokens[2][3] == t and t not in tokens[2][:3] and len(tokens[2]) == 4  # ends at the stop id
    # the penalties count from the chunked prefill's first token on: greedy under vLLM's definition
    raw = _model_logits(model, [*prompt, *tokens[3]])[len(prompt) - 1 :]
    for i, token in enumerate(tokens[3]):
        ref = reference_logits(raw[i], list(prompt), tokens[3][:i], rows[3])
        assert ref[token] >= ref.max() - ATOL
    assert tokens[3].count(t) < 6


def test_a_grammar_mask_composes_with_the_bias_and_penalties(tiny):
    """A structured output's mask applies first: a bias cannot bring back a token it forbids, and
    among the tokens it allows the bias and penalties act as without it."""
    model, engine, params = tiny
    prompt = model.tokenizer.encode(TEXT)[:9]
    allowed = [7, 11, 40, 41, 42]
    words = -(-VOCAB // 32)
    mask = np.zeros((engine.max_concurrent_decodes, words), np.uint32)
    for token in allowed:
        mask[:, token // 32] |= np.uint32(1 << (token % 32))
    mask = mask.view(np.int32)
    rows = [
        SamplingParams(max_tokens=5, logit_bias=((100, 100.0),)),  # forbidden by the mask: no effect
        SamplingParams(max_tokens=5, logit_bias=((41, 100.0),)),  # allowed: always chosen
        SamplingParams(max_tokens=5, logit_bias=((41, 3.0),), frequency_penalty=2.0, presence_penalty=2.0),
    ]
    state = engine.init_decode_state()
    for slot, s in enumerate(rows):
        prefix, _ = engine.prefill(params, engine.limits.pad(prompt), len(prompt), s, mask[0])
        state = engine.insert(prefix, state, slot)
    tokens = [[] for _ in rows]
    for _ in range(4):
        state, result = engine.generate(params, state, masks=mask)
        for slot in range(len(rows)):
            if np.asarray(result.valid)[0, slot]:
                tokens[slot].append(int(np.asarray(result.tokens)[0, slot]))
    assert all(t in allowed for out in tokens for t in out) and all(len(out) == 4 for out in tokens)
    assert tokens[1] == [41] * 4 and tokens[2] != [41] * 4


def test_record_skips_the_scatter_only_when_no_emitting_row_reads_its_history():
    """A batch whose rows read no history (no penalty, no bad word) keeps none; once one emitting
    row reads its own, every emitting row's tokens are counted (and a non-emitting reader's are not)."""
    from serving.engine import penalties

    history = penalties.init_history(3, 10)
    rows, tokens = jnp.arange(3), jnp.array([[3], [4], [5]])
    valid = jnp.array([[True], [True], [False]])
    kept = penalties.record(history, rows, tokens, valid, jnp.array([False, False, True]))
    assert int(kept.counts.sum()) == 0 and bool(jnp.all(kept.recent == history.recent))
    counted = penalties.record(history, rows, tokens, valid, jnp.array([False, True, False]))
    assert [list(axis) for axis in np.asarray(counted.counts).nonzero()] == [[0, 1], [3, 4]]
    assert np.asarray(counted.recent)[:, -1].tolist() == [3, 4, penalties.NO_TOKEN]


def test_the_chunked_path_applies_a_repetition_penalty_over_the_whole_prompt(tiny):
    """A repetition penalty reads every prompt token: the final row carries the whole prompt (its
    earlier chunks, and cached pages, never pass through that call), and the tokens equal the
    whole prefill's, greedy under vLLM's definition; without the prompt they differ."""
    model, engine, params = tiny
    prompt = tuple(model.tokenizer.encode(TEXT)[:13])
    s = SamplingParams(max_tokens=8, logprobs=1, repetition_penalty=0.2, frequency_penalty=0.3)
    whole, _ = _decode(engine, params, [list(prompt)], [s], steps=4)

    def chunked(carried: tuple[int, ...]) -> list[int]:
        state = engine.init_decode_state()
        state, *_ = engine.prefill_slots(params, state, [PrefillRow(0, prompt[:8], 0, False, s)])
        state, firsts, _ = engine.prefill_slots(params, state, [PrefillRow(0, prompt[8:], 8, True, s, prompt_ids=carried)])
        tokens = [firsts[0]]
        while len(tokens) < 8:
            state, result = engine.generate(params, state)
            valid, out = np.asarray(result.valid), np.asarray(result.tokens)
            tokens += [int(out[step, 0]) for step in range(valid.shape[0]) if valid[step, 0]]
        return tokens

    tokens = chunked(prompt)
    assert tokens == whole[0]
    raw = _model_logits(model, [*prompt, *tokens])[len(prompt) - 1 :]
    for i, token in enumerate(tokens):
        ref = reference_logits(raw[i], list(prompt), tokens[:i], s)
        assert ref[token] >= ref.max() - ATOL
    assert chunked(()) != tokens  # the prompt's tokens are what the penalty read


def test_a_final_row_alone_carries_its_prompt_and_mask():
    from serving.engine.limits import Limits

    limits = Limits(max_concurrent_decodes=2, max_prefill_length=16, max_target_length=32)
    with pytest.raises(ValueError, match="prompt_ids"):
        _check_inputs(limits, PrefillRow(0, (1, 2), 0, False, SamplingParams(repetition_penalty=2.0), prompt_ids=(1, 2)))
    with pytest.raises(ValueError, match="mask"):
        _check_inputs(limits, PrefillRow(0, (1, 2), 0, False, SamplingParams(), mask=np.zeros(10, np.int32)))
    # a matcher's mask over a tokenizer wider than the decodable vocabulary (12 words for 10): cut
    rows = [PrefillRow(0, (1, 2), 0, True, SamplingParams(), mask=np.full(12, 5, np.int32)), PrefillRow(1, (3,), 0, True, SamplingParams())]
    inputs, _ = _check_inputs(limits, rows)
    assert (inputs[8][0, :10] == 5).all() and (inputs[8][1] == -1).all()  # a row without a grammar allows every token


def _check_inputs(limits, rows):
    from types import SimpleNamespace

    from serving.engine.chunked import ChunkedPrefill

    fake = SimpleNamespace(limits=limits, row_buckets=(1, 2), history_window=lambda start: 0, sampler=Sampler(300))
    return ChunkedPrefill._slot_inputs(fake, rows if isinstance(rows, list) else [rows])


def test_a_chunked_final_row_gives_the_first_tokens_logprobs_as_the_whole_prefill(tiny):
    model, engine, params = tiny
    prompt = tuple(model.tokenizer.encode(TEXT)[:13])
    s = SamplingParams(max_tokens=4, logprobs=5, temperature=0.7, seed=5, repetition_penalty=1.4, logit_bias=((prompt[2], 2.0),))
    prefix, first = engine.prefill(params, engine.limits.pad(list(prompt)), len(prompt), s)
    whole = engine.prefill_outputs(prefix).first_logprobs[0]
    state = engine.init_decode_state()
    state, *_ = engine.prefill_slots(params, state, [PrefillRow(1, prompt[:8], 0, False, s)])
    plain = PrefillRow(0, prompt, 0, True, SamplingParams(max_tokens=4))  # a row that wants none, beside it
    state, firsts, logprobs = engine.prefill_slots(params, state, [plain, PrefillRow(1, prompt[8:], 8, True, s, prompt_ids=prompt)])
    assert firsts[1] == first and logprobs[0] is None
    got = logprobs[1]
    assert got.token == whole.token == first
    np.testing.assert_allclose(got.logprob, whole.logprob, atol=ATOL)
    assert [t for t, _ in got.top[:5]] == [t for t, _ in whole.top[:5]]
    np.testing.assert_allclose([v for _, v in got.top], [v for _, v in whole.top], atol=ATOL)


def test_the_prompts_logprobs_in_chunks_are_the_whole_prefills(tiny):
    """A prompt scored chunk by chunk (`prefill_slots_scored`: each chunk's positions, the last
    one's against the next chunk's first token) gives the whole prefill's prompt logprobs: token,
    logprob, rank and top 5; and the final chunk's first token."""
    model, engine, params = tiny
    prompt = tuple(model.tokenizer.encode(TEXT)[:21])
    s = SamplingParams(max_tokens=4, prompt_logprobs=5)
    prefix, first = engine.prefill(params, engine.limits.pad(list(prompt)), len(prompt), s)
    whole = engine.prefill_outputs(prefix).prompt_logprobs
    state, scored = engine.init_decode_state(), []
    for start, end in ((0, 8), (8, 16), (16, 21)):
        final = end == len(prompt)
        row = PrefillRow(2, prompt[start:end], start, final, s, score=True, score_next=-1 if final else prompt[end])
        state, token, logprob, scores = engine.prefill_slots_scored(params, state, row)
        assert len(scores) == end - start - final and logprob is None
        scored += scores
        assert (token == first) if final else token is None
    got = (None, *scored)
    assert len(got) == len(whole) == len(prompt) and got[0] is whole[0] is None
    for a, b in zip(got[1:], whole[1:], strict=True):
        assert a.token == b.token and a.rank == b.rank
        np.testing.assert_allclose(a.logprob, b.logprob, atol=ATOL)
        assert [t for t, _ in a.top[:5]] == [t for t, _ in b.top[:5]]
    with pytest.raises(ValueError, match="scores the prompt"):
        engine.prefill_slots_scored(params, state, PrefillRow(3, prompt[:4], 0, False, s))


def test_the_engine_samples_with_the_sampler_it_is_given(tiny_model_dir):
    """The sampler is a part passed in (serving.engine.sampler): one that always draws token 7
    gives only 7s, from the final chunk's first token and from generate."""
    import jax.numpy as jnp

    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine.engine import Engine
    from serving.orchestrator.offline import run_to_completion

    class Sevens(Sampler):
        def sample(self, logits, keys, sampling):
            return jnp.zeros(logits.shape[:1], jnp.int32) + 7

    cfg = ServingConfig(per_device_batch_size=2, max_prefill_predict_length=64, max_target_length=128,
                        cpu_kernels="off", enable_model_warmup=False)
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine, sampler=Sevens(200))
    assert engine.sampler.num_decodable == 200
    done = run_to_completion(engine, engine.load_params(), [(list(range(5, 15)), SamplingParams(max_tokens=5))])
    assert done[0].token_ids == [7] * 5
    plain = Engine(model, cfg.engine)
    assert plain.sampler == Sampler(min(model.config.vocab_size, model.tokenizer.vocab_size))
