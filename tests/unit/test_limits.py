"""Limits: which requests an engine's shapes serve, and which field a refusal names."""

from __future__ import annotations

import pytest

from serving.engine.limits import Limits, prefills_whole, slot_buckets
from serving.errors import GenerationError
from serving.request import SamplingParams

LIMITS = Limits(8, max_prefill_length=64, max_target_length=256, prefill_chunk_size=32)


def test_chunked_requests_may_be_as_long_as_the_context_leaves_room_for():
    LIMITS.check(250, SamplingParams(max_tokens=6))  # past max_prefill_predict_length: chunks
    with pytest.raises(GenerationError, match="max_target_length=256") as err:
        LIMITS.check(250, SamplingParams(max_tokens=7))
    assert err.value.field == "max_tokens"
    with pytest.raises(GenerationError, match="leaves no room") as err:
        LIMITS.check(256, SamplingParams(max_tokens=1))
    assert err.value.field == "prompt"


def test_the_whole_path_keeps_max_prefill_predict_length():
    assert prefills_whole(SamplingParams(max_tokens=0, prompt_logprobs=1)) and prefills_whole(SamplingParams(n=2))
    assert not prefills_whole(SamplingParams(max_tokens=3, temperature=1.0))
    # logprobs, a repetition penalty and the prompt's logprobs go in chunks (the final one gives
    # the first token's logprobs and carries the whole prompt; each scores its positions), at any
    # prompt length
    assert not prefills_whole(SamplingParams(logprobs=1)) and not prefills_whole(SamplingParams(repetition_penalty=1.3))
    assert not prefills_whole(SamplingParams(prompt_logprobs=1))
    LIMITS.check(65, SamplingParams(max_tokens=4, logprobs=1, repetition_penalty=1.3, prompt_logprobs=1))
    # n > 1 goes in chunks where the prefix cache shares the prompt's pages, whole otherwise
    LIMITS.check(65, SamplingParams(max_tokens=4, n=2), prefix_cache=True)
    with pytest.raises(GenerationError, match="max_prefill_predict_length=64"):
        LIMITS.check(65, SamplingParams(max_tokens=4, n=2))
    with pytest.raises(GenerationError, match="max_prefill_predict_length=64") as err:  # the prompt's logprobs alone
        LIMITS.check(65, SamplingParams(max_tokens=0, prompt_logprobs=1), prefix_cache=True)
    assert err.value.field == "prompt"


def test_buckets():
    assert LIMITS.buckets == (16, 32, 64)
    assert Limits(8, 100, 256, prefill_chunk_size=48).buckets == (16, 32, 48, 64, 100)
    assert slot_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert slot_buckets(48, (1, 4, 16, 99)) == (1, 4, 16, 48)
    assert LIMITS.decode_buckets == (1, 2, 4, 8) and LIMITS.decode_slots(3) == 4 and LIMITS.decode_slots(8) == 8
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        Limits(8, 64, 256, prefill_chunk_size=65)
