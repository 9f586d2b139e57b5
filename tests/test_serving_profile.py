"""Your own model gets the serving profile: `pathserve serve DIR` on a Hugging Face directory (the
tiny random Llama) starts with the profile's slots sized to the memory, not one slot, batches
concurrent requests, and its ready line says where each figure came from."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.server_process import ServerProcess


def test_serve_of_your_own_model_directory_gets_the_serving_profile(tiny_model_dir):
    # No slot count, no profile key but the warmup (off: a faster test; the ready line says so).
    server = ServerProcess.pathserve(str(tiny_model_dir), "enable_model_warmup=false")
    try:
        server.wait_ready()

        def generate(i: int) -> int:
            body = {"prompt": f"the keeper {i}", "max_tokens": 4}
            return httpx.post(f"{server.url}/generate", json=body, timeout=300).status_code

        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(generate, range(8))) == [200] * 8
    finally:
        assert server.stop() == 0, server.output()
    ready = next(line for line in server.output().splitlines() if "ready:" in line)
    slots = int(re.search(r"(\d+) slots", ready).group(1))
    assert 1 < slots <= 64, ready  # the profile's 64 at most, sized to this machine's memory
    assert "slots: serving profile (memory allows" in ready, ready
    assert "quantization: default" in ready and "quantization=none" in ready, ready  # not the default model's int8w
    assert "warmup: command line" in ready and "prefix cache: serving profile" in ready, ready
    assert "max_target_length: serving profile" in ready, ready
