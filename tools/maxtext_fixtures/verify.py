"""Check every MaxText fixture against its reference HF weights, leaf by leaf, exactly.

Run with ``.venv-maxtext/bin/python`` (orbax + safetensors + numpy; no MaxText import):

    python tools/maxtext_fixtures/verify.py tests/data/maxtext

What is checked (and so what a loader may rely on):

* bf16 (scanned, unscanned NNX, unscanned Linen): every leaf equals the bfloat16 of the HF weight
  under the mapping below, bit for bit. query = q_proj.T / sqrt(head_dim) (here / 4, exact);
  llama3: q/k heads in HF's rotate-half order; llama3.1: q/k heads in Meta's interleaved order.
* int8: qvalue and scale equal AQT's rule applied to the kernel, exactly, computed in the dtype
  the scale is stored in (``dt``: bfloat16 in every fixture, MaxText computes AQT in its activation
  ``dtype``, bfloat16, whatever weight_dtype is):
  ``scale = dt(absmax over the contraction axes / 127.5)`` (one per output channel) and
  ``qvalue = clip(round_half_even(dt(w * dt(1 / scale))), -127, 127)``. Note the reciprocal and
  the product are rounded to ``dt``: with bf16 this differs from ``round(w / scale)`` in ~2% of
  elements (by 1). Dequantize as ``qvalue * scale``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree import leaves, restore

BF16 = ml_dtypes.bfloat16


def interleave(w: np.ndarray) -> np.ndarray:
    """HF rotate-half head layout -> Meta's interleaved layout, along the last axis."""
    half = w.shape[-1] // 2
    out = np.empty_like(w)
    out[..., 0::2] = w[..., :half]
    out[..., 1::2] = w[..., half:]
    return out


def expected_layer(hf: dict, i: int, heads: int, kv: int, hd: int, interleaved: bool) -> dict:
    g = lambda name: hf[f"model.layers.{i}.{name}.weight"]  # noqa: E731
    emb = g("self_attn.q_proj").shape[1]
    q = g("self_attn.q_proj").T.reshape(emb, heads, hd)
    k = g("self_attn.k_proj").T.reshape(emb, kv, hd)
    if interleaved:
        q, k = interleave(q), interleave(k)
    return {
        "self_attention/query/kernel": q / np.sqrt(hd),
        "self_attention/key/kernel": k,
        "self_attention/value/kernel": g("self_attn.v_proj").T.reshape(emb, kv, hd),
        "self_attention/out/kernel": g("self_attn.o_proj").T.reshape(heads, hd, emb),
        "mlp/wi_0/kernel": g("mlp.gate_proj").T,
        "mlp/wi_1/kernel": g("mlp.up_proj").T,
        "mlp/wo/kernel": g("mlp.down_proj").T,
        "pre_self_attention_layer_norm/scale": g("input_layernorm"),
        "post_self_attention_layer_norm/scale": g("post_attention_layernorm"),
    }


def expected(hf_dir: Path, interleaved: bool) -> tuple[dict, dict, int]:
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(str(hf_dir / "model.safetensors"))
    heads, kv, hd, n = (
        cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers")
    )
    top = {
        "token_embedder/embedding": hf["model.embed_tokens.weight"],
        "decoder/logits_dense/kernel": hf["lm_head.weight"].T,
        "decoder/decoder_norm/scale": hf["model.norm.weight"],
    }
    layers = {i: expected_layer(hf, i, heads, kv, hd, interleaved) for i in range(n)}
    return top, layers, n


def strip(name: str) -> str:
    for prefix in ("params/params/", "params/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name[: -len("/value")] if name.endswith("/value") else name


def check_bf16(ckpt: Path, hf_dir: Path, interleaved: bool, scanned: bool) -> int:
    _, values = restore(str(ckpt))
    top, layers, n = expected(hf_dir, interleaved)
    want = {}
    for name, w in top.items():
        want[name] = w
    for i, layer in layers.items():
        for name, w in layer.items():
            if scanned:
                want.setdefault(f"decoder/layers/{name}", [None] * n)[i] = w
            else:
                want[f"decoder/layers_{i}/{name}"] = w
    if scanned:  # MaxText's scanned layout: layer axis at position 1 (param_scan_axis=1)
        want = {k: (np.stack(v, axis=1) if isinstance(v, list) else v) for k, v in want.items()}
    got = {strip(k): v for k, v in leaves(values) if k != "step"}
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, value in got.items():
        w = want[name].astype(np.float32)
        assert value.shape == w.shape, (name, value.shape, w.shape)
        ok = np.array_equal(np.asarray(value).astype(np.float32), w.astype(BF16).astype(np.float32))
        assert ok, f"{ckpt}: {name} differs from the HF reference"
        assert np.array_equal(w.astype(BF16).astype(np.float32), w), f"{name}: reference not bf16-exact"
    print(f"OK  {ckpt}: {len(got)} leaves equal the HF reference exactly (dtype {value.dtype})")
    return len(got)


def check_int8(ckpt: Path, hf_dir: Path, interleaved: bool) -> None:
    _, values = restore(str(ckpt))
    top, layers, _ = expected(hf_dir, interleaved)
    flat = {strip(k): v for k, v in leaves(values)}
    aqt = {}
    plain = {}
    for name, v in flat.items():
        if v is None:
            continue
        name = name.replace("aqt/", "", 1) if name.startswith("aqt/") else name
        if "/AqtDotGeneral_0/qrhs/frozen/" in name:
            module, leaf = name.split("/AqtDotGeneral_0/qrhs/frozen/")
            aqt.setdefault(module, {})[leaf.removeprefix("value/")] = np.asarray(v)
        else:
            plain[name] = np.asarray(v)
    worst_scale, worst_q, nq = 0.0, 0, 0
    for module, parts in sorted(aqt.items()):
        layer = int(module.split("/")[1].removeprefix("layers_"))
        w = layers[layer][module.split("/", 2)[2] + "/kernel"].astype(BF16).astype(np.float32)
        q, scale = parts["qvalue"], parts["scale/0"].astype(np.float32)
        assert q.dtype == np.int8 and q.shape == w.shape, (module, q.dtype, q.shape)
        dt = parts["scale/0"].dtype  # = weight_dtype: the dtype AQT computed in
        axes = tuple(a for a in range(w.ndim) if scale.shape[a] == 1)
        absmax = np.max(np.abs(w), axis=axes, keepdims=True)
        want_scale = (absmax / 127.5).astype(dt).astype(np.float32)
        worst_scale = max(worst_scale, float(np.max(np.abs(want_scale - scale) / np.maximum(scale, 1e-30))))
        inverse = (1.0 / scale).astype(dt)
        want_q = np.clip(np.round((w.astype(dt) * inverse).astype(np.float32)), -127, 127).astype(np.int8)
        worst_q = max(worst_q, int(np.max(np.abs(want_q.astype(np.int32) - q))))
        nq += int(np.sum(want_q != q))
    for name, value in plain.items():
        layer_name = name.split("/", 2)
        w = top[name] if name in top else layers[int(layer_name[1].removeprefix("layers_"))][layer_name[2]]
        assert np.array_equal(value.astype(np.float32), w.astype(BF16).astype(np.float32)), name
    print(
        f"OK  {ckpt}: {len(aqt)} quantized kernels, {len(plain)} plain leaves (exact); "
        f"scale vs bf16(absmax/127.5) max rel diff {worst_scale:.2e}; "
        f"qvalue vs clip(round(w * (1/scale))) in {dt} max |diff| {worst_q} ({nq} elements differ)"
    )
    assert worst_scale == 0 and nq == 0, f"{ckpt}: int8 does not follow the documented rule"


def main(root: Path) -> None:
    for model, interleaved in (("llama3", False), ("llama31", True)):
        base, hf = root / model, root / model / "hf"
        check_bf16(base / "bf16/scanned/0/items", hf, interleaved, scanned=True)
        check_bf16(base / "bf16/unscanned/checkpoints/0/items", hf, interleaved, scanned=False)
        for sub in sorted(p.name for p in base.iterdir() if p.is_dir()):
            if sub.startswith("int8") or sub == "linen_aqt_int8":
                check_int8(base / sub, hf, interleaved)
            if sub == "linen_bf16":
                check_bf16(base / sub / "unscanned/checkpoints/0/items", hf, interleaved, scanned=False)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
