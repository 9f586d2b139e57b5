"""MaxText's own forward pass on each fixture vs transformers on the reference HF weights.

Run with ``.venv-maxtext/bin/python`` (maxtext 0.2.5):

    python tools/maxtext_fixtures/check_forward.py tests/data/maxtext [--write]

For each checkpoint MaxText builds its model (``model_creation_utils.from_pretrained``; float32
activations and weights, ``matmul_precision=highest``), loads the checkpoint and runs a train-mode
forward on 64 fixed tokens (positions 0..63); the logits are compared with ``LlamaForCausalLM``
(float32) on ``<model>/hf``. With ``--write``, MaxText's logits on the int8 checkpoint (AQT int8
quantizes activations as well, so they are not transformers' logits) are saved as
``<model>/maxtext_int8_logits.npz``: ``tokens`` int32 [1, 64] (``numpy.random.default_rng(0)
.integers(0, 320, (1, 64))``) and ``maxtext_int8_logits`` float32 [1, 64, 320].
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np

SEQ = 64
TINY = [
    "override_model_config=true",
    "base_emb_dim=64",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=16",
    "base_mlp_dim=112",
    "base_num_decoder_layers=2",
    "vocab_size=320",
]
RUN = [
    "hardware=cpu",
    "skip_jax_distributed_system=true",
    "async_checkpointing=false",
    "per_device_batch_size=1",
    f"max_target_length={SEQ}",
    "max_prefill_predict_length=8",
    "enable_checkpointing=false",
    "attention=dot_product",
    "dtype=float32",
    "matmul_precision=highest",
]


def hf_logits(hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.numpy()


def maxtext_logits(model_name: str, ckpt: Path, tokens: np.ndarray, extra: list[str]) -> np.ndarray:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from maxtext.common import common_types
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils, model_creation_utils

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    argv = [None, base, f"model_name={model_name}", f"load_parameters_path={ckpt}", *TINY, *RUN, *extra]
    config = pyconfig.initialize(argv)
    mesh = Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    quantized = "checkpoint_is_quantized=true" in extra
    with mesh:
        model = model_creation_utils.from_pretrained(
            config,
            mesh=mesh,
            model_mode=common_types.MODEL_MODE_TRAIN,
            quant_mode_str="serve" if quantized else "train",
        )
        logits = model(
            jnp.asarray(tokens),
            jnp.arange(SEQ, dtype=jnp.int32)[None, :],
            decoder_segment_ids=jnp.ones((1, SEQ), dtype=jnp.int32),
            enable_dropout=False,
            model_mode=common_types.MODEL_MODE_TRAIN,
        )
    return np.asarray(jax.device_get(logits), dtype=np.float32)


CASES = [  # (subpath, extra MaxText args, tolerance on max |logit diff|)
    ("bf16/scanned/0/items", ["scan_layers=true", "weight_dtype=float32"], 1e-4),
    ("bf16/unscanned/checkpoints/0/items", ["scan_layers=false", "weight_dtype=float32"], 1e-4),
    # MaxText's AQT int8 (config_v3, fwd_bits=8) also quantizes the activations (per token, dynamic):
    # its logits are further from the float reference than weight-only int8 would be.
    (
        "int8",
        ["scan_layers=false", "quantization=int8", "checkpoint_is_quantized=true", "weight_dtype=bfloat16"],
        0.5,
    ),
    (
        "int8_weight_dtype_float32",
        ["scan_layers=false", "quantization=int8", "checkpoint_is_quantized=true", "weight_dtype=float32"],
        0.5,
    ),
]


def main(root: Path, write: bool, only: str | None = None) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 320, size=(1, SEQ), dtype=np.int32)
    failures = 0
    for model_dir, model_name in (("llama3", "llama3-8b"), ("llama31", "llama3.1-8b")):
        ref = hf_logits(root / model_dir / "hf", tokens)
        saved = {"tokens": tokens}
        for sub, extra, tol in CASES:
            ckpt = root / model_dir / sub
            if not ckpt.exists() or (only and only not in str(ckpt)):
                continue
            got = maxtext_logits(model_name, ckpt, tokens, extra)
            if sub == "int8":
                saved["maxtext_int8_logits"] = got
            diff = float(np.max(np.abs(got - ref)))
            same_argmax = float(np.mean(got.argmax(-1) == ref.argmax(-1)))
            status = "OK " if diff <= tol else "BAD"
            failures += diff > tol
            print(
                f"{status} {model_dir}/{sub} ({model_name}): max |logits - HF| = {diff:.2e} "
                f"(tol {tol:.0e}, |HF logits| max {np.max(np.abs(ref)):.2f}), argmax agreement {same_argmax:.2f}",
                flush=True,
            )
        if write:
            np.savez(root / model_dir / "maxtext_int8_logits.npz", **saved)
    if failures:
        raise SystemExit(f"{failures} checkpoint(s) disagree with the HF reference")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(Path(args[0]).resolve(), "--write" in sys.argv, args[1] if len(args) > 1 else None)
