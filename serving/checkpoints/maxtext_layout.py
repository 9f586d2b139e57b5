"""MaxText's inference checkpoints, described: which layout a tree is, and where each of its leaves
goes in our params pytree. Plain Python over paths and shapes (no JAX, no I/O), so that detection,
the checks against `model_name` and the placement of each leaf are decided before anything is read.

The layouts (all Orbax PyTree checkpoints; the paths below leave out NNX's trailing `value`):

    bf16-scanned    params/params/{token_embedder/embedding [vocab, embed],
                    decoder/decoder_norm/scale [embed], decoder/logits_dense/kernel [embed, vocab],
                    decoder/layers/MODULE/kernel, .../scale}, the layer axis at position 1
                    (llama_or_mistral_ckpt.py: a Linen TrainState, beside `step` and `opt_state`)
    bf16-unscanned  the same with decoder/layers_{i}/MODULE/... per layer, with or without the
                    `params/params` wrapper (generate_param_only_checkpoint.py force_unroll=true;
                    maxtext 0.2.5 writes it as an NNX dict: .../kernel/value)
    int8-linen      params/params/... without the quantized kernels, and params/aqt/decoder/
                    layers_{i}/MODULE/AqtDotGeneral_0/qrhs/frozen/{qvalue, scale} (the JetStream
                    guide's era: Flax Linen + AQT, saved straight into the directory)
    int8-nnx        .../MODULE/AqtDotGeneral_0/qrhs/frozen/value/{qvalue, scale/0} inline, beside the
                    float leaves (maxtext.utils.layerwise_quantization)

MODULE and its kernel's shape (E embed, H heads, K kv heads, D head_dim, M mlp):

    self_attention/query  [E, H, D]   ours: wq [E, H*D]  (1/sqrt(D) folded in by the conversion)
    self_attention/key    [E, K, D]        wk [E, K*D]
    self_attention/value  [E, K, D]        wv [E, K*D]
    self_attention/out    [H, D, E]        wo [H*D, E]
    mlp/wi_0, mlp/wi_1    [E, M]           w_gate, w_up
    mlp/wo                [M, E]           w_down
    pre_self_attention_layer_norm/scale [E]   attn_norm;   post_self_attention_layer_norm  mlp_norm

An int8 kernel's `qvalue` has the kernel's shape and its `scale` the kernel's shape with the
contraction axes set to 1 (one scale per output channel), so `qvalue * scale` is the kernel and the
scales are ours too: only their shape changes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from serving.checkpoints.errors import CheckpointError
from serving.models.config import ModelConfig
from serving.models.params import EMBEDDING, LAYER_KEYS

Path = tuple[str, ...]

LAYOUTS = ("bf16-scanned", "bf16-unscanned", "int8-linen", "int8-nnx")

# MaxText module -> our layer entry.
LAYER_MODULES: dict[str, str] = {
    "self_attention/query": "wq",
    "self_attention/key": "wk",
    "self_attention/value": "wv",
    "self_attention/out": "wo",
    "mlp/wi_0": "w_gate",
    "mlp/wi_1": "w_up",
    "mlp/wo": "w_down",
    "pre_self_attention_layer_norm": "attn_norm",
    "post_self_attention_layer_norm": "mlp_norm",
}
TOP_LEVEL: dict[str, str] = {
    "token_embedder/embedding": EMBEDDING,
    "decoder/decoder_norm/scale": "final_norm",
    "decoder/logits_dense/kernel": "lm_head",
}
# The contraction axes of each kernel (MaxText's shapes above): what the int8 scales reduce over.
CONTRACTED: dict[str, tuple[int, ...]] = {
    "wq": (0,), "wk": (0,), "wv": (0,), "wo": (0, 1), "w_gate": (0,), "w_up": (0,), "w_down": (0,),
}
# Leaves of a checkpoint that are not weights (a TrainState's bookkeeping).
IGNORED_ROOTS = ("step", "opt_state")
_LAYER = re.compile(r"^layers_(\d+)$")
AQT_TAIL = ("AqtDotGeneral_0", "qrhs", "frozen")


@dataclass(frozen=True)
class Entry:
    """One checkpoint leaf and where it goes.

    name: our params entry; layer: its layer (None for top-level entries and for a scanned leaf,
    which holds every layer on axis `layer_axis`); part: "kernel" (a float weight or norm scale),
    "qvalue" or "scale" (an int8 kernel's two halves)."""

    path: Path
    shape: tuple[int, ...]
    dtype: str
    name: str
    layer: int | None
    part: str
    layer_axis: int | None = None


@dataclass(frozen=True)
class Layout:
    """A MaxText checkpoint's layout and its leaves, checked against a model config."""

    kind: str  # one of LAYOUTS
    entries: tuple[Entry, ...]
    scanned: bool

    @property
    def quantized(self) -> bool:
        return self.kind.startswith("int8")

    @property
    def dtype(self) -> str:
        """The float leaves' dtype (bfloat16 or float32), as stored."""
        floats = {e.dtype for e in self.entries if e.part == "kernel"}
        return "float32" if floats == {"float32"} else "bfloat16" if "bfloat16" in floats else sorted(floats)[0]

    @property
    def quantized_names(self) -> frozenset[str]:
        return frozenset(e.name for e in self.entries if e.part == "qvalue")

    def nbytes(self) -> int:
        itemsize = {"bfloat16": 2, "float32": 4, "float16": 2, "int8": 1}
        return sum(math.prod(e.shape) * itemsize.get(e.dtype, 4) for e in self.entries)


def _canonical(path: Path) -> tuple[Path, bool]:
    """The path without wrappers: Linen's params/params (or NNX's none), NNX's `value` boxes and a
    scale's list index; and whether it sat in Linen's separate `aqt` collection."""
    parts = list(path)
    aqt = False
    while parts and parts[0] in ("params", "aqt"):
        aqt = aqt or parts[0] == "aqt"
        parts.pop(0)
    # NNX's box: a trailing `value`, or the one between `frozen` and an int8 tensor's halves (the
    # attention's `value` module is a name, not a box).
    parts = [p for i, p in enumerate(parts) if not _nnx_box(parts, i)]
    if len(parts) >= 2 and parts[-2] == "scale" and parts[-1].isdigit():
        parts.pop()  # AQT keeps a QTensor's scales as a list: scale/0
    return tuple(parts), aqt


def _nnx_box(parts: list[str], i: int) -> bool:
    return parts[i] == "value" and (i == len(parts) - 1 or (i > 0 and parts[i - 1] == "frozen"))


def _where(canonical: Path) -> tuple[str, int | None, str, bool] | None:
    """(our name, layer or None, part, scanned) of a canonical path, or None when it is not a weight."""
    text = "/".join(canonical)
    if text in TOP_LEVEL:
        return TOP_LEVEL[text], None, "kernel", False
    if len(canonical) < 3 or canonical[0] != "decoder":
        return None
    match = _LAYER.match(canonical[1])
    if canonical[1] != "layers" and match is None:
        return None
    layer = int(match.group(1)) if match else None
    rest = canonical[2:]
    part = "kernel"
    if len(rest) > 4 and rest[-4:-1] == AQT_TAIL and rest[-1] in ("qvalue", "scale"):
        rest, part = rest[:-4], rest[-1]
    elif rest[-1] in ("kernel", "scale"):
        rest = rest[:-1]
    else:
        return None
    name = LAYER_MODULES.get("/".join(rest))
    if name is None:
        return None
    return name, layer, part, layer is None


def describe_tree(leaves: Mapping[Path, tuple[tuple[int, ...], str]]) -> Layout | None:
    """The layout of a checkpoint whose leaves (path -> (shape, dtype)) are given, or None when the
    tree is not a MaxText Llama checkpoint at all (no decoder layers)."""
    entries: list[Entry] = []
    kinds: set[str] = set()
    linen_aqt = nnx = False
    for path, (shape, dtype) in leaves.items():
        if path and path[0] in IGNORED_ROOTS:
            continue
        canonical, in_aqt = _canonical(path)
        where = _where(canonical)
        if where is None:
            raise CheckpointError(f"{'/'.join(path)}: not a leaf of a MaxText Llama checkpoint")
        name, layer, part, scanned = where
        linen_aqt = linen_aqt or in_aqt
        nnx = nnx or any(_nnx_box(list(path), i) for i in range(len(path)))
        if part != "kernel":
            kinds.add("int8")
        if name in LAYER_KEYS:
            kinds.add("scanned" if scanned else "unscanned")
        axis = 1 if scanned else None
        entries.append(Entry(path, tuple(shape), str(dtype), name, layer, part, axis))
    if not entries or not kinds - {"int8"}:
        return None
    if {"scanned", "unscanned"} <= kinds:
        raise CheckpointError("a MaxText checkpoint with both scanned (decoder/layers) and unscanned layers")
    scanned = "scanned" in kinds
    if "int8" in kinds:
        if scanned:
            raise CheckpointError("a scanned int8 MaxText checkpoint: MaxText quantizes unscanned layers only")
        kind = "int8-linen" if linen_aqt or not nnx else "int8-nnx"
    else:
        kind = "bf16-scanned" if scanned else "bf16-unscanned"
    order = {n: i for i, n in enumerate((EMBEDDING, *LAYER_MODULES.values(), "final_norm", "lm_head"))}
    entries.sort(key=lambda e: (e.layer or 0, order[e.name], e.part))
    return Layout(kind, tuple(entries), scanned)


def maxtext_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """MaxText's shape of one entry (without the layer axis)."""
    e, h, k, d, m, v = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
    return {
        EMBEDDING: (v, e),
        "final_norm": (e,),
        "lm_head": (e, v),
        "wq": (e, h, d),
        "wk": (e, k, d),
        "wv": (e, k, d),
        "wo": (h, d, e),
        "w_gate": (e, m),
        "w_up": (e, m),
        "w_down": (m, e),
        "attn_norm": (e,),
        "mlp_norm": (e,),
    }[name]


def expected_shape(cfg: ModelConfig, entry: Entry) -> tuple[int, ...]:
    """What `entry` must hold for `cfg` (with the layer axis where scanned; a scale's contraction
    axes set to 1)."""
    shape = list(maxtext_shape(cfg, entry.name))
    if entry.part == "scale":
        for axis in CONTRACTED[entry.name]:
            shape[axis] = 1
    if entry.layer_axis is not None:
        shape.insert(entry.layer_axis, cfg.num_layers)
    return tuple(shape)


def check_against(layout: Layout, cfg: ModelConfig, where: str) -> None:
    """Refuse a checkpoint whose tree or shapes do not match `cfg`, naming the first path that does
    not (in the checkpoint's order), or the first tensor it lacks."""
    if cfg.tie_embeddings:
        raise CheckpointError(f"{where}: MaxText Llama checkpoints have an untied head; {cfg.name} ties it")
    seen: set[tuple[str, int | None, str]] = set()
    for entry in layout.entries:
        label = "/".join(entry.path)
        if entry.layer is not None and entry.layer >= cfg.num_layers:
            raise CheckpointError(f"{where}: {label}: layer {entry.layer} is beyond {cfg.name}'s {cfg.num_layers}")
        expected = expected_shape(cfg, entry)
        if entry.shape != expected:
            raise CheckpointError(
                f"{where}: {label}: shape {entry.shape} does not match model {cfg.name!r}, which expects {expected}"
            )
        if entry.part == "qvalue" and entry.dtype != "int8":
            raise CheckpointError(f"{where}: {label}: dtype {entry.dtype}, expected int8")
        seen.add((entry.name, entry.layer, entry.part))
    missing = [label for label, key in _required(layout, cfg) if key not in seen]
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CheckpointError(f"{where}: missing {shown} for model {cfg.name!r}")


def _required(layout: Layout, cfg: ModelConfig) -> list[tuple[str, tuple[str, int | None, str]]]:
    """Every (label, (name, layer, part)) the layout must hold for `cfg`."""
    quantized = layout.quantized_names
    out = [("token_embedder/embedding", (EMBEDDING, None, "kernel")),
           ("decoder/decoder_norm/scale", ("final_norm", None, "kernel")),
           ("decoder/logits_dense/kernel", ("lm_head", None, "kernel"))]
    layers: Sequence[int | None] = [None] if layout.scanned else range(cfg.num_layers)
    for module, name in LAYER_MODULES.items():
        parts = ("qvalue", "scale") if name in quantized else ("kernel",)
        for layer in layers:
            for part in parts:
                where = "layers" if layer is None else f"layers_{layer}"
                out.append((f"decoder/{where}/{module}/{part}", (name, layer, part)))
    return out


def interleaved_rope(model_name: str) -> bool:
    """Whether MaxText's conversion kept Meta's interleaved q/k pairs: it does for Llama 3.1 and 3.3
    (whose rotary embedding MaxText applies to interleaved pairs) and reorders every other Llama to
    the rotate-half layout (llama_or_mistral_ckpt.py: `llama3_variants`, permute_to_match_maxtext_rope)."""
    return model_name[:8] in ("llama3.1", "llama3.3")
