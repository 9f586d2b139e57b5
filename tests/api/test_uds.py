"""`pathserve serve --uds PATH`: the HTTP API on a unix socket (uvicorn's), JetStream's gRPC on
unix:PATH.grpc, as a sidecar or a gateway reaches them, and as a TPU VM without TCP is measured.
Driven by the official `openai` client over httpx's unix-socket transport, and gRPC's HealthCheck."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import openai

from tests.server_process import ServerProcess, grpc_is_live


def test_serve_on_a_unix_socket_with_the_openai_client(tiny_model_dir):
    with tempfile.TemporaryDirectory(prefix="pathserve-uds-") as directory:
        uds = str(Path(directory) / "serve.sock")
        server = ServerProcess.pathserve_uds(
            uds, str(tiny_model_dir), "per_device_batch_size=2", "max_prefill_predict_length=128",
            "max_target_length=192", "enable_model_warmup=false",
        ).wait_ready(timeout=300, grpc=True)
        try:
            assert Path(uds).is_socket() and Path(uds + ".grpc").is_socket()
            http = httpx.Client(transport=httpx.HTTPTransport(uds=uds), base_url="http://pathserve")
            client = openai.OpenAI(base_url="http://pathserve/v1", api_key="unused", http_client=http)
            model = client.models.list().data[0].id
            done = client.completions.create(model=model, prompt="The sea", max_tokens=5, temperature=0)
            assert done.usage.completion_tokens == 5 and done.choices[0].text
            streamed = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
            assert sum(1 for chunk in streamed if chunk.choices and chunk.choices[0].delta.content) >= 1
            assert http.post("/generate", json={"prompt": "a", "max_tokens": 3}).json()["response"]
            assert grpc_is_live(server.grpc_address)
            assert "listening on http+unix://" in server.output()
        finally:
            assert server.stop() == 0


def test_flags_a_unix_socket_cannot_honour_are_refused(tmp_path, capsys):
    """--host/--port or a gRPC port beside --uds would be silently ignored: refused, naming them."""
    from serving.cli.main import EXIT_USAGE, main

    uds = str(tmp_path / "s.sock")
    for args, named in (
        (["--uds", uds, "--port", "8001"], "--host/--port"),
        (["--uds", uds, "--host", "0.0.0.0"], "--host/--port"),
        (["--uds", uds, "grpc_port=9001"], "grpc_port=9001 with --uds"),
    ):
        assert main(["serve", str(tmp_path), *args]) == EXIT_USAGE
        assert named in capsys.readouterr().err
