"""Regenerate the checked-in Python stubs of jetstream.proto and multi_lora_decoding.proto:
`python -m serving.grpc.generate`.

Needs grpcio-tools (the dev extra). The stubs are checked in so that serving needs only grpcio and
protobuf; tests/grpc/test_proto.py regenerates them into a temporary directory and fails when the
checked-in files differ (an edited .proto, or a different grpcio-tools).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO = PACKAGE_DIR.parent.parent
PROTOS = ("jetstream", "multi_lora_decoding")
PROTO = PACKAGE_DIR / "jetstream.proto"
STUBS = tuple(f"{name}{suffix}" for name in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def _header(proto: str) -> str:
    """Generated code is neither linted nor reformatted (ruff would rewrite it on every regeneration)."""
    return f"# fmt: off\n# ruff: noqa\n# Generated from {proto}.proto by `python -m serving.grpc.generate`.\n"


def generate() -> dict[str, str]:
    """The stubs' text, file name -> contents, generated from the .proto files as they are now."""
    stubs: dict[str, str] = {}
    for name in PROTOS:
        stubs |= _generate(name)
    return stubs


def _generate(name: str) -> dict[str, str]:
    from grpc_tools import protoc

    proto = PACKAGE_DIR / f"{name}.proto"
    relative = proto.relative_to(REPO)  # its name under -I REPO makes the stubs serving.grpc.<name>_pb2
    with tempfile.TemporaryDirectory(prefix="pathserve-protoc-") as out:
        status = protoc.main(
            [
                "protoc",
                f"-I{REPO}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(proto),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed on {proto} (exit status {status})")
        generated = Path(out) / relative.parent
        files = (f"{name}_pb2.py", f"{name}_pb2.pyi", f"{name}_pb2_grpc.py")
        return {file: _header(name) + (generated / file).read_text() for file in files}


def stale() -> list[str]:
    """Names of the checked-in stubs that differ from freshly generated ones."""
    return [name for name, text in generate().items() if _read(PACKAGE_DIR / name) != text]


def _read(path: Path) -> str | None:
    return path.read_text() if path.is_file() else None


def main() -> int:
    for name, text in generate().items():
        (PACKAGE_DIR / name).write_text(text)
        print(f"wrote {PACKAGE_DIR / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
