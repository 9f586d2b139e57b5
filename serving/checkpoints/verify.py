"""`pathserve inspect` (what a checkpoint holds) and `pathserve verify` (is every tensor intact)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serving.checkpoints.checkpoint import PARAMS_DIR, CheckpointMetadata, read_metadata, sha256
from serving.checkpoints.orbax_io import read_leaf
from serving.checkpoints.storage import join


def describe(metadata: CheckpointMetadata) -> str:
    """A readable table of the metadata and the stored tensors."""
    cfg = metadata.config
    rows = [
        ("model", cfg.name),
        (
            "layers / embed / heads / kv heads",
            f"{cfg.num_layers} / {cfg.embed_dim} / {cfg.num_heads} / {cfg.num_kv_heads}",
        ),
        ("vocab", str(cfg.vocab_size)),
        ("parameters", f"{cfg.num_params:,}"),
        ("quantization", metadata.quantization or "none"),
        ("dtype", metadata.dtype),
        ("layout", "scanned (stacked layers)" if metadata.scan_layers else "unscanned (one entry per layer)"),
        ("source", f"{metadata.source_format}: {metadata.source_path}"),
        ("tokenizer", ", ".join(metadata.tokenizer_files) or "none"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    total = 0
    lines.append("")
    lines.append(f"{'tensor'.ljust(28)} {'dtype'.ljust(9)} shape")
    for name, info in metadata.tensors.items():
        total += int(np.prod(info["shape"])) * np.dtype(_dtype(info["dtype"])).itemsize
        lines.append(f"{name.ljust(28)} {info['dtype'].ljust(9)} {tuple(info['shape'])}")
    lines.append(f"{len(metadata.tensors)} tensors, {total / 2**20:,.1f} MiB")
    return "\n".join(lines)


def _dtype(name: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else name


@dataclass(frozen=True)
class VerifyResult:
    checked: int
    bad: list[str]  # "leaf[layer]: reason"


def verify(path: str) -> VerifyResult:
    """Re-read every stored slice and compare its sha256 with the metadata."""
    metadata = read_metadata(path)
    directory = join(path, PARAMS_DIR)
    bad, checked = [], 0
    for name, info in metadata.tensors.items():
        leaf = tuple(name.split("."))
        for label, expected in info["sha256"].items():
            layer = int(label[label.index("[") + 1 : -1]) if label.endswith("]") else None
            checked += 1
            try:
                actual = sha256(read_leaf(directory, leaf, layer))
            except Exception as exc:  # a damaged chunk fails to decode
                bad.append(f"{label}: unreadable ({str(exc).splitlines()[0][:200]})")
                continue
            if actual != expected:
                bad.append(f"{label}: checksum mismatch")
    return VerifyResult(checked, bad)
