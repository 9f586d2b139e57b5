"""Start-up's resolution without JAX devices: what `quantization` means (one function, one table),
the serving profile for any model and where each key came from, slots sized to memory and model."""

from __future__ import annotations

import pytest

from serving.config import ConfigError, config_dir, load_model_config
from serving.engine.partitioning import Numerics
from serving.models.params import EMBEDDING, LAYER_MATMULS, MATMUL_WEIGHTS
from serving.quantization_mode import Quantization, decide_quantization
from serving.startup.profile import FROM_COMMAND, FROM_DEFAULT, FROM_OVERRIDE, FROM_PROFILE, given_config
from serving.startup.slots import size_slots

BOTH = ("quantization", "checkpoint_is_quantized")
OURS_INT8 = tuple(sorted((*MATMUL_WEIGHTS, EMBEDDING)))  # a converted int8 checkpoint stores these
MAXTEXT_INT8 = tuple(sorted(LAYER_MATMULS))  # a MaxText int8 checkpoint: the layers' matmuls


# (asked, checkpoint_is_quantized, keys given, stored, implied) -> (mode, int8 entries, activations, stored)
@pytest.mark.parametrize(
    ("asked", "ciq", "given", "stored", "implied", "expected"),
    [
        # flags alone, or a source that is not a checkpoint (stored None): the flag is the meaning
        ("", False, (), None, "int8w", ("", (), False, ())),
        ("int8w", False, BOTH, None, "int8w", ("int8w", OURS_INT8, False, ())),
        ("int8", False, BOTH, None, "int8w", ("int8", MAXTEXT_INT8, True, ())),
        # a float checkpoint: quantized on load as asked
        ("int8w", False, ("quantization",), (), "int8w", ("int8w", OURS_INT8, False, ())),
        # our int8 checkpoint: int8w implied, or int8 (W8A8) when asked
        ("", False, (), OURS_INT8, "int8w", ("int8w", OURS_INT8, False, OURS_INT8)),
        ("int8", True, BOTH, OURS_INT8, "int8w", ("int8", OURS_INT8, True, OURS_INT8)),
        # MaxText's int8 checkpoint: int8 (W8A8) implied, as MaxText serves it
        ("", False, (), MAXTEXT_INT8, "int8", ("int8", MAXTEXT_INT8, True, MAXTEXT_INT8)),
        # int8w asked of it: the embedding is quantized while loading
        ("int8w", False, ("quantization",), MAXTEXT_INT8, "int8", ("int8w", OURS_INT8, False, MAXTEXT_INT8)),
    ],
)
def test_what_quantization_means_is_decided_in_one_function(asked, ciq, given, stored, implied, expected):
    q = decide_quantization(asked, ciq, given, stored, implied, source="ckpt" if stored is not None else "")
    assert (q.mode, q.int8, q.activations, q.stored) == expected
    assert q.checkpoint_is_quantized == bool(expected[3])
    assert q.quantized_on_load == tuple(sorted(set(expected[1]) - set(expected[3])))


@pytest.mark.parametrize(
    ("asked", "ciq", "given", "stored", "must_mention"),
    [
        ("", True, BOTH, None, "checkpoint_is_quantized=true requires quantization"),
        ("int8", True, BOTH, None, "ckpt is not an int8 checkpoint"),
        ("int8", True, BOTH, (), "ckpt holds float weights"),
        ("", False, ("quantization",), OURS_INT8, "quantization='' contradicts ckpt"),
        ("int8", False, BOTH, OURS_INT8, "checkpoint_is_quantized=False contradicts ckpt"),
        ("int4", False, BOTH, None, "quantization"),
    ],
)
def test_flags_that_contradict_the_checkpoint_are_refused_naming_both(asked, ciq, given, stored, must_mention):
    with pytest.raises(ConfigError, match=must_mention):
        decide_quantization(asked, ciq, given, stored, "int8w", source="ckpt")


def test_the_placement_reads_the_decided_int8_entries():
    q = Quantization("int8", stored=MAXTEXT_INT8)
    assert Numerics("float32", "float32", q.mode, int8=q.int8).int8_entries == frozenset(MAXTEXT_INT8)


def test_the_engine_config_carries_the_decided_quantization_as_a_value():
    """What `quantization` means is decided once: ServingConfig.engine carries the flags' decision,
    a launch plan's engine its own (the checkpoint's stored int8 entries with it), and the
    placement reads its int8 entries from that value."""
    from dataclasses import replace

    from serving.config import ServingConfig

    engine = ServingConfig(quantization="int8").engine
    assert engine.quantization == Quantization("int8") and engine.quantization.activations
    decided = replace(engine, quantization=Quantization("int8", stored=MAXTEXT_INT8))
    assert Numerics.of(decided).int8_entries == frozenset(MAXTEXT_INT8)
    flags_alone = Numerics.of(ServingConfig(quantization="int8w")).int8_entries
    assert "embed" in flags_alone and frozenset(MAXTEXT_INT8) < flags_alone  # int8w: the embedding too


def test_the_serving_profile_applies_to_any_model_and_says_where_each_key_came_from(tmp_path):
    mine = given_config(None, ["max_target_length=512"], str(tmp_path))
    cfg = mine.config
    assert (cfg.per_device_batch_size, cfg.enable_model_warmup, cfg.prefix_cache) == (64, True, "on")
    assert cfg.quantization == ""  # the default model's own choice (int8w) is not applied to yours
    assert mine.origin("per_device_batch_size") == mine.origin("enable_model_warmup") == FROM_PROFILE
    assert mine.origin("max_target_length") == FROM_OVERRIDE and mine.origin("quantization") == FROM_DEFAULT
    # the profile's lengths fit under yours: its 512-token prefill within a 512 max_target_length
    assert (cfg.max_prefill_predict_length, cfg.prefill_chunk_size) == (512, 256)
    short = given_config(None, ["max_prefill_predict_length=64", "max_target_length=128"], str(tmp_path)).config
    assert (short.max_prefill_predict_length, short.prefill_chunk_size) == (64, 64)
    default = given_config(None, [], None)
    assert default.config.quantization == "int8w" and default.origin("quantization") == FROM_PROFILE
    one_shot = given_config(None, [], str(tmp_path), {"per_device_batch_size": 1, "enable_model_warmup": False})
    assert one_shot.config.per_device_batch_size == 1 and one_shot.origin("per_device_batch_size") == FROM_COMMAND


def test_a_maxtext_config_file_keeps_maxtexts_defaults_not_the_profile():
    recipe = str(config_dir() / "maxtext" / "inference" / "inference_jetstream.yml")
    given = given_config(recipe, ["model_name=llama3.1-8b"], None)
    assert given.origin("decode_steps_per_call") == FROM_DEFAULT  # the profile's 2 is not applied
    assert given.config.decode_steps_per_call == 4 and given.origin("model_name") == FROM_OVERRIDE


def test_slots_are_sized_to_the_memory_and_the_model():
    llama_1b = load_model_config("llama3.2-1b")  # 16 layers x 8 kv heads x 64: 64 MiB per slot at 1024
    numerics = Numerics("float32", "float32", "int8w")
    plenty = size_slots(llama_1b, numerics, (1, 1, 1), 64, 1024, memory_per_chip=20 << 30)
    assert plenty.per_device == 64 and plenty.kv_per_slot_per_chip == 64 << 20
    tight = size_slots(llama_1b, numerics, (1, 1, 1), 64, 1024, memory_per_chip=4 << 30)
    assert 1 < tight.per_device < 64 and tight.per_device == tight.fit
    assert "memory allows" in tight.describe(64)
    none_left = size_slots(llama_1b, numerics, (1, 1, 1), 64, 1024, memory_per_chip=1 << 20)
    assert none_left.per_device == 1  # at least one: the memory check then says what does not fit


class _Chip:
    """A stand-in TPU device for start-up's plan: its platform and the memory it reports."""

    platform = "tpu"

    def __init__(self, bytes_limit: int):
        self.bytes_limit = bytes_limit

    def memory_stats(self) -> dict:
        return {"bytes_limit": self.bytes_limit}


def test_the_profiles_kv_cache_turns_int8_only_where_bfloat16_holds_fewer_slots(tiny_model_dir, tmp_path, monkeypatch):
    """On a TPU the profile's KV cache is bfloat16 (the ragged kernel reads it faster than int8's);
    where bfloat16 would hold fewer of the profile's slots than int8, start-up takes int8 and says
    why; a format the user gave stays whatever it holds. The model: 8 kv heads of 64 (Llama 3.2
    1B's, whose int8 rows fill the pool's 128 lanes; the tiny model's 32 values a position pad
    to 128 lanes either way, so int8 with its scales holds fewer there, and bfloat16 stays)."""
    from loadtest.random_model import write_random_model
    from serving.startup.plan import plan_launch

    shape = load_model_config("llama3.2-1b").model_copy(update={
        "name": "kv-heads-test", "num_layers": 1, "embed_dim": 128, "num_heads": 8, "num_kv_heads": 8,
        "head_dim": 64, "mlp_dim": 128, "vocab_size": 384, "rope_scaling": None,
    })
    model_dir = write_random_model(tmp_path / "model", shape, tiny_model_dir, dtype="float32")
    monkeypatch.setenv("PATHSERVE_PLATFORM", "tpu")
    given = given_config(None, [], str(model_dir))
    asked = int(given.config.per_device_batch_size)
    assert given.config.quantize_kvcache is False and given.origin("quantize_kvcache") == FROM_PROFILE

    def plan(limit: int, overrides=()):
        g = given_config(None, list(overrides), str(model_dir))
        return plan_launch(g.config, str(model_dir), [_Chip(limit)], g.origins)

    plenty = plan(1 << 40)
    assert plenty.config.quantize_kvcache is False and plenty.config.per_device_batch_size == asked
    assert plenty.origins["quantize_kvcache"] == FROM_PROFILE
    # the largest power of two of memory in which bfloat16 holds fewer than the profile's slots
    limit = next(1 << k for k in range(40, 10, -1) if plan(1 << k, ["quantize_kvcache=false"]).config.per_device_batch_size < asked)
    floating = plan(limit, ["quantize_kvcache=false"])  # the user's choice: kept, fewer slots
    assert floating.config.quantize_kvcache is False and floating.origins["quantize_kvcache"] == FROM_OVERRIDE
    tight = plan(limit)
    held = int(floating.config.per_device_batch_size)
    assert tight.config.quantize_kvcache is True and tight.config.per_device_batch_size > held
    assert tight.origins["quantize_kvcache"] == f"{FROM_PROFILE} (bfloat16 holds {held} of {asked} slots)"
    assert "int8 kv cache: serving profile (bfloat16 holds" in tight.origins_line()
    tiny = given_config(None, [], str(tiny_model_dir))  # int8 rows padded as bfloat16's: bfloat16 stays
    kept = plan_launch(tiny.config, str(tiny_model_dir), [_Chip(1 << 28)], tiny.origins).config
    assert kept.quantize_kvcache is False and kept.per_device_batch_size < asked
