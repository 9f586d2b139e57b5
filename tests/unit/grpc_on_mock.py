"""Run by tests/grpc/test_grpc_on_mock.py in a process of its own (the server's stubs and the stubs
tests/grpc generates cannot share one process): JetStream's gRPC API over the mock engine, checked
with hand-computable answers. Prints "ok" or fails with an AssertionError."""

from __future__ import annotations

import grpc

from serving.api.state import ServerState
from serving.config import ServingConfig
from serving.engine.mock import AsciiTokenizer, MockEngine
from serving.grpc import jetstream_pb2 as pb
from serving.grpc import jetstream_pb2_grpc as pb_grpc
from serving.grpc.server import GrpcServer
from serving.orchestrator import Orchestrator
from serving.request import SamplingParams

TOKENIZER = AsciiTokenizer()


def main() -> None:
    cfg = ServingConfig(max_queued_requests=1, max_prefill_predict_length=64, max_target_length=256)
    state = ServerState(config=cfg.server)
    server = GrpcServer(state, "127.0.0.1", 0).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.OrchestratorStub(channel)
    try:
        assert not stub.HealthCheck(pb.HealthCheckRequest()).is_live  # nothing loaded yet
        _code(stub, pb.DecodeRequest(max_tokens=3, text_content=pb.DecodeRequest.TextContent(text="ab")),
              grpc.StatusCode.UNAVAILABLE)
        orchestrator = Orchestrator(MockEngine(slots=2), {}, TOKENIZER, cfg.orchestrator).start()
        state.set_ready(orchestrator, "mock")
        assert stub.HealthCheck(pb.HealthCheckRequest()).is_live

        text = pb.DecodeRequest(max_tokens=4, text_content=pb.DecodeRequest.TextContent(text="ab"))
        samples = [s for r in stub.Decode(text) for s in r.stream_content.samples]
        assert "".join(s.text for s in samples) == "cdef", samples
        assert [i for s in samples for i in s.token_ids] == TOKENIZER.encode("cdef")

        tokens = pb.DecodeRequest(max_tokens=3, token_content=pb.DecodeRequest.TokenContent(token_ids=[10, 11]))
        ids = [i for r in stub.Decode(tokens) for s in r.stream_content.samples for i in s.token_ids]
        assert ids == [12, 13, 14], ids

        # longer than max_prefill_predict_length: prefilled in chunks
        chunked = pb.DecodeRequest(max_tokens=2, token_content=pb.DecodeRequest.TokenContent(token_ids=[1] * 65))
        ids = [i for r in stub.Decode(chunked) for s in r.stream_content.samples for i in s.token_ids]
        assert ids == [2, 3], ids
        too_long = pb.DecodeRequest(max_tokens=2, token_content=pb.DecodeRequest.TokenContent(token_ids=[1] * 255))
        _code(stub, too_long, grpc.StatusCode.INVALID_ARGUMENT)
        _code(stub, pb.DecodeRequest(max_tokens=0, text_content=pb.DecodeRequest.TextContent(text="ab")),
              grpc.StatusCode.INVALID_ARGUMENT)
        lora = pb.DecodeRequest(max_tokens=2, text_content=pb.DecodeRequest.TextContent(text="ab"), lora_adapter_id="x")
        _code(stub, lora, grpc.StatusCode.NOT_FOUND)  # an adapter this server does not know

        orchestrator.stop(timeout=10)  # nothing drains the queue any more: fill it, then one more
        idle = Orchestrator(MockEngine(slots=1), {}, TOKENIZER, cfg.orchestrator)
        state.orchestrator = idle
        for _ in range(1 + 1):  # its one slot and its queue of one
            idle.submit(TOKENIZER.encode("a"), SamplingParams(max_tokens=2))
        _code(stub, text, grpc.StatusCode.RESOURCE_EXHAUSTED)
        state.start_draining()
        _code(stub, text, grpc.StatusCode.UNAVAILABLE)
    finally:
        channel.close()
        server.stop()
    failed_engine(cfg)
    maxtext_sampling()
    print("ok")


def maxtext_sampling() -> None:
    """The proto has no sampling fields: Decode samples as MaxText's decode_sampling_* keys say."""
    from serving.config import load_config
    from serving.grpc.decode import sampling

    request = pb.DecodeRequest(max_tokens=3, text_content=pb.DecodeRequest.TextContent(text="ab"))

    def drawn(*overrides: str):
        return sampling(request, TOKENIZER, load_config(None, overrides).server)

    greedy = drawn()
    assert greedy.temperature == 0.0 and greedy.top_k == 0 and greedy.top_p == 1.0, greedy
    weighted = drawn("decode_sampling_strategy=weighted", "decode_sampling_temperature=0.7")
    assert weighted.temperature == 0.7 and weighted.top_k == 0 and weighted.top_p == 1.0, weighted
    nucleus = drawn("decode_sampling_strategy=nucleus", "decode_sampling_nucleus_p=0.9")
    assert (nucleus.temperature, nucleus.top_p, nucleus.top_k) == (1.0, 0.9, 0), nucleus
    topk = drawn("decode_sampling_strategy=topk", "decode_sampling_top_k=5", "decode_sampling_temperature=0.5")
    assert (topk.temperature, topk.top_p, topk.top_k) == (0.5, 1.0, 5), topk
    composite = drawn("decode_sampling_strategy=composite", "decode_sampling_top_k=5", "decode_sampling_nucleus_p=0.8")
    assert (composite.top_k, composite.top_p) == (5, 0.8), composite
    assert len({drawn("decode_sampling_strategy=weighted").seed for _ in range(8)}) > 1  # a fresh seed a request


def failed_engine(cfg: ServingConfig) -> None:
    """A Decode the device loop fails under ends INTERNAL after the tokens it had (not OK and short),
    and HealthCheck then says not live."""
    from tests.failing_engine import FailsAfter


    state = ServerState(config=cfg.server)
    server = GrpcServer(state, "127.0.0.1", 0).start()
    state.set_ready(Orchestrator(FailsAfter(2, slots=2, step_seconds=0.02), {}, TOKENIZER, cfg.orchestrator).start(), "mock")
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = pb_grpc.OrchestratorStub(channel)
        call = stub.Decode(pb.DecodeRequest(max_tokens=50, text_content=pb.DecodeRequest.TextContent(text="ab")))
        received = []
        try:
            for response in call:
                received.append(response)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INTERNAL and "engine failed" in exc.details(), (exc.code(), exc.details())
        else:
            raise AssertionError(f"the stream ended {call.code()} after {len(received)} messages")
        assert not stub.HealthCheck(pb.HealthCheckRequest()).is_live
    finally:
        channel.close()
        server.stop()


def _code(stub, request: pb.DecodeRequest, expected: grpc.StatusCode) -> None:
    try:
        list(stub.Decode(request))
    except grpc.RpcError as exc:
        assert exc.code() == expected, (exc.code(), exc.details())
        return
    raise AssertionError(f"expected {expected}, the call succeeded")


if __name__ == "__main__":
    main()
