"""The AMX kernels' tile logic on machines without AMX: tests/test_cpu_kernels.py's AMX tests
(marked `amx`) rerun in a pytest of their own with PATHSERVE_CPU_AMX=emulate, where the kernels'
tile instructions run as plain C++ (serving/kernels/cpu_amx.h) with the hardware's checks on tile
shapes. On a CPU with AMX, where those tests ran on the tiles already, this run checks the
emulation against the hardware: the same tests pass on both. AVX2-only CPUs cannot run the AMX
kernels' AVX-512 parts at all."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from serving.kernels import library
from tests import backends

ROOT = Path(__file__).resolve().parent.parent
FLAGS = backends.cpu_flags()
AVX512 = library.ISA_FLAGS["avx512"] <= FLAGS and os.environ.get(library.ISA_ENV, "") in ("", "avx512")


@pytest.mark.slow
@pytest.mark.skipif(not AVX512, reason="the AMX kernels' other parts need AVX-512 VNNI")
@pytest.mark.skipif(backends.choice() == "off", reason="PATHSERVE_CPU_KERNELS=off: the suite runs on XLA's ops")
def test_the_amx_kernels_pass_their_tests_with_the_tiles_emulated():
    env = {**os.environ, library.AMX_ENV: "emulate"}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "amx", "tests/test_cpu_kernels.py"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "PATHSERVE_CPU_AMX=emulate" in output  # the inner session's header: emulated tiles
    summary = output.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    # every AMX test ran (none skipped): the int8w, W8A8, float32 pairs and blocks kernels, the
    # engine's W8A8 tokens
    assert passed and int(passed.group(1)) >= 70 and "skipped" not in summary, summary
