"""loadtest.random_model writes a Hugging Face Llama directory that both our reader and
transformers load whole, of the preset's shape."""

from __future__ import annotations

import numpy as np

from loadtest.random_model import write_random_model
from serving.checkpoints.model_source import describe_model
from serving.config import ServingConfig, load_model_config


def test_a_random_model_of_a_presets_shape_loads_in_both_readers(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    out = write_random_model(tmp_path / "random", "tiny-random", tiny_model_dir, dtype="float32", seed=3)
    preset = load_model_config("tiny-random")
    ours = describe_model(str(out), ServingConfig())
    for field in ("num_layers", "embed_dim", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size",
                  "tie_embeddings", "rope_theta"):
        assert getattr(ours, field) == getattr(preset, field), field
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    weights = model.state_dict()
    assert sum(w.numel() for name, w in weights.items() if "rotary" not in name) == preset.num_params
    q = weights["model.layers.1.self_attn.q_proj.weight"].numpy()
    assert q.shape == (preset.num_heads * preset.head_dim, preset.embed_dim)
    assert 0.015 < float(np.std(q)) < 0.025  # transformers' init: std 0.02
    assert np.all(weights["model.norm.weight"].numpy() == 1)


def test_tensors_larger_than_the_drawn_block_repeat_it_and_load_whole(tiny_model_dir, tmp_path, monkeypatch):
    """A tensor of more values than DRAWN repeats one drawn block from a random offset (the 8B
    shape's 16 GB written in a minute); the file, written header first, loads in transformers with
    those values; a declared shape the stream does not match is refused."""
    import pytest
    import torch
    from transformers import AutoModelForCausalLM

    from loadtest import random_model
    from serving.checkpoints.export_hf import write_safetensors

    monkeypatch.setattr(random_model, "DRAWN", 1000)
    out = write_random_model(tmp_path / "random", "tiny-random", tiny_model_dir, dtype="float32", seed=3)
    weights = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    embed = weights["model.embed_tokens.weight"].numpy().reshape(-1)  # more than 1000 values
    assert embed.size > 2000 and np.array_equal(embed[1000:2000], embed[:1000])
    assert 0.015 < float(np.std(embed)) < 0.025
    for tensor, shape in ((np.zeros((2, 3), np.float32), (3, 2)), (np.zeros((2, 3), np.float64), (2, 3))):
        with pytest.raises(ValueError, match="declared"):  # a shape or a dtype the header did not say
            write_safetensors(tmp_path / "bad.safetensors", [("a", tensor)], "F32", shapes=[("a", shape)])
    assert not list(tmp_path.glob("bad.safetensors*"))  # nothing half written left behind
