"""Files of a batch job through fsspec: local paths and gs:// (gcsfs) alike.

Writes are atomic: the bytes go to a temporary name beside the target, then move into place, so a
reader (or a rerun after kill -9) sees a whole file or none.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from serving.batch.errors import BatchError

TMP_DIR = "_tmp"


def is_gcs(url: str) -> bool:
    return url.startswith("gs://")


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def _fs(url: str):
    import fsspec

    if is_gcs(url):
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        try:
            import gcsfs  # noqa: F401
        except ImportError:
            raise BatchError("gs:// URLs need gcsfs: pip install 'pathserve[gcs]'") from None
    return fsspec.core.url_to_fs(url)


def _url(url: str, path: str) -> str:
    return f"gs://{path}" if is_gcs(url) else path


@dataclass(frozen=True)
class InputFile:
    url: str
    size: int
    # What changes whenever the content does, at the same size too: the object's generation on
    # gs://, the modification time in ns locally.
    version: str


def list_inputs(url: str, output_url: str) -> list[InputFile]:
    """The input: one file, or every *.jsonl under a directory / prefix, sorted, less those under
    the output (its results are *.jsonl too, and come and go with each run)."""
    fs, path = _fs(url)
    output = _fs(output_url)[1].rstrip("/") if is_gcs(url) == is_gcs(output_url) else None
    if output is not None and output == path.rstrip("/"):
        raise BatchError(f"--output {output_url}: the input directory itself; name a directory inside it or elsewhere")
    try:
        fs.invalidate_cache()
        if fs.isfile(path):
            return [_input_file(url, path, fs.info(path))]
        if not fs.isdir(path):
            raise BatchError(f"--input {url}: no such file, directory or prefix")
        found = sorted(
            (p, info)
            for p, info in fs.find(path, detail=True).items()
            if p.endswith(".jsonl")
            and info.get("type", "file") == "file"
            and (output is None or not p.startswith(output + "/"))
        )
        inputs = [_input_file(_url(url, p), p, info) for p, info in found]
    except BatchError:
        raise
    except Exception as exc:
        raise BatchError(f"--input {url}: cannot list it: {exc}") from None
    if not inputs:
        raise BatchError(f"--input {url}: no *.jsonl files there")
    return inputs


def _input_file(url: str, path: str, info: dict) -> InputFile:
    if is_gcs(url):
        version = f"generation {info.get('generation', '')}"
    else:
        version = f"mtime_ns {os.stat(path).st_mtime_ns}"
    return InputFile(url, int(info.get("size") or 0), version)


def iter_lines(url: str, start: int, end: int) -> Iterator[bytes]:
    """The lines (without their newline) between byte offsets start and end of a file."""
    fs, path = _fs(url)
    try:
        with fs.open(path, "rb") as f:
            f.seek(start)
            remaining = end - start
            while remaining > 0:
                line = f.readline()
                if not line:
                    break
                remaining -= len(line)
                yield line.rstrip(b"\r\n")
    except FileNotFoundError:
        raise BatchError(f"{url}: the input file disappeared") from None


def lines(url: str) -> Iterator[bytes]:
    """Every line of a file with its newline, streamed (not held in memory)."""
    fs, path = _fs(url)
    with fs.open(path, "rb") as f:
        yield from f


def read_bytes(url: str) -> bytes | None:
    """The file's bytes, or None when there is none."""
    fs, path = _fs(url)
    try:
        with fs.open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def exists(url: str) -> bool:
    fs, path = _fs(url)
    return fs.exists(path)


def write_atomic(url: str, data: bytes) -> None:
    """Write `data` whole or not at all: locally to a temporary name in `_tmp/` beside it, then
    renamed into place; on gs:// as one upload."""
    fs, path = _fs(url)
    directory, name = path.rsplit("/", 1)
    tmp = f"{directory}/{TMP_DIR}/{name}.{uuid.uuid4().hex}"
    try:
        if not is_gcs(url):
            os.makedirs(os.path.dirname(tmp), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return
        # A GCS object appears whole when its upload completes: no temporary and no move (a
        # move is a copy and a delete there, and a temporary another worker could sweep away).
        fs.pipe_file(path, data)
    except Exception as exc:
        raise BatchError(f"cannot write {url}: {exc}") from None


def check_output(url: str) -> None:
    """Fail before any work when the output cannot be written: a local path that is a file, or
    whose folder cannot be made there; a bucket that cannot be reached."""
    if not is_gcs(url):
        path = Path(url)
        if path.exists() and not path.is_dir():
            raise BatchError(f"--output {url}: a file, not a folder for the results")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BatchError(f"--output {url}: cannot make the folder ({exc.strerror})") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise BatchError(f"--output {url}: the folder is not writable")
        return
    bucket = url[len("gs://") :].split("/", 1)[0]
    fs, _ = _fs(url)
    try:
        found = fs.exists(bucket)
    except Exception as exc:
        raise BatchError(f"--output {url}: cannot reach bucket gs://{bucket}: {exc}") from None
    if not found:
        raise BatchError(f"--output {url}: bucket gs://{bucket} does not exist or is not accessible")


def remove_stale_temporaries(output_url: str, older_than_s: float) -> None:
    """Remove local temporaries that writes killed half-way left, but none that a live worker may
    still be writing (those are seconds old)."""
    if is_gcs(output_url):
        return
    directory = join(output_url, TMP_DIR)
    now = time.time()
    for name in list_names(directory):
        path = join(directory, name)
        try:
            if now - os.path.getmtime(path) > older_than_s:
                os.remove(path)
        except FileNotFoundError:
            pass


def remove(url: str) -> None:
    """Delete a file, or a directory / prefix and everything under it (missing is fine)."""
    fs, path = _fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def list_names(url: str) -> list[str]:
    """Names directly under a directory / prefix (none when it does not exist)."""
    fs, path = _fs(url)
    try:
        fs.invalidate_cache()
        return sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []
