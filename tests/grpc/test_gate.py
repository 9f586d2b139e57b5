"""The gRPC server's checks before any model is there, on a bare server in its own process (no
engine, no JAX): HealthCheck says not live, Decode is UNAVAILABLE, and with an API key set a call
without `authorization: Bearer KEY` is UNAUTHENTICATED (HealthCheck stays open, as probes do)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from tests.server_process import REPO

KEY = "sesame"
BARE_SERVER = f"""
import sys
from serving.api.state import ServerState
from serving.config import ServingConfig
from serving.grpc.server import GrpcServer

server = GrpcServer(ServerState(config=ServingConfig().server, api_key={KEY!r}), "127.0.0.1", 0).start()
print(server.port, flush=True)
sys.stdin.read()  # serve until the test closes stdin
server.stop()
"""


@pytest.fixture(scope="module")
def address():
    process = subprocess.Popen(
        [sys.executable, "-c", BARE_SERVER],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield f"127.0.0.1:{int(process.stdout.readline())}"
    finally:
        process.stdin.close()
        assert process.wait(timeout=30) == 0


def test_before_the_model_health_is_false_and_decode_unavailable_and_the_key_is_checked(address, stubs):
    pb = stubs.pb
    request = pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text="hello"), max_tokens=4)
    with grpc.insecure_channel(address) as channel:
        stub = stubs.pb_grpc.OrchestratorStub(channel)
        assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).is_live is False
        for metadata, code in [
            ((), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", f"Bearer {KEY}"),), grpc.StatusCode.UNAVAILABLE),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Decode(request, metadata=metadata, timeout=10))
            assert info.value.code() == code, info.value.details()
        assert "still loading" in info.value.details()
