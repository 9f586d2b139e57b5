"""The engine's logprobs, choices and grammar masks on the tiny random model, against the plain
definitions: log_softmax of the model's logits, one request per choice, the mask's tokens only.
And a bug that was: finished and freed slots were still sampled at their old temperature."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.models import prefill
from serving.request import SamplingParams
from tests.conftest import DATA, tiny_engine

TEXT = (DATA / "english.txt").read_text()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_engine(tiny_model_dir, decode_steps_per_call=3)


def _run(engine, params, prompt, sampling, slots=(0,), calls=2, state=None, masks=None):
    """Prefill into `slots` (choice i in slots[i]); `calls` generate calls; tokens per slot."""
    state = engine.init_decode_state() if state is None else state
    prefix, _ = engine.prefill(params, engine.limits.pad(prompt), len(prompt), sampling)
    outputs = engine.prefill_outputs(prefix)
    for choice, slot in enumerate(slots):
        state = engine.insert(prefix, state, slot, choice)
    tokens = {slot: [outputs.first_tokens[i]] for i, slot in enumerate(slots)}
    results = []
    for _ in range(calls):
        state, result = engine.generate(params, state, masks=masks)
        results.append(result)
        for slot in slots:
            tokens[slot] += [int(t) for t, v in zip(np.asarray(result.tokens)[:, slot],
                                                     np.asarray(result.valid)[:, slot], strict=True) if v]
    return tokens, outputs, results, state


def test_generated_logprobs_are_the_models_log_softmax_and_greedy_is_top_1(tiny):
    model, engine, params = tiny
    prompt = model.tokenizer.encode(TEXT)[:9]
    tokens, outputs, results, _ = _run(engine, params, prompt, SamplingParams(max_tokens=8, logprobs=4))
    ids = tokens[0]
    sequence = jnp.asarray([prompt + ids])
    logits, _ = prefill(model.params, sequence, jnp.asarray([sequence.shape[1]]), model.config)
    # over the tokens the tokenizer can decode (its 300 of the model's 320), which are what is sampled
    expected = np.asarray(jax.nn.log_softmax(logits[0, len(prompt) - 1 : -1, :300], axis=-1))
    steps = [float(np.asarray(r.logprobs)[step, 0]) for r in results for step in range(3)]
    got = [outputs.first_logprobs[0].logprob, *steps[: len(ids) - 1]]
    np.testing.assert_allclose(got, expected[np.arange(len(ids)), ids], atol=1e-4)
    first = outputs.first_logprobs[0]
    assert first.token == ids[0] and first.top[0][0] == ids[0] and first.top[0][1] == pytest.approx(first.logprob)
    top_ids = np.asarray(results[0].top_ids)[:, 0]
    assert (top_ids[:, 0] == np.asarray(results[0].tokens)[:, 0]).all()


def test_sampled_logprobs_are_after_temperature(tiny):
    model, engine, params = tiny
    prompt = model.tokenizer.encode(TEXT)[:5]
    _, outputs, _, _ = _run(engine, params, prompt, SamplingParams(max_tokens=2, temperature=0.5, seed=1,
                                                                   logprobs=0), calls=0)
    logits, _ = prefill(model.params, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), model.config)
    expected = np.asarray(jax.nn.log_softmax(logits[0, -1, :300] / 0.5))  # the tokenizer's 300 tokens
    first = outputs.first_logprobs[0]
    assert first.logprob == pytest.approx(float(expected[first.token]), abs=1e-4)


def test_n_choices_equal_one_request_per_choice_seed(tiny):
    model, engine, params = tiny
    prompt = model.tokenizer.encode(TEXT)[20:27]
    # logprobs=0 throughout: one compiled prefill variant for the module (its logprobs are unused here)
    sampling = SamplingParams(max_tokens=7, temperature=1.0, seed=5, n=3, logprobs=0)
    together, outputs, _, _ = _run(engine, params, prompt, sampling, slots=(0, 1, 2))
    assert len(outputs.first_tokens) == 3
    for choice, slot in enumerate((0, 1, 2)):
        alone = SamplingParams(max_tokens=7, temperature=1.0, seed=sampling.choice_seed(choice), logprobs=0)
        assert _run(engine, params, prompt, alone, slots=(3,))[0][3] == together[slot]
    assert len({tuple(t) for t in together.values()}) > 1


def test_masks_restrict_every_token(tiny):
    model, engine, params = tiny
    prompt = model.tokenizer.encode(TEXT)[:6]
    allowed = [7, 42, 99]
    mask = np.zeros((4, -(-300 // 32)), np.int32)
    for t in allowed:
        mask[:, t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(1 << 31))
    sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=2, logprobs=3)
    prefix, first = engine.prefill(params, engine.limits.pad(prompt), len(prompt), sampling, mask[0])
    assert first in allowed
    state = engine.insert(prefix, engine.init_decode_state(), 0)
    for _ in range(4):
        state, result = engine.generate(params, state, masks=mask)
        assert np.asarray(result.tokens).shape[0] == 1  # one step per call under masks
        assert int(np.asarray(result.tokens)[0, 0]) in allowed
        probs = np.exp(np.asarray(result.top_logprobs)[0, 0, :3])
        assert set(np.asarray(result.top_ids)[0, 0, :3].tolist()) == set(allowed)
        assert probs.sum() == pytest.approx(1.0, abs=1e-5)  # logprobs of the masked distribution


def test_finished_and_free_slots_are_not_sampled(tiny):
    """A slot keeps its last request's sampling state after it finishes; the step must not draw for
    it. Its (discarded) tokens then depend on its last token alone, not on that request's seed:
    two finished requests with the same first token and different seeds leave the same ones."""
    model, engine, params = tiny
    prompt = model.tokenizer.encode(TEXT)[:8]
    padded = engine.limits.pad(prompt)

    def finished(seed):  # top_k 3: a first token that seeds share often; done at insert
        return SamplingParams(max_tokens=1, temperature=1.0, top_k=3, seed=seed, logprobs=0)

    firsts = {seed: engine.prefill(params, padded, len(prompt), finished(seed))[1] for seed in range(12)}
    token = max(set(firsts.values()), key=list(firsts.values()).count)
    seeds = [seed for seed, first in firsts.items() if first == token][:2]
    assert len(seeds) == 2
    stale = []
    for seed in seeds:
        prefix, _ = engine.prefill(params, padded, len(prompt), finished(seed))
        state = engine.insert(prefix, engine.init_decode_state(), 0)
        _, _, results, _ = _run(engine, params, prompt[:5], SamplingParams(max_tokens=20, logprobs=0), slots=(1,),
                                state=state, calls=4)
        assert not any(np.asarray(r.valid)[:, 0].any() for r in results)
        stale.append([np.asarray(r.tokens)[:, 0].tolist() for r in results])
    assert stale[0] == stale[1]


def test_a_call_of_middle_chunks_reads_nothing_back_and_the_prompt_ends_as_whole(tiny, monkeypatch):
    """prefill_slots with no final row returns without reading the device (the host does not wait
    for the call: the next one is dispatched behind it); the prompt's last chunk then samples the
    same first token as the whole prompt's prefill."""
    from serving.engine import chunked
    from serving.engine.api import PrefillRow

    _model, engine, params = tiny
    prompt = [5 + i % 200 for i in range(40)]
    whole, _ = engine.prefill(params, engine.limits.pad(prompt), len(prompt), SamplingParams(max_tokens=4))
    pages = np.zeros((engine.limits.max_concurrent_decodes, engine.limits.max_pages), np.int32)
    pages[0, : engine.limits.max_pages] = np.arange(1, engine.limits.max_pages + 1)
    state = engine.set_pages(engine.init_decode_state(), pages)
    sampling = SamplingParams(max_tokens=4)

    class NoReads:  # chunked's numpy, whose asarray (the first tokens' read) fails
        def __getattr__(self, name):
            if name == "asarray":
                raise AssertionError("a call of middle chunks read the device")
            return getattr(np, name)

    monkeypatch.setattr(chunked, "np", NoReads())
    state, tokens, logprobs = engine.prefill_slots(params, state, [PrefillRow(0, tuple(prompt[:16]), 0, False, sampling)])
    monkeypatch.undo()
    assert tokens == (None,) and logprobs == (None,)
    state, tokens, _ = engine.prefill_slots(params, state, [PrefillRow(0, tuple(prompt[16:]), 16, True, sampling)])
    assert tokens == (int(np.asarray(whole.first_tokens)[0]),)
