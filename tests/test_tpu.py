"""The `tpu` tier: run on a TPU in one process (`make test-tpu`), skipped elsewhere saying why.

- the tiny model's greedy tokens on the chip (the TPU backend: XLA's ops over a lanes pool, float32
  at jax.default_matmul_precision('highest')) equal to the CPU engine's on the same weights;
- the generate and chunked-prefill programs compiled for the chip hold no copy, copy-start or
  transpose of a KV pool array (values or scales: the pool stays in its lanes layout,
  serving.models.cache);
- the memory plan of the serving profile counts the compiled programs' temporaries and fits, and
  every slot filled to its maximum length runs;
- JAX's Pallas paged-attention kernel compiled for the chip (not interpret mode) against XLA's
  attention and float64 numpy over shuffled page tables, float and int8 pages;
- pathserve's ragged paged attention kernel (decodes and chunks in one call) on the chip against
  float64 attention over each sequence's pages;
- pathserve's int8w matmul kernel on the chip against float64 of the same int8 weights, and an
  engine through it giving XLA's int8w tokens;
- Llama 3.2 1B's shape: the chip's bfloat16 logits within bfloat16's reach of the CPU's float32;
- the served loop (the orchestrator's device loop) gives the engine's own tokens.
"""

from __future__ import annotations

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.config import DevicesConfig, ServingConfig
from serving.runtime import make_mesh

pytestmark = pytest.mark.tpu

# tests/conftest.py sets JAX_PLATFORMS=cpu unless it is set: `make test-tpu` sets tpu,cpu (the chip,
# and the CPU the tokens are compared with) and PATHSERVE_REQUIRE_TPU=1, so that a run meant for the
# chip fails where it finds none instead of skipping every test
ON_TPU = any(d.platform == "tpu" for d in jax.devices())
if os.environ.get("PATHSERVE_REQUIRE_TPU") == "1" and not ON_TPU:
    raise RuntimeError(f"PATHSERVE_REQUIRE_TPU=1 but JAX sees no TPU: {jax.devices()}")
requires_tpu = pytest.mark.skipif(not ON_TPU, reason="no TPU here (jax.devices() has none): the tpu tier runs on a TPU host")


@pytest.fixture(scope="module")
def chip_model_dir(tmp_path_factory):
    """The tiny random Llama (tiny-random's shape, tests/conftest's vocabulary) written with numpy
    alone: a TPU VM has no torch for conftest's transformers-made one."""
    from loadtest.random_model import write_random_model
    from serving.config import load_model_config
    from tests.conftest import make_hf_tokenizer

    tokenizer = make_hf_tokenizer(tmp_path_factory.mktemp("chip-tokenizer"), vocab=300)
    shape = load_model_config("tiny-random").model_copy(update={"vocab_size": 320})
    return write_random_model(tmp_path_factory.mktemp("chip-model"), shape, tokenizer, dtype="float32")


def _config(**keys) -> ServingConfig:
    return ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=256, prefill_chunk_size=64, **keys
    )


def _tokens(engine, params) -> list[list[int]]:
    from serving.orchestrator.offline import run_to_completion
    from serving.request import SamplingParams

    requests = [(list(range(3, 3 + n)), SamplingParams(max_tokens=16)) for n in (5, 60, 130, 9)]
    return [r.token_ids for r in run_to_completion(engine, params, requests, prefix_caching=True)]


@requires_tpu
def test_tiny_models_greedy_tokens_on_the_chip_equal_the_cpu_engines(chip_model_dir):
    from serving.checkpoints.model_source import load_model
    from serving.engine.engine import Engine

    cfg = _config(cpu_kernels="off")
    model = load_model(str(chip_model_dir), cfg)
    with jax.default_matmul_precision("highest"):
        cpu = Engine(model, cfg.engine, make_mesh(DevicesConfig(), jax.devices("cpu")[:1]))
        tpu = Engine(model, cfg.engine, make_mesh(DevicesConfig(), jax.devices("tpu")[:1]))
        assert tpu.ops.pool_layout == "lanes" and cpu.ops.pool_layout == "tokens"
        assert _tokens(tpu, tpu.load_params()) == _tokens(cpu, cpu.load_params())


@requires_tpu
@pytest.mark.parametrize("ragged", [False, True], ids=["xla", "ragged"])
@pytest.mark.parametrize("kv", ["int8", "bfloat16"])
def test_no_program_copies_the_kv_pool(chip_model_dir, kv, ragged):
    """Llama 3.2 1B's attention (8 KV heads of 64: a lanes pool 128 int32 or 512 bfloat16 wide, its
    16 layers) with abstract weights and the profile's pool (128 slots of 2,048: a small pool is
    staged in VMEM by XLA, which says nothing of serving's); XLA's attention and the ragged
    kernel's (use_ragged_attention). No op of generate or of a chunk's prefill outputs as many
    elements as a pool array (values or scales) but the pool passed along or written in place:
    no copy, relayout, cast or gather of a whole pool (a scale pool's copies once hid behind
    other shapes, a flattened scatter's and a hoisted cast's, two every step)."""
    from loadtest.tpu_plan import abstract_model
    from serving.config import load_model_config
    from serving.engine.compiled_memory import abstract_params, abstract_state
    from serving.engine.engine import Engine

    shape = load_model_config("llama3.2-1b").model_copy(update={"vocab_size": 320})
    cfg = ServingConfig(
        per_device_batch_size=128, max_prefill_predict_length=512, max_target_length=2048, prefill_chunk_size=512,
        dtype="bfloat16", quantize_kvcache=kv == "int8", use_ragged_attention=ragged,
    )
    engine = Engine(abstract_model(shape, chip_model_dir, cfg.quantization, "bfloat16"), cfg.engine)
    assert engine.ops.name == ("ragged-tpu" if ragged else "xla-tpu")
    from serving.engine.api import PrefillRow
    from serving.engine.chunked import _model_inputs
    from serving.request import SamplingParams

    params, state = abstract_params(engine), abstract_state(engine)
    rows = jax.ShapeDtypeStruct((64,), "int32")
    generate = engine._generate_fn.lower(
        params, state, None, rows, window=engine.windows[0], steps=engine.decode_steps_per_call
    ).compile().as_text()
    chunk = [PrefillRow(i, (1,) * 512, 512, True, SamplingParams(max_tokens=1)) for i in range(4)]
    inputs, shape = engine.chunks._slot_inputs(chunk)
    prefill = engine.chunks._prefill_slots_fn.lower(
        params, state.cache, state.pages, *_model_inputs(inputs), window=shape[2]
    ).compile().as_text()
    pools = {math.prod(leaf.shape) for leaf in state.cache if leaf is not None}
    assert _pool_sized_ops(generate, pools) == [] and _pool_sized_ops(prefill, pools) == []


def _pool_sized_ops(hlo: str, sizes: set[int]) -> list[str]:
    """The instructions of compiled HLO text whose output has one of `sizes` elements, other than
    an array passed along (parameter, tuple, bitcast, loop) or written in place (a scatter or
    dynamic-update-slice fusion)."""
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s+(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\(", line)
        if m is None:
            continue
        name, dims, op = m.groups()
        if op in ("parameter", "get-tuple-element", "bitcast", "tuple", "while", "conditional", "call", "opt-barrier"):
            continue
        if op == "scatter" or name.startswith(("scatter", "dynamic-update-slice", "dynamic_update_slice")):
            continue
        if math.prod(int(d) for d in dims.split(",") if d) in sizes:
            found.append(line.strip()[:200])
    return found


@requires_tpu
def test_the_serving_profiles_plan_fits_with_its_compiled_temporaries(chip_model_dir, monkeypatch):
    from serving.launch import bring_up
    from serving.startup.profile import given_config

    monkeypatch.setenv("PATHSERVE_PLATFORM", "tpu")
    given = given_config(None, ["enable_model_warmup=false"], str(chip_model_dir))
    up = bring_up(given.config, str(chip_model_dir), given.origins)
    engine, params = up.engine, up.params
    assert engine.max_concurrent_decodes == 128 and engine.config.max_target_length == 2048
    assert _tokens(engine, params)


@requires_tpu
def test_every_slot_filled_to_its_maximum_length_fits(chip_model_dir, monkeypatch):
    """The TPU profile's 128 slots each to max_target_length at once: the pool, the programs'
    temporaries and the windows at their widest, without RESOURCE_EXHAUSTED."""
    from serving.launch import bring_up
    from serving.orchestrator.offline import run_to_completion
    from serving.request import SamplingParams
    from serving.startup.profile import given_config

    monkeypatch.setenv("PATHSERVE_PLATFORM", "tpu")
    given = given_config(None, ["enable_model_warmup=false"], str(chip_model_dir))
    up = bring_up(given.config, str(chip_model_dir), given.origins)
    engine, length = up.engine, up.engine.config.max_target_length
    prompt = 1000
    requests = [([3 + (i + j) % 250 for j in range(prompt)], SamplingParams(max_tokens=length - prompt)) for i in range(128)]
    done = run_to_completion(engine, up.params, requests)
    assert [len(r.token_ids) for r in done] == [length - prompt] * 128


@requires_tpu
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
@pytest.mark.parametrize("groups", [1, 3])
def test_pallas_kernel_on_the_chip_matches_xlas_attention(int8, groups):
    """The kernel as the chip runs it (no interpret mode) over shuffled page tables, rows at the
    pages' edges and a parked row, against XLA's attention on the same pool (float32 at 'highest')
    and float64 numpy; the kernel loads float pages as bfloat16, hence the tolerance."""
    from serving.kernels.tpu_paged import PallasPagedOps
    from serving.models.ops import XlaOps
    from tests.test_tpu_paged import MAX_PAGES, _case, _reference

    page_size, head_dim = 16, 128
    rng = np.random.default_rng(groups * 10 + int8)
    q, cache, tables, positions, k_new, v_new = _case(rng, 2, page_size, groups, head_dim, int8)
    window = MAX_PAGES[page_size] * page_size
    for layer in range(2):
        args = (q[layer], cache, positions, k_new[layer], v_new[layer])
        # the kernel as serving runs it: under 'highest' Mosaic is asked for float32 dots of the
        # bfloat16 pages it loads, which it refuses
        kernel = jax.jit(lambda q, c, p, k, v, layer=layer: PallasPagedOps().decode_attention(q, c, layer, p, k, v, 0, tables))
        got = np.asarray(kernel(*args))
        assert jax.devices()[0].platform == "tpu"
        with jax.default_matmul_precision("highest"):
            xla = jax.jit(lambda q, c, p, k, v, layer=layer: XlaOps().decode_attention(q, c, layer, p, k, v, window, tables))
            want = np.asarray(xla(*args))
        assert not got[-1].any()  # the parked row: no pages, zeros
        np.testing.assert_allclose(got[:-1], want[:-1], atol=2e-2)
        exact = _reference(q[layer], cache, layer, tables, positions, k_new[layer], v_new[layer], round_kv=not int8)
        # the chip's dots run at the default precision (bfloat16 passes): up to 4.4e-3 (float) and
        # 6.9e-3 (int8) from float64 measured on a v5e; interpret mode on a CPU is within 1e-5
        np.testing.assert_allclose(got, exact, atol=1e-2)


@requires_tpu
@pytest.mark.parametrize("decode", [False, True], ids=["chunks", "decodes"])
@pytest.mark.parametrize(
    ("dtype", "int8"), [(jnp.float32, ""), (jnp.bfloat16, ""), (jnp.bfloat16, "dkv"), (jnp.bfloat16, "heads_and_dkv")]
)
def test_ragged_paged_kernel_on_the_chip_matches_attention_over_each_rows_pages(dtype, int8, decode):
    """The ragged paged attention kernel (serving.kernels.ragged_paged) compiled for the chip:
    decodes and chunks of different lengths in one call over shuffled pages, or a decode step's
    units four a block, float and int8, against float64 attention over each sequence's pages (the
    chip's dots at the default precision: bfloat16 passes, hence the tolerance), empty units zeros."""
    from tests.test_ragged_paged import ragged_case

    run, check = ragged_case(dtype, seed=1, int8=int8, decode=decode)
    out = run(interpret=False)
    assert jax.devices()[0].platform == "tpu"
    check(out, 2e-2)


@requires_tpu
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("transposed", [False, True], ids=["weight", "tied-head"])
def test_int8_matmul_kernel_on_the_chip_matches_xlas_int8w_matmul(rows, transposed):
    """The int8w matmul kernel (serving.kernels.int8_matmul) compiled for the chip, a layer of a
    stack of the 1B shape's MLP weight (or its tied embedding as the head), bfloat16 rows, against
    float64 numpy of the same int8 values and scales: within bfloat16's reach."""
    from serving.kernels.int8_matmul import int8_matmul

    rng = np.random.default_rng(rows)
    k, n = (2048, 8192) if not transposed else (2048, 128256)  # the head: 501 blocks of 256
    layers, layer = (1, 0) if transposed else (3, 1)
    values = rng.integers(-127, 128, (layers, n, k) if transposed else (layers, k, n), dtype=np.int8)
    scales = (rng.random((layers, 1, n)) * 0.01 + 0.001).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    out_dtype = jnp.float32 if transposed else None  # the head's logits: float32, as ops.tied_head asks
    got = int8_matmul(x, jnp.asarray(values), jnp.asarray(scales), layer, transposed=transposed, out_dtype=out_dtype)
    assert jax.devices()[0].platform == "tpu" and got.dtype == (jnp.float32 if transposed else jnp.bfloat16)
    cols = np.sort(rng.choice(n, 2048, replace=False))  # a sample of the outputs: float64 of all 128,256 is slow
    w = (values[layer][cols].T if transposed else values[layer][:, cols]).astype(np.float64)
    want = np.asarray(x, np.float64) @ (w * scales[layer][:, cols])
    error = np.max(np.abs(np.asarray(got, np.float64)[:, cols] - want)) / np.max(np.abs(want))
    assert error < 1e-2, error


@requires_tpu
def test_an_engine_with_the_int8_kernel_on_the_chip_gives_xlas_int8w_tokens(tmp_path):
    """int8w weights the kernel's blocks divide, a tied head (read transposed), on the chip's TPU
    backend with `int8_matmul_kernel` and without it (float32 at the highest precision): the
    same greedy tokens, prompts in chunks and decode steps."""
    from serving.checkpoints.model_source import load_model
    from serving.engine.engine import Engine
    from tests.conftest import make_hf_tokenizer
    from tests.test_int8_matmul import kernel_sized_model

    (tmp_path / "tokenizer").mkdir()
    model_dir = kernel_sized_model(tmp_path / "model", make_hf_tokenizer(tmp_path / "tokenizer", vocab=300), tied=True)
    tokens = {}
    with jax.default_matmul_precision("highest"):
        for kernel in (False, True):
            cfg = _config(quantization="int8w", int8_matmul_kernel=kernel)
            engine = Engine(load_model(str(model_dir), cfg), cfg.engine)
            assert (getattr(engine.ops, "int8_matmul", None) is not None) == kernel
            tokens[kernel] = _tokens(engine, engine.load_params())
    assert tokens[True] == tokens[False]


@requires_tpu
@pytest.mark.parametrize("ragged", [False, True], ids=["xla", "ragged"])
def test_the_prompts_logprobs_in_chunks_on_the_chip_are_the_whole_prefills(chip_model_dir, ragged):
    """A prompt scored chunk by chunk on the chip (`prefill_slots_scored`, XLA's attention and the
    ragged kernel's, int8 pages, bfloat16) against the same chip's whole prefill: the same tokens,
    logprobs within bfloat16's tolerance."""
    from serving.checkpoints.model_source import load_model
    from serving.engine.api import PrefillRow
    from serving.engine.engine import Engine
    from serving.request import SamplingParams

    cfg = _config(dtype="bfloat16", quantize_kvcache=True, use_ragged_attention=ragged)
    model = load_model(str(chip_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    assert engine.ops.name == ("ragged-tpu" if ragged else "xla-tpu")
    params = engine.load_params()
    prompt = tuple(3 + (i * 7) % 250 for i in range(50))
    s = SamplingParams(max_tokens=4, prompt_logprobs=5)
    prefix, first = engine.prefill(params, engine.limits.pad(list(prompt)), len(prompt), s)
    whole = engine.prefill_outputs(prefix).prompt_logprobs
    state, scored = engine.init_decode_state(), []
    for start in range(0, len(prompt), 32):  # chunks of prefill_chunk_size (64): 32 here, two of them
        end = min(start + 32, len(prompt))
        final = end == len(prompt)
        row = PrefillRow(1, prompt[start:end], start, final, s, score=True, score_next=-1 if final else prompt[end])
        state, token, _, scores = engine.prefill_slots_scored(params, state, row)
        scored += scores
    assert token == first and len(scored) == len(prompt) - 1
    for a, b in zip(scored, whole[1:], strict=True):
        assert a.token == b.token
        np.testing.assert_allclose(a.logprob, b.logprob, atol=0.05)


@requires_tpu
def test_the_1b_shapes_logits_on_the_chip_within_bfloat16_of_the_cpus():
    """Llama 3.2 1B's shape, random weights: the whole-prompt forward in bfloat16 (weights and
    activations) on the chip against float32 at 'highest' on the CPU, 64 tokens."""
    from serving.config import load_model_config
    from serving.models.llama import init_params, prefill

    cfg = load_model_config("llama3.2-1b")
    cpu, tpu = jax.devices("cpu")[0], jax.devices("tpu")[0]
    with jax.default_device(cpu):
        params = init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 64)).astype(np.int32)
    lengths = np.array([64], np.int32)
    with jax.default_matmul_precision("highest"):
        run = jax.jit(lambda p, t, n: prefill(p, t, n, cfg)[0])
        want = np.asarray(run(params, tokens, lengths), np.float64)[0]
    on_chip = jax.device_put(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), tpu)
    del params
    run = jax.jit(lambda p, t, n: prefill(p, t, n, cfg, dtype=jnp.bfloat16)[0])
    got = np.asarray(run(on_chip, jax.device_put(tokens, tpu), jax.device_put(lengths, tpu)).astype(jnp.float32), np.float64)[0]
    # bfloat16 keeps 8 bits: each of 16 layers' sums rounds at ~2^-9 relative
    relative = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert relative.max() < 0.05, relative.max()
    top = np.argsort(want, axis=-1)[:, -1]
    assert (got[np.arange(64), top] >= np.sort(got, axis=-1)[:, -5]).mean() >= 0.95  # the CPU's top 1 in the chip's top 5


@requires_tpu
def test_the_served_loops_tokens_equal_the_engines(chip_model_dir):
    """The orchestrator's device loop (what `serve` runs) on the chip gives the tokens the engine
    gives driven directly (the offline driver), for prompts arriving together."""
    from serving.checkpoints.model_source import load_model
    from serving.engine.engine import Engine
    from serving.orchestrator.orchestrator import Orchestrator
    from serving.request import SamplingParams

    cfg = _config(dtype="bfloat16", quantize_kvcache=True)
    model = load_model(str(chip_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    want = _tokens(engine, params)
    orchestrator = Orchestrator(engine, params, model.tokenizer, cfg.orchestrator).start()
    try:
        handles = [orchestrator.submit(list(range(3, 3 + n)), SamplingParams(max_tokens=16)) for n in (5, 60, 130, 9)]
        got = [h.result().token_ids for h in handles]
    finally:
        orchestrator.stop(timeout=60)
    assert got == want
