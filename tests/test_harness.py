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
