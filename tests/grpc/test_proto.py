"""The wire contract: our jetstream.proto has JetStream's package, service, messages, field names,
numbers and types; the checked-in stubs are what grpcio-tools makes of it; no JAX behind it."""

from __future__ import annotations

import subprocess
import sys

from google.protobuf.descriptor import FieldDescriptor as F

from tests.server_process import REPO

# JetStream's jetstream/core/proto/jetstream.proto: message -> field -> (number, type, repeated)
CONTRACT = {
    "DecodeRequest": {
        "max_tokens": (4, F.TYPE_INT32, False),
        "text_content": (5, F.TYPE_MESSAGE, False),
        "token_content": (6, F.TYPE_MESSAGE, False),
        "metadata": (7, F.TYPE_MESSAGE, False),
        "num_samples": (8, F.TYPE_INT32, False),
        "lora_adapter_id": (9, F.TYPE_STRING, False),
        "has_bos": (10, F.TYPE_BOOL, False),
    },
    "DecodeRequest.TextContent": {"text": (1, F.TYPE_STRING, False)},
    "DecodeRequest.TokenContent": {"token_ids": (1, F.TYPE_INT32, True)},
    "DecodeRequest.Metadata": {"start_time": (1, F.TYPE_FLOAT, False)},
    "DecodeResponse": {
        "initial_content": (2, F.TYPE_MESSAGE, False),
        "stream_content": (3, F.TYPE_MESSAGE, False),
    },
    "DecodeResponse.InitialContent": {},
    "DecodeResponse.StreamContent": {"samples": (1, F.TYPE_MESSAGE, True)},
    "DecodeResponse.StreamContent.Sample": {
        "text": (1, F.TYPE_STRING, False),
        "token_ids": (2, F.TYPE_INT32, True),
    },
    "HealthCheckRequest": {},
    "HealthCheckResponse": {"is_live": (1, F.TYPE_BOOL, False)},
}
ONEOFS = {
    "DecodeRequest": {"content": {"text_content", "token_content"}, "metadata_optional": {"metadata"}},
    "DecodeResponse": {"content": {"initial_content", "stream_content"}},
}


def _message(pb, dotted: str):
    cls = pb
    for part in dotted.split("."):
        cls = getattr(cls, part)
    return cls.DESCRIPTOR


def test_messages_fields_and_service_are_jetstreams(stubs):
    pb = stubs.pb
    assert pb.DESCRIPTOR.package == "jetstream_proto"
    for dotted, fields in CONTRACT.items():
        descriptor = _message(pb, dotted)
        assert descriptor.full_name == f"jetstream_proto.{dotted}"
        found = {f.name: (f.number, f.type, f.is_repeated) for f in descriptor.fields}
        assert found == fields, dotted
    for dotted, oneofs in ONEOFS.items():
        descriptor = _message(pb, dotted)
        assert {o.name: {f.name for f in o.fields} for o in descriptor.oneofs} == oneofs
    sample = pb.DecodeResponse.StreamContent.Sample.DESCRIPTOR
    assert pb.DecodeResponse.StreamContent.DESCRIPTOR.fields_by_name["samples"].message_type is sample
    service = pb.DESCRIPTOR.services_by_name["Orchestrator"]
    decode, health = service.methods_by_name["Decode"], service.methods_by_name["HealthCheck"]
    assert decode.input_type.name == "DecodeRequest" and decode.output_type.name == "DecodeResponse"
    assert decode.server_streaming and not decode.client_streaming
    assert health.input_type.name == "HealthCheckRequest" and health.output_type.name == "HealthCheckResponse"
    assert not health.server_streaming
    text = (REPO / "serving" / "grpc" / "jetstream.proto").read_text()
    assert "reserved 1, 2, 3;" in text and "reserved 1;" in text  # JetStream's retired numbers


def test_checked_in_stubs_are_what_grpcio_tools_generates():
    code = "from serving.grpc.generate import stale; print(stale())"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert run.stdout.strip() == "[]", (
        f"stale stubs {run.stdout.strip()}: run `python -m serving.grpc.generate` and commit them"
    )


def test_the_grpc_front_end_imports_no_jax():
    code = (
        "import sys, serving.grpc.server, serving.grpc.service, serving.grpc.decode, serving.api.server;"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert run.stdout.strip() == "[]"
