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
