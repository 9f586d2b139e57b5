"""serving.checkpoints.export_hf: what a peer server (vLLM, transformers) loads is our model.

A tiny random Llama goes Hugging Face -> export (weights equal), and Hugging Face -> GGUF (written
here the way llama.cpp lays it out: q/k rows interleaved, tokenizer in metadata) -> export, which
transformers then loads to the same logits and token ids as the original directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.export_hf import export_hf
from serving.checkpoints.hf import iter_safetensors, read_hf_config

TEXT = "the old lighthouse keeper walked down to the harbour"


def _interleave_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Hugging Face's half-split q/k rows -> llama.cpp's interleaved pairs."""
    pairs = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, pairs, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(hf_dir: Path, path: Path) -> Path:
    """`hf_dir` (a tiny HF Llama and its byte-level BPE tokenizer.json) as a llama.cpp GGUF file."""
    from gguf import GGUFWriter

    config = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in vocab]
    for content, i in specials.items():
        if i >= len(tokens):
            tokens.append(content)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer = GGUFWriter(path, "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(specials["<|im_start|>"])
    writer.add_eos_token_id(specials["<|im_end|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for name, tensor in iter_safetensors(hf_dir):
        tensor = np.asarray(tensor, dtype=np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            base = rest.removesuffix(".weight")
            gguf_name = f"blk.{layer}.{names[base]}.weight"
            if base == "self_attn.q_proj":
                tensor = _interleave_rotary_rows(tensor, config["num_attention_heads"])
            elif base == "self_attn.k_proj":
                tensor = _interleave_rotary_rows(tensor, config["num_key_value_heads"])
        writer.add_tensor(gguf_name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def plain_model_dir(tmp_path_factory):
    """The tiny model without llama3 rope scaling, which the GGUF path computes from rope_freqs."""
    from tests.conftest import make_hf_llama, make_hf_tokenizer

    directory = tmp_path_factory.mktemp("tiny-plain")
    make_hf_llama(directory, vocab=320)
    return make_hf_tokenizer(directory, vocab=300)


def transformers_logits(directory: Path) -> tuple[list[int], np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(directory)(TEXT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return ids, model(torch.tensor([ids])).logits[0].numpy()


def test_hf_export_keeps_every_tensor_and_the_config(tiny_model_dir, tmp_path):
    out = export_hf(tiny_model_dir, tmp_path / "out", "float32")
    original = dict(iter_safetensors(tiny_model_dir))
    exported = dict(iter_safetensors(out))
    assert exported.keys() == original.keys()
    assert all(np.array_equal(exported[k], original[k]) for k in original)
    assert read_hf_config(out).model_copy(update={"name": "x"}) == read_hf_config(tiny_model_dir).model_copy(
        update={"name": "x"}
    )  # llama3 rope scaling included
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    half = dict(iter_safetensors(export_hf(tiny_model_dir, tmp_path / "bf16")))
    assert str(half["model.norm.weight"].dtype) == "bfloat16"
    with pytest.raises(CheckpointError, match="dtype 'int4'"):
        export_hf(tiny_model_dir, tmp_path / "bad", "int4")


def test_gguf_export_loads_in_transformers_as_the_original(plain_model_dir, tmp_path):
    gguf = write_gguf(plain_model_dir, tmp_path / "tiny.gguf")
    out = export_hf(gguf, tmp_path / "out", "float32")
    settings = json.loads((out / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == "<|im_end|>" and settings["chat_template"].startswith("{% for m")
    ids, logits = transformers_logits(out)
    expected_ids, expected = transformers_logits(plain_model_dir)
    assert ids == expected_ids and len(ids) > 5
    assert np.abs(logits - expected).max() <= 1e-4  # q/k rows un-interleaved, [out, in] restored
