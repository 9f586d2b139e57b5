"""Conversion streams: converting a 1.5 GB model peaks near its largest tensor, not its size."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from serving.checkpoints.checkpoint import read_metadata

# 4 layers of a 2048-wide Llama with a 32000 vocabulary: 1.49 GB in float32; the largest tensors
# (embedding and LM head) are 262 MB each.
CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    e, m, v, kv = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_key_value_heads"] * 128
    shapes = {"model.embed_tokens.weight": (v, e), "model.norm.weight": (e,), "lm_head.weight": (v, e)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (e,),
            p + "post_attention_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (e, e),
            p + "self_attn.k_proj.weight": (kv, e),
            p + "self_attn.v_proj.weight": (kv, e),
            p + "self_attn.o_proj.weight": (e, e),
            p + "mlp.gate_proj.weight": (m, e),
            p + "mlp.up_proj.weight": (m, e),
            p + "mlp.down_proj.weight": (e, m),
        }
    return shapes


def write_random_model(directory: Path) -> tuple[int, int]:
    """Stream a random float32 safetensors model to disk; returns (total bytes, largest tensor bytes)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    shapes = tensor_shapes(CONFIG)
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    rng = np.random.default_rng(0)
    with (directory / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for shape in shapes.values():
            rng.standard_normal(shape, dtype=np.float32).__imul__(0.02).tofile(f)
    return offset, max(int(np.prod(s)) * 4 for s in shapes.values())


def test_converting_a_1_5_gb_model_peaks_below_3x_largest_tensor_plus_1_gib(tmp_path):
    total, largest = write_random_model(tmp_path / "big")
    assert total > 1.4e9
    # The peak is the converter's own VmHWM, read by the child itself at the end. The rusage that
    # wait4 returns is no good here: Linux carries the parent's high-water mark over fork and exec,
    # so a child of this (large) pytest process would report pytest's memory, not its own.
    code = (
        "import sys; from serving.cli.main import main; "
        f"rc = main(['convert', {str(tmp_path / 'big')!r}, {str(tmp_path / 'ckpt')!r}, '--quiet']); "
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]; "
        "print('VmHWM_KB', hwm); sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    peak = int(result.stdout.split("VmHWM_KB")[1].split()[0]) * 1024
    limit = 3 * largest + (1 << 30)
    print(
        f"model {total / 1e9:.2f} GB, largest tensor {largest / 1e6:.0f} MB, peak RSS {peak / 1e9:.2f} GB, limit {limit / 1e9:.2f} GB"
    )
    assert peak < limit, (peak, limit)
    assert peak < total, "conversion must not hold the whole model"
    metadata = read_metadata(str(tmp_path / "ckpt"))
    assert metadata.tensors["layers.w_gate"]["shape"] == [4, 2048, 8192]
