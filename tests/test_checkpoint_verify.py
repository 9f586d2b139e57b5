"""`pathserve verify` covers every file a converted checkpoint holds: a flipped byte anywhere (a
tensor chunk, Orbax's and zarr's metadata, the tokenizer, pathserve.json itself) is named, and the
command exits non-zero. A checkpoint converted before files were recorded says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.checkpoints.convert import convert
from serving.checkpoints.verify import verify
from tests.test_checkpoints import run_cli

METADATA = "pathserve.json"


@pytest.fixture(scope="module")
def checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("verify") / "ckpt"
    convert(tiny_model_dir, str(ckpt), quantize="int8", progress=False)
    return ckpt


def every_file(ckpt: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())


class Flipped:
    """One byte of one file flipped (bits 0x40), put back on leaving."""

    def __init__(self, path: Path, offset: int | None = None):
        self.path, self.original = path, path.read_bytes()
        self.offset = len(self.original) // 2 if offset is None else offset

    def __enter__(self) -> None:
        data = bytearray(self.original)
        data[self.offset] ^= 0x40
        self.path.write_bytes(bytes(data))

    def __exit__(self, *exc) -> None:
        self.path.write_bytes(self.original)


def test_conversion_records_every_file_and_verify_checks_them_all(checkpoint):
    metadata = json.loads((checkpoint / METADATA).read_text())
    files = every_file(checkpoint)
    assert sorted(metadata["files"]) == [f for f in files if f != METADATA]
    assert "tokenizer/tokenizer.json" in files and any(f.startswith("params/") for f in files)
    result = verify(str(checkpoint))
    assert result.bad == [] and result.notes == [] and result.files_checked == len(files)


def one_of_each_kind(files: list[str]) -> list[str]:
    """Every file but the zarr chunks, and the first chunk of each array (the ~900 chunks of the
    tiny model's arrays are all the same kind of file; verifying once per chunk would take minutes)."""
    chosen, arrays = [], set()
    for name in files:
        directory, _, base = name.rpartition("/")
        if not base[0].isdigit():
            chosen.append(name)
        elif directory not in arrays:
            arrays.add(directory)
            chosen.append(name)
    return chosen


def test_a_flipped_byte_in_any_file_is_named(checkpoint):
    files = one_of_each_kind(every_file(checkpoint))
    assert {f for f in files if not f.startswith("params/")} >= {METADATA, "tokenizer/tokenizer.json"}
    assert sum(f.endswith("/.zarray") for f in files) > 10 and any(f.endswith("_METADATA") for f in files)
    for name in files:
        with Flipped(checkpoint / name):
            result = verify(str(checkpoint))
        assert any(line.startswith(f"{name}: ") for line in result.bad), (name, result.bad)
    assert verify(str(checkpoint)).bad == []


@pytest.mark.parametrize("where", ["own sha256", "a file's sha256", "the key of its own sha256", "a value"])
def test_a_flipped_byte_anywhere_in_the_metadata_is_named(checkpoint, where):
    text = (checkpoint / METADATA).read_text()
    seal = text.index('"metadata_sha256": "') + len('"metadata_sha256": "')
    offset = {
        "own sha256": seal + 10,
        "a file's sha256": text.index('"tokenizer/tokenizer.json": "') + len('"tokenizer/tokenizer.json": "') + 5,
        "the key of its own sha256": text.index('"metadata_sha256"') + 3,
        "a value": text.index('"source_path": "') + len('"source_path": "') + 2,
    }[where]
    with Flipped(checkpoint / METADATA, offset):
        result = verify(str(checkpoint))
    assert any(line.startswith(f"{METADATA}: ") for line in result.bad), result.bad


def test_the_command_exits_non_zero_naming_a_flipped_tokenizer_file(checkpoint):
    with Flipped(checkpoint / "tokenizer" / "tokenizer.json"):
        run = run_cli("verify", str(checkpoint))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "BAD tokenizer/tokenizer.json: checksum mismatch" in run.stdout
    assert "tokenizer/tokenizer.json" in run.stderr
    clean = run_cli("verify", str(checkpoint))
    assert clean.returncode == 0 and f"all {len(every_file(checkpoint))} files and all" in clean.stdout


def test_a_checkpoint_from_before_file_checksums_says_what_was_not_checked(checkpoint, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(checkpoint, old)
    metadata = json.loads((old / METADATA).read_text())
    del metadata["files"], metadata["metadata_sha256"]
    (old / METADATA).write_text(json.dumps(metadata, indent=1))
    run = run_cli("verify", str(old))
    assert run.returncode == 0, run.stderr
    assert "NOTE this checkpoint was converted before pathserve recorded a sha256 of each file" in run.stdout
    assert "tensors verified" in run.stdout and "files and" not in run.stdout
    with Flipped(old / "tokenizer" / "tokenizer.json"):  # not caught, and the note says so
        assert "NOTE" in run_cli("verify", str(old)).stdout
