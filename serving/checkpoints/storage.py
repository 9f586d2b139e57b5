"""Where checkpoints live: a local path or a gs:// URL, through fsspec (files) and tensorstore
(arrays). gs:// needs gcsfs; both honour STORAGE_EMULATOR_HOST / TENSORSTORE_GCS_HTTP_URL for an
emulator."""

from __future__ import annotations

import os
from typing import Any

from serving.checkpoints.errors import CheckpointError


def is_gcs(path: str) -> bool:
    return str(path).startswith("gs://")


def join(base: str, *parts: str) -> str:
    return "/".join([str(base).rstrip("/"), *parts])


def _fs(path: str):
    import fsspec

    if is_gcs(path):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        try:
            import gcsfs  # noqa: F401
        except ImportError:
            raise CheckpointError("gs:// paths need gcsfs: pip install gcsfs") from None
    fs, stripped = fsspec.core.url_to_fs(str(path))
    return fs, stripped


def exists(path: str) -> bool:
    fs, p = _fs(path)
    try:
        return fs.exists(p)
    except Exception as exc:
        raise CheckpointError(f"cannot reach {path}: {exc}") from None


def check_writable_location(path: str) -> None:
    """Fail early, with the bucket's name, when a gs:// destination's bucket cannot be reached."""
    if not is_gcs(path):
        return
    bucket = str(path)[len("gs://") :].split("/", 1)[0]
    fs, _ = _fs(path)
    try:
        found = fs.exists(bucket)
    except Exception as exc:
        raise CheckpointError(f"cannot reach bucket gs://{bucket}: {exc}") from None
    if not found:
        raise CheckpointError(f"bucket gs://{bucket} does not exist or is not accessible (writing {path})")


def write_bytes(path: str, data: bytes) -> None:
    fs, p = _fs(path)
    try:
        if not is_gcs(path):
            os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        with fs.open(p, "wb") as f:
            f.write(data)
    except Exception as exc:
        raise CheckpointError(f"cannot write {path}: {exc}") from None


def read_bytes(path: str) -> bytes:
    fs, p = _fs(path)
    try:
        with fs.open(p, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"not found: {path}") from None
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def list_files(path: str) -> list[str]:
    """Every file under the directory `path`, as '/'-separated paths within it, sorted."""
    fs, p = _fs(path)
    root = p.rstrip("/")
    try:
        return sorted(f[len(root) + 1 :] for f in fs.find(root))
    except FileNotFoundError:
        return []
    except Exception as exc:
        raise CheckpointError(f"cannot list {path}: {exc}") from None


def open_file(path: str):
    """A binary reader of `path` (a context manager)."""
    fs, p = _fs(path)
    try:
        return fs.open(p, "rb")
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def list_names(path: str) -> list[str]:
    fs, p = _fs(path)
    try:
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(p, detail=False))
    except FileNotFoundError:
        return []


def remove_tree(path: str) -> None:
    fs, p = _fs(path)
    if fs.exists(p):
        fs.rm(p, recursive=True)


def rename(src: str, dst: str) -> None:
    """Move a finished local checkpoint into place, atomically."""
    os.rename(src, dst)


def kvstore(path: str) -> dict[str, Any]:
    """tensorstore kvstore spec for a directory."""
    if is_gcs(path):
        bucket, _, prefix = str(path)[len("gs://") :].partition("/")
        return {"driver": "gcs", "bucket": bucket, "path": prefix.rstrip("/") + "/"}
    return {"driver": "file", "path": os.path.abspath(path) + "/"}
