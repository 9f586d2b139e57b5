"""runtime=pathways on CPU: pathwaysutils' real initialisation and proxy backend factory, with the
IFRT proxy client substituted (see proxy_boot.py for why that is the seam), against the local
runtime on the same 8 devices; and the start-up errors a user can fix (exit 2, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.server_process import REPO, free_port
from tests.xla_flags import cpu_devices

BOOT = Path(__file__).with_name("proxy_boot.py")
ENGINE = [
    "ici_tensor_parallelism=4",
    "ici_autoregressive_parallelism=2",
    "cpu_kernels=off",
    "max_target_length=128",
    "max_prefill_predict_length=16",
]
PROMPT = ["--prompt", "the number one", "--max-tokens", "10", "--json"]


def run(command: list[str], env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return start(command, env).communicate_completed(timeout)


class start(subprocess.Popen):
    """A process with the test's environment less XLA_FLAGS / JAX_PLATFORMS, plus `env`."""

    def __init__(self, command: list[str], env: dict[str, str]):
        merged = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        super().__init__(command, cwd=REPO, env={**merged, **env}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        self.command = command

    def communicate_completed(self, timeout: float = 240) -> subprocess.CompletedProcess:
        out, err = self.communicate(timeout=timeout)
        return subprocess.CompletedProcess(self.command, self.returncode, out, err)


def test_pathways_start_up_serves_the_local_runtimes_tokens(tiny_model_dir):
    target = f"grpc://127.0.0.1:{free_port()}"
    # Both at once: the local runtime on 8 CPU devices, and the Pathways path onto a substituted
    # proxy client of 8 CPU devices.
    local = start(
        [sys.executable, "-m", "serving.cli", "generate", str(tiny_model_dir), *PROMPT, *ENGINE],
        cpu_devices(8),
    )
    proxy = start(
        [sys.executable, str(BOOT), "generate", str(tiny_model_dir), *PROMPT, *ENGINE,
         "jax_compilation_cache_dir=/tmp/unused-jax-cache"],
        {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": target, "ENABLE_PATHWAYS_PERSISTENCE": "1"},
    )
    result, reference = proxy.communicate_completed(), local.communicate_completed()
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stderr
    # pathwaysutils initialised, its factory asked our substitute for the configured target, and
    # the engine ran on the 8 devices that client holds.
    assert "initialized: Pathways backend used: True; Orbax restores through its handler: True" in log
    assert f"ifrt_proxy.get_client({target!r})" in log
    assert "runtime pathways: process 0 of 1, 8 devices" in log
    assert "jax_compilation_cache_dir=/tmp/unused-jax-cache does not apply on Pathways" in log
    assert json.loads(result.stdout)["token_ids"] == json.loads(reference.stdout)["token_ids"]


def test_persistence_registers_pathwaysutils_orbax_handler(tmp_path):
    """With ENABLE_PATHWAYS_PERSISTENCE=1, after our init_runtime Orbax restores jax.Arrays through
    pathwaysutils' CloudPathwaysArrayHandler (the one registered for jax.Array)."""
    script = tmp_path / "check.py"
    script.write_text(
        "import runpy, sys\n"
        f"boot = runpy.run_path({str(BOOT)!r}, run_name='boot')\n"
        "boot['_substitute_proxy_client']()\n"
        "from serving.config import load_config\n"
        "from serving.runtime import init_runtime\n"
        "print(init_runtime(load_config(None, ['runtime=pathways']).devices))\n"
        "import jax\n"
        "from orbax.checkpoint import type_handlers\n"
        "print(type(type_handlers.get_type_handler(jax.Array)).__name__)\n"
        "print(len(jax.devices()))\n"
    )
    result = run([sys.executable, str(script)], {"JAX_BACKEND_TARGET": "grpc://127.0.0.1:1",
                                                  "ENABLE_PATHWAYS_PERSISTENCE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["pathways", "CloudPathwaysArrayHandler", "8"]


def test_proxy_without_pathwaysutils_exits_2_naming_the_package(tiny_model_dir):
    # sys.modules[name] = None makes `import pathwaysutils` raise ImportError, as if not installed.
    code = (
        "import sys; sys.modules['pathwaysutils'] = None\n"
        "from serving.cli import main\n"
        f"sys.exit(main(['generate', {str(tiny_model_dir)!r}, '--prompt', 'hi']))\n"
    )
    result = run([sys.executable, "-c", code], {"JAX_PLATFORMS": "proxy"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert "pathwaysutils" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreachable_proxy_exits_2_naming_jax_backend_target(tiny_model_dir):
    target = f"grpc://127.0.0.1:{free_port()}"  # nothing listens there
    result = run(
        [sys.executable, "-m", "serving.cli", "generate", str(tiny_model_dir), "--prompt", "hi"],
        {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": target, "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS": "2"},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"JAX_BACKEND_TARGET={target!r}" in result.stderr
    assert "Traceback" not in result.stderr
