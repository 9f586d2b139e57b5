"""`pathserve inspect` (what a checkpoint holds) and `pathserve verify` (is every file and tensor intact)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from serving.checkpoints.checkpoint import (
    METADATA_FILE,
    PARAMS_DIR,
    TOKENIZER_DIR,
    CheckpointMetadata,
    seal_matches,
    sha256,
)
from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.orbax_io import read_leaf
from serving.checkpoints.storage import join, list_files, open_file, read_bytes

FILE_BLOCK_BYTES = 4 << 20


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
    checked: int  # tensor slices re-read
    bad: list[str]  # "leaf[layer]: reason" or "path/of/file: reason"
    files_checked: int = 0  # files hashed (pathserve.json included)
    notes: list[str] = field(default_factory=list)  # what was not checked, and why


def verify(path: str) -> VerifyResult:
    """Every file against the sha256 the metadata recorded at conversion (the metadata against its
    own), then every stored slice re-read against its tensor's sha256. A checkpoint converted before
    files were recorded gets its tensors checked and a note saying what was not."""
    bad, notes = [], []
    metadata, files_checked = _check_metadata(path, bad, notes)
    if metadata is None:
        return VerifyResult(0, bad, files_checked, notes)
    files_checked += _check_files(path, metadata.files, bad, notes)
    checked = _check_tensors(path, metadata, bad)
    return VerifyResult(checked, bad, files_checked, notes)


def _check_metadata(path: str, bad: list[str], notes: list[str]) -> tuple[CheckpointMetadata | None, int]:
    """The metadata, if it can be read; its own checksum checked (1 file) when it has one."""
    where = join(path, METADATA_FILE)
    try:
        text = read_bytes(where).decode()
        data = json.loads(text)
        metadata = CheckpointMetadata.from_json(text, where)
    except (CheckpointError, UnicodeDecodeError, ValueError) as exc:
        bad.append(f"{METADATA_FILE}: unreadable ({str(exc).splitlines()[0][:200]})")
        return None, 1
    recorded = data.get("metadata_sha256")
    if recorded:
        if not seal_matches(text, recorded):
            bad.append(f"{METADATA_FILE}: checksum mismatch")
        return metadata, 1
    if metadata.files:
        bad.append(f"{METADATA_FILE}: its own sha256 is missing")
        return metadata, 1
    notes.append(
        "this checkpoint was converted before pathserve recorded a sha256 of each file: its tensors "
        f"are checked, its other files ({METADATA_FILE}, {TOKENIZER_DIR}/, Orbax's metadata) are not; "
        "convert it again to cover every file"
    )
    return metadata, 0


def _check_files(path: str, recorded: dict[str, str], bad: list[str], notes: list[str]) -> int:
    if not recorded:
        return 0
    present = set(list_files(path)) - {METADATA_FILE}
    for name in sorted(recorded):
        if name not in present:
            bad.append(f"{name}: missing")
        elif file_sha256(join(path, name)) != recorded[name]:
            bad.append(f"{name}: checksum mismatch")
    for name in sorted(present - set(recorded)):
        notes.append(f"{name}: not part of the checkpoint when it was converted (not checked)")
    return len(recorded)


def _check_tensors(path: str, metadata: CheckpointMetadata, bad: list[str]) -> int:
    """Re-read every stored slice and compare its sha256 with the metadata."""
    directory = join(path, PARAMS_DIR)
    checked = 0
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
    return checked


def file_checksums(path: str) -> dict[str, str]:
    """sha256 of every file under the checkpoint directory `path` but its metadata file, by path
    within it (what conversion records; local or gs://)."""
    return {name: file_sha256(join(path, name)) for name in list_files(path) if name != METADATA_FILE}


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open_file(path) as f:
        while block := f.read(FILE_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()
