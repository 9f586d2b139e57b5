"""tools/kube-apiserver/build.sh builds one at a time: a second run (another pytest-xdist worker on
a cold machine) waits for the first and then finds its binaries, instead of unpacking over the tree
the first is building from (which failed a whole module's tests once)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from pathlib import Path

BUILD = Path(__file__).resolve().parents[2] / "tools" / "kube-apiserver" / "build.sh"


def test_a_second_build_waits_for_the_first_then_finds_its_binaries(tmp_path):
    home = tmp_path / "kube-home"
    with open(f"{home}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first build, running
        second = subprocess.Popen(
            ["bash", str(BUILD)], env={**os.environ, "KUBE_TEST_HOME": str(home)},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(1.0)  # however long: it cannot pass the lock
        assert second.poll() is None and not home.exists()
        for binary in (home / "bin" / "kube-apiserver", home / "root" / "usr" / "bin" / "etcd"):
            binary.parent.mkdir(parents=True)
            binary.write_text("#!/bin/sh\n")
            binary.chmod(0o755)
        fcntl.flock(lock, fcntl.LOCK_UN)  # the first build is done
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert f"kube-apiserver already built in {home}" in out
