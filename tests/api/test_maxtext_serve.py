"""`pathserve serve MAXTEXT_CONFIG.yml key=value ...`, as the JetStream guide starts its engine: a real
server on loopback, on 2 CPU devices, placed by the recipe file's logical_axis_rules."""

from __future__ import annotations

import httpx

from tests.server_process import ServerProcess, free_port, with_free_grpc_port
from tests.test_cli import assert_usage_error, run_cli
from tests.xla_flags import cpu_devices

RECIPE = "src/maxtext/configs/inference/multihost/interleaved/llama3_405b_v5e-64.yml"
ARGS = [
    "max_prefill_predict_length=64",
    "max_target_length=256",
    "async_checkpointing=false",  # MaxText flags with no effect on serving: accepted, logged
    "steps=1",
    "enable_single_controller=true",
    "ici_fsdp_parallelism=1",
    "ici_autoregressive_parallelism=2",
    "ici_tensor_parallelism=1",
    "scan_layers=false",
    "per_device_batch_size=2",
    "dtype=float32",
    "weight_dtype=float32",
]


def test_serve_takes_a_maxtext_recipe_first_and_places_by_its_rules(tiny_model_dir):
    env = cpu_devices(2)
    server = ServerProcess.pathserve(
        RECIPE, "model_name=default", f"load_parameters_path={tiny_model_dir}", *ARGS, env=env
    ).wait_ready()
    try:
        reply = httpx.post(
            f"{server.url}/generate", json={"prompt": "The lighthouse", "max_tokens": 6}, timeout=120
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["response"]
    finally:
        assert server.stop() == 0, server.output()
    out = server.output()
    # The recipe's cache_batch -> autoregressive: the 4 slots split over the 2 devices.
    assert "4 slots" in out and "placed [-, autoregressive, -, -, -] over {'fsdp': 1, 'autoregressive': 2" in out
    assert "no effect on serving: " in out and "async_checkpointing" in out and "enable_single_controller" in out


def free_ports() -> list[str]:
    """A free HTTP and gRPC port: never the defaults, 8000 and 9000, another server may hold."""
    return [*with_free_grpc_port([]), "--port", str(free_port())]


def test_serve_refuses_an_unknown_key_after_a_maxtext_file():
    result = run_cli("serve", RECIPE, "per_device_batch_sise=2", *free_ports())
    assert_usage_error(result, "unknown config key 'per_device_batch_sise'", "per_device_batch_size")


def test_serve_names_a_base_config_that_does_not_exist(tmp_path):
    mine = tmp_path / "mine.yml"
    mine.write_text('base_config: "inference/no_such_parent.yml"\nper_device_batch_size: 2\n')
    result = run_cli("serve", str(mine), *free_ports())
    assert_usage_error(result, "base_config 'inference/no_such_parent.yml' not found")
