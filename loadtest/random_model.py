"""A Hugging Face Llama directory with random weights of a preset's shape, for benchmarks where the
real weights cannot be had (a machine that reaches no registry, a model too large to fetch) and
only speed is measured: a greedy decode with `ignore_eos` costs the same on any weights.

    python -m loadtest.random_model OUT [--shape llama3.2-1b] [--tokenizer DIR] [--dtype bfloat16]

The shape is a preset of configs/models/ (its vocabulary size included, so the head costs what the
real one does); the tokenizer is copied from DIR's tokenizer.json and tokenizer_config.json (default:
the default model's, exported once as `make bench-peers` does), so its decodable vocabulary may be
smaller than the shape's. The GPU figures in docs/performance.md were measured on such a model. Weights are drawn as transformers initializes a Llama (normal, std 0.02;
norms one), seeded, written one tensor at a time; a tensor of more than 4M values repeats one drawn
block of 4M from a random offset (speed does not depend on the values, and the 8B shape's 16 GB
are written in a minute rather than drawn for minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from serving.checkpoints.export_hf import DTYPES, hf_config, write_safetensors
from serving.config import load_model_config
from serving.models.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DRAWN = 1 << 22  # values drawn for a tensor up to this size; larger ones repeat a drawn block


def hf_shapes(cfg: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a transformers Llama of this shape: (name, [out, in] shape)."""
    dim, q, kv = cfg.embed_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    yield "model.embed_tokens.weight", (cfg.vocab_size, dim)
    for layer in range(cfg.num_layers):
        at = f"model.layers.{layer}"
        yield f"{at}.input_layernorm.weight", (dim,)
        yield f"{at}.self_attn.q_proj.weight", (q, dim)
        yield f"{at}.self_attn.k_proj.weight", (kv, dim)
        yield f"{at}.self_attn.v_proj.weight", (kv, dim)
        yield f"{at}.self_attn.o_proj.weight", (dim, q)
        yield f"{at}.post_attention_layernorm.weight", (dim,)
        yield f"{at}.mlp.gate_proj.weight", (cfg.mlp_dim, dim)
        yield f"{at}.mlp.up_proj.weight", (cfg.mlp_dim, dim)
        yield f"{at}.mlp.down_proj.weight", (dim, cfg.mlp_dim)
    yield "model.norm.weight", (dim,)
    if not cfg.tie_embeddings:
        yield "lm_head.weight", (cfg.vocab_size, dim)


def write_random_model(
    out: Path, shape: str | ModelConfig, tokenizer_dir: Path, dtype: str = "bfloat16", seed: int = 0
) -> Path:
    """Write the directory `out` (config.json, model.safetensors, the tokenizer's files) of `shape`
    (a preset's name, or a ModelConfig); returns it. Needs numpy alone (no torch: a TPU VM has none)."""
    cfg = load_model_config(shape) if isinstance(shape, str) else shape
    numpy_dtype, code = DTYPES[dtype]
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:  # tokenizer.json at least
        if name == "tokenizer.json" or (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
    config = tokenizer_dir / "tokenizer_config.json"
    special = json.loads(config.read_text()) if config.is_file() else {}
    rng = np.random.default_rng(seed)
    block: list[np.ndarray] = []  # drawn once, at the first tensor larger than it

    def tensors():
        for name, dims in hf_shapes(cfg):
            if len(dims) == 1:  # a norm's weight
                yield name, np.ones(dims, numpy_dtype)
            elif math.prod(dims) <= DRAWN:
                yield name, (rng.standard_normal(dims, np.float32) * 0.02).astype(numpy_dtype)
            else:  # repeats of one drawn block from a random offset: 8B's 16 GB in seconds, not minutes
                if not block:
                    block.append((rng.standard_normal(DRAWN, np.float32) * 0.02).astype(numpy_dtype))
                yield name, _tiled(block[0], dims, int(rng.integers(DRAWN)))

    write_safetensors(out / "model.safetensors", tensors(), code, shapes=list(hf_shapes(cfg)))
    ids = _special_ids(tokenizer_dir / "tokenizer.json", special)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, *ids, dtype), indent=2))
    return out


def _tiled(block: np.ndarray, dims: tuple[int, ...], offset: int) -> np.ndarray:
    """An array of `dims` filled with `block`'s values from `offset` on, repeated."""
    size = math.prod(dims)
    out = np.empty(size, block.dtype)
    period = np.concatenate([block[offset:], block[:offset]])
    filled = min(size, period.size)
    out[:filled] = period[:filled]
    while filled < size:  # doubling copies of whole periods: log2(size / block) of them
        n = min(filled, size - filled)
        out[filled : filled + n] = out[:n]
        filled += n
    return out.reshape(dims)


def _special_ids(tokenizer_json: Path, special: dict) -> tuple[int | None, int | None]:
    """(bos id, eos id) of the tokenizer_config's bos_token and eos_token, from tokenizer.json's
    added tokens."""
    added = {t["content"]: t["id"] for t in json.loads(tokenizer_json.read_text()).get("added_tokens", [])}

    def token_id(field: str) -> int | None:
        token = special.get(field)
        token = token.get("content") if isinstance(token, dict) else token
        return added.get(token)

    return token_id("bos_token"), token_id("eos_token")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="llama3.2-1b", help="a preset of configs/models/")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a directory with tokenizer.json (default: the default model's)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=0)
    ns = parser.parse_args(argv)
    tokenizer = ns.tokenizer
    if tokenizer is None:
        from loadtest.peers import default_model_dir

        tokenizer = default_model_dir()
    print(write_random_model(ns.out, ns.shape, tokenizer, ns.dtype, ns.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
