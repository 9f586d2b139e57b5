"""gs:// end to end against fake-gcs-server: convert to a bucket, inspect, verify, load and generate."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests import cli
from tests.gcs_emulator import create_bucket, emulator_env, fake_gcs_server

BUCKET = "pathserve-test"


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with fake_gcs_server(tmp_path_factory.mktemp("gcs")) as url:
        create_bucket(url, BUCKET)
        yield url


def run_cli(url: str, *args: str) -> subprocess.CompletedProcess:
    """A subprocess: gcsfs and tensorstore read the emulator's address from the environment once."""
    return cli.run_cli(*args, env=emulator_env(url))


def test_convert_inspect_verify_and_generate_from_a_bucket(gcs, tiny_model_dir, tmp_path):
    dst = f"gs://{BUCKET}/tiny-int8"
    converted = run_cli(gcs, "convert", str(tiny_model_dir), dst, "--quantize", "int8", "--quiet")
    assert converted.returncode == 0, converted.stderr
    inspected = run_cli(gcs, "inspect", dst, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["quantization"] == "int8"
    verified = run_cli(gcs, "verify", dst)
    assert verified.returncode == 0 and "files and all" in verified.stdout, verified.stderr
    assert "NOTE" not in verified.stdout  # every file's sha256 was recorded in the bucket too

    local = tmp_path / "tiny-int8"
    assert (
        run_cli(gcs, "convert", str(tiny_model_dir), str(local), "--quantize", "int8", "--quiet").returncode
        == 0
    )
    args = (
        "--prompt",
        "The lighthouse",
        "--max-tokens",
        "8",
        "--json",
        "quantization=int8",
        "checkpoint_is_quantized=true",
    )
    from_bucket = run_cli(gcs, "generate", dst, *args)
    from_disk = run_cli(gcs, "generate", str(local), *args)
    assert from_bucket.returncode == 0, from_bucket.stderr
    assert json.loads(from_bucket.stdout) == json.loads(from_disk.stdout)

    again = run_cli(gcs, "convert", str(tiny_model_dir), dst, "--quiet")
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_unreachable_bucket_is_a_clear_error_and_leaves_nothing(gcs, tiny_model_dir):
    result = run_cli(gcs, "convert", str(tiny_model_dir), "gs://no-such-bucket/ckpt", "--quiet")
    assert result.returncode == 2, result.stderr
    assert "bucket gs://no-such-bucket does not exist" in result.stderr and "Traceback" not in result.stderr
    listing = run_cli(gcs, "inspect", "gs://no-such-bucket/ckpt")
    assert listing.returncode == 2
