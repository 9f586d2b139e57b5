"""Regenerate the checked-in Python stubs of jetstream.proto: `python -m serving.grpc.generate`.

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
PROTO = PACKAGE_DIR / "jetstream.proto"
STUBS = ("jetstream_pb2.py", "jetstream_pb2.pyi", "jetstream_pb2_grpc.py")
# Generated code is neither linted nor reformatted (ruff would rewrite it on every regeneration).
HEADER = "# fmt: off\n# ruff: noqa\n# Generated from jetstream.proto by `python -m serving.grpc.generate`.\n"


def generate() -> dict[str, str]:
    """The stubs' text, file name -> contents, generated from jetstream.proto as it is now."""
    from grpc_tools import protoc

    relative = PROTO.relative_to(REPO)  # its name under -I REPO makes the stubs serving.grpc.jetstream_pb2
    with tempfile.TemporaryDirectory(prefix="pathserve-protoc-") as out:
        status = protoc.main(
            [
                "protoc",
                f"-I{REPO}",
                f"--python_out={out}",
                f"--pyi_out={out}",
                f"--grpc_python_out={out}",
                str(PROTO),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (exit status {status})")
        generated = Path(out) / relative.parent
        return {name: HEADER + (generated / name).read_text() for name in STUBS}


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
