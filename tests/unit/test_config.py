"""The serving config: presets, YAML files, key=value overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.config import (
    ConfigError,
    ServingConfig,
    config_dir,
    load_config,
    load_model_config,
    model_presets,
    parse_overrides,
    read_yaml,
)

PRESETS = ["llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "llama3.2-1b", "smollm2-135m", "tiny-random"]


def test_presets_exist_and_parse():
    assert set(PRESETS) <= set(model_presets())
    for name in PRESETS:
        assert load_model_config(name).name == name


@pytest.mark.parametrize(
    ("name", "billions"),
    [("llama3.1-8b", 8.03), ("llama3.1-70b", 70.55), ("llama3.1-405b", 405.85), ("llama3.2-1b", 1.24)],
)
def test_preset_parameter_counts_match_the_published_sizes(name, billions):
    assert load_model_config(name).num_params / 1e9 == pytest.approx(billions, abs=0.01)


def test_smollm2_preset_size():
    cfg = load_model_config("smollm2-135m")
    assert cfg.num_params == pytest.approx(134.5e6, rel=1e-3)
    assert cfg.tie_embeddings and cfg.num_groups == 3


def test_llama31_presets_have_llama3_rope_scaling():
    cfg = load_model_config("llama3.1-405b")
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert cfg.num_kv_heads == 8 and cfg.rope_theta == 500000.0


def test_overrides_parse_as_yaml_scalars():
    assert parse_overrides(
        ["scan_layers=false", "max_target_length=64", "quantization=int8", "quantization="]
    ) == {
        "scan_layers": False,
        "max_target_length": 64,
        "quantization": "",
    }
    cfg = load_config(
        overrides=["scan_layers=false", "max_target_length=64", "max_prefill_predict_length=32"]
    )
    assert cfg.scan_layers is False and cfg.max_target_length == 64


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "serve.yml"
    path.write_text("model_name: llama3.1-8b\nquantization: int8\nper_device_batch_size: 4\n")
    cfg = load_config(path, ["per_device_batch_size=8"])
    assert (cfg.model_name, cfg.quantization, cfg.per_device_batch_size) == ("llama3.1-8b", "int8", 8.0)


@pytest.mark.parametrize(
    ("override", "must_mention"),
    [
        ("weight_dtype=float64", ["weight_dtype", "float32", "bfloat16"]),
        ("quantization=int4", ["quantization", "int8"]),
        ("max_target_length=abc", ["max_target_length", "integer"]),
        ("max_target_length=0", ["max_target_length", "greater than 0"]),
        ("scan_layers=maybe", ["scan_layers", "boolean"]),
        ("enable_background_warmup=later", ["enable_background_warmup", "boolean"]),
        ("ici_tensor_parallelism=0", ["ici_tensor_parallelism"]),
        ("max_target_lenght=8", ["max_target_lenght", "did you mean 'max_target_length'"]),
        ("no_such_key=1", ["unknown config key 'no_such_key'"]),
        ("checkpoint_is_quantized=true", ["checkpoint_is_quantized", "quantization=int8"]),
        ("quantize_activations=true", ["quantize_activations", "quantization=int8"]),
        ("max_prefill_predict_length=4096", ["max_prefill_predict_length", "max_target_length"]),
        ("justtext", ["key=value"]),
    ],
)
def test_bad_values_name_the_key(override, must_mention):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    for text in must_mention:
        assert text in str(info.value)


def test_bad_yaml_types_in_a_file(tmp_path):
    path = tmp_path / "bad.yml"
    path.write_text("max_target_length: '128'\n")
    with pytest.raises(ConfigError, match="max_target_length"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yml")


def test_unknown_model_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"llama3\.1-8b"):
        load_model_config("llama9")


def test_bad_model_preset_names_the_field(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "odd.yml").write_text(
        "name: odd\nnum_layers: 2\nembed_dim: 64\nnum_heads: 3\nnum_kv_heads: 2\nhead_dim: 16\nmlp_dim: 8\n"
        "vocab_size: 10\nrope_theta: 10000.0\nnorm_eps: 1.0e-5\nmax_position: 64\n"
    )
    monkeypatch.setenv("PATHSERVE_CONFIG_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="num_kv_heads"):
        load_model_config("odd")


def test_deploy_overrides_of_serving_are_parsed_as_serve_parses_them():
    """`pathserve deploy plan CONFIG key=value` and `pathserve serve key=value`: the same ServingConfig."""
    from pathlib import Path

    from serving.deploy.config import load_deployment

    config = Path(__file__).resolve().parents[2] / "configs" / "deployments" / "llama3.1-405b-int8-v6e-16.yml"
    overrides = ["per_device_batch_size=2.5", "scan_layers=true", "cpu_kernels=off", "max_target_length=4096"]
    deployed = load_deployment(config, overrides).serving_config()
    serving = dict(load_deployment(config).serving)
    served = load_config(
        serving.pop("base_config"),
        [f"{k}={v}" for k, v in serving.items()]
        + overrides
        + ["model_name=llama3.1-405b", "load_parameters_path=gs://my-bucket/checkpoints/llama3.1-405b-int8"],
    )
    assert deployed == served
    assert (deployed.per_device_batch_size, deployed.scan_layers, deployed.cpu_kernels) == (2.5, True, "off")


def test_the_placement_of_405b_on_the_seeds_mesh_without_jax():
    """serving.engine.partitioning (read by deploy plan on a laptop) under base.yml's rules: MaxText's
    axes, leaf by leaf."""
    import subprocess
    import sys

    from serving.engine.partitioning import Numerics, describe, placement

    where = placement(
        load_model_config("llama3.1-405b"),
        Numerics("bfloat16", "bfloat16", "int8", True),
        {"fsdp": 1, "autoregressive": 2, "tensor": 8},
        num_pages=160,
        page_size=2048,
    )
    specs = {"/".join(p): describe(leaf.spec) for p, leaf in where.params.items()}
    assert specs["layers/wq/values"] == "[-, -, tensor x autoregressive]"
    assert specs["layers/wk/values"] == specs["layers/wk/scales"] == "[-, -, tensor]"  # 8 kv heads
    assert specs["layers/w_down/values"] == "[-, tensor x autoregressive, -]"
    assert specs["layers/w_down/scales"] == "[-, -, -]"  # [1, embed]: fsdp is 1
    # quantization=int8 is MaxText's: the layers' matmuls in int8, the embedding and head in bfloat16.
    assert specs["embed"] == "[tensor x autoregressive, -]" and specs["final_norm"] == "[tensor]"
    assert where.params[("embed",)].dtype == where.params[("lm_head",)].dtype == "bfloat16"
    # base.yml: cache_heads over (autoregressive, tensor), 8 kv heads split 8 ways; slots whole.
    assert {describe(leaf.spec) for leaf in where.cache.values()} == {"[-, -, -, tensor, -]"}
    assert where.cache[("k",)].shape == (126, 160, 2048, 8, 128)
    assert where.cache_bytes_per_chip() == 160 * 2048 * 126 * 2 * (128 + 4)  # one kv head per chip
    code = "import sys, serving.engine.partitioning; assert 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compilation_cache_auto_is_pathserve_homes_unless_jax_has_one(monkeypatch, tmp_path):
    from serving.runtime import compilation_cache_dir

    monkeypatch.setenv("PATHSERVE_HOME", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert compilation_cache_dir("auto") == str(tmp_path / "jax-cache")
    assert compilation_cache_dir("") == ""
    assert compilation_cache_dir("~/cache") == str(Path.home() / "cache")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/elsewhere")  # JAX reads it itself
    assert compilation_cache_dir("auto") == ""
    served = read_yaml(config_dir() / "serving" / "default.yml")  # the default model's serving config
    assert load_config(None, [], defaults=served).devices.jax_compilation_cache_dir == "auto"


def test_the_background_warmup_is_on_by_default_and_off_by_its_own_key():
    """enable_background_warmup reaches the engine's part; off, the warmup starts no thread and
    leaves `engine.background_warmup` None (those shapes compile at first use)."""
    from types import SimpleNamespace

    from serving.engine.warmup import start_background

    assert load_config().engine.enable_background_warmup is True
    cfg = load_config(overrides=["enable_model_warmup=true", "enable_background_warmup=false"])
    assert (cfg.enable_model_warmup, cfg.engine.enable_background_warmup) == (True, False)
    engine = SimpleNamespace(config=cfg.engine)
    assert start_background(engine, {}, state=None, shapes=[(1, 16, 128)]) is None


def test_each_default_is_written_once_on_servingconfig_and_the_parts_read_it():
    """A component's part built with no arguments equals ServingConfig's defaults' part."""
    from serving.config import (
        DevicesConfig,
        EngineConfig,
        LoraConfig,
        OrchestratorConfig,
        ServerConfig,
        ServingConfig,
        SpeculativeConfig,
    )

    cfg = ServingConfig()
    assert (cfg.engine, cfg.lora, cfg.devices, cfg.server) == (EngineConfig(), LoraConfig(), DevicesConfig(), ServerConfig())
    assert (cfg.orchestrator, cfg.speculative) == (OrchestratorConfig(), SpeculativeConfig())
    source = (Path(__file__).parents[2] / "serving" / "config.py").read_text()
    assert source.count("max_lora_rank: int = Field(default=16") == 1 and "max_lora_rank: int = 16" not in source


@pytest.mark.parametrize("page", [16, 64])
def test_attention_paged_over_the_default_serving_file_takes_maxtexts_page_size(page):
    # the default serving file leaves prefix_block_size unset: given there, MaxText's
    # pagedattn_tokens_per_page (64 in a test of the disaggregated groups) was refused as differing
    cfg = load_config(
        config_dir() / "serving" / "default.yml",
        ["attention=paged", "pagedattn_num_pages=512", f"pagedattn_tokens_per_page={page}"],
    )
    assert cfg.prefix_block_size == page
    assert load_config(config_dir() / "serving" / "default.yml").prefix_block_size == 32


def test_attention_paged_sizes_the_pool_with_maxtexts_keys():
    cfg = ServingConfig(attention="paged", pagedattn_num_pages=40, pagedattn_tokens_per_page=16, max_target_length=256, max_prefill_predict_length=64)
    assert cfg.prefix_block_size == 16 and cfg.engine.pagedattn_num_pages == 40
    # MaxText reads the pagedattn_* keys only with attention=paged
    assert ServingConfig(pagedattn_tokens_per_page=16).prefix_block_size == 32
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        ServingConfig(attention="paged", pagedattn_num_pages=16, pagedattn_tokens_per_page=16, max_target_length=256, max_prefill_predict_length=64)
    with pytest.raises(ValueError, match=r"pagedattn_max_pages_per_group \(8\) is below the 16 pages"):
        ServingConfig(attention="paged", pagedattn_tokens_per_page=16, pagedattn_max_pages_per_group=8, max_target_length=256, max_prefill_predict_length=64)
    with pytest.raises(ValueError, match="with attention=paged the page is the prefix cache's block"):
        ServingConfig(attention="paged", pagedattn_tokens_per_page=16, prefix_block_size=64, max_target_length=256, max_prefill_predict_length=64)
    with pytest.raises(ValueError, match="both size the pool"):
        ServingConfig(attention="paged", kv_cache_bytes_per_chip=1 << 20, max_target_length=256, max_prefill_predict_length=64)


def test_kv_quant_axis_is_maxtexts_scale_layout_in_the_placement():
    from serving.engine.partitioning import Numerics, describe, placement

    cfg = load_model_config("llama3.1-405b")
    axes = {"fsdp": 1, "autoregressive": 2, "tensor": 8}
    per_head = placement(cfg, Numerics("bfloat16", "bfloat16", "int8", True), axes, num_pages=160, page_size=64)
    per_token = placement(
        cfg, Numerics("bfloat16", "bfloat16", "int8", True, kv_quant_axis="heads_and_dkv"), axes, num_pages=160, page_size=64
    )
    assert per_head.cache[("k_scale",)].shape == (126, 160, 64, 8, 1)
    assert describe(per_head.cache[("k_scale",)].spec) == "[-, -, -, tensor, -]"
    assert per_token.cache[("k_scale",)].shape == (126, 160, 64, 1, 1)
    assert describe(per_token.cache[("k_scale",)].spec) == "[-, -, -, -, -]"  # every chip of the token's pages
    with pytest.raises(ValueError, match="quantize_kvcache=true needs kv_quant_axis"):
        ServingConfig(quantize_kvcache=True, kv_quant_axis="")


def test_attention_without_paged_and_its_keys_are_logged_as_without_effect(caplog):
    with caplog.at_level("WARNING", logger="serving.config"):
        ServingConfig(attention="flash", pagedattn_num_pages=80)
    assert "no effect on serving" in caplog.text and "attention=flash, pagedattn_num_pages" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="serving.config"):
        ServingConfig()
    assert "no effect" not in caplog.text
