"""A sharded restore on two processes (4 CPU devices each, one 8-device mesh) reads, per process,
about the bytes of the shards its devices hold, not the whole checkpoint: from a local directory
and from gs:// (fake-gcs-server). Bytes are tensorstore's own counters (kvstore .../bytes_read)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gcs_emulator import create_bucket, emulator_env, fake_gcs_server
from tests.multihost.probe_pair import run_probe_pair
from tests.server_process import REPO

PROBE = Path(__file__).with_name("restore_probe.py")
BUCKET = "pathserve-multihost"


def convert(source: Path, destination: str, env: dict[str, str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "serving.cli", "convert", str(source), destination, "--quiet"],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def restore_on_two_processes(path: str, env: dict[str, str]) -> list[dict]:
    return run_probe_pair(PROBE, path, env=env, timeout=240)


def check(reports: list[dict]) -> None:
    for report in reports:
        total, held, read = report["total"], report["held"], report["read"]
        # Half of each weight matrix lives on each process (norms and scales are replicated).
        assert held < 0.7 * total, report
        assert 0.8 * held <= read <= 1.3 * held + 64 * 1024, report  # + metadata and zarr headers


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with fake_gcs_server(tmp_path_factory.mktemp("gcs")) as url:
        create_bucket(url, BUCKET)
        yield url


def test_each_process_reads_its_shards_from_a_directory(tiny_model_dir, tmp_path):
    checkpoint = tmp_path / "tiny"
    convert(tiny_model_dir, str(checkpoint), {})
    check(restore_on_two_processes(str(checkpoint), {}))


def test_each_process_reads_its_shards_from_a_bucket(tiny_model_dir, gcs):
    env = emulator_env(gcs)
    convert(tiny_model_dir, f"gs://{BUCKET}/tiny", env)
    check(restore_on_two_processes(f"gs://{BUCKET}/tiny", env))
