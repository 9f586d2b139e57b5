"""Multi-controller serving for real: two `pathserve` processes x 4 virtual CPU devices each, JAX's
distributed runtime over loopback with gloo collectives, one 8-device mesh (tensor=4 x
autoregressive=2). Process 0 serves HTTP and broadcasts every step plan; process 1 follows.

- 8 concurrent greedy completions sent to process 0 equal those of one process with 8 devices;
- `pathserve batch` on such a pair writes the same completions;
- a follower SIGKILLed mid-stream: process 0's /livez fails, the streams end with an error, and
  process 0 exits non-zero.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_process import REPO, ServerProcess, free_port
from tests.xla_flags import cpu_devices

pytestmark = pytest.mark.slow  # three servers over 4 + 4 + 8 virtual devices (docs/development.md)

PROMPTS = [f"{word} number {i}" for i, word in enumerate(["the", "a", "one", "two", "red", "blue", "cat", "sun"])]
MAX_TOKENS = 12
LIVENESS_TIMEOUT_S = 10
ENGINE = [
    "ici_tensor_parallelism=4",
    "ici_autoregressive_parallelism=2",
    "per_device_batch_size=1",  # 8 slots: the 8 requests run at once
    "max_prefill_predict_length=16",  # one prefill bucket and one attention window to compile
    "max_target_length=128",
    "cpu_kernels=off",
    "enable_model_warmup=true",
    # On, unlike the suite's other servers: a leader's executor must answer for the background
    # warmup while plans flow (its loop once died on it under the lockstep).
    "enable_background_warmup=true",
    f"liveness_timeout_s={LIVENESS_TIMEOUT_S}",
]


def devices_env(count: int) -> dict[str, str]:
    return cpu_devices(count)


def group_args(process_id: int, coordinator_port: int) -> list[str]:
    return [
        "runtime=multicontroller",
        f"coordinator_address=127.0.0.1:{coordinator_port}",
        "num_processes=2",
        f"process_id={process_id}",
        "distributed_timeout_s=10",
    ]


def start_pair(source: Path) -> tuple[ServerProcess, ServerProcess]:
    """Process 0 (HTTP on its port) and process 1 (no server: it follows)."""
    coordinator = free_port()
    leader = ServerProcess.pathserve(str(source), *ENGINE, *group_args(0, coordinator), env=devices_env(4))
    follower = ServerProcess.pathserve(str(source), *ENGINE, *group_args(1, coordinator), env=devices_env(4))
    return leader, follower


@pytest.fixture(scope="module")
def servers(tiny_checkpoint, batch_job):
    """(one process with 8 devices, the pair's leader, the pair's follower), all ready."""
    single = ServerProcess.pathserve(str(tiny_checkpoint), *ENGINE, env=devices_env(8))
    leader, follower = start_pair(tiny_checkpoint)
    try:
        single.wait_ready()
        leader.wait_ready()
        yield single, leader, follower
    finally:
        for server in (single, leader, follower):
            server.stop()


def complete_all(url: str, model: str) -> list[tuple[str, str, int]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)

    def one(prompt: str) -> tuple[str, str, int]:
        response = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        choice = response.choices[0]
        return choice.text, choice.finish_reason, response.usage.completion_tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


@pytest.fixture(scope="module")
def reference(servers) -> list[tuple[str, str, int]]:
    single, _, _ = servers
    return complete_all(single.url, model_name(single.url))


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def test_pair_serves_the_same_tokens_as_one_process(servers, reference):
    _, leader, follower = servers
    got = complete_all(leader.url, model_name(leader.url))
    assert got == reference
    assert all(count > 0 for _, _, count in got)
    assert all(reason != "error" for _, reason, _ in got)
    # Only process 0 serves; process 1 says that it follows and opens no port.
    assert "follows process 0 (no servers here)" in follower.output()
    for process in (leader, follower):
        assert "restores only the shards its devices hold" in process.output()
    assert "listening on" not in follower.output()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{follower.url}/healthcheck", timeout=2)


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model converted: the pair restores it sharded, each process its own shards."""
    from serving.checkpoints.convert import convert

    path = tmp_path_factory.mktemp("multihost-ckpt") / "tiny"
    convert(tiny_model_dir, str(path), progress=False)
    return path


@pytest.fixture(scope="module")
def batch_job(tiny_checkpoint, tmp_path_factory):
    """`pathserve batch` on a pair of processes over the 8 prompts, started before the servers so
    that both compile at once; yields (directory, the two processes)."""
    work = tmp_path_factory.mktemp("multihost-batch")
    prompts = work / "in.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": p, "max_tokens": MAX_TOKENS}) + "\n" for i, p in enumerate(PROMPTS))
    )
    coordinator = free_port()

    def batch(process_id: int) -> subprocess.Popen:
        command = [
            sys.executable, "-m", "serving.cli", "batch", str(tiny_checkpoint), *ENGINE,
            *group_args(process_id, coordinator), "--input", str(prompts), "--output", str(work / "out"),
            "--quiet",
        ]
        log = (work / f"batch-{process_id}.log").open("w")
        env = {**os.environ, **devices_env(4)}
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    processes = [batch(1), batch(0)]
    try:
        yield work, processes
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_batch_on_a_pair_writes_the_same_rows(batch_job, reference):
    work, processes = batch_job
    codes = [p.wait(timeout=240) for p in processes]
    out = work / "out"
    logs = {i: (work / f"batch-{i}.log").read_text() for i in (0, 1)}
    assert codes == [0, 0], logs
    assert "follows process 0" in logs[1]
    assert all("restores only the shards its devices hold" in log for log in logs.values())
    rows = {}
    for results in sorted(out.glob("results-*.jsonl")):
        for line in results.read_text().splitlines():
            record = json.loads(line)
            choice = record["response"]["body"]["choices"][0]
            rows[record["custom_id"]] = (choice["text"], choice["finish_reason"])
    assert rows == {f"r{i}": (text, reason) for i, (text, reason, _) in enumerate(reference)}


def test_a_killed_follower_fails_liveness_and_stops_the_leader(servers):
    _, leader, follower = servers
    client = openai.OpenAI(base_url=f"{leader.url}/v1", api_key="none", max_retries=0, timeout=120)
    model = model_name(leader.url)
    streaming, flowing = ThreadPoolExecutor(3), threading.Event()

    def stream(prompt: str) -> str:
        """How the stream ended: a finish_reason, or the error the client raised."""
        try:
            last = None
            for chunk in client.completions.create(
                model=model, prompt=prompt, max_tokens=100, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            ):
                flowing.set()
                last = chunk.choices[0].finish_reason or last
            return str(last)
        except (openai.APIError, httpx.HTTPError) as exc:
            return f"raised {type(exc).__name__}"

    ends = [streaming.submit(stream, p) for p in PROMPTS[:3]]
    assert flowing.wait(timeout=60), "no token streamed"
    follower.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()

    livez, failed_at = [], None
    while time.monotonic() - killed < LIVENESS_TIMEOUT_S + 30 and leader.proc.poll() is None:
        try:
            status = httpx.get(f"{leader.url}/livez", timeout=5).status_code
        except httpx.TransportError:
            status = None
        livez.append(status)
        if status != 200 and failed_at is None:
            failed_at = time.monotonic() - killed
        time.sleep(0.1)
    endings = [f.result(timeout=30) for f in ends]
    streaming.shutdown()
    code = leader.proc.wait(timeout=LIVENESS_TIMEOUT_S + 30)
    assert failed_at is not None and failed_at < LIVENESS_TIMEOUT_S + 30, livez
    assert 503 in livez, livez  # /livez answered 503 before the process went
    assert all(e == "error" or e.startswith("raised") for e in endings), endings
    assert code != 0
    # The leader sees the dead peer either as a failed collective (gloo reports the closed socket)
    # or as a collective that never returns (the stall watchdog): both are this exit, and which
    # comes first depends on the machine's load.
    out = leader.output()
    assert "lockstep device loop failed" in out or "lockstep device loop made no progress" in out, out[-2000:]
