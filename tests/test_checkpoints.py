"""Checkpoint conversion (HF, Meta, GGUF) to Orbax, restore, int8, verify, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from serving.checkpoints.checkpoint import read_metadata
from serving.checkpoints.convert import convert
from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.hf import load_hf_params, read_hf_config
from serving.checkpoints.model_source import default_checkpoint_dir
from serving.checkpoints.restore import load_checkpoint_tokenizer, restore_params
from serving.checkpoints.verify import verify
from serving.models import prefill
from tests.cli import call_cli, run_cli
from tests.conftest import DATA, make_hf_llama

TOKENS = jnp.asarray([[5, 17, 250, 3, 99, 42, 7, 1, 300, 11, 64, 2]])
LENGTHS = jnp.array([12])


def logits(params, cfg):
    out, _ = prefill(params, TOKENS, LENGTHS, cfg)
    return np.asarray(out)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
def test_hf_round_trip_float32_is_identical(tiny_model_dir, tmp_path, scan_layers):
    cfg = read_hf_config(tiny_model_dir)
    expected = logits(load_hf_params(tiny_model_dir, cfg), cfg)
    convert(tiny_model_dir, str(tmp_path / "ckpt"), dtype="float32", scan_layers=scan_layers, progress=False)
    restored = restore_params(str(tmp_path / "ckpt"))
    assert np.abs(logits(restored, cfg) - expected).max() <= 1e-5
    metadata = read_metadata(str(tmp_path / "ckpt"))
    assert metadata.source_format == "hf" and metadata.scan_layers is scan_layers
    assert metadata.config == cfg
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tempfile, "tempdir", str(scratch))
        tokenizer = load_checkpoint_tokenizer(str(tmp_path / "ckpt"), metadata)
    assert tokenizer.decode(tokenizer.encode("the lighthouse keeper")) == "the lighthouse keeper"
    assert list(scratch.iterdir()) == []  # the tokenizer's files were staged in a directory since removed


def _interleave_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's half-split q/k rows -> Meta's interleaved pairs (the inverse of our loader's step)."""
    pairs = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, pairs, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_meta_checkpoint(hf_dir: Path, out: Path, num_shards: int = 2) -> Path:
    """Meta's layout from a Hugging Face model: renamed, q/k interleaved, split into model-parallel shards."""
    import torch
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    state = load_file(str(hf_dir / "model.safetensors"))
    names = {
        "self_attn.q_proj": ("attention.wq", 0),
        "self_attn.k_proj": ("attention.wk", 0),
        "self_attn.v_proj": ("attention.wv", 0),
        "self_attn.o_proj": ("attention.wo", 1),
        "mlp.gate_proj": ("feed_forward.w1", 0),
        "mlp.up_proj": ("feed_forward.w3", 0),
        "mlp.down_proj": ("feed_forward.w2", 1),
        "input_layernorm": ("attention_norm", None),
        "post_attention_layernorm": ("ffn_norm", None),
    }
    meta: dict[str, tuple[torch.Tensor, int | None]] = {
        "tok_embeddings.weight": (state["model.embed_tokens.weight"], 0),
        "norm.weight": (state["model.norm.weight"], None),
        "output.weight": (state["lm_head.weight"], 0),
    }
    for i in range(config["num_hidden_layers"]):
        for hf, (name, axis) in names.items():
            tensor = state[f"model.layers.{i}.{hf}.weight"]
            if name == "attention.wq":
                tensor = torch.from_numpy(_interleave_rotary_rows(tensor.numpy(), heads))
            elif name == "attention.wk":
                tensor = torch.from_numpy(_interleave_rotary_rows(tensor.numpy(), kv_heads))
            meta[f"layers.{i}.{name}.weight"] = (tensor, axis)
    out.mkdir()
    for shard in range(num_shards):
        part = {
            name: (t.clone() if axis is None else torch.chunk(t, num_shards, dim=axis)[shard].clone()).to(
                torch.bfloat16
            )
            for name, (t, axis) in meta.items()
        }
        torch.save(part, out / f"consolidated.{shard:02d}.pth")
    params = {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": kv_heads,
        "vocab_size": config["vocab_size"],
        "norm_eps": config["rms_norm_eps"],
        "rope_theta": config["rope_parameters"]["rope_theta"],
        "use_scaled_rope": config["rope_parameters"].get("rope_type") == "llama3",
        "rope_scaling_factor": config["rope_parameters"].get("factor", 8.0),
    }
    (out / "params.json").write_text(json.dumps(params))
    return out


def test_meta_two_shards_convert_to_the_same_logits_as_hf(tmp_path):
    # Meta's llama3 rope scaling has fixed factors (original context 8192), so build the HF model alike.
    hf_dir = make_hf_llama(
        tmp_path / "hf", num_kv_heads=2, rope_scaling=True, vocab=320, original_max_position=8192
    )
    cfg = read_hf_config(hf_dir)
    # Meta checkpoints are bfloat16: compare against the HF model rounded the same way.
    expected = logits(load_hf_params(hf_dir, cfg, "bfloat16"), cfg)
    meta_dir = write_meta_checkpoint(hf_dir, tmp_path / "meta")
    result = call_cli("convert", str(meta_dir), str(tmp_path / "ckpt"), "--dtype", "float32", "--quiet")
    assert result.returncode == 0, result.stderr
    metadata = read_metadata(str(tmp_path / "ckpt"))
    assert metadata.source_format == "meta"
    assert metadata.config.model_copy(update={"name": cfg.name, "max_position": cfg.max_position}) == cfg
    assert np.abs(logits(restore_params(str(tmp_path / "ckpt")), cfg) - expected).max() <= 1e-5


@pytest.fixture(scope="module")
def smollm2_checkpoints(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("smollm2")
    convert(smollm2_path, str(root / "bf16"), dtype="bfloat16", progress=False)
    convert(smollm2_path, str(root / "int8"), dtype="bfloat16", quantize="int8", progress=False)
    return root


def _tensor_bytes(path: Path) -> int:
    """Stored tensor bytes (shape x itemsize, as `pathserve inspect` reports them)."""
    import ml_dtypes

    tensors = read_metadata(str(path)).tensors.values()
    return sum(
        int(np.prod(t["shape"]))
        * np.dtype(ml_dtypes.bfloat16 if t["dtype"] == "bfloat16" else t["dtype"]).itemsize
        for t in tensors
    )


def test_int8_smollm2_checkpoint_quality_and_size(smollm2_checkpoints):
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig

    models = {  # each checkpoint restored once; the bf16 one also gives the tokenizer
        name: load_model(str(smollm2_checkpoints / name), ServingConfig(**overrides))
        for name, overrides in (
            ("bf16", {}),
            ("int8", {"quantization": "int8w", "checkpoint_is_quantized": True}),
        )
    }
    ids = jnp.asarray([models["bf16"].tokenizer.encode((DATA / "english.txt").read_text())[:257]])
    results = {}
    for name, model in models.items():
        out, _ = prefill(model.params, ids, jnp.array([ids.shape[1]]), model.config)
        logprobs = np.asarray(jnp.take_along_axis(jax_log_softmax(out[0, :-1]), ids[0, 1:, None], axis=-1))
        results[name] = (np.argmax(np.asarray(out[0, :-1]), -1), float(np.exp(-logprobs.mean())))
    agreement = np.mean(results["int8"][0] == results["bf16"][0])
    assert agreement >= 0.9, agreement
    assert results["int8"][1] <= results["bf16"][1] * 1.02, results
    assert _tensor_bytes(smollm2_checkpoints / "int8") <= 0.55 * _tensor_bytes(smollm2_checkpoints / "bf16")


def jax_log_softmax(x):
    import jax

    return jax.nn.log_softmax(x, axis=-1)


def test_an_int8_checkpoint_refuses_flags_that_contradict_its_metadata(smollm2_checkpoints):
    ckpt = str(smollm2_checkpoints / "int8")
    result = run_cli("generate", ckpt, "--prompt", "hi", "quantization=")
    assert result.returncode == 2 and "quantization=''" in result.stderr and "int8" in result.stderr
    result = run_cli("perplexity", ckpt, "--text-file", str(DATA / "english.txt"), "checkpoint_is_quantized=false")
    assert result.returncode == 2 and "checkpoint_is_quantized=False" in result.stderr


def test_generate_and_perplexity_take_an_int8_checkpoint_without_flags(smollm2_checkpoints):
    ckpt = str(smollm2_checkpoints / "int8")
    result = run_cli("generate", ckpt, "--prompt", "The capital of France is", "--max-tokens", "6", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert "Paris" in out["text"] and out["quantization"] == "int8w"  # weight-only, as converted
    result = run_cli("perplexity", ckpt, "--text-file", str(DATA / "english.txt"), "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert 1 < out["perplexity"] < 100 and out["quantization"] == "int8w"


@pytest.mark.slow  # converts the default model in an empty home (docs/development.md)
def test_default_model_is_converted_once_into_pathserve_home(tmp_path):
    env_home = {"PATHSERVE_HOME": str(tmp_path / "home")}
    # The conversion is what is under test, not the CPU kernels' build (keyed by their sources,
    # serving/kernels/library.py): the empty home borrows the suite's kernels directory.
    shared_kernels = Path(os.environ["PATHSERVE_HOME"]) / "kernels"
    shared_kernels.mkdir(parents=True, exist_ok=True)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "kernels").symlink_to(shared_kernels, target_is_directory=True)
    args = ("generate", "--prompt", "Hello", "--max-tokens", "2", "--json")
    first = subprocess.run(
        [sys.executable, "-m", "serving.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**_env(), **env_home},
    )
    assert first.returncode == 0, first.stderr
    assert "converting the default model" in first.stderr
    second = subprocess.run(
        [sys.executable, "-m", "serving.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**_env(), **env_home},
    )
    assert second.returncode == 0 and "converting" not in second.stderr
    assert json.loads(first.stdout) == json.loads(second.stdout)
    assert (Path(env_home["PATHSERVE_HOME"]) / "checkpoints" / default_checkpoint_dir().name / "pathserve.json").is_file()


def _env() -> dict:
    import os

    return dict(os.environ)


def test_verify_names_a_flipped_byte(tiny_model_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    convert(tiny_model_dir, str(ckpt), dtype="float32", progress=False)
    assert verify(str(ckpt)).bad == []
    chunk = next(p for p in sorted((ckpt / "params" / "layers.w_up").iterdir()) if not p.name.startswith("."))
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x40
    chunk.write_bytes(bytes(data))
    result = call_cli("verify", str(ckpt))
    assert result.returncode == 2
    assert "BAD layers.w_up[" in result.stdout and "Traceback" not in result.stderr
    assert "layers.w_up" in result.stderr or "failed verification" in result.stderr


def test_existing_destination_is_refused_unless_overwrite(tiny_model_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert call_cli("convert", str(tiny_model_dir), str(ckpt), "--quiet").returncode == 0
    again = call_cli("convert", str(tiny_model_dir), str(ckpt), "--quiet")
    assert again.returncode == 2 and "--overwrite" in again.stderr
    replaced = call_cli(
        "convert", str(tiny_model_dir), str(ckpt), "--quiet", "--overwrite", "--quantize", "int8"
    )
    assert replaced.returncode == 0, replaced.stderr
    assert read_metadata(str(ckpt)).quantization == "int8"


def _assert_nothing_written(tmp_path: Path, dst: Path) -> None:
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_truncated_safetensors_leaves_nothing_at_dst(tiny_model_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-2000])
    result = call_cli("convert", str(broken), str(tmp_path / "ckpt"), "--quiet")
    assert result.returncode == 2 and "truncated" in result.stderr and "Traceback" not in result.stderr
    _assert_nothing_written(tmp_path, tmp_path / "ckpt")


def test_wrong_shape_for_the_config_names_the_tensor(tiny_model_dir, tmp_path):
    result = call_cli(
        "convert", str(tiny_model_dir), str(tmp_path / "ckpt"), "--model-config", "tiny-random", "--quiet"
    )
    assert result.returncode == 2
    assert "tensor '" in result.stderr and "does not match the model config 'tiny-random'" in result.stderr
    _assert_nothing_written(tmp_path, tmp_path / "ckpt")


def test_bad_convert_arguments(tiny_model_dir, tmp_path):
    missing = call_cli("convert", str(tmp_path / "nothing"), str(tmp_path / "ckpt"))
    assert missing.returncode == 2 and "not found" in missing.stderr
    bad_format = call_cli("convert", str(tiny_model_dir), str(tmp_path / "ckpt"), "--format", "onnx")
    assert bad_format.returncode == 2 and "--format" in bad_format.stderr
    wrong_format = call_cli("convert", str(tiny_model_dir), str(tmp_path / "ckpt"), "--format", "gguf")
    assert wrong_format.returncode == 2 and "Traceback" not in wrong_format.stderr
    _assert_nothing_written(tmp_path, tmp_path / "ckpt")
    not_a_checkpoint = call_cli("inspect", str(tmp_path))
    assert not_a_checkpoint.returncode == 2 and "pathserve.json" in not_a_checkpoint.stderr


def test_inspect_prints_table_and_json(tiny_model_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    convert(tiny_model_dir, str(ckpt), quantize="int8", progress=False)
    table = call_cli("inspect", str(ckpt))
    assert table.returncode == 0 and "layers.wq.values" in table.stdout and "int8" in table.stdout
    as_json = json.loads(call_cli("inspect", str(ckpt), "--json").stdout)
    assert as_json["quantization"] == "int8" and as_json["source_format"] == "hf"
    assert set(as_json["tensors"]["layers.wq.values"]["sha256"]) == {
        "layers.wq.values[0]",
        "layers.wq.values[1]",
    }


def test_gguf_source_in_raises_for_a_truncated_file(tmp_path, smollm2_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(smollm2_path.read_bytes()[: 10 << 20])
    result = call_cli("convert", str(broken), str(tmp_path / "ckpt"), "--quiet")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    _assert_nothing_written(tmp_path, tmp_path / "ckpt")
    with pytest.raises(CheckpointError):
        convert(broken, str(tmp_path / "ckpt2"), progress=False)


@pytest.mark.parametrize("missing", ["num_attention_heads", "hidden_size", "vocab_size"])
def test_hf_config_without_a_key_is_a_checkpoint_error_naming_it(missing):
    from serving.checkpoints.hf import model_config_from_hf

    config = {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "intermediate_size": 112,
        "vocab_size": 320,
    }
    del config[missing]
    with pytest.raises(CheckpointError, match=missing):
        model_config_from_hf(config, "x")
