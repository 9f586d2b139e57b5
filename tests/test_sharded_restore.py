"""Restore with target shardings on 8 virtual CPU devices: each array lands with the requested
sharding and equals the unsharded restore. Runs in a subprocess: the device count is fixed when
JAX starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from serving.checkpoints.convert import convert
from tests.xla_flags import cpu_devices

SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from serving.checkpoints.checkpoint import leaves, read_metadata
    from serving.checkpoints.restore import restore_params

    path = sys.argv[1]
    assert len(jax.devices()) == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("autoregressive", "tensor"))
    column = {"wq", "wk", "wv", "w_gate", "w_up", "lm_head"}  # split the output features
    row = {"wo", "w_down"}  # split the input features

    def spec(path):
        name = next(p for p in path if p not in ("layers", "values", "scales"))
        stacked = path[0] == "layers"
        lead = (None,) if stacked else ()
        if name == "embed":
            return P(None, "tensor") if path[-1] != "scales" else P()
        if name in column:
            return P(*lead, None, "tensor")
        if name in row:
            return P(*lead, "tensor", None) if path[-1] != "scales" else P()
        return P()

    metadata = read_metadata(path)
    stored = leaves(metadata.config, metadata.quantization, metadata.dtype, metadata.scan_layers)
    shardings = {p: NamedSharding(mesh, spec(p)) for p in stored}
    sharded = restore_params(path, shardings=shardings)
    plain = restore_params(path)
    flat_sharded = jax.tree_util.tree_flatten_with_path(sharded)[0]
    flat_plain = dict(jax.tree_util.tree_flatten_with_path(plain)[0])
    checked = 0
    for key_path, array in flat_sharded:
        names = tuple(getattr(k, "key", getattr(k, "name", None)) for k in key_path)
        expected = shardings[names]
        assert array.sharding.is_equivalent_to(expected, array.ndim), (names, array.sharding, expected)
        np.testing.assert_array_equal(np.asarray(array), np.asarray(flat_plain[key_path]))
        if "tensor" in tuple(expected.spec):
            assert len({str(s.index) for s in array.addressable_shards}) == 4, names
        checked += 1
    print("checked", checked)
    """
)


@pytest.mark.parametrize("quantize", ["", "int8"], ids=["bf16", "int8"])
def test_restore_with_shardings_on_8_devices(tiny_model_dir, tmp_path, quantize):
    ckpt = tmp_path / "ckpt"
    convert(tiny_model_dir, str(ckpt), quantize=quantize, progress=False)
    env = {**os.environ, **cpu_devices(8)}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ckpt)], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checked" in result.stdout
    assert int(result.stdout.split("checked")[1]) >= (12 if not quantize else 20)
