"""Adapters from gs:// (fake-gcs-server): lora_input_adapters_path in a bucket lists and reads each
adapter as from local disk, the same matrices; the load times of both are printed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.gcs_emulator import create_bucket, emulator_env, fake_gcs_server
from tests.lora.adapters import make_adapters

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import numpy as np
    from serving.checkpoints import storage
    from serving.checkpoints.hf import read_hf_config
    from serving.config import LoraConfig
    from serving.lora.peft import read_adapter
    from serving.lora.registry import AdapterRegistry
    from serving.lora.serving import make_registry

    base, local_root, bucket = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    cfg = read_hf_config(base)
    for adapter in sorted(local_root.iterdir()):
        for file in adapter.iterdir():
            storage.write_bytes(f"{bucket}/adapters/{adapter.name}/{file.name}", file.read_bytes())
    registry = make_registry(LoraConfig(f"{bucket}/adapters", 2, 16, 2), cfg)
    assert sorted(a.name for a in registry.list()) == sorted(p.name for p in local_root.iterdir())
    for adapter in sorted(local_root.iterdir()):
        started = time.perf_counter()
        local = read_adapter(str(adapter), cfg, 16)
        local_s = time.perf_counter() - started
        started = time.perf_counter()
        remote = read_adapter(f"{bucket}/adapters/{adapter.name}", cfg, 16)
        remote_s = time.perf_counter() - started
        assert local.matrices.keys() == remote.matrices.keys() and local.scaling == remote.scaling
        for name, (a, b) in local.matrices.items():
            np.testing.assert_array_equal(a, remote.matrices[name][0])
            np.testing.assert_array_equal(b, remote.matrices[name][1])
        print(f"{adapter.name}: {local.nbytes} bytes, local {local_s * 1e3:.1f} ms, gs:// {remote_s * 1e3:.1f} ms")
    print("ok")
    """
)


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with fake_gcs_server(tmp_path_factory.mktemp("gcs")) as url:
        create_bucket(url, "adapters-bucket")
        yield url


def test_adapters_in_a_bucket_load_as_from_disk(gcs, tiny_model_dir, tmp_path):
    root = tmp_path / "adapters"
    make_adapters(tiny_model_dir, root)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(root), "gs://adapters-bucket"],
        capture_output=True, text=True, env={**os.environ, **emulator_env(gcs)}, timeout=300,
    )
    assert result.returncode == 0 and result.stdout.endswith("ok\n"), result.stderr[-3000:]
    print(result.stdout)
