"""The test suite itself: a session leaves nothing behind in the temporary directory, and keeps what it
builds once (kernels, the default model's conversion) in the persistent cache, not there."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.server_process import REPO

SPY = """
import os, sys, pytest
class Spy:
    def pytest_collection_finish(self, session):
        scratch = os.environ["PATHSERVE_TEST_SCRATCH"]
        (open(os.path.join(scratch, "marker"), "w")).close()
        print("SCRATCH=" + scratch, flush=True)
        print("HOME=" + os.environ["PATHSERVE_HOME"], flush=True)
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_sampling.py"], plugins=[Spy()]))
"""


def test_a_session_removes_its_scratch_and_keeps_its_home_in_the_cache(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "PATHSERVE_TEST_CACHE": str(tmp_path.parent / "kept-cache")}
    env.pop("PATHSERVE_HOME", None)
    env.pop("PATHSERVE_TEST_SCRATCH", None)
    result = subprocess.run(
        [sys.executable, "-c", SPY], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    printed = dict(line.split("=", 1) for line in result.stdout.splitlines() if line.startswith(("HOME=", "SCRATCH=")))
    assert printed["SCRATCH"].startswith(str(tmp_path))
    assert not os.path.exists(printed["SCRATCH"])
    assert os.listdir(tmp_path) == []
    assert printed["HOME"] == str(tmp_path.parent / "kept-cache" / "home")


ORDER = """
import sys, pytest
from tests.conftest import worker_group
class Spy:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("ITEM", item.nodeid, worker_group(item.nodeid), flush=True)
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[Spy()]))
"""


def test_the_workers_groups_keep_the_shared_server_on_one_worker_and_its_drain_last():
    """`make test`'s two workers (`-n 2`) run by the groups tests/conftest.py gives (worker_group)."""
    files = ["tests/test_sampling.py", "tests/grpc/test_server.py", "tests/api/test_server.py", "tests/test_sharding.py"]
    result = subprocess.run(
        [sys.executable, "-c", ORDER, *files], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    items = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("ITEM ")]
    groups = {node: group for node, group in items}
    order = [node for node, _ in items]
    assert set(groups.values()) == {"tiny_server", "tests/test_sampling.py", "tests/test_sharding.py"}
    # A module with tests on the shared server is in its group whole (one worker runs it).
    assert groups["tests/api/test_server.py::test_healthcheck_is_503_until_ready_then_200"] == "tiny_server"
    assert groups["tests/api/test_server.py::test_serve_exits_2_when_the_model_cannot_be_loaded"] == "tiny_server"
    # The drain runs last; the module with a `slow` test first.
    assert order[-1] == "tests/grpc/test_server.py::test_sigterm_drains_grpc_streams_and_refuses_new_calls"
    slow = [node.startswith("tests/test_sharding.py::") for node in order]
    assert slow == sorted(slow, reverse=True) and any(slow)


def test_a_server_that_is_not_ready_in_time_is_stopped_not_left_running():
    """wait_ready's timeout stops the process (a server left behind held its cores for the session)."""
    import pytest

    from tests.server_process import ServerProcess, free_port

    never = ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"], free_port())
    with pytest.raises(TimeoutError, match=r"not ready after 0\.5 s"):
        never.wait_ready(timeout=0.5)
    assert never.proc.poll() is not None


def test_every_process_compiles_with_the_suite_xla_flags_and_cpu_devices_keeps_them():
    """conftest puts tests/xla_flags.py's flags in this process's XLA_FLAGS (not the tiny models'
    level 0: the workers run SmolLM2); a process started on N virtual devices (cpu_devices) gets N
    devices, the same flags and the tiny models', not a bare device count."""
    from tests.xla_flags import FLAGS, TINY, cpu_devices, with_suite_flags

    assert os.environ["XLA_FLAGS"].startswith(FLAGS) and (not TINY or TINY not in os.environ["XLA_FLAGS"])
    probe = "import os, jax; print(len(jax.devices()), os.environ['XLA_FLAGS'])"
    result = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **cpu_devices(3)},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    count, flags = result.stdout.strip().split(" ", 1)
    assert count == "3"
    assert flags.startswith(FLAGS) and "--xla_force_host_platform_device_count=3" in flags and TINY in flags
    assert len(flags.split()) == len(set(flags.split())), flags  # each once: they are in every cache key
    assert with_suite_flags(with_suite_flags()) == with_suite_flags()  # a worker imports conftest again


def test_the_kube_build_starts_in_the_background_at_the_lowest_priority_unless_built(tmp_path):
    from tests.conftest import build_in_background

    script = tmp_path / "build.sh"
    script.write_text(f"nice > {tmp_path / 'niceness'}\n")
    home = tmp_path / "kube"
    build = build_in_background(script, home)
    assert build is not None and build.wait(timeout=30) == 0
    assert (tmp_path / "niceness").read_text().strip() == "19"
    for binary in (home / "bin" / "kube-apiserver", home / "root" / "usr" / "bin" / "etcd"):
        binary.parent.mkdir(parents=True)
        binary.touch()
    assert build_in_background(script, home) is None
