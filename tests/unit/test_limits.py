"""Limits: which requests an engine's shapes serve, and which field a refusal names."""

from __future__ import annotations

import pytest

from serving.engine.limits import Limits, slot_buckets
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


def test_every_request_goes_in_chunks_at_any_prompt_length():
    """n > 1, logprobs, a repetition penalty, the prompt's logprobs (with max_tokens 0 too): no
    request is held to max_prefill_predict_length (there is no whole-prompt path left)."""
    for sampling in (
        SamplingParams(max_tokens=4, logprobs=1, repetition_penalty=1.3, prompt_logprobs=1),
        SamplingParams(max_tokens=4, n=2, temperature=1.0),
        SamplingParams(max_tokens=0, prompt_logprobs=1),
    ):
        LIMITS.check(65, sampling)
    with pytest.raises(GenerationError, match="n=9 choices") as err:
        LIMITS.check(5, SamplingParams(max_tokens=4, n=9, temperature=1.0))
    assert err.value.field == "n"


def test_buckets():
    assert LIMITS.buckets == (16, 32, 64)
    assert Limits(8, 100, 256, prefill_chunk_size=48).buckets == (16, 32, 48, 64, 100)
    assert slot_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert slot_buckets(48, (1, 4, 16, 99)) == (1, 4, 16, 48)
    assert LIMITS.decode_buckets == (1, 2, 4, 8) and LIMITS.decode_slots(3) == 4 and LIMITS.decode_slots(8) == 8
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        Limits(8, 64, 256, prefill_chunk_size=65)
