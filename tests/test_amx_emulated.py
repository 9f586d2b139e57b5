"""The AMX kernels' tile logic on machines without AMX: tests/test_cpu_kernels.py's AMX tests
(marked `amx`) rerun in a pytest of their own with PATHSERVE_CPU_AMX=emulate, where the kernels'
tile instructions run as plain C++ (serving/kernels/cpu_amx.h) with the hardware's checks on tile
shapes. On a CPU with AMX, where those tests ran on the tiles already, this run checks the
emulation against the hardware: the same tests pass on both. AVX2-only CPUs cannot run the AMX
kernels' AVX-512 parts at all. And the emulation alone, on any x86-64 machine with a compiler: a
small byte multiply against numpy, and the faults it raises where the hardware would."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    # Not the whole models' logits on every float32 layout, nor SmolLM2's packing, nor which float32
    # weights take AMX: what they add to the kernels' own tests is which weights take AMX (their
    # normal runs check that everywhere), and emulated they took a third of this run. The engine's
    # W8A8 greedy tokens stay, with a float KV cache (the int8 one is the same matmuls).
    skipped = (
        "not test_packed_params_give_the_models_logits and not test_smollm2s_q4_1"
        " and not test_only_float32_weights_exact and not test_w8a8_on_the_kernels_gives_xlas_w8a8_tokens[True]"
    )
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "amx", "-k", skipped]
    command.append("tests/test_cpu_kernels.py")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "PATHSERVE_CPU_AMX=emulate" in output  # the inner session's header: emulated tiles
    summary = output.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    # every AMX test chosen ran (none skipped): the int8w, W8A8, float32 pairs and blocks kernels,
    # the engine's W8A8 tokens
    assert passed and int(passed.group(1)) >= 65 and "skipped" not in summary, summary


# A 2 x 8 by 8 x 3 byte multiply through the emulation alone (cpu_amx.h, no kernel): its sums,
# and the faults it raises where the hardware would. argv[1] picks the case.
PROGRAM = r"""
#include "cpu_amx.h"
#include <cstdio>
#include <cstring>
using namespace pathserve;
int main(int argc, char** argv) {
  const char* what = argv[1];
  TileConfig config;
  config.colsb[0] = 12; config.rows[0] = 2;  // C: 2 rows of 3 int32
  config.colsb[1] = 8;  config.rows[1] = 2;  // A: 2 rows of 8 bytes
  config.colsb[2] = 12; config.rows[2] = 2;  // B: 2 groups of 4 input rows, 3 columns
  if (!std::strcmp(what, "start_row")) config.start_row = 1;
  _tile_loadconfig(&config);
  int8_t a[16], b[24];
  for (int i = 0; i < 16; ++i) a[i] = static_cast<int8_t>(i % 2 ? -128 : 127 - i);
  for (int i = 0; i < 24; ++i) b[i] = static_cast<int8_t>(i * 11 - 100);
  int32_t out[6];
  _tile_zero(0);
  _tile_loadd(1, a, 8);
  _tile_loadd(2, b, 12);
  if (!std::strcmp(what, "same_tile")) _tile_dpbssd(0, 1, 1);
  if (!std::strcmp(what, "shapes")) _tile_dpbssd(1, 0, 2);
  if (!std::strcmp(what, "unsigned")) _tile_dpbusd(0, 1, 2); else _tile_dpbssd(0, 1, 2);
  _tile_stored(0, out, 12);
  _tile_release();
  for (int32_t v : out) std::printf("%d ", v);
}
"""


@pytest.fixture(scope="module")
def emulation(tmp_path_factory):
    compiler = library.find_compiler()
    if not compiler or platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 C++ compiler")
    folder = tmp_path_factory.mktemp("amx")
    (folder / "emulation.cc").write_text(PROGRAM)
    binary = folder / "emulation"
    include = ROOT / "serving" / "kernels"
    flags = ["-O2", "-std=c++17", "-DPATHSERVE_AMX_EMULATE", "-ffp-contract=off", "-I", str(include)]
    subprocess.run([compiler, *flags, str(folder / "emulation.cc"), "-o", str(binary)], check=True, timeout=120)
    return binary


def test_the_emulated_byte_multiplies_are_intels_integer_sums(emulation):
    a = np.array([127 - i if i % 2 == 0 else -128 for i in range(16)], np.int64).reshape(2, 8)
    b = (np.arange(24) * 11 - 100).astype(np.int8).astype(np.int64).reshape(2, 3, 4)  # [k, n, i]
    b = b.transpose(0, 2, 1).reshape(8, 3)  # input row 4k + i, column n
    for case, x in (("signed", a), ("unsigned", a % 256)):  # TDPBSSD; TDPBUSD reads A unsigned
        run = subprocess.run([str(emulation), case], capture_output=True, text=True, check=True)
        assert [int(v) for v in run.stdout.split()] == (x @ b).ravel().tolist()


@pytest.mark.parametrize(
    ("case", "fault"),
    [
        ("same_tile", "a multiply naming one tile twice"),
        ("shapes", "tile shapes that do not multiply"),
        ("start_row", "a start row other than 0"),
    ],
)
def test_the_emulation_faults_where_the_hardware_would(emulation, case, fault):
    run = subprocess.run([str(emulation), case], capture_output=True, text=True)
    assert run.returncode != 0 and f"emulated AMX: {fault}" in run.stderr
