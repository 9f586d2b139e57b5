"""`make bench-tpu-maxtext`: MaxText's own engine (MaxEngine, what JetStream serves with) decoding
on one chip, the peer that pathserve's engine is measured against (issue 65: our decode step at
most 0.8x its time, same shape, weights, batch and context).

MaxText's code does all the device work; this file only chooses its settings and keeps the clock,
in the manner of MaxText's `inference_microbenchmark` stripped to one configuration:

1. config: MaxText's `pyconfig.initialize` over the key=value list `maxtext_keys` builds (the shape
   from a preset of configs/models/ laid over MaxText's llama3.1-8b model config, random weights in
   bfloat16, one chip, no checkpoint, no tokenizer: prompts are random ids);
2. init: `MaxEngine(config)`, `load_params` (random init; with `--quantization int8`, AQT's int8
   weights as `quantize_params` converts them, or as AQT's serving layout initializes them with
   `--init-quantized`);
3. compile: `aot_compile` (generate with XLA's auto layouts, the params laid out to match, the decode
   state's init), then `PrefillProcessor.aot_compile` (prefill + insert of one prompt length);
4. fill: one prompt of `--prompt-length` random ids prefilled and inserted into every slot;
5. generate: `--warmup` calls, then `--steps` calls back to back, timed to the last one's result.

JSON goes to OUT/<label>.json as each phase starts and finishes (`phase` names the last one
started, `seconds` holds each one finished), so a run cut short (a timeout, an out-of-memory) still
says where its time went and what stopped it; a one-line summary is printed at the end. The JSON
also holds every MaxText key given, what MaxText resolved them to (`resolved`), the JAX version,
the device kind, the params' and the KV cache's bytes by dtype, and the sources' commits.

Set-up. The sources travel in .tpu-maxtext/ (ignored, ~14 MiB; tools/tpu/maxtext_export.sh makes
it): MaxText at a commit that runs on Python 3.11 with JAX 0.10.2 (its packaged releases need
Python 3.12 and a newer JAX), JetStream at the commit MaxText pins, and the wheels the VM's index
lacks; tools/tpu/maxtext.sh installs the rest from the VM's index. On a TPU VM (Python 3.11, its
own JAX 0.10.2, no network), with .tpu-maxtext carried:

    make bench-tpu-maxtext        # 1B, bf16 and int8 weights, batch 64 and 1, int8 KV cache
    make bench-tpu-maxtext MAXTEXT_QUANT=int8 MAXTEXT_BATCHES=64     # one configuration
    source tools/tpu/maxtext.sh && python3 -m loadtest.maxtext_peer OUT --shape llama3.2-1b \
        --batch 64 --quantization int8 --quantize-kvcache --cache-dir results/tpu-maxtext/jax-cache

Llama 3.1 8B's shape (`--shape llama3.1-8b`) fits a 16 GB v5e only with int8 weights initialized
in AQT's serving layout (`--quantization int8 --init-quantized`): bfloat16 weights (16 GB), or
the bfloat16 copy that `quantize_params` converts from, do not (not run on a chip yet).

`--cache-dir` is MaxText's `jax_cache_dir` (JAX's persistent compilation cache): a second run of a
configuration loads its programs instead of compiling them; a fresh VM starts with it empty
unless it is carried there. Extra key=value pairs go to MaxText last and override ours (say
`scan_layers=true`: one layer traced instead of all, MaxText's layout for training). On a CPU host
the same runs in .venv-maxtext311 (`--hardware cpu`, a tiny shape such as tiny-random):

    tools/tpu/maxtext_export.sh   # once: .tpu-maxtext/ and .venv-maxtext311/
    export PYTHON=.venv-maxtext311/bin/python MT_SITE=$PWD/.venv-maxtext311/mtsite
    source tools/tpu/maxtext.sh
    JAX_PLATFORMS=cpu $PYTHON -m loadtest.maxtext_peer /tmp/peer --shape tiny-random --hardware cpu \
        --batch 4 --prompt-length 16 --max-target-length 64 --steps 8 --quantization int8

Where the host's time goes: MaxText traces its whole model (16 layers unscanned for the 1B shape)
about eight times before the first token (init, two KV-cache annotations, int8 conversion, the
decode state's shape and init, generate, prefill + insert), and tracing, not XLA, dominates a warm
run. On the 2-core CPU host (2026-12-07), a tiny model with the 1B shape's 16 layers, warm cache:
init 11 s, compile 11 + 4 s with bfloat16 weights; 38 s, 28 + 11 s with AQT int8 (AQT's ops trace
at about 2.5x). Without `skip_tracer_origins` (below) the int8 one took 61 s and 48 + 15 s.

Two things this file does to MaxText's surroundings, neither to its device work: JetStream's
engine modules import seqio (and with it TensorFlow) for tokenizers this run never builds; where
seqio is absent a placeholder module stands in, whose vocabulary classes raise if anything builds
one (MaxEngine needs JetStream's real base class and ResultTokens pytree: MaxText's own stand-ins
for a missing JetStream are not pytrees, so its prefill and generate cannot run under jit). And
`skip_tracer_origins` spares JAX a walk of the trace for error text that is never read
(`--keep-tracer-origins` keeps it, for init and compile times as a user sees them).

Not a test: figures of the chip it runs on.
"""

from __future__ import annotations

import argparse
import enum
import json
import platform
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
PRESETS = REPO / "configs" / "models"
# MaxText's model config whose architecture (decoder_block llama2, silu x linear MLP) every preset of
# configs/models has; the preset's sizes are laid over it (override_model_config).
BASE_MODEL = "llama3.1-8b"
# One chip, random bfloat16 weights, no checkpoint, as MaxText's inference scripts serve (scan_layers
# false, dot_product attention, the whole mesh on tensor parallelism); the Linen model by default,
# whose `quantize_params` stores int8 weights (the NNX model at this commit quantizes bfloat16
# weights at every call instead).
RUN_KEYS = {
    "skip_jax_distributed_system": "true",
    "enable_checkpointing": "false",
    "async_checkpointing": "false",
    "scan_layers": "false",
    "weight_dtype": "bfloat16",
    "dtype": "bfloat16",
    "attention": "dot_product",
    "ici_fsdp_parallelism": "1",
    "ici_autoregressive_parallelism": "1",
    "ici_tensor_parallelism": "-1",
    "log_config": "false",
    "run_name": "maxtext_peer",
}
API_KEYS = {
    "linen": {"pure_nnx": "false", "enable_nnx": "false", "pure_nnx_decoder": "false"},
    "nnx": {"pure_nnx": "true", "enable_nnx": "true", "pure_nnx_decoder": "true"},
}


# What MaxText made of the keys (read back from its config into the JSON): the model's sizes after
# its scaling rules, the decoder block that the model name brought, the run's settings.
RESOLVED = (
    "decoder_block",
    "emb_dim",
    "num_query_heads",
    "num_kv_heads",
    "head_dim",
    "mlp_dim",
    "num_decoder_layers",
    "vocab_size",
    "mlp_activations",
    "logits_via_embedding",
    "rope_max_timescale",
    "weight_dtype",
    "dtype",
    "quantization",
    "checkpoint_is_quantized",
    "quantize_kvcache",
    "per_device_batch_size",
    "max_prefill_predict_length",
    "max_target_length",
    "scan_layers",
    "attention",
    "pure_nnx",
    "decode_sampling_strategy",
)


def shape_keys(preset: dict[str, Any]) -> dict[str, str]:
    """MaxText's keys for a preset of configs/models/ (its sizes over BASE_MODEL's config). The
    rope scaling of Llama 3.x is left to MaxText's config: it changes no array's shape or cost."""
    try:
        return {
            "model_name": BASE_MODEL,
            "override_model_config": "true",
            "base_emb_dim": str(preset["embed_dim"]),
            "base_num_query_heads": str(preset["num_heads"]),
            "base_num_kv_heads": str(preset["num_kv_heads"]),
            "head_dim": str(preset["head_dim"]),
            "base_mlp_dim": str(preset["mlp_dim"]),
            "base_num_decoder_layers": str(preset["num_layers"]),
            "vocab_size": str(preset["vocab_size"]),
            "rope_max_timescale": str(int(preset["rope_theta"])),
            "normalization_layer_epsilon": str(preset["norm_eps"]),
            "logits_via_embedding": str(bool(preset["tie_embeddings"])).lower(),
        }
    except KeyError as missing:
        raise ValueError(f"the preset {preset.get('name')!r} has no {missing}") from None


def load_preset(name: str) -> dict[str, Any]:
    """configs/models/NAME.yml as a dict; ValueError naming --shape if there is none."""
    path = PRESETS / f"{name}.yml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yml")))
        raise ValueError(f"--shape {name!r}: no {path.relative_to(REPO)} (known: {known})")
    return yaml.safe_load(path.read_text())


def maxtext_keys(ns: argparse.Namespace, preset: dict[str, Any], out: Path) -> dict[str, str]:
    """Every key=value this run gives MaxText: the shape, the run's fixed settings, the API, the
    arguments, each of these replacing the ones before where a key repeats, the user's extra
    key=value pairs last. ValueError names the argument that cannot work."""
    if ns.max_target_length - ns.prompt_length < ns.warmup + ns.steps:
        raise ValueError(
            f"--max-target-length {ns.max_target_length} leaves {ns.max_target_length - ns.prompt_length} decode "
            f"positions after --prompt-length {ns.prompt_length}: fewer than --warmup + --steps ({ns.warmup + ns.steps})"
        )
    keys = {**shape_keys(preset), **RUN_KEYS, **API_KEYS[ns.api]}
    keys.update(
        hardware=ns.hardware,
        per_device_batch_size=str(ns.batch),
        max_prefill_predict_length=str(ns.prompt_length),
        max_target_length=str(ns.max_target_length),
        base_output_directory=str(out / "maxtext_output"),
    )
    if ns.quantization == "int8":
        keys["quantization"] = "int8"
        keys["checkpoint_is_quantized"] = str(ns.init_quantized).lower()
    if ns.quantize_kvcache:
        keys["quantize_kvcache"] = "true"
    if ns.cache_dir:
        keys["jax_cache_dir"] = str(Path(ns.cache_dir).expanduser().resolve())
    for pair in ns.overrides:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r}: MaxText settings are key=value")
        keys[key] = value
    return keys


def default_label(ns: argparse.Namespace) -> str:
    """The JSON file's name for a configuration: shape, weights, KV cache, batch, lengths."""
    weights = "int8" if ns.quantization == "int8" else "bf16"
    if ns.quantization == "int8" and ns.init_quantized:
        weights += "init"
    kv = "-kvint8" if ns.quantize_kvcache else ""
    return f"{ns.shape}-{weights}{kv}-b{ns.batch}-p{ns.prompt_length}-t{ns.max_target_length}"


def decode_rates(seconds: float, steps: int, batch: int) -> dict[str, float]:
    """A timed run of `steps` generate calls, each one token for each of `batch` slots."""
    step_s = seconds / steps
    return {
        "step_ms": 1000 * step_s,
        "ms_per_token_per_slot": 1000 * step_s / batch,
        "tokens_per_s": batch / step_s,
    }


def summary(report: dict[str, Any]) -> str:
    """One line: the configuration, then the step and rate, or the phase that stopped it, then the
    seconds each finished phase took."""
    head = f"maxtext {report['label']}"
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in report["seconds"].items())
    if "error" in report:
        return f"{head}: stopped in {report['phase']} ({report['error'].splitlines()[0]}); {phases}"
    if report["arguments"]["only_config"] and "config" in report["seconds"]:
        return f"{head}: config only: " + " ".join(f"{k}={v}" for k, v in report["resolved"].items())
    if "generate" not in report:
        where = "after" if report["phase"] in report["seconds"] else "in"
        return f"{head}: cut short {where} {report['phase']}; {phases}"
    gen = report["generate"]
    return f"{head}: step {gen['step_ms']:.2f} ms, {gen['tokens_per_s']:.1f} tok/s; {phases}"


def stand_in_for_seqio() -> bool:
    """Install a placeholder `seqio` where none is importable (see the module docstring); True if
    it did. JetStream's token_utils and mock_utils import two vocabulary classes from it."""
    import importlib.util

    if importlib.util.find_spec("seqio") is not None:
        return False

    class Vocabulary:
        """seqio's base vocabulary, as far as JetStream subclasses it at import."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(
                "seqio is not installed: this run builds no tokenizer (maxtext_peer uses random ids)"
            )

    class SentencePieceVocabulary(Vocabulary):
        """seqio's SentencePiece vocabulary; building one raises."""

    vocabularies = types.ModuleType("seqio.vocabularies")
    vocabularies.Vocabulary = Vocabulary
    vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
    seqio = types.ModuleType("seqio")
    seqio.vocabularies = vocabularies
    sys.modules.update({"seqio": seqio, "seqio.vocabularies": vocabularies})
    return True


def skip_tracer_origins() -> bool:
    """Make JAX's tracer error text skip its walk of the trace so far; True if this JAX has it.

    Flax's nnx `Variable.set_value` (0.12.8) asks each value for `.sharding` under `getattr(..,
    None)`; on a tracer JAX 0.10.2 answers with an AttributeError whose text names the operations
    the value came from, found by walking every equation traced so far. MaxText's model sets its
    params that way while being traced, so a trace of L unscanned layers costs O(L^2): with AQT int8
    a tiny 16-layer model took 61 s to init and 48 s to compile generate on a warm cache (CPU host),
    38 s and 28 s without the walk. The text is only ever read in an error; the device's work is
    unchanged."""
    try:
        from jax._src.interpreters import partial_eval
    except ImportError:
        return False
    tracer = getattr(partial_eval, "DynamicJaxprTracer", None)
    if tracer is None or not hasattr(tracer, "_origin_msg"):
        return False
    tracer._origin_msg = lambda self: "\n(the origin of this value was not traced: loadtest.maxtext_peer)"
    return True


class Report:
    """The run's JSON, rewritten as each phase starts and ends: `phase` names the last one started,
    `seconds` holds each one finished."""

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path, self.data = path, {**data, "phase": "start", "seconds": {}}
        self._started = 0.0
        self.write()

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2, default=str))

    def start(self, phase: str) -> None:
        self.data["phase"], self._started = phase, time.perf_counter()
        self.write()

    def done(self, **facts: Any) -> None:
        self.data["seconds"][self.data["phase"]] = round(time.perf_counter() - self._started, 3)
        self.data.update(facts)
        self.write()


def _plain(value: Any) -> Any:
    """A config value as JSON shows it plainly (an enum's value, a dtype's name)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (bool, int, float, str, list, tuple)) or value is None:
        return value
    return str(value)


def _bytes_by_dtype(tree: Any) -> dict[str, int]:
    import jax

    found: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "dtype") and hasattr(leaf, "nbytes"):
            found[str(leaf.dtype)] = found.get(str(leaf.dtype), 0) + int(leaf.nbytes)
    return found


def _sources() -> dict[str, str]:
    """The commits of the MaxText and JetStream sources imported (the SOURCE files the export writes)."""
    import jetstream
    import maxtext

    found = {}
    for name, module in (("maxtext", maxtext), ("jetstream", jetstream)):
        source = Path(module.__file__).resolve().parent.parent / "SOURCE"
        found[name] = source.read_text().strip() if source.is_file() else str(Path(module.__file__).parent)
    return found


def run_phases(report: Report, keys: dict[str, str], ns: argparse.Namespace) -> None:
    """Phases 1-5 of the module docstring, each recorded in `report` as it finishes."""
    report.start("import")
    import jax
    import jax.numpy as jnp

    # MaxText's microbenchmark runs with this PRNG, and aot_compile's rng shape ([4] uint32) is its key's.
    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    seqio_placeholder = stand_in_for_seqio()
    tracer_origins_skipped = ns.skip_tracer_origins and skip_tracer_origins()
    from maxtext.configs import pyconfig
    from maxtext.inference.maxengine import maxengine
    from maxtext.input_pipeline.packing import prefill_packing

    device = jax.devices()[0]
    report.done(
        jax_version=jax.__version__,
        device_kind=device.device_kind,
        platform=device.platform,
        num_devices=jax.device_count(),
        python=platform.python_version(),
        sources=_sources(),
        seqio_placeholder=seqio_placeholder,
        tracer_origins_skipped=tracer_origins_skipped,
    )

    report.start("config")
    config = pyconfig.initialize(["", *(f"{k}={v}" for k, v in keys.items())])
    report.done(resolved={key: _plain(getattr(config, key)) for key in RESOLVED})
    if ns.only_config:
        return

    report.start("init")
    engine = maxengine.MaxEngine(config)
    rng = jax.random.PRNGKey(1234)
    rng, rng_params = jax.random.split(rng)
    params = engine.load_params(rng=rng_params)
    jax.block_until_ready(params)
    report.done(param_bytes_by_dtype=_bytes_by_dtype(params), slots=engine.max_concurrent_decodes)

    report.start("compile_generate")
    generate, params, init_decode_state = engine.aot_compile(params, pass_rng_shape=True)
    rng, rng_state = jax.random.split(rng)
    decode_state = init_decode_state(rng_state)
    jax.block_until_ready(decode_state)
    report.done(cache_bytes_by_dtype=_bytes_by_dtype(decode_state["cache"]))

    report.start("compile_insert")
    prefill_insert = prefill_packing.PrefillProcessor(engine).aot_compile(params, ns.prompt_length)
    report.done()

    report.start("fill")
    prompt = jax.random.randint(
        jax.random.PRNGKey(7), (ns.prompt_length,), 1, int(keys["vocab_size"]), jnp.int32
    )
    for slot in range(engine.max_concurrent_decodes):
        rng, rng_insert = jax.random.split(rng)
        _, decode_state = prefill_insert(params, prompt, slot, ns.prompt_length, decode_state, rng_insert)
    jax.block_until_ready(decode_state)
    report.done()

    report.start("generate")
    for _ in range(ns.warmup):
        rng, rng_step = jax.random.split(rng)
        decode_state, _ = generate(params, decode_state, rng_step)
    jax.block_until_ready(decode_state)
    started = time.perf_counter()
    for _ in range(ns.steps):
        rng, rng_step = jax.random.split(rng)
        decode_state, _ = generate(params, decode_state, rng_step)
    jax.block_until_ready(decode_state)
    elapsed = time.perf_counter() - started
    report.done(generate={"steps": ns.steps, "seconds": elapsed, **decode_rates(elapsed, ns.steps, ns.batch)})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of the module docstring."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("out", type=Path, help="folder for <label>.json (made if missing)")
    parser.add_argument("overrides", nargs="*", help="MaxText key=value settings, applied last")
    parser.add_argument(
        "--shape", default="llama3.2-1b", help="a preset of configs/models/ (default llama3.2-1b)"
    )
    parser.add_argument(
        "--batch", type=int, default=64, help="slots decoding at once (per_device_batch_size)"
    )
    parser.add_argument("--prompt-length", type=int, default=1024, help="the prompt filling each slot")
    parser.add_argument("--max-target-length", type=int, default=2048, help="each slot's KV cache length")
    parser.add_argument(
        "--quantization", choices=("none", "int8"), default="none", help="int8: AQT int8 weights"
    )
    parser.add_argument("--quantize-kvcache", action="store_true", help="MaxText's int8 KV cache")
    parser.add_argument(
        "--init-quantized",
        action="store_true",
        help="int8: initialize the weights in AQT's serving layout (checkpoint_is_quantized: no bfloat16 copy first)",
    )
    parser.add_argument(
        "--api", choices=sorted(API_KEYS), default="linen", help="MaxText's model API (default linen)"
    )
    parser.add_argument("--hardware", default="tpu", help="MaxText's hardware key (cpu on a CPU host)")
    parser.add_argument("--steps", type=int, default=64, help="generate calls timed")
    parser.add_argument("--warmup", type=int, default=2, help="generate calls before the clock")
    parser.add_argument(
        "--keep-tracer-origins",
        dest="skip_tracer_origins",
        action="store_false",
        help="trace as JAX does by default (slow: see skip_tracer_origins), for MaxText's init and compile times as a user sees them",
    )
    parser.add_argument("--cache-dir", default="", help="JAX's persistent compilation cache (jax_cache_dir)")
    parser.add_argument(
        "--only-config", action="store_true", help="stop after MaxText's config (checks the keys)"
    )
    parser.add_argument("--label", default="", help="the JSON's name (default: from the configuration)")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    keys = maxtext_keys(ns, load_preset(ns.shape), ns.out.resolve())
    ns.out.mkdir(parents=True, exist_ok=True)
    label = ns.label or default_label(ns)
    settings = {k: v for k, v in vars(ns).items() if k not in ("out", "overrides")}
    report = Report(ns.out / f"{label}.json", {"label": label, "arguments": settings, "maxtext_keys": keys})
    try:
        run_phases(report, keys, ns)
    except Exception as error:
        report.data.update(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(limit=20))
        report.write()
        print(summary(report.data), flush=True)
        return 1
    print(summary(report.data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
