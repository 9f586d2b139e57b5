"""Small objects written only if they are still what the writer last read: the one primitive that
lets many batch workers share an output prefix without a coordinator.

`create(name, data)` succeeds only if no object `name` exists; `replace(name, data, generation)`
only if the object is still at `generation` (the one `read` returned). `write_fenced` writes a
shard's results only while its claim is the writer's (see serving.batch.claims). On `gs://` these are GCS's
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

    def generation(self, name: str) -> int:
        """The generation of a plain object (a shard's results), 0 when absent (locally: 1 when
        it exists, as the local store fences results by the claim instead)."""

    def write_fenced(
        self, name: str, data: bytes, claim: str, claim_generation: int, results_generation: int
    ) -> bool:
        """Write the plain object `name` whole, only if the claim object `claim` is still at
        `claim_generation` (locally, checked under the lock) or `name` is still at
        `results_generation` (GCS, checked by the service); False when it was not written."""


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

    def _upload(self, name: str, data: bytes, generation: int, content_type: str = "application/json") -> int | None:
        from google.api_core import exceptions

        blob = self._blob(name)
        try:
            blob.upload_from_string(data, content_type=content_type, if_generation_match=generation)
        except exceptions.PreconditionFailed:
            return None
        return int(blob.generation)

    def generation(self, name: str) -> int:
        blob = self.bucket.get_blob(self._blob(name).name)
        return 0 if blob is None else int(blob.generation)

    def write_fenced(
        self, name: str, data: bytes, claim: str, claim_generation: int, results_generation: int
    ) -> bool:
        if self._upload(name, data, results_generation, "application/jsonl") is not None:
            return True
        found = self.read(name)  # a retried upload whose first try landed fails its precondition
        return found is not None and found[0] == data


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

    def generation(self, name: str) -> int:
        return 1 if os.path.exists(os.path.join(self.root, name)) else 0

    def write_fenced(
        self, name: str, data: bytes, claim: str, claim_generation: int, results_generation: int
    ) -> bool:
        path = os.path.join(self.root, name)
        tmp = os.path.join(self.root, files.TMP_DIR, f"{os.path.basename(name)}.{uuid.uuid4().hex}")
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        with self._locked():
            current = self._read(claim)
            if current is None or current[1] != claim_generation:
                os.remove(tmp)
                return False
            os.replace(tmp, path)
        return True


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
