"""Your own model gets the serving profile: `pathserve serve DIR` on a Hugging Face directory (the
tiny random Llama) starts with the profile's slots sized to the memory, not one slot, batches
concurrent requests, and its ready line says where each figure came from; on a TPU, the profile's
KV cache turns int8 only where bfloat16 would hold fewer of its slots."""

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


class _Chip:
    """A stand-in TPU device for start-up's plan: its platform and the memory it reports."""

    platform = "tpu"

    def __init__(self, bytes_limit: int):
        self.bytes_limit = bytes_limit

    def memory_stats(self) -> dict:
        return {"bytes_limit": self.bytes_limit}


def test_the_profiles_kv_cache_turns_int8_only_where_bfloat16_holds_fewer_slots(tiny_model_dir, tmp_path, monkeypatch):
    """On a TPU the profile's KV cache is bfloat16 (the ragged kernel reads it faster than int8's);
    where bfloat16 would hold fewer of the profile's slots than int8, start-up takes int8 and says
    why; a format the user gave stays whatever it holds. The model: 8 kv heads of 64 (Llama 3.2
    1B's, whose int8 rows fill the pool's 128 lanes; the tiny model's 32 values a position pad
    to 128 lanes either way, so int8 with its scales holds fewer there, and bfloat16 stays)."""
    from loadtest.random_model import write_random_model
    from serving.config import load_model_config
    from serving.startup.plan import plan_launch
    from serving.startup.profile import FROM_OVERRIDE, FROM_PROFILE, given_config

    shape = load_model_config("llama3.2-1b").model_copy(update={
        "name": "kv-heads-test", "num_layers": 1, "embed_dim": 128, "num_heads": 8, "num_kv_heads": 8,
        "head_dim": 64, "mlp_dim": 128, "vocab_size": 384, "rope_scaling": None,
    })
    model_dir = write_random_model(tmp_path / "model", shape, tiny_model_dir, dtype="float32")
    monkeypatch.setenv("PATHSERVE_PLATFORM", "tpu")
    given = given_config(None, [], str(model_dir))
    asked = int(given.config.per_device_batch_size)
    assert given.config.quantize_kvcache is False and given.origin("quantize_kvcache") == FROM_PROFILE

    def plan(limit: int, overrides=()):
        g = given_config(None, list(overrides), str(model_dir))
        return plan_launch(g.config, str(model_dir), [_Chip(limit)], g.origins)

    plenty = plan(1 << 40)
    assert plenty.config.quantize_kvcache is False and plenty.config.per_device_batch_size == asked
    assert plenty.origins["quantize_kvcache"] == FROM_PROFILE
    # the largest power of two of memory in which bfloat16 holds fewer than the profile's slots
    limit = next(1 << k for k in range(40, 10, -1) if plan(1 << k, ["quantize_kvcache=false"]).config.per_device_batch_size < asked)
    floating = plan(limit, ["quantize_kvcache=false"])  # the user's choice: kept, fewer slots
    assert floating.config.quantize_kvcache is False and floating.origins["quantize_kvcache"] == FROM_OVERRIDE
    tight = plan(limit)
    held = int(floating.config.per_device_batch_size)
    assert tight.config.quantize_kvcache is True and tight.config.per_device_batch_size > held
    assert tight.origins["quantize_kvcache"] == f"{FROM_PROFILE} (bfloat16 holds {held} of {asked} slots)"
    assert "int8 kv cache: serving profile (bfloat16 holds" in tight.origins_line()
    tiny = given_config(None, [], str(tiny_model_dir))  # int8 rows padded as bfloat16's: bfloat16 stays
    kept = plan_launch(tiny.config, str(tiny_model_dir), [_Chip(1 << 28)], tiny.origins).config
    assert kept.quantize_kvcache is False and kept.per_device_batch_size < asked
