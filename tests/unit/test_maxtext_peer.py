"""loadtest/maxtext_peer.py's parts that need no MaxText: the arguments -> MaxText key=value list
(the shape from our presets, the run's settings, quantization, the user's overrides last), the
rates and the one-line summary, and the JSON written as phases start and finish. MaxText itself
runs only in its own venv or on the chip (`make bench-tpu-maxtext`); this module never imports it."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from loadtest import maxtext_peer


def _keys(*argv: str) -> dict[str, str]:
    ns = maxtext_peer.parse_args(["out", *argv])
    return maxtext_peer.maxtext_keys(ns, maxtext_peer.load_preset(ns.shape), ns.out)


def test_llama32_1b_is_described_to_maxtext_by_its_preset():
    keys = _keys()
    assert keys["model_name"] == "llama3.1-8b" and keys["override_model_config"] == "true"
    sizes = {k: keys[k] for k in ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim")}
    assert sizes == {
        "base_emb_dim": "2048",
        "base_num_query_heads": "32",
        "base_num_kv_heads": "8",
        "head_dim": "64",
    }
    assert (keys["base_mlp_dim"], keys["base_num_decoder_layers"], keys["vocab_size"]) == (
        "8192",
        "16",
        "128256",
    )
    assert keys["logits_via_embedding"] == "true"  # 3.2 1B ties its head to the embedding
    assert keys["rope_max_timescale"] == "500000"


def test_the_8b_preset_has_an_untied_head():
    keys = _keys("--shape", "llama3.1-8b")
    assert (keys["base_emb_dim"], keys["base_num_decoder_layers"], keys["logits_via_embedding"]) == (
        "4096",
        "32",
        "false",
    )


def test_the_run_settings_and_arguments_become_keys():
    keys = _keys(
        "--batch", "16", "--prompt-length", "512", "--max-target-length", "1024", "--hardware", "cpu"
    )
    assert keys["per_device_batch_size"] == "16"
    assert (keys["max_prefill_predict_length"], keys["max_target_length"]) == ("512", "1024")
    assert (keys["weight_dtype"], keys["scan_layers"], keys["attention"]) == (
        "bfloat16",
        "false",
        "dot_product",
    )
    assert keys["pure_nnx"] == "false"  # Linen by default: its quantize_params stores int8 weights
    assert keys["hardware"] == "cpu" and keys["enable_checkpointing"] == "false"
    assert "quantization" not in keys and "quantize_kvcache" not in keys and "jax_cache_dir" not in keys


def test_int8_kv_cache_and_compilation_cache():
    keys = _keys("--quantization", "int8", "--quantize-kvcache", "--cache-dir", "/tmp/jc")
    assert (keys["quantization"], keys["checkpoint_is_quantized"], keys["quantize_kvcache"]) == (
        "int8",
        "false",
        "true",
    )
    assert keys["jax_cache_dir"] == "/tmp/jc"
    assert _keys("--quantization", "int8", "--init-quantized")["checkpoint_is_quantized"] == "true"


def test_the_users_keys_win():
    keys = _keys("scan_layers=true", "--api", "nnx", "ici_tensor_parallelism=4", "prompt=hello")
    assert keys["scan_layers"] == "true" and keys["ici_tensor_parallelism"] == "4"
    assert keys["prompt"] == "hello" and keys["pure_nnx"] == "true"


def test_bad_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="--max-target-length 1100 leaves 76 decode positions"):
        _keys("--max-target-length", "1100", "--steps", "80")
    with pytest.raises(ValueError, match="MaxText settings are key=value"):
        _keys("scan_layers")
    with pytest.raises(ValueError, match=r"--shape 'llama9'.*known: .*llama3\.2-1b"):
        maxtext_peer.load_preset("llama9")
    with pytest.raises(ValueError, match="has no 'num_heads'"):
        maxtext_peer.shape_keys({"name": "half", "embed_dim": 8})


def test_labels_name_the_configuration():
    ns = maxtext_peer.parse_args(["out", "--quantization", "int8", "--quantize-kvcache", "--batch", "1"])
    assert maxtext_peer.default_label(ns) == "llama3.2-1b-int8-kvint8-b1-p1024-t2048"
    ns = maxtext_peer.parse_args(["out", "--quantization", "int8", "--init-quantized"])
    assert maxtext_peer.default_label(ns) == "llama3.2-1b-int8init-b64-p1024-t2048"


def test_decode_rates():
    rates = maxtext_peer.decode_rates(seconds=0.5, steps=10, batch=64)
    assert rates == pytest.approx(
        {"step_ms": 50.0, "ms_per_token_per_slot": 50.0 / 64, "tokens_per_s": 1280.0}
    )


def _report(**extra) -> dict:
    args = {"only_config": False}
    return {"label": "L", "arguments": args, "seconds": {"init": 12.34, "compile_generate": 40.0}, **extra}


def test_summary_says_the_rate_or_what_stopped_the_run():
    done = _report(phase="generate", generate={"step_ms": 5.0, "tokens_per_s": 12800.0})
    assert (
        maxtext_peer.summary(done)
        == "maxtext L: step 5.00 ms, 12800.0 tok/s; init 12.3 s, compile_generate 40.0 s"
    )
    failed = _report(phase="fill", error="XlaRuntimeError: RESOURCE_EXHAUSTED\nmore lines")
    assert maxtext_peer.summary(failed).startswith(
        "maxtext L: stopped in fill (XlaRuntimeError: RESOURCE_EXHAUSTED);"
    )
    assert maxtext_peer.summary(_report(phase="fill")).startswith("maxtext L: cut short in fill;")
    assert maxtext_peer.summary(_report(phase="init")).startswith("maxtext L: cut short after init;")


def test_the_json_is_written_as_each_phase_starts_and_ends(tmp_path):
    path = tmp_path / "run.json"
    report = maxtext_peer.Report(path, {"label": "L"})
    report.start("init")
    assert json.loads(path.read_text())["phase"] == "init"  # a run killed now says where it was
    report.done(slots=4)
    written = json.loads(path.read_text())
    assert written["slots"] == 4 and set(written["seconds"]) == {"init"}


def test_a_placeholder_seqio_stands_in_only_where_none_is_installed(monkeypatch):
    monkeypatch.setattr(sys, "modules", {k: v for k, v in sys.modules.items() if not k.startswith("seqio")})
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert maxtext_peer.stand_in_for_seqio()
    with pytest.raises(RuntimeError, match="builds no tokenizer"):
        sys.modules["seqio.vocabularies"].SentencePieceVocabulary("path")
    assert issubclass(
        sys.modules["seqio"].vocabularies.SentencePieceVocabulary,
        sys.modules["seqio.vocabularies"].Vocabulary,
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert not maxtext_peer.stand_in_for_seqio()


def test_the_module_imports_no_maxtext_of_its_own():
    assert "maxtext" not in sys.modules and "jetstream" not in sys.modules
