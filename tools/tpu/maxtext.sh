#!/usr/bin/env bash
# On a TPU VM without internet: what MaxText's own engine needs to run loadtest/maxtext_peer.py
# (`make bench-tpu-maxtext`), installed into $MT_SITE (default /tmp/mtsite). Source it, as
# tools/tpu/setup.sh: the VM's own JAX, jaxlib, numpy and libtpu stay first on the path.
#
# Three sources, all local (the VM reaches no network), made by tools/tpu/maxtext_export.sh (which
# says why these commits):
#   .tpu-maxtext/maxtext-src   MaxText's src/maxtext at 479dd99946c5 (2026-08-14; jax>=0.10.2);
#   .tpu-maxtext/jetstream-src JetStream's engine at 29329e8e7382 (the commit MaxText pins);
#   .tpu-maxtext/wheels        what the VM's package index lacks: aqtp, qwix, tokamax, grain,
#                              array-record, einshape, pathwaysutils, portpicker; typeguard 2.13.3
#                              (tokamax's pin; the index has 4.6); omegaconf 2.4 (the index's 2.3
#                              needs antlr4, also absent).
# Everything else comes from the VM's index (PIP_INDEX, default file:///opt/pypi/simple) at the
# versions it holds; pip resolves the carried wheels' own needs against both.
#
# PYTHON (default python3) is the interpreter the packages are for: on a CPU host, the Python 3.11
# venv that stands in for the VM (.venv-maxtext311, made by tools/tpu/maxtext_export.sh). A second
# source finds $MT_SITE/.installed and installs nothing.
MT_SITE=${MT_SITE:-/tmp/mtsite}
PIP_INDEX=${PIP_INDEX:-file:///opt/pypi/simple}
MT_PYTHON=${PYTHON:-python3}
MT_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MT_CARRIED="$MT_HERE/.tpu-maxtext"
# What MaxText imports on its way to MaxEngine at that commit (its module-level imports: the
# config's pydantic and omegaconf, AQT and Qwix quantization, tokamax kernels, grain and orbax for
# checkpointing, transformers' configs for checkpoint conversion, PIL for multimodal inputs, sympy
# for engram layers), and what JetStream's engine modules import (transformers, tiktoken).
MT_PACKAGES="aqtp qwix tokamax grain array-record einshape pathwaysutils portpicker omegaconf
  flax optax orbax-checkpoint tensorstore jaxtyping pydantic jinja2 packaging transformers
  huggingface-hub tokenizers tiktoken sentencepiece pillow sympy protobuf pyyaml absl-py tqdm"
if [ ! -d "$MT_CARRIED/maxtext-src/maxtext" ] || [ ! -d "$MT_CARRIED/jetstream-src/jetstream" ]; then
  echo "maxtext.sh: $MT_CARRIED has no MaxText or JetStream source: run tools/tpu/maxtext_export.sh" \
    "where git and pip reach them, and carry .tpu-maxtext" >&2
  return 1 2>/dev/null || exit 1
fi
if [ ! -f "$MT_SITE/.installed" ]; then
  # shellcheck disable=SC2086  # the package list is word-split on purpose
  PIP_CONFIG_FILE=/dev/null "$MT_PYTHON" -m pip install --isolated -q --only-binary=:all: --no-compile \
    --disable-pip-version-check --upgrade --target "$MT_SITE" --index-url "$PIP_INDEX" \
    --find-links "$MT_CARRIED/wheels" $MT_PACKAGES \
    || { echo "maxtext.sh: pip could not install MaxText's packages into $MT_SITE" >&2; return 1 2>/dev/null || exit 1; }
  # a jax, numpy or scipy that pip brought along must not hide the VM's own
  rm -rf "$MT_SITE"/jax "$MT_SITE"/jaxlib "$MT_SITE"/jax-* "$MT_SITE"/jaxlib-* "$MT_SITE"/numpy "$MT_SITE"/numpy-* \
    "$MT_SITE"/numpy.libs "$MT_SITE"/ml_dtypes* "$MT_SITE"/scipy "$MT_SITE"/scipy-* "$MT_SITE"/scipy.libs \
    "$MT_SITE"/libtpu* "$MT_SITE"/bin
  touch "$MT_SITE/.installed"
fi
export PYTHONPATH="$MT_HERE:${PYTHONPATH:+$PYTHONPATH:}$MT_SITE:$MT_CARRIED/maxtext-src:$MT_CARRIED/jetstream-src"
