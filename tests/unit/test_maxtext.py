"""MaxText config files read as MaxText reads them (serving.maxtext_config), and the JetStream guide's engine
arguments, verbatim, through `pathserve deploy plan` (no JAX)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from serving.cli.main import main
from serving.config import ConfigError, load_config, model_description
from serving.deploy.config import load_deployment
from serving.deploy.plan import make_plan
from serving.engine.partitioning import Numerics, describe, placement

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENT = REPO / "configs" / "deployments" / "llama3.1-405b-int8-v6e-16.yml"
# The engine container's arguments in the JetStream-on-Pathways guide's LeaderWorkerSet, verbatim.
GUIDE_ARGS = ["MaxText/configs/v5e/inference/llama3_405b_v5e-64.yml", "model_name=llama3.1-405b", "load_parameters_path=CHECKPOINT_PATH", "max_prefill_predict_length=1024", "max_target_length=2048", "async_checkpointing=false", "steps=1", "ici_fsdp_parallelism=1", "ici_autoregressive_parallelism=2", "ici_tensor_parallelism=8", "scan_layers=false", "weight_dtype=bfloat16", "per_device_batch_size=10", "enable_single_controller=true", "quantization=int8", "quantize_kvcache=true", "checkpoint_is_quantized=true", "enable_model_warmup=true"]
TODAY = "src/maxtext/configs/inference/multihost/interleaved/llama3_405b_v5e-64.yml"


def _rules(cfg) -> dict[str, list]:
    return {name: list(axes) for name, axes in Numerics.of(cfg).logical_axis_rules}


def test_the_guides_arguments_load_with_the_recipes_rules_and_name_the_keys_without_effect(caplog):
    with caplog.at_level(logging.WARNING, logger="serving.maxtext_config"):
        cfg = load_config(GUIDE_ARGS[0], GUIDE_ARGS[1:])
    assert (cfg.model_name, cfg.load_parameters_path, cfg.per_device_batch_size) == (
        "llama3.1-405b", "CHECKPOINT_PATH", 10.0,
    )
    assert (cfg.quantization, cfg.quantize_kvcache, cfg.scan_layers, cfg.weight_dtype) == ("int8", True, False, "bfloat16")
    assert cfg.dtype == "bfloat16"  # base.yml's default, as in MaxText
    assert cfg.replicate_quant_scale is True and cfg.enable_model_warmup is True
    rules = _rules(cfg)
    # The guide's path keeps the rules it had there (the recipe's list replaces base.yml's).
    assert rules["cache_batch"] == ["autoregressive"] and rules["cache_heads"] == ["tensor"]
    assert rules["q_heads"] == ["tensor", "autoregressive"] and rules["kv_head_dim"] == ["autoregressive"]
    assert "embed_vocab" not in rules  # base.yml's list is replaced, not merged
    logged = " ".join(r.getMessage() for r in caplog.records)
    for key in ("async_checkpointing", "steps", "enable_single_controller", "sharding_strategy"):
        assert key in logged
    assert logged.count("no effect on serving") == 1


def test_todays_paths_resolve_to_todays_rules():
    for path in (TODAY, "MaxText/configs/tpu/v5e/llama3_405b_v5e-64.yml"):
        rules = _rules(load_config(path))
        assert rules["q_heads"] == ["tensor"] and rules["kv_head_dim"] == []
        assert rules["cache_batch"] == ["autoregressive"]
    disaggregated = _rules(load_config("inference/multihost/disaggregation/llama3_405b_v6e-16-16.yml"))
    assert disaggregated["cache_batch"] == []


def test_rules_given_as_an_override_merge_by_name_unless_told_to_replace():
    merged = _rules(load_config(TODAY, ["logical_axis_rules=[['cache_batch', []], ['extra', ['tensor']]]"]))
    assert merged["cache_batch"] == [] and merged["extra"] == ["tensor"] and merged["cache_heads"] == ["tensor"]
    replaced = load_config(
        TODAY, ["override_logical_axis_rules=true", "logical_axis_rules=[['cache_batch', []]]"]
    )
    assert _rules(replaced) == {"cache_batch": []}
    # Without a file the chain is base.yml: an override merges with its rules.
    plain = _rules(load_config(overrides=["logical_axis_rules=[['norm', []]]"]))
    assert plain["norm"] == [] and plain["cache_heads"] == ["autoregressive", "tensor", "tensor_sequence"]


def test_a_users_own_file_chains_beside_itself_then_to_the_configs_root(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "parent.yml").write_text(
        'base_config: "inference/inference_jetstream.yml"\nper_device_batch_size: 3\nsteps: 5\n'
    )
    (tmp_path / "mine" / "child.yml").write_text(
        "base_config: parent.yml\nmax_target_length: 256\nlogical_axis_rules: [['cache_batch', ['fsdp']]]\n"
    )
    cfg = load_config(tmp_path / "mine" / "child.yml", ["max_prefill_predict_length=32"])
    assert (cfg.per_device_batch_size, cfg.max_target_length, cfg.max_prefill_predict_length) == (3.0, 256, 32)
    assert _rules(cfg) == {"cache_batch": ["fsdp"]}
    assert cfg.ici_fsdp_parallelism == -1  # base.yml's: fsdp takes the devices the others leave
    assert cfg.parallelism(16) == (16, 1, 1)


def test_a_missing_base_config_and_an_unknown_key_are_named(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text('base_config: "no/such/parent.yml"\n')
    with pytest.raises(ConfigError, match=r"base_config 'no/such/parent.yml' not found"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"unknown config key 'per_device_batch_sise'.*per_device_batch_size"):
        load_config(TODAY, ["per_device_batch_sise=2"])
    with pytest.raises(ConfigError, match=r"config file not found: MaxText/configs/v5e/nope\.yml"):
        load_config("MaxText/configs/v5e/nope.yml")


def test_a_presets_keys_need_override_model_config():
    with pytest.raises(ConfigError, match=r"base_num_decoder_layers.*override_model_config=true"):
        load_config(TODAY, ["base_num_decoder_layers=4"])
    cfg = load_config(TODAY, ["override_model_config=true", "base_num_decoder_layers=4"])
    model = model_description(cfg)
    assert (model.name, model.num_layers, model.embed_dim, model.num_kv_heads) == ("llama3.1-405b", 4, 16384, 8)


def test_a_model_without_a_preset_is_described_as_maxtext_describes_one():
    cfg = load_config(
        "inference/inference_jetstream.yml",
        [
            "model_name=my-llama", "override_model_config=true", "base_emb_dim=64", "base_num_query_heads=4",
            "base_num_kv_heads=2", "base_num_decoder_layers=2", "base_mlp_dim=128", "head_dim=16",
            "vocab_size=256", "rope_max_timescale=10000", "max_target_length=512",
        ],
    )
    model = model_description(cfg)
    assert (model.name, model.num_layers, model.num_heads, model.head_dim, model.vocab_size) == (
        "my-llama", 2, 4, 16, 256,
    )
    assert model.rope_theta == 10000.0 and not model.tie_embeddings and model.max_position == 512


def test_a_maxtext_model_pathserve_has_no_preset_for_is_refused_not_served_as_base_ymls():
    """MaxText reads configs/models/gemma-2b.yml; base.yml's "default" description must not stand
    in for it (it planned a 16-layer llama of 32,000 tokens)."""
    with pytest.raises(ConfigError, match=r"model_name: 'gemma-2b' has no pathserve preset"):
        load_config("MaxText/configs/base.yml", ["model_name=gemma-2b"])
    assert load_config("MaxText/configs/base.yml", ["model_name=llama3.1-8b"]).model_name == "llama3.1-8b"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["decoder_block=gemma"], "decoder_block='gemma'"),
        (["mlp_activations=[gelu,linear]"], "mlp_activations="),
        (["quantize_kvcache=true", "kv_quant_dtype=int4"], "kv_quant_dtype='int4'"),
        (["ici_data_parallelism=2", "ici_fsdp_parallelism=-1"], "ici_data_parallelism=2"),
        (["dcn_fsdp_parallelism=2"], "dcn_fsdp_parallelism=2"),
        (["sliding_window_size=4096"], "sliding_window_size=4096"),
        (["add_bos=false"], "add_bos=False"),
        (["save_quantized_params_path=gs://b/q"], "save_quantized_params_path="),
        (["load_full_state_path=gs://b/s"], "load_full_state_path="),
        (["model_name=llama3-8b", "rope_type=llama3.1"], "rope_type='llama3.1'"),
        (["rope_type=yarn"], "rope_type='yarn'"),
        (["attention=bogus"], "attention"),
    ],
)
def test_maxtext_keys_that_would_change_what_is_served_are_refused_by_name(overrides, named):
    """A MaxText key pathserve does not implement is accepted at base.yml's value (recipes carry
    them) and refused, naming it, at any value with which MaxText would serve something else."""
    for path in (None, "MaxText/configs/base.yml"):
        with pytest.raises(ConfigError, match=re.escape(named)):
            load_config(path, ["model_name=llama3.1-8b", *overrides] if "model_name=" not in " ".join(overrides) else overrides)


def test_maxtext_keys_at_base_ymls_values_still_load_and_the_profiler_flag_maps_without_a_file():
    neutral = ["decoder_block=llama2", "mlp_activations=[silu,linear]", "kv_quant_dtype=int8", "ici_data_parallelism=1",
               "dcn_data_parallelism=-1", "add_bos=true", "rope_type=default", "model_name=llama3.1-8b", "rope_type=llama3.1"]
    assert load_config(None, neutral).model_name == "llama3.1-8b"
    assert load_config(None, ["enable_jax_profiler=true", "jax_profiler_port=9123"]).profiler_port == 9123


def test_maxtexts_own_base_yml_a_root_without_base_config_is_read_as_maxtext_reads_it(tmp_path):
    """MaxText's base.yml has no base_config (it is every chain's root): keys only MaxText has say
    what it is. Its prefill_chunk_size (256, over a max_prefill_predict_length of 64) counts only
    with use_chunked_prefill, and its default model's keys give way to a preset's."""
    root = tmp_path / "base.yml"
    root.write_text(
        "run_name: ''\nsteps: 150001\nmodel_name: default\nbase_emb_dim: 2048\nbase_num_query_heads: 16\n"
        "base_num_kv_heads: 16\nbase_num_decoder_layers: 16\nbase_mlp_dim: 7168\nhead_dim: 128\n"
        "vocab_size: 32000\nmax_prefill_predict_length: 64\nmax_target_length: 2048\n"
        "prefill_chunk_size: 256\nuse_chunked_prefill: false\nkv_quant_axis: heads_and_dkv\n"
    )
    cfg = load_config(str(root), ["model_name=llama3.1-8b"])
    assert (cfg.model_name, cfg.prefill_chunk_size, cfg.kv_quant_axis) == ("llama3.1-8b", 0, "heads_and_dkv")
    assert model_description(cfg).num_layers == 32  # the preset's, not base.yml's 16
    with pytest.raises(ConfigError, match="prefill_chunk_size"):  # asked for on the command line: checked
        load_config(str(root), ["model_name=llama3.1-8b", "prefill_chunk_size=256"])


def test_the_recipes_placement_of_405b_splits_slots_and_heads_without_copies():
    """The issue's figures: 160 slots x 2048 positions of int8 KV (84.6 GB) are 5.3 GB per chip."""
    cfg = load_config(TODAY, GUIDE_ARGS[1:])
    where = placement(
        model_description(cfg), Numerics.of(cfg), {"fsdp": 1, "autoregressive": 2, "tensor": 8}, 160, 2048
    )
    k = where.cache[("k",)]
    assert describe(k.spec) == "[-, autoregressive, -, tensor, -]"
    assert k.nbytes * 2 == pytest.approx(84.56e9, rel=1e-3)
    assert where.cache_bytes_per_chip() == 126 * 2 * 80 * 2048 * (128 + 4)  # 80 slots, 1 kv head
    assert where.cache_bytes_per_chip() / 1e9 == pytest.approx(5.45, abs=0.01)  # values 5.29 + scales
    specs = {"/".join(p): describe(leaf.spec) for p, leaf in where.params.items()}
    assert specs["layers/wq/values"] == "[-, -, tensor]"  # today's q_heads: tensor
    assert specs["layers/wq/scales"] == "[-, -, -]"  # replicate_quant_scale
    assert specs["layers/wo/values"] == "[-, tensor x autoregressive, -]"
    assert where.notes == ()


def test_deploy_plan_takes_the_guides_arguments_verbatim(capsys):
    assert main(["deploy", "plan", str(DEPLOYMENT), *GUIDE_ARGS, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["slots"] == 160 and plan["chips"] == 16
    assert plan["bytes_limit_per_chip"] == 33_550_237_696
    used = plan["weight_bytes_per_chip"] + plan["kv_bytes_per_chip"] + plan["temporaries_bytes_per_chip"]
    assert used < 33.55e9 and plan["headroom_bytes_per_chip"] == pytest.approx(33_550_237_696 - used)
    assert 30e9 < used < 32e9  # "about 31 GB per chip"


def test_the_deployment_renders_the_guides_arguments_unchanged():
    cfg = load_deployment(DEPLOYMENT)
    assert cfg.serving_args() == [
        *GUIDE_ARGS[:2],
        "load_parameters_path=gs://my-bucket/checkpoints/llama3.1-405b-int8",
        *GUIDE_ARGS[3:],
        "grpc_port=9000",  # the port the Service names, after the guide's arguments
    ]
    assert make_plan(cfg).slots == 160


def test_405b_in_bfloat16_on_v6e_16_is_refused_with_the_numbers(capsys):
    args = [a for a in GUIDE_ARGS if not a.startswith(("quantization=", "checkpoint_is_quantized="))]
    args += ["quantization=", "checkpoint_is_quantized=false"]  # over the deployment file's int8
    assert main(["deploy", "plan", str(DEPLOYMENT), *args]) == 2
    err = capsys.readouterr().err
    assert "exceed its bytes_limit of 33.55 GB" in err and "params 50.74 GB" in err
    assert "quantization=int8" in err


def test_serve_checks_a_live_devices_bytes_limit_before_placing_anything():
    """serving.engine.memory.check_devices, as launch calls it: the plan's sum against each device's
    memory_stats()["bytes_limit"]; devices without memory stats (CPUs) are not checked."""
    from types import SimpleNamespace

    from serving.engine.memory import check_devices, memory_use

    cfg = load_config(GUIDE_ARGS[0], GUIDE_ARGS[1:])
    model = model_description(cfg)
    where = placement(model, Numerics.of(cfg), {"fsdp": 1, "autoregressive": 2, "tensor": 8}, 160, 2048)
    need = memory_use(model, where, cfg.dtype, 1024, 160).total

    def device(limit):
        return SimpleNamespace(memory_stats=lambda: {"bytes_limit": limit})

    cpu = SimpleNamespace(memory_stats=lambda: None)
    v6e = device(33_550_237_696)
    check_devices(model, where, cfg.dtype, 1024, 160, [cpu, v6e])  # fits
    with pytest.raises(ConfigError, match=r"does not fit: params 25\.72 GB \+ KV cache 5\.45 GB .* exceed its bytes_limit"):
        check_devices(model, where, cfg.dtype, 1024, 160, [device(need - 1)])
    # Today's recipe path splits q heads only 8 ways: with MaxText's int8 (embedding and head in
    # bfloat16) its 160 slots no longer fit a v6e.
    today = load_config(TODAY, GUIDE_ARGS[1:])
    where = placement(model, Numerics.of(today), {"fsdp": 1, "autoregressive": 2, "tensor": 8}, 160, 2048)
    with pytest.raises(ConfigError, match=r"params 28\.09 GB \+ KV cache 5\.45 GB"):
        check_devices(model, where, today.dtype, 1024, 160, [v6e])
