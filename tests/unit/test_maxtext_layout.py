"""serving.checkpoints.maxtext_layout: which MaxText layout a tree is, and the checks against a model,
on trees written down by hand from MaxText's documented layouts (no JAX, no files)."""

from __future__ import annotations

import pytest

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.maxtext_layout import check_against, describe_tree, interleaved_rope
from serving.models.config import ModelConfig

CFG = ModelConfig(
    name="tiny", num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=112,
    vocab_size=320, rope_theta=500000.0, norm_eps=1e-5, max_position=64,
)
KERNELS = {
    "self_attention/query": (64, 4, 16),
    "self_attention/key": (64, 2, 16),
    "self_attention/value": (64, 2, 16),
    "self_attention/out": (4, 16, 64),
    "mlp/wi_0": (64, 112),
    "mlp/wi_1": (64, 112),
    "mlp/wo": (112, 64),
}
SCALES = {
    "self_attention/query": (1, 4, 16),
    "self_attention/key": (1, 2, 16),
    "self_attention/value": (1, 2, 16),
    "self_attention/out": (1, 1, 64),
    "mlp/wi_0": (1, 112),
    "mlp/wi_1": (1, 112),
    "mlp/wo": (1, 64),
}
NORMS = ("pre_self_attention_layer_norm", "post_self_attention_layer_norm")


def _top(prefix: tuple[str, ...], nnx: bool) -> dict:
    box = ("value",) if nnx else ()
    return {
        (*prefix, "token_embedder", "embedding", *box): ((320, 64), "bfloat16"),
        (*prefix, "decoder", "decoder_norm", "scale", *box): ((64,), "bfloat16"),
        (*prefix, "decoder", "logits_dense", "kernel", *box): ((64, 320), "bfloat16"),
    }


def scanned_tree() -> dict:
    """llama_or_mistral_ckpt.py: a Linen TrainState, layers stacked at axis 1."""
    p = ("params", "params")
    tree = {("step",): ((), "int32"), **_top(p, nnx=False)}
    for module, shape in KERNELS.items():
        tree[(*p, "decoder", "layers", *module.split("/"), "kernel")] = ((shape[0], 2, *shape[1:]), "bfloat16")
    for norm in NORMS:
        tree[(*p, "decoder", "layers", norm, "scale")] = ((64, 2), "bfloat16")
    return tree


def unscanned_tree(nnx: bool) -> dict:
    p = () if nnx else ("params", "params")
    box = ("value",) if nnx else ()
    tree = _top(p, nnx)
    for i in range(2):
        for module, shape in KERNELS.items():
            tree[(*p, "decoder", f"layers_{i}", *module.split("/"), "kernel", *box)] = (shape, "bfloat16")
        for norm in NORMS:
            tree[(*p, "decoder", f"layers_{i}", norm, "scale", *box)] = ((64,), "bfloat16")
    return tree


def int8_tree(linen: bool) -> dict:
    """The guide's Linen AQT layout ({params: {aqt, params}}) or current MaxText's inline NNX one."""
    tree = {k: v for k, v in unscanned_tree(nnx=not linen).items() if not any(m in "/".join(k) for m in KERNELS)}
    for i in range(2):
        for module in KERNELS:
            if linen:
                base = ("params", "aqt", "decoder", f"layers_{i}", *module.split("/"), "AqtDotGeneral_0", "qrhs", "frozen")
                tree[(*base, "qvalue")] = (KERNELS[module], "int8")
                tree[(*base, "scale")] = (SCALES[module], "bfloat16")
            else:
                base = ("decoder", f"layers_{i}", *module.split("/"), "AqtDotGeneral_0", "qrhs", "frozen", "value")
                tree[(*base, "qvalue")] = (KERNELS[module], "int8")
                tree[(*base, "scale", "0")] = (SCALES[module], "float32")
    return tree


@pytest.mark.parametrize(
    ("tree", "kind"),
    [
        (scanned_tree(), "bf16-scanned"),
        (unscanned_tree(nnx=False), "bf16-unscanned"),
        (unscanned_tree(nnx=True), "bf16-unscanned"),
        (int8_tree(linen=True), "int8-linen"),
        (int8_tree(linen=False), "int8-nnx"),
    ],
)
def test_each_layout_is_told_from_its_tree_and_fits_the_model(tree, kind):
    layout = describe_tree(tree)
    assert layout is not None and layout.kind == kind
    check_against(layout, CFG, "ckpt")
    assert layout.quantized == kind.startswith("int8")
    expected_int8 = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"} if layout.quantized else set()
    assert layout.quantized_names == expected_int8
    # The attention's `value` module is a name, not NNX's box: wv is found in every layout.
    assert any(e.name == "wv" for e in layout.entries)


def test_a_shape_that_does_not_fit_names_the_first_path():
    layout = describe_tree(unscanned_tree(nnx=True))
    wider = CFG.model_copy(update={"mlp_dim": 128})
    with pytest.raises(CheckpointError, match=r"ckpt: decoder/layers_0/mlp/wi_0/kernel/value: shape \(64, 112\)"):
        check_against(layout, wider, "ckpt")


def test_a_missing_tensor_or_layer_is_named():
    tree = unscanned_tree(nnx=False)
    del tree[("params", "params", "decoder", "layers_1", "mlp", "wo", "kernel")]
    with pytest.raises(CheckpointError, match=r"missing decoder/layers_1/mlp/wo/kernel"):
        check_against(describe_tree(tree), CFG, "ckpt")
    deeper = CFG.model_copy(update={"num_layers": 3})
    with pytest.raises(CheckpointError, match="layers_2"):
        check_against(describe_tree(unscanned_tree(nnx=False)), deeper, "ckpt")


def test_a_tree_that_is_not_maxtexts_is_refused_or_not_recognised():
    with pytest.raises(CheckpointError, match="not a leaf of a MaxText Llama checkpoint"):
        describe_tree({**unscanned_tree(nnx=True), ("decoder", "layers_0", "moe", "kernel"): ((4,), "float32")})
    assert describe_tree({("step",): ((), "int32")}) is None


def test_rope_layout_follows_maxtexts_conversion():
    """llama_or_mistral_ckpt.py keeps Meta's interleaved q/k for llama3.1 / llama3.3 model sizes."""
    assert interleaved_rope("llama3.1-405b") and interleaved_rope("llama3.3-70b")
    assert not interleaved_rope("llama3-8b") and not interleaved_rope("llama2-70b")
