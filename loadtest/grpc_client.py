"""A streaming client for JetStream's gRPC `Decode` that times every token as it arrives.

It works as JetStream's benchmarks/benchmark_serving.py does: prompts are tokenized here and sent
as `token_content`, the server streams token ids back. TTFT is the time to the first message that
carries tokens, ITL the gaps between later ones, output tokens the ids received; the `Result` is
the HTTP client's, so both feed the same report.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from loadtest.client import Result
from serving.grpc import jetstream_pb2 as pb
from serving.grpc import jetstream_pb2_grpc as pb_grpc

TIMEOUT_S = 600.0


def channel(address: str) -> grpc.aio.Channel:
    """One channel for a whole run: every call is a stream multiplexed over it."""
    return grpc.aio.insecure_channel(address)


def stub(chan: grpc.aio.Channel) -> pb_grpc.OrchestratorStub:
    return pb_grpc.OrchestratorStub(chan)


async def wait_live(address: str, timeout: float = 30.0) -> bool:
    """Whether HealthCheck says live within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    async with channel(address) as chan:
        while time.monotonic() < deadline:
            try:
                reply = await stub(chan).HealthCheck(pb.HealthCheckRequest(), timeout=5)
                if reply.is_live:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.25)
    return False


async def stream_one(
    orchestrator: pb_grpc.OrchestratorStub,
    token_ids: Sequence[int],
    max_tokens: int,
    metadata: Sequence[tuple[str, str]] = (),
) -> Result:
    """One Decode call with client-side tokens; never raises for gRPC errors (they are in the Result)."""
    request = pb.DecodeRequest(
        token_content=pb.DecodeRequest.TokenContent(token_ids=token_ids), max_tokens=max_tokens
    )
    result = Result(ok=False, started=time.perf_counter(), prompt_tokens=len(token_ids))
    last = None
    try:
        async for response in orchestrator.Decode(request, metadata=tuple(metadata), timeout=TIMEOUT_S):
            count = sum(len(s.token_ids) for s in response.stream_content.samples[:1])
            if not count:
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft = now - result.started
            else:
                result.itl.append(now - last)
            last = now
            result.output_tokens += count
    except grpc.aio.AioRpcError as exc:
        result.error = f"gRPC {exc.code().name}: {exc.details()}"
        return result
    result.finished = time.perf_counter()
    result.e2e = result.finished - result.started
    result.ok = last is not None
    if not result.ok:
        result.error = "the stream carried no tokens"
    return result


def load_tokenizer(spec: str | None):
    """The client-side tokenizer: a Hugging Face directory, tokenizer.json, tokenizer.model or a
    GGUF file; None means the default model's (SmolLM2-135M-Instruct's GGUF)."""
    from serving.text.tokenizer import load_tokenizer as from_files
    from serving.text.tokenizer import tokenizer_from_gguf

    if spec is None:
        from serving.checkpoints.model_source import default_model_path

        path = default_model_path()
    else:
        path = Path(spec)
    if path.suffix == ".gguf":
        from serving.checkpoints.gguf_file import GGUFFile

        return tokenizer_from_gguf(GGUFFile(path).tokenizer_data())
    return from_files(path)
