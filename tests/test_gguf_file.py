"""Our GGUF header reader (serving/checkpoints/gguf_file.py) against the `gguf` package's own
reader, on a file written by the package's writer with every metadata value type, a custom
alignment and plain and quantized tensors; and the errors for files that are not GGUF or are cut."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from serving.checkpoints.errors import CheckpointError
from serving.checkpoints.gguf_file import GGUFFile, read_gguf

SCALARS = [
    (GGUFValueType.UINT8, 250),
    (GGUFValueType.INT8, -7),
    (GGUFValueType.UINT16, 65000),
    (GGUFValueType.INT16, -30000),
    (GGUFValueType.UINT32, 4_000_000_000),
    (GGUFValueType.INT32, -2_000_000_000),
    (GGUFValueType.FLOAT32, 0.25),
    (GGUFValueType.BOOL, True),
    (GGUFValueType.UINT64, 2**63 + 5),
    (GGUFValueType.INT64, -(2**62)),
    (GGUFValueType.FLOAT64, 1e-300),
    (GGUFValueType.STRING, "rope → théta, 日本"),
]
ARRAYS = [
    (GGUFValueType.INT32, [3, -1, 2**31 - 1]),
    (GGUFValueType.FLOAT32, [0.5, -2.0]),
    (GGUFValueType.BOOL, [True, False, True]),
    (GGUFValueType.UINT8, [255]),
    (GGUFValueType.STRING, ["Ġthe", "", "<|im_end|>", "ü"]),
]


def write_every_kind(path: Path) -> dict[str, np.ndarray]:
    """A GGUF file with every scalar type, arrays of several, alignment 64, and F32, F16, Q8_0 and
    I32 tensors; returns the float tensors as written."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    for kind, value in SCALARS:
        writer.add_key_value(f"test.scalar.{kind.name.lower()}", value, kind)
    for kind, values in ARRAYS:
        writer.add_key_value(f"test.array.{kind.name.lower()}", values, GGUFValueType.ARRAY, sub_type=kind)
    tensors = {
        "f32.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "f16.weight": rng.standard_normal((4, 7)).astype(np.float16),
        "q8.weight": rng.standard_normal((2, 64)).astype(np.float32),
    }
    writer.add_tensor("f32.weight", tensors["f32.weight"])
    writer.add_tensor("f16.weight", tensors["f16.weight"])
    q8 = quantize(tensors["q8.weight"], GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8.weight", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("i32.ids", np.arange(6, dtype=np.int32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.fixture(scope="module")
def every_kind(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "every-kind.gguf"
    write_every_kind(path)
    return path


def test_fields_and_tensors_equal_the_gguf_packages_reader(every_kind):
    fields, tensors = read_gguf(every_kind)
    reference = GGUFReader(every_kind)
    expected = {k: f.contents() for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert fields == expected
    assert fields["general.alignment"] == 64
    for kind, value in SCALARS:
        got = fields[f"test.scalar.{kind.name.lower()}"]
        assert got == pytest.approx(value) if kind == GGUFValueType.FLOAT32 else got == value, kind
    for kind, values in ARRAYS:
        assert fields[f"test.array.{kind.name.lower()}"] == values, kind
    assert [t.name for t in tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(tensors, reference.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type and ours.dims == tuple(theirs.shape.tolist()), ours.name
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape, ours.name
        np.testing.assert_array_equal(ours.data, theirs.data, err_msg=ours.name)


def test_iter_tensors_gives_float_arrays_in_numpy_order(every_kind, tmp_path):
    written = write_every_kind(tmp_path / "again.gguf")
    arrays = dict(GGUFFile(every_kind).iter_tensors())
    np.testing.assert_array_equal(arrays["f32.weight"], written["f32.weight"])
    np.testing.assert_array_equal(arrays["f16.weight"], written["f16.weight"].astype(np.float32))
    q8 = GGMLQuantizationType.Q8_0
    np.testing.assert_array_equal(arrays["q8.weight"], dequantize(quantize(written["q8.weight"], q8), q8))
    assert np.abs(arrays["q8.weight"] - written["q8.weight"]).max() < 0.05
    np.testing.assert_array_equal(arrays["i32.ids"], np.arange(6).reshape(2, 3))


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: b"GGML" + data[4:], id="magic"),
        pytest.param(lambda data: data[:4] + (1).to_bytes(4, "little") + data[8:], id="version-1"),
        pytest.param(lambda data: data[:4] + (3).to_bytes(4, "big") + data[8:], id="big-endian"),
        pytest.param(lambda data: data[:200], id="cut-in-the-header"),
        # The last tensor (24 bytes of I32) and its padding to 64: cut 70, and it is short by 6.
        pytest.param(lambda data: data[:-70], id="cut-in-the-data"),
    ],
)
def test_a_damaged_file_is_a_checkpoint_error(every_kind, tmp_path, damage):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(damage(every_kind.read_bytes()))
    with pytest.raises(ValueError):
        read_gguf(broken)
    with pytest.raises(CheckpointError, match="cannot read GGUF"):
        GGUFFile(broken)
