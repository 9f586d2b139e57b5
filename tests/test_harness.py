"""The test suite itself: a session leaves nothing behind in the temporary directory."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.server_process import REPO

SPY = """
import os, sys, pytest
class Spy:
    def pytest_collection_finish(self, session):
        home = os.environ["PATHSERVE_HOME"]
        (open(os.path.join(home, "marker"), "w")).close()
        print("HOME=" + home, flush=True)
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_sampling.py"], plugins=[Spy()]))
"""


def test_a_session_removes_its_pathserve_home(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("PATHSERVE_HOME", None)
    result = subprocess.run(
        [sys.executable, "-c", SPY], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    home = next(line[5:] for line in result.stdout.splitlines() if line.startswith("HOME="))
    assert home.startswith(str(tmp_path))
    assert not os.path.exists(home)
    assert os.listdir(tmp_path) == []
