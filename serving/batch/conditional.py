"""Small objects written only if they are still what the writer last read: the one primitive that
lets many batch workers share an output prefix without a coordinator.

`create(name, data)` succeeds only if no object `name` exists; `replace(name, data, generation)`
only if the object is still at `generation` (the one `read` returned). On `gs://` these are GCS's
own preconditions (`ifGenerationMatch=0` and `ifGenerationMatch=<generation>`), checked by the
storage service, so two workers can never both win. On a local directory an exclusive `flock` on
one lock file makes the check and the write one step (workers on one machine or one shared POSIX
file system), and the generation is a counter stored beside the data.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from contextlib import contextmanager
from typing import Protocol

from serving.batch import files
from serving.batch.errors import BatchError


class ConditionalStore(Protocol):
    """Objects under one prefix, by name (which may hold '/')."""

    def read(self, name: str) -> tuple[bytes, int] | None:
        """(data, generation), or None when there is no such object."""

    def create(self, name: str, data: bytes) -> int | None:
        """Write `name` if it does not exist; its generation, or None when it existed."""

    def replace(self, name: str, data: bytes, generation: int) -> int | None:
        """Overwrite `name` if it is still at `generation`; the new generation, or None when not."""

    def names(self, prefix: str) -> list[str]:
        """Names of the objects under `prefix` (a folder name, relative to the store)."""


def store(url: str) -> ConditionalStore:
    """The store for a local directory or a gs:// prefix."""
    return GcsStore(url) if files.is_gcs(url) else LocalStore(url)


class GcsStore:
    """GCS generation preconditions through google-cloud-storage (it reads STORAGE_EMULATOR_HOST)."""

    def __init__(self, url: str):
        bucket, _, prefix = url[len("gs://") :].partition("/")
        self.prefix = prefix.strip("/")
        self.bucket = _gcs_client().bucket(bucket)

    def _blob(self, name: str):
        return self.bucket.blob(f"{self.prefix}/{name}" if self.prefix else name)

    def read(self, name: str) -> tuple[bytes, int] | None:
        from google.api_core import exceptions

        blob = self._blob(name)
        try:
            data = blob.download_as_bytes()
        except exceptions.NotFound:
            return None
        return data, int(blob.generation)

    def create(self, name: str, data: bytes) -> int | None:
        return self._upload(name, data, 0)

    def replace(self, name: str, data: bytes, generation: int) -> int | None:
        return self._upload(name, data, generation)

    def _upload(self, name: str, data: bytes, generation: int) -> int | None:
        from google.api_core import exceptions

        blob = self._blob(name)
        try:
            blob.upload_from_string(data, content_type="application/json", if_generation_match=generation)
        except exceptions.PreconditionFailed:
            return None
        return int(blob.generation)

    def names(self, prefix: str) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        return sorted(b.name[len(base) :] for b in self.bucket.list_blobs(prefix=f"{base}{prefix}/"))


def _gcs_client():
    try:
        from google.cloud import storage
    except ImportError:
        raise BatchError("gs:// URLs need google-cloud-storage: pip install 'pathserve[gcs]'") from None
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(project="emulator", credentials=AnonymousCredentials())
    return storage.Client()


class LocalStore:
    """A directory; the generation of each object is kept in the object's own JSON envelope."""

    def __init__(self, url: str):
        self.root = url.rstrip("/")
        os.makedirs(self.root, exist_ok=True)

    @contextmanager
    def _locked(self):
        with open(os.path.join(self.root, ".conditional.lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read(self, name: str) -> tuple[bytes, int] | None:
        try:
            with open(os.path.join(self.root, name), "rb") as f:
                envelope = json.loads(f.read())
        except FileNotFoundError:
            return None
        return envelope["data"].encode(), int(envelope["generation"])

    def _write(self, name: str, data: bytes, generation: int) -> int:
        path = os.path.join(self.root, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "w") as f:
            json.dump({"generation": generation, "data": data.decode()}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return generation

    def read(self, name: str) -> tuple[bytes, int] | None:
        with self._locked():
            return self._read(name)

    def create(self, name: str, data: bytes) -> int | None:
        with self._locked():
            return None if self._read(name) is not None else self._write(name, data, 1)

    def replace(self, name: str, data: bytes, generation: int) -> int | None:
        with self._locked():
            current = self._read(name)
            if current is None or current[1] != generation:
                return None
            return self._write(name, data, generation + 1)

    def names(self, prefix: str) -> list[str]:
        directory = os.path.join(self.root, prefix)
        try:
            found = os.listdir(directory)
        except FileNotFoundError:
            return []
        return sorted(f"{prefix}/{n}" for n in found if not n.endswith(".tmp"))


def create_new(url: str, data: bytes) -> bool:
    """Write the whole file `url` only if it does not exist yet; False when it did (another
    worker's). GCS: `ifGenerationMatch=0`; local: a hard link, which fails on an existing name."""
    if files.is_gcs(url):
        base, _, name = url.rpartition("/")
        return GcsStore(base).create(name, data) is not None
    directory = os.path.dirname(url) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = f"{url}.{uuid.uuid4().hex}.new"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, url)
        return True
    except FileExistsError:
        return False
    finally:
        os.remove(tmp)
