"""Write the reference Hugging Face Llama and its Meta .pth twin for one MaxText fixture.

Run with the project's own venv (``.venv/bin/python``): the weights come from the test helpers
``tests.conftest.make_hf_llama`` and ``tests.test_checkpoints.write_meta_checkpoint``.

    python tools/maxtext_fixtures/make_reference.py {llama3|llama3.1} HF_OUT META_OUT

* The shapes and norms come from ``make_hf_llama``; its std-0.02 matrices are redrawn at unit
  activation scale (q/k at twice that) so that attention is peaked and the logits depend strongly on
  the q/k head layout and on RoPE (see the README in tests/data/maxtext).
* Every weight is rounded to a bfloat16-representable float32 before the HF model is saved, so the
  bf16 MaxText conversion is lossless and transformers on ``HF_OUT`` is the exact reference.
* ``llama3``: rope_theta 500000, plain RoPE (no scaling).
* ``llama3.1``: Llama 3.1 rope scaling with MaxText's fixed constants (factor 8, low_freq_factor 1,
  high_freq_factor 4, original context 8192: ``maxtext/layers/embeddings.py``
  ``LLaMARotaryEmbedding._apply_scaling_factor``).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SEEDS = {"llama3": 3, "llama3.1": 31}


def main(variant: str, hf_out: Path, meta_out: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from tests.conftest import make_hf_llama
    from tests.test_checkpoints import write_meta_checkpoint

    scaled = variant == "llama3.1"
    if variant not in SEEDS:
        raise SystemExit(f"unknown variant {variant!r}")
    for path in (hf_out, meta_out):
        if path.exists():
            shutil.rmtree(path)
    meta_out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = make_hf_llama(
            Path(tmp) / "raw",
            num_heads=4,
            num_kv_heads=2,
            layers=2,
            vocab=320,
            rope_scaling=scaled,
            original_max_position=8192,
            seed=SEEDS[variant],
            tie=False,
        )
        config = json.loads((raw / "config.json").read_text())
        if not scaled:  # make_hf_llama's plain RoPE uses theta 10000; Llama 3 uses 500000.
            config["rope_parameters"]["rope_theta"] = 500000.0
        # Llama 3's context lengths (make_hf_llama's 256 is below llama3.1's original 8192).
        config["max_position_embeddings"] = 131072 if scaled else 8192
        (raw / "config.json").write_text(json.dumps(config, indent=2))
        model = LlamaForCausalLM.from_pretrained(str(raw), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(SEEDS[variant])
    with torch.no_grad():
        for name, p in model.named_parameters():
            # make_hf_llama's std-0.02 matrices give near-uniform attention, under which a wrong q/k
            # layout or rope scaling barely moves the logits. Unit-scale activations instead, and
            # q/k twice that, so attention is peaked and RoPE (and llama3.1's scaling, over a
            # 128-token sequence) changes the logits by O(0.1..1). The norms stay make_hf_llama's.
            if p.ndim == 2:
                std = 1.0 if "embed_tokens" in name else 1.0 / p.shape[1] ** 0.5
                if "q_proj" in name or "k_proj" in name:
                    std *= 2.0
                p.copy_(torch.randn(p.shape, generator=generator) * std)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))  # bf16-exact: the bf16 conversion is lossless
    assert model.config.head_dim == 16 and model.config.hidden_size == 64
    model.save_pretrained(hf_out)
    write_meta_checkpoint(hf_out, meta_out, num_shards=2)
    print(f"{variant}: wrote {hf_out} and {meta_out}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
