"""What per-token int8 activations (quantization=int8, MaxText's W8A8) cost SmolLM2, and what
SmoothQuant-style smoothing buys back: per input channel j of each matmul group, activations divided
and weights multiplied by s_j = max|x_j|^alpha / max|w_j|^(1 - alpha), folded into the weights
(attn_norm and mlp_norm for q/k/v and gate/up; v's output channels for wo, per kv head; up's output
channels for w_down), so the float model is unchanged and the int8 rows lose their outlier channels.
The channel maxima come from a calibration text that is not the text measured.

    .venv/bin/python -m loadtest.w8a8_smoothing [--alphas 0.3,0.5,0.7] [--out results]

Prints and writes results/w8a8-smoothing.json: perplexity over tests/data/english.txt (256 tokens)
and top-1 agreement with float32, for weight-only int8 (int8w), W8A8, and W8A8 after smoothing.
An experiment, not a serving path: `quantization=int8` serves without smoothing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

CALIBRATION = (
    "The committee met on Tuesday to discuss the budget for next year. Several members raised concerns "
    "about rising costs in transportation and housing, while others argued that investment in schools and "
    "public health would pay for itself over time. After a long debate, they agreed to revisit the question. "
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "Photosynthesis converts light energy into chemical energy stored in glucose. "
) * 2
GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"), ("wo",), ("w_down",))


def channel_maxima(params: dict, cfg, ids: list[int]) -> dict[tuple[int, tuple[str, ...]], np.ndarray]:
    """Per layer and matmul group, each input channel's largest magnitude over the tokens `ids`
    (the float model run eagerly, layer by layer, through ops that record their inputs)."""
    from serving.models import prefill
    from serving.models.llama import unstack_layers
    from serving.models.ops import XlaOps

    layers = unstack_layers(params)["layers"]
    found: dict = {}

    def record(i: int, names: tuple[str, ...], x) -> None:
        found[(i, names)] = np.abs(np.asarray(x)).reshape(-1, x.shape[-1]).max(0)

    class Recording(XlaOps):
        def matmuls(self, x, layer, names):
            record(layer["index"], names, x)
            return super().matmuls(x, layer, names)

        def matmul(self, x, w):
            for i, layer in enumerate(layers):
                for name in ("wo", "w_down"):
                    if w is layer[name]:
                        record(i, (name,), x)
            return super().matmul(x, w)

    indexed = [{**layer, "index": i} for i, layer in enumerate(layers)]
    tokens = jnp.asarray([ids])
    prefill({**params, "layers": indexed}, tokens, jnp.asarray([len(ids)]), cfg, scan_layers=False, ops=Recording())
    return found


def _scale(activations: np.ndarray, weights: np.ndarray, alpha: float) -> np.ndarray:
    return np.maximum(activations, 1e-5) ** alpha / np.maximum(weights, 1e-5) ** (1 - alpha)


def smooth(params: dict, cfg, maxima: dict, alpha: float) -> dict:
    """float params (stacked layers) with each matmul group's input channels smoothed (module doc)."""
    stacked = {k: np.array(v) for k, v in params["layers"].items()}
    kv, groups, head_dim = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    for i in range(cfg.num_layers):
        for names, norm in ((GROUPS[0], "attn_norm"), (GROUPS[1], "mlp_norm")):
            w = np.concatenate([stacked[n][i] for n in names], axis=1)
            s = _scale(maxima[(i, names)], np.abs(w).max(1), alpha)
            stacked[norm][i] /= s
            for n in names:
                stacked[n][i] *= s[:, None]
        wo = stacked["wo"][i].reshape(kv, groups, head_dim, -1)
        a = maxima[(i, ("wo",))].reshape(kv, groups, head_dim).max(1)  # groups share v's channel
        s = _scale(a, np.abs(wo).max(axis=(1, 3)), alpha)  # [kv, head_dim]
        stacked["wv"][i] /= s.reshape(-1)[None, :]
        stacked["wo"][i] = (wo * s[:, None, :, None]).reshape(kv * groups * head_dim, -1)
        s = _scale(maxima[(i, ("w_down",))], np.abs(stacked["w_down"][i]).max(1), alpha)
        stacked["w_up"][i] /= s[None, :]
        stacked["w_down"][i] *= s[:, None]
    return {**params, "layers": {k: jnp.asarray(v) for k, v in stacked.items()}}


def main(argv: list[str] | None = None) -> int:
    from serving.checkpoints.model_source import default_model_path, load_model
    from serving.config import ServingConfig
    from serving.models import prefill, quantize_params
    from serving.models.params import int8_entries
    from serving.models.quantization import with_int8_activations

    parser = argparse.ArgumentParser(prog="python -m loadtest.w8a8_smoothing", description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", default="0.3,0.5,0.7")
    parser.add_argument("--out", type=Path, default=Path("results"))
    ns = parser.parse_args(argv)
    model = load_model(str(default_model_path()), ServingConfig())
    cfg, params = model.config, model.params
    text = (Path(__file__).parent.parent / "tests" / "data" / "english.txt").read_text()
    ids = model.tokenizer.encode_prompt(text)[:256]
    tokens, lengths = jnp.asarray([ids]), jnp.asarray([len(ids)])
    score = jax.jit(lambda p: prefill(p, tokens, lengths, cfg)[0][0])

    def measure(p) -> tuple[float, np.ndarray]:
        logits = score(p)
        logprobs = jax.nn.log_softmax(logits[:-1], axis=-1)
        nll = -float(jnp.mean(jnp.take_along_axis(logprobs, tokens[0, 1:, None], axis=-1)))
        return float(np.exp(nll)), np.argmax(np.asarray(logits), -1)

    base, top1 = measure(params)
    rows = {"float32": {"perplexity": base, "agreement": 1.0}}

    def add(name: str, p) -> None:
        ppl, picks = measure(p)
        rows[name] = {"perplexity": ppl, "vs_float": ppl / base - 1, "agreement": float(np.mean(picks == top1))}
        print(f"{name:>22}: perplexity {ppl:.3f} ({rows[name]['vs_float']:+.2%}), top-1 agreement "
              f"{rows[name]['agreement']:.3f}", flush=True)

    print(f"{'float32':>22}: perplexity {base:.3f}")
    add("int8w", quantize_params(params))
    w8a8 = lambda p: with_int8_activations(quantize_params(p, int8_entries("int8")))  # noqa: E731
    add("int8 (W8A8)", w8a8(params))
    maxima = channel_maxima(params, cfg, model.tokenizer.encode_prompt(CALIBRATION)[:256])
    for alpha in (float(a) for a in ns.alphas.split(",")):
        add(f"int8, smoothed a={alpha}", w8a8(smooth(params, cfg, maxima, alpha)))
    ns.out.mkdir(parents=True, exist_ok=True)
    (ns.out / "w8a8-smoothing.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
