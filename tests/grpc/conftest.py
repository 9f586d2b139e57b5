"""Client stubs generated in the test from serving/grpc/jetstream.proto as shipped, the way a
JetStream user generates them (top-level `jetstream_pb2`, `jetstream_pb2_grpc`).

This process never imports the server's checked-in stubs (serving.grpc.jetstream_pb2*): both
define jetstream_proto.* in protobuf's one default descriptor pool, which refuses a second file
defining the same names. The server runs in its own process; so does anything that needs both.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

PROTO = Path(__file__).resolve().parents[2] / "serving" / "grpc" / "jetstream.proto"


@pytest.fixture(scope="session")
def stubs(tmp_path_factory) -> SimpleNamespace:
    """`pb` (messages) and `pb_grpc` (OrchestratorStub), generated with grpcio-tools into tmp."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("stubs")
    args = ["protoc", f"-I{PROTO.parent}", f"--python_out={out}", f"--grpc_python_out={out}", str(PROTO)]
    assert protoc.main(args) == 0
    sys.path.insert(0, str(out))
    try:
        return SimpleNamespace(
            pb=importlib.import_module("jetstream_pb2"), pb_grpc=importlib.import_module("jetstream_pb2_grpc")
        )
    finally:
        sys.path.remove(str(out))
