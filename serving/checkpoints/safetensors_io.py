"""A small safetensors reader that reads tensors one at a time.

Our own rather than `safetensors.safe_open(framework="numpy")`: numpy has no bfloat16, and Llama
checkpoints are mostly bfloat16. The format is an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}} and the raw little-endian data.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from serving.checkpoints.errors import CheckpointError

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """The header's tensor entries and the offset where data starts."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated safetensors file (no header)")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise CheckpointError(f"{file}: truncated safetensors file (header of {length} bytes)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{file}: corrupt safetensors header: {exc}") from None
    header.pop("__metadata__", None)
    data_start = 8 + length
    for name, entry in header.items():
        end = entry["data_offsets"][1]
        if data_start + end > size:
            raise CheckpointError(
                f"{file}: truncated safetensors file: tensor {name!r} ends at byte {data_start + end}, "
                f"the file has {size}"
            )
        if entry["dtype"] not in _DTYPES:
            raise CheckpointError(f"{file}: tensor {name!r} has unsupported dtype {entry['dtype']}")
    return header, data_start


def iter_tensors(file: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, array) in file order. Each tensor is read into its own buffer (no mapping of
    the whole file), so memory stays at one tensor at a time."""
    header, data_start = read_header(file)
    with file.open("rb") as f:
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            f.seek(data_start + begin)
            raw = np.fromfile(f, dtype=np.uint8, count=end - begin)
            yield name, raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])
