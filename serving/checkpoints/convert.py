"""`pathserve convert`: any source format -> a pathserve checkpoint, streamed tensor by tensor.

Peak memory is about one source tensor, its converted copy and its quantized copy, never the model.
A local checkpoint is written under a temporary name beside DST and moved into place when complete;
on gs:// the metadata file is written last. Either way a failed conversion leaves nothing at DST.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from serving.checkpoints.checkpoint import (
    METADATA_FILE,
    PARAMS_DIR,
    TOKENIZER_DIR,
    CheckpointMetadata,
    leaves,
    sha256,
    slice_label,
    stored_slices,
)
from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.layout import ParamTracker
from serving.checkpoints.orbax_io import ArrayWriter, leaf_name
from serving.checkpoints.sources import open_source
from serving.checkpoints.storage import (
    check_writable_location,
    exists,
    is_gcs,
    join,
    remove_tree,
    rename,
    write_bytes,
)
from serving.checkpoints.verify import file_checksums
from serving.models.config import ModelConfig
from serving.models.params import LAYER_KEYS

QUANTIZATIONS = ("", "int8")
DTYPES = ("float32", "bfloat16")


def convert(
    src: Path,
    dst: str,
    fmt: str | None = None,
    model_config: ModelConfig | None = None,
    quantize: str = "",
    dtype: str = "bfloat16",
    scan_layers: bool = True,
    overwrite: bool = False,
    progress: bool = True,
) -> CheckpointMetadata:
    """Convert `src` into a checkpoint at `dst` (a local path or gs://)."""
    if quantize not in QUANTIZATIONS:
        raise CheckpointError(f"--quantize: {quantize!r} is not one of: int8")
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    dst = str(dst).rstrip("/")
    check_writable_location(dst)
    if exists(dst) and not overwrite:
        raise CheckpointError(f"{dst} already exists; pass --overwrite to replace it")
    source = open_source(Path(src), fmt, model_config)
    # Local: write beside DST and rename into place. GCS has no atomic rename: write at DST with the
    # metadata file last (readers look for it), and remove the prefix if anything fails.
    target = dst if is_gcs(dst) else f"{dst}.partial-{os.getpid()}"
    if overwrite or target != dst:
        remove_tree(target)
    try:
        metadata = _write(source, target, quantize, dtype, scan_layers, progress)
        if target != dst:
            remove_tree(dst)
            rename(target, dst)
    except BaseException:
        remove_tree(target)
        raise
    return metadata


def _write(
    source, directory: str, quantize: str, dtype: str, scan_layers: bool, progress: bool
) -> CheckpointMetadata:
    from tqdm import tqdm

    cfg = source.config
    layout = leaves(cfg, quantize, dtype, scan_layers)
    writer = ArrayWriter(join(directory, PARAMS_DIR), layout)
    tracker = ParamTracker(cfg)
    checksums: dict[str, dict[str, str]] = {leaf_name(path): {} for path in layout}
    total = sum(cfg.num_layers if n in LAYER_KEYS else 1 for n in tracker.shapes)
    bar = tqdm(
        total=total,
        unit="tensor",
        desc=f"converting {source.path.name}",
        file=sys.stderr,
        disable=not progress,
    )
    written = 0
    with bar:
        for key, tensor, name in source.iter_params():
            tracker.check(key, tensor, name)
            for path, layer, array in stored_slices(key, tensor, quantize, dtype, scan_layers):
                writer.write(path, array, layer)
                checksums[leaf_name(path)][slice_label(path, layer)] = sha256(array)
                written += array.nbytes
            bar.update(1)
            bar.set_postfix_str(f"{written / 2**20:,.0f} MiB written", refresh=False)
        tracker.check_complete()
    for name, data in source.tokenizer_files.items():
        write_bytes(join(directory, TOKENIZER_DIR, name), data)
    files = file_checksums(directory)  # every file but the metadata, which seals itself
    metadata = CheckpointMetadata(
        model_config=cfg.model_dump(),
        quantization=quantize,
        dtype=dtype,
        scan_layers=scan_layers,
        source_format=source.format,
        source_path=str(source.path),
        tokenizer_files=sorted(source.tokenizer_files),
        tensors={
            leaf_name(path): {
                "shape": list(shape),
                "dtype": str(np_dtype),
                "sha256": checksums[leaf_name(path)],
            }
            for path, (shape, np_dtype, _) in layout.items()
        },
        files=files,
    )
    write_bytes(join(directory, METADATA_FILE), metadata.to_json().encode())
    return metadata
