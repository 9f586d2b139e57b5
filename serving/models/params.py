"""The params pytree's layout in one place: every entry's name and shape (see serving.models.llama).

Per-layer entries are stacked on a leading [layers] axis in the pytree; `param_shapes` gives each
one's shape without it, as a checkpoint stores one layer at a time.
"""

from __future__ import annotations

from serving.models.config import ModelConfig

# Matmul weights of a layer, [in, out]; with "lm_head" every matmul weight (the embedding and the
# norms are not matmul weights).
LAYER_MATMULS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
MATMUL_WEIGHTS = (*LAYER_MATMULS, "lm_head")
LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
EMBEDDING = "embed"


def int8_entries(quantization: str) -> tuple[str, ...]:
    """The entries a `quantization` mode keeps in int8 when it quantizes float weights: "int8"
    (W8A8, MaxText's meaning) the layers' matmuls, as MaxText does (the embedding and the head stay
    float); "int8w" (weight-only, ours) every matmul weight and the embedding."""
    if quantization == "int8":
        return LAYER_MATMULS
    if quantization == "int8w":
        return (*MATMUL_WEIGHTS, EMBEDDING)
    return ()


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of each entry; per layer for LAYER_KEYS (without the leading layers axis)."""
    e, d = cfg.embed_dim, cfg.head_dim
    shapes = {
        EMBEDDING: (cfg.vocab_size, e),  # [vocab, embed]
        "final_norm": (e,),
        "attn_norm": (e,),
        "mlp_norm": (e,),
        "wq": (e, cfg.num_heads * d),  # [embed, heads * head_dim]
        "wk": (e, cfg.num_kv_heads * d),  # [embed, kv_heads * head_dim]
        "wv": (e, cfg.num_kv_heads * d),
        "wo": (cfg.num_heads * d, e),
        "w_gate": (e, cfg.mlp_dim),  # [embed, mlp]
        "w_up": (e, cfg.mlp_dim),
        "w_down": (cfg.mlp_dim, e),
    }
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (e, cfg.vocab_size)  # [embed, vocab]
    return shapes
