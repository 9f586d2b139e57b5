"""serving/kernels/library.py builds the CPU kernels' library once per machine even when several
processes ask at once (a cold cache: a server, its test process and pytest's other worker), with a
stand-in compiler that records each compile and takes a second over it."""

from __future__ import annotations

import stat
import threading

from serving.kernels import library

FAKE_COMPILER = """#!/usr/bin/env bash
if [ "$1" = --version ]; then echo "fake-c++ 1.0"; exit 0; fi
echo compile >> "{log}"
sleep 1
while [ $# -gt 0 ]; do if [ "$1" = -o ]; then shift; echo library > "$1"; fi; shift; done
"""


def test_concurrent_builders_compile_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PATHSERVE_HOME", str(tmp_path / "home"))
    calls = tmp_path / "compiles.log"
    compiler = tmp_path / "c++"
    compiler.write_text(FAKE_COMPILER.format(log=calls))
    compiler.chmod(compiler.stat().st_mode | stat.S_IEXEC)
    built: list = []
    threads = [threading.Thread(target=lambda: built.append(library._build(str(compiler)))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert calls.read_text().splitlines() == ["compile"]
    assert len(built) == 3 and len(set(built)) == 1
    assert built[0].read_text() == "library\n"
    assert built[0].parent == tmp_path / "home" / "kernels"
    assert not list(built[0].parent.glob("*.tmp"))
