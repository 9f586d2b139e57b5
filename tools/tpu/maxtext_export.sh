#!/usr/bin/env bash
# Makes .tpu-maxtext/ (ignored), what a TPU VM needs beside the checkout to run MaxText's own engine
# (`make bench-tpu-maxtext`, loadtest/maxtext_peer.py; tools/tpu/maxtext.sh installs it there), and
# .venv-maxtext311/, the Python 3.11 + JAX 0.10.2 venv that stands in for the VM on a CPU host.
#
#   tools/tpu/maxtext_export.sh [MAXTEXT_GIT JETSTREAM_GIT]
#
# MAXTEXT_GIT / JETSTREAM_GIT: git directories (bare or not) holding the commits below; without
# them both repositories are cloned from GitHub into a temporary folder (blobs fetched as needed).
#
# Why these commits: MaxText's packaged releases (maxtext 0.2.x on PyPI) need Python >= 3.12 and a
# JAX newer than the VM's 0.10.2. Its source ran on 3.11 until 2026-08-14: 479dd99946c5 is the last
# commit before `type X = ...` statements (kernels/mhc, imported by every decoder) that 3.11 cannot
# parse, and its requirements already ask for jax>=0.10.2 (since 2026-07-06). JetStream's commit is
# the one that MaxText's requirements pin there. Only what the engine imports is exported: MaxText's
# src/maxtext without its tokenizer assets, examples and scratch code (8.5 MB); JetStream's engine
# and core/config_lib (0.2 MB); the wheels the VM's index lacks (6.5 MB). ~15 MB in all travel.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="$ROOT/.tpu-maxtext"
MAXTEXT_COMMIT=479dd99946c595fac8dff0def6052c9739aadbb2
JETSTREAM_COMMIT=29329e8e73820993f77cfc8efe34eb2a73f5de98
# Absent from the VM's index (2026-12), or absent at the version MaxText's packages need: tokamax
# pins typeguard 2.13.3 (the index has 4.6); the index's omegaconf 2.3 needs antlr4 (absent).
WHEELS="aqtp==0.9.0 qwix==0.1.8 tokamax==0.0.12 grain==0.2.18 array-record==0.8.6 einshape==1.0
  pathwaysutils==0.1.13 portpicker==1.6.0 omegaconf==2.4.0 typeguard==2.13.3"
PYTHON311=${PYTHON311:-python3.11}
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

git_dir() {  # git_dir GIVEN REPO: the given git directory, or a fresh partial clone of REPO
  if [ -n "$1" ]; then echo "$1"; return; fi
  git clone --quiet --bare --filter=blob:none "https://github.com/AI-Hypercomputer/$2" "$WORK/$2.git"
  echo "$WORK/$2.git"
}
MAXTEXT_GIT="$(git_dir "${1:-}" maxtext)"
JETSTREAM_GIT="$(git_dir "${2:-}" JetStream)"

rm -rf "$OUT/maxtext-src" "$OUT/jetstream-src" "$OUT/wheels"
mkdir -p "$OUT/maxtext-src" "$OUT/jetstream-src" "$OUT/wheels"
git --git-dir="$MAXTEXT_GIT" archive "$MAXTEXT_COMMIT" LICENSE src/maxtext ':(exclude)src/maxtext/assets' \
  ':(exclude)src/maxtext/examples' ':(exclude)src/maxtext/scratch_code' | tar -x -C "$OUT/maxtext-src"
mv "$OUT/maxtext-src/src/maxtext" "$OUT/maxtext-src/maxtext" && rmdir "$OUT/maxtext-src/src"
echo "AI-Hypercomputer/maxtext $MAXTEXT_COMMIT" >"$OUT/maxtext-src/SOURCE"
git --git-dir="$JETSTREAM_GIT" archive "$JETSTREAM_COMMIT" LICENSE jetstream/__init__.py jetstream/core/__init__.py \
  jetstream/core/config_lib.py jetstream/core/utils jetstream/engine jetstream/external_tokenizers \
  | tar -x -C "$OUT/jetstream-src"
echo "AI-Hypercomputer/JetStream $JETSTREAM_COMMIT" >"$OUT/jetstream-src/SOURCE"

# shellcheck disable=SC2086  # the wheel list is word-split on purpose
"$PYTHON311" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$OUT/wheels" $WHEELS

# The VM's interpreter on a CPU host: Python 3.11 with JAX 0.10.2 and scipy, nothing else (the
# VM's own); tools/tpu/maxtext.sh adds the rest, as on the VM.
VENV="$ROOT/.venv-maxtext311"
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON311" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet jax==0.10.2 jaxlib==0.10.2 scipy
fi
du -sh "$OUT"
