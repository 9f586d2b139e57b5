#!/usr/bin/env bash
# On a TPU VM without internet: pathserve's run-time dependencies into $SITE (default /tmp/site),
# from the wheels `make wheelhouse` saved (WHEELHOUSE, when it exists), else from the VM's own
# package index (PIP_INDEX, default file:///opt/pypi/simple). The VM's own JAX stays first:
# source this file, and $SITE is appended to PYTHONPATH, the checkout prepended. A v5e VM's index
# (2026-12) holds grpcio 1.84, older than the checked-in stubs need: without a wheelhouse, serve
# with grpc_port=0 (HTTP only, as `make bench-tpu` does).
SITE=${SITE:-/tmp/site}
PIP_INDEX=${PIP_INDEX:-file:///opt/pypi/simple}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
WHEELHOUSE=${WHEELHOUSE:-$HERE/wheelhouse}
# What serving imports to serve and to run the tpu tests (kubernetes and xgrammar are imported
# only by deploy and grammar requests; torch only by the float32 reference).
PACKAGES="pydantic pyyaml tokenizers tiktoken gguf jinja2 jsonschema orbax-checkpoint fsspec tqdm
  fastapi uvicorn httptools uvloop prometheus-client grpcio protobuf httpx openai safetensors"
pip_install() {
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --no-compile \
    --disable-pip-version-check --target "$SITE" "$@"
}
if [ -d "$WHEELHOUSE" ]; then
  pip_install --no-index --find-links "$WHEELHOUSE" $PACKAGES
else
  pip_install --index-url "$PIP_INDEX" $PACKAGES || for p in $PACKAGES; do
    pip_install --index-url "$PIP_INDEX" "$p" || echo "setup.sh: $p did not install" >&2
  done
fi
# a jax or numpy that pip brought along must not hide the VM's own
rm -rf "$SITE"/jax "$SITE"/jaxlib "$SITE"/jax-* "$SITE"/jaxlib-* "$SITE"/numpy "$SITE"/numpy-* "$SITE"/ml_dtypes*
export PYTHONPATH="$HERE:${PYTHONPATH:-}:$SITE"
