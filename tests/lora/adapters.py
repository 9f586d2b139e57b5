"""Random PEFT LoRA adapters for the tests, saved with `peft` as a trainer would, and the
transformers + peft (unmerged) reference they are compared with."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

# (name, rank, alpha, target modules, rsLoRA): different ranks, subsets and scalings.
ADAPTERS = (
    ("attn-r4", 4, 8, ["q_proj", "v_proj"], False),
    ("all-r8", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    ("mlp-r16-rs", 16, 4, ["k_proj", "gate_proj", "down_proj", "up_proj"], True),
)


def make_adapter(
    base_dir: Path, out: Path, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int, std: float = 0.1
) -> Path:
    """A PEFT adapter of random A and B (peft's own init leaves B zero: no delta to test)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = _base(base_dir)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False, lora_dropout=0.0
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(out)
    return out


def make_adapters(base_dir: Path, root: Path, std: float = 0.1) -> dict[str, Path]:
    """Every adapter of ADAPTERS under root/<name>."""
    return {
        name: make_adapter(base_dir, root / name, rank, alpha, targets, rslora, seed, std)
        for seed, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS)
    }


def _base(base_dir: Path):
    """transformers' model of a Hugging Face directory, or of a GGUF file (dequantized), float32:
    a copy of the one read first (dequantizing a GGUF takes a while)."""
    return copy.deepcopy(_read_base(base_dir))


@functools.cache
def _read_base(base_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    if base_dir.suffix == ".gguf":
        from tests.conftest import CACHE
        from tests.hf_reference import transformers_from_gguf

        return transformers_from_gguf(base_dir, CACHE)
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)


def peft_model(base_dir: Path, adapter_dir: Path | None):
    """transformers' Llama with the adapter applied unmerged (None: the base model)."""
    from peft import PeftModel

    base = _base(base_dir).eval()
    return base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()


def reference_logits(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def reference_greedy(model, ids: list[int], max_tokens: int, vocab: int) -> list[int]:
    """Greedy tokens by full forward passes (no cache: the plainest reference), among the first
    `vocab` ids (those the tokenizer decodes, as the engine samples)."""
    out = list(ids)
    for _ in range(max_tokens):
        out.append(int(reference_logits(model, out)[-1][:vocab].argmax()))
    return out[len(ids) :]
