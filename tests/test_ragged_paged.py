"""The ragged paged attention kernel (serving.kernels.ragged_paged) in Pallas' TPU interpret mode,
against attention in float64 over each sequence's positions read through its block table: decodes
and chunks of different lengths in one call, pages shuffled, blocks partly padding, empty blocks."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from serving.kernels.ragged_paged import pack_blocks, ragged_paged_attention  # noqa: E402

KV_HEADS, GROUPS, HEAD_DIM, PAGE, MAX_PAGES, LAYERS = 2, 4, 64, 8, 8, 2


def _reference(q_tokens, pool_k, pool_v, layer, table, start):
    """Attention of q_tokens [n, kv_heads, groups, d] at positions start.. over the row's pages."""
    n = q_tokens.shape[0]
    length = start + n
    pos = np.arange(length)
    pages = table[pos // PAGE]
    k = pool_k[layer, pages, pos % PAGE].reshape(length, KV_HEADS, HEAD_DIM).astype(np.float64)
    v = pool_v[layer, pages, pos % PAGE].reshape(length, KV_HEADS, HEAD_DIM).astype(np.float64)
    scores = np.einsum("thgd,shd->thgs", q_tokens.astype(np.float64), k) / np.sqrt(HEAD_DIM)
    visible = pos[None, :] <= (start + np.arange(n))[:, None]  # [n, length]
    scores = np.where(visible[:, None, None, :], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("thgs,shd->thgd", weights, v)


def _int8_lanes(values: np.ndarray, per_head: bool):
    """Float pool values [layers, pages, page_size, kv_heads * head_dim] as an int8 lanes pool:
    (int32 lanes, scales [layers, pages, heads x page_size] head-major, the dequantized values)."""
    from serving.models.cache import quantize_kv, to_lanes

    layers, pages, page, _ = values.shape
    split = jnp.asarray(values).reshape(layers, pages, page, KV_HEADS, HEAD_DIM)
    quantized, scales = quantize_kv(split, per_head)  # scales [..., heads or 1, 1]
    lanes = to_lanes(quantized, jnp.zeros((), jnp.int32))
    head_major = jnp.moveaxis(scales[..., 0], -1, 2).reshape(layers, pages, -1)  # [.., heads * page]
    exact = np.asarray(quantized.astype(jnp.float32) * scales).reshape(values.shape)
    return lanes, head_major, exact


def ragged_case(dtype, seed: int = 0, int8: str = "", decode: bool = False):
    """(run, check): `run(interpret)` calls the kernel on a ragged step (decodes at 0 and deep in,
    a fresh chunk, chunks after history, two empty units at the end: a bucket's padding) over
    shuffled pages in layer 1 of 2; `check(out, tolerance)` compares its output with float64
    attention over each sequence's pages (the inputs rounded to `dtype` first) and the empty
    units with zeros. `decode`: a decode step's units instead, one token each, four a kernel
    block. Shared with the chip's tier (tests/test_tpu.py)."""
    rng = np.random.default_rng(seed)
    if decode:  # (query tokens, first position)
        seqs, block_q, segments = [(1, 20), (1, 0), (1, 63), (1, 5), (1, 33), (1, 31), (1, 32), (1, 40), (1, 2), (1, 17)], 1, 4
    else:
        seqs, block_q, segments = [(1, 20), (1, 0), (13, 0), (7, 30), (4, 3), (1, 63), (16, 40)], 8, 1
    num_pages, layer = 1 + len(seqs) * MAX_PAGES, 1
    tables = np.zeros((len(seqs), MAX_PAGES), np.int32)
    shuffled = rng.permutation(np.arange(1, num_pages))  # page 0 is scratch
    for s in range(len(seqs)):
        tables[s] = shuffled[s * MAX_PAGES : (s + 1) * MAX_PAGES]

    def rounded(shape):
        return np.asarray(jnp.asarray(rng.standard_normal(shape), dtype).astype(jnp.float32))

    pool_k, pool_v = (rounded((LAYERS, num_pages, PAGE, KV_HEADS * HEAD_DIM)) for _ in range(2))
    stored, scales = (jnp.asarray(pool_k, dtype), jnp.asarray(pool_v, dtype)), {}
    if int8:  # "dkv": a scale per token and head; "heads_and_dkv": per token
        (k8, ks, pool_k), (v8, vs, pool_v) = (_int8_lanes(x, int8 == "dkv") for x in (pool_k, pool_v))
        stored, scales = (k8, v8), dict(k_scale=ks, v_scale=vs)
    block_seq, block_start, block_rows, offsets = pack_blocks([n for n, _ in seqs], [s for _, s in seqs], block_q)
    block_seq, block_start, block_rows = [*block_seq, 0, 0], [*block_start, 0, 0], [*block_rows, 0, 0]
    blocks = len(block_seq)
    tokens = rounded((blocks * block_q, KV_HEADS, GROUPS, HEAD_DIM))
    # [units * block_q * groups, kv_heads, head_dim]: row (t, g) of head h
    q = jnp.asarray(tokens.transpose(0, 2, 1, 3).reshape(-1, KV_HEADS, HEAD_DIM), dtype)

    def run(interpret: bool) -> np.ndarray:
        out, _ = ragged_paged_attention(
            q, *stored, layer, jnp.asarray(tables), jnp.asarray(block_seq), jnp.asarray(block_start),
            jnp.asarray(block_rows), block_q=block_q, segments=segments, pages_per_block=2, interpret=interpret, **scales,
        )
        return np.asarray(out.astype(jnp.float32))

    def check(out: np.ndarray, tolerance: float) -> None:
        got = out.reshape(blocks * block_q, GROUPS, KV_HEADS, HEAD_DIM).transpose(0, 2, 1, 3)
        for s, (n, start) in enumerate(seqs):
            first = offsets[s] * block_q
            want = _reference(tokens[first : first + n], pool_k, pool_v, layer, tables[s], start)
            np.testing.assert_allclose(got[first : first + n], want, atol=tolerance, rtol=tolerance, err_msg=f"sequence {s}")
        np.testing.assert_array_equal(got[(blocks - 2) * block_q :], 0.0)  # the empty units

    return run, check


@pytest.mark.parametrize("decode", [False, True], ids=["chunks", "decodes"])
@pytest.mark.parametrize(
    ("dtype", "int8"), [(jnp.float32, ""), (jnp.bfloat16, ""), (jnp.float32, "dkv"), (jnp.bfloat16, "heads_and_dkv")]
)
def test_ragged_paged_attention_matches_attention_over_each_rows_pages(dtype, int8, decode):
    """Float pages, and int8 pages (four values an int32 lane, scales per token and head or per
    token) against float64 attention over their dequantized values; chunks and decodes mixed a
    unit a block, and a decode step's units four a block."""
    run, check = ragged_case(dtype, int8=int8, decode=decode)
    with pltpu.force_tpu_interpret_mode():
        out = run(interpret=False)
    check(out, 2e-5 if dtype == jnp.float32 else 3e-2)  # bfloat16: the output's rounding


def test_pack_blocks_starts_each_sequence_at_a_block():
    assert pack_blocks([1, 5, 4], [9, 0, 2], 4) == ([0, 1, 1, 2], [9, 0, 4, 2], [1, 4, 1, 4], [0, 1, 3])


def _lanes_case(rng, dtype, batch: int, int8: bool = False):
    """A lanes pool of 2 layers with random values (float, or int8 with scales per token and
    head), each row its own shuffled pages, the last row parked (all scratch)."""
    from serving.models.cache import KVCache, init_pool
    from serving.models.config import ModelConfig

    cfg = ModelConfig(
        name="ragged", vocab_size=32, embed_dim=KV_HEADS * GROUPS * HEAD_DIM, num_layers=LAYERS,
        num_heads=KV_HEADS * GROUPS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, mlp_dim=64, rope_theta=1e4,
        norm_eps=1e-5, max_position=MAX_PAGES * PAGE,
    )
    num_pages = 1 + batch * MAX_PAGES
    pool = init_pool(cfg, num_pages, PAGE, dtype, layout="lanes")
    values = [rng.standard_normal((LAYERS, num_pages, PAGE, KV_HEADS * HEAD_DIM)) for _ in range(2)]
    if int8:
        (k8, ks, _), (v8, vs, _) = (_int8_lanes(x, True) for x in values)
        pool = KVCache(k8, v8, ks, vs)
    else:
        pool = pool._replace(k=jnp.asarray(values[0], dtype), v=jnp.asarray(values[1], dtype))
    tables = rng.permutation(np.arange(1, num_pages))[: batch * MAX_PAGES].reshape(batch, MAX_PAGES).astype(np.int32)
    tables[-1] = 0
    return pool, jnp.asarray(tables)


@pytest.mark.parametrize(("dtype", "int8"), [(jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True)])
def test_ragged_ops_attend_as_xlas_over_the_lanes_pool(dtype, int8):
    """RaggedPagedOps' decode and chunk attention (history through the kernel in interpret mode,
    own tokens by XLA, merged) against TpuXlaOps' over the same pool: rows at position 0, deep in,
    at a page's edge, chunks after history and fresh ones, the parked row's output not compared."""
    from serving.kernels.ragged_paged import RaggedPagedOps
    from serving.models.ops import TpuXlaOps

    rng = np.random.default_rng(3)
    cache, tables = _lanes_case(rng, dtype, 5, int8)
    window = MAX_PAGES * PAGE
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    positions = jnp.asarray([0, 17, 8, 63, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((5, 1, KV_HEADS, GROUPS, HEAD_DIM)), dtype)
    k_new, v_new = (jnp.asarray(rng.standard_normal((5, KV_HEADS, HEAD_DIM)), dtype) for _ in range(2))
    # Pallas' generic interpreter (interpret=True): the TPU interpreter's callbacks run JAX ops of
    # their own, and with this test's eager ops dispatched beside them the two threads hung on a
    # 2-core host (py-spy: the callback in SharedMemory.update_clocks_for_device_barrier, the main
    # thread in apply_primitive). The kernel's own tests await one jitted call under the TPU
    # interpreter; this one is about the ops around the kernel.
    ragged = RaggedPagedOps(pages_per_block=2, interpret=True)
    with jax.default_matmul_precision("highest"):
        for layer in range(LAYERS):
            got = ragged.decode_attention(q, cache, layer, positions, k_new, v_new, window, tables)
            want = TpuXlaOps().decode_attention(q, cache, layer, positions, k_new, v_new, window, tables)
            np.testing.assert_allclose(np.asarray(got[:-1], np.float32), np.asarray(want[:-1], np.float32),
                                       atol=tolerance, rtol=tolerance)

        seq = 12
        starts, lengths = jnp.asarray([0, 20, 8, 40, 0], jnp.int32), jnp.asarray([12, 5, 12, 1, 3], jnp.int32)
        q = jnp.asarray(rng.standard_normal((5, seq, KV_HEADS, GROUPS, HEAD_DIM)), dtype)
        k_new, v_new = (jnp.asarray(rng.standard_normal((5, seq, KV_HEADS, HEAD_DIM)), dtype) for _ in range(2))
        offsets = jnp.arange(seq)
        own = (offsets[:, None] >= offsets[None, :])[None] & (offsets[None, None, :] < lengths[:, None, None])
        earlier = jnp.broadcast_to(jnp.arange(window)[None, None, :] < starts[:, None, None], (5, seq, window))
        mask = jnp.concatenate([earlier, own], axis=-1)
        got = ragged.chunk_attention(q, cache, 1, starts, k_new, v_new, mask, window, tables, lengths)
        want = TpuXlaOps().chunk_attention(q, cache, 1, starts, k_new, v_new, mask, window, tables, lengths)
    for b in range(4):  # each row's real tokens (the rest, and the parked row, are anything)
        n = int(lengths[b])
        np.testing.assert_allclose(np.asarray(got[b, :n], np.float32), np.asarray(want[b, :n], np.float32),
                                   atol=tolerance, rtol=tolerance, err_msg=f"row {b}")


@pytest.mark.parametrize("quantize_kvcache", [False, True], ids=["float", "int8"])
def test_an_engine_on_the_ragged_kernel_gives_the_tpu_backends_tokens(tiny_model_dir, monkeypatch, quantize_kvcache):
    """The tiny model served on RaggedPagedOps (the kernel in interpret mode: decode steps, a prompt
    in chunks, a prefix hit's rest after cached pages, one window compiled) gives the greedy tokens
    of the same engine on TpuXlaOps (XLA's gather of each call's window), float32 on the CPU, over
    a float and an int8 KV cache."""
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine import engine as engine_module
    from serving.kernels.ragged_paged import RaggedPagedOps
    from serving.models.ops import TPU_XLA
    from serving.orchestrator.offline import run_to_completion
    from serving.request import SamplingParams

    cfg = ServingConfig(
        per_device_batch_size=2, max_prefill_predict_length=64, max_target_length=128, prefill_chunk_size=32,
        decode_steps_per_call=2, cpu_kernels="off", enable_model_warmup=False, quantize_kvcache=quantize_kvcache,
    )
    model = load_model(str(tiny_model_dir), cfg)
    prompt = list(range(5, 45))  # 40 tokens: two chunks; its first page cached for the repeat
    # two slots: the repeat waits for one, by then the prompt's first page is in the prefix cache
    requests = [(prompt, SamplingParams(max_tokens=5)), (list(range(7, 19)), SamplingParams(max_tokens=4)),
                (prompt, SamplingParams(max_tokens=5))]
    tokens = {}
    # the generic interpreter: the host dispatches the next call while one runs, which the TPU
    # interpreter's callbacks do not stand (test_ragged_ops_attend_as_xlas_over_the_lanes_pool)
    for ops in (TPU_XLA, RaggedPagedOps(pages_per_block=2, interpret=True)):
        monkeypatch.setattr(engine_module, "select_ops", lambda config, mesh, ops=ops: ops)
        engine = engine_module.Engine(model, cfg.engine)
        assert engine.ops is ops
        done = run_to_completion(engine, engine.load_params(), requests, prefix_caching=True)
        assert [r.cached_tokens for r in done] == [0, 0, 32]  # the repeat's rest after a cached page
        assert done[2].token_ids == done[0].token_ids
        tokens[ops.name] = [r.token_ids for r in done]
    assert tokens["ragged-tpu"] == tokens["xla-tpu"]


def test_use_ragged_attention_is_maxtexts_key_and_says_where_it_does_nothing(caplog):
    """use_ragged_attention / ragged_block_size are MaxText's keys: honoured (not logged as without
    effect); off a TPU a warning says the kernel does not run there."""
    import logging

    from serving.config import DevicesConfig, ServingConfig
    from serving.engine.engine import select_ops
    from serving.runtime import make_mesh

    with caplog.at_level(logging.WARNING):
        cfg = ServingConfig(use_ragged_attention=True, ragged_block_size=128, quantize_kvcache=True)
    assert "no effect" not in caplog.text
    with pytest.raises(ValueError, match="ragged_block_size"):
        ServingConfig(ragged_block_size=0)
    with pytest.raises(ValueError, match="whole number of pages"):  # the kernel copies whole pages
        ServingConfig(use_ragged_attention=True, ragged_block_size=48, prefix_block_size=32)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ServingConfig(ragged_block_size=128)  # without use_ragged_attention: said, not silent
        ServingConfig(use_ragged_attention=True, attention="paged", pagedattn_num_pages=129)
    assert "ragged_block_size (without use_ragged_attention)" in caplog.text
    assert "the ragged kernel serves attention on a TPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ops = select_ops(cfg.engine, make_mesh(DevicesConfig(), jax.devices()[:1]))
    assert ops.name != "ragged-tpu" and "the ragged paged kernel runs on TPUs" in caplog.text


def test_an_engine_on_the_ragged_kernel_compiles_one_window(tiny_model_dir, monkeypatch):
    """Decode and chunks read each row's positions in place: one generate window and one history
    window, where XLA's gather has the ladder's (512 and 2,048 on a TPU). Every chunk call takes
    that window, a fresh prompt's too, so a prefix hit's rest is a fresh prompt's program: warmup
    compiles each (rows, length) once, where XLA's attention has a program per history window. Its
    prompt lengths grow by 2 (padding costs MXU time; a program is cheap), its rows by 4."""
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine import engine as engine_module
    from serving.engine import warmup
    from serving.kernels.ragged_paged import RaggedPagedOps
    from serving.models.ops import TPU_XLA

    cfg = ServingConfig(
        per_device_batch_size=2, max_prefill_predict_length=256, max_target_length=2048, prefill_chunk_size=256,
        cpu_kernels="off",
    )
    model = load_model(str(tiny_model_dir), cfg)
    windows, starts, programs, ladders = {}, {}, {}, {}
    for ops in (TPU_XLA, RaggedPagedOps()):
        monkeypatch.setattr(engine_module, "select_ops", lambda config, mesh, ops=ops: ops)
        engine = engine_module.Engine(model, cfg.engine)
        windows[ops.name] = (engine.windows, engine.history_windows)
        starts[ops.name] = [engine.history_window(at) for at in (0, 100, 1000)]
        ladders[ops.name] = (engine.limits.buckets, engine.row_buckets)
        jobs = warmup.compile_jobs(engine, None, None, generate=False)
        keys = [engine.chunks._slot_inputs(rows)[1] for _fn, (_params, _state, rows) in jobs]
        assert len(keys) == len(set(keys))  # no program twice
        programs[ops.name] = (len(keys), len(warmup.chunk_shapes(engine)), len(warmup.rest_shapes(engine)))
    assert windows == {"xla-tpu": ([512, 2048], [512, 2048]), "ragged-tpu": ([2048], [2048])}
    assert starts == {"xla-tpu": [0, 512, 2048], "ragged-tpu": [2048, 2048, 2048]}
    assert ladders == {"xla-tpu": ((128, 256), (1, 4, 8)), "ragged-tpu": ((16, 32, 64, 128, 256), (1, 4, 8))}
    jobs, fresh, rests = programs["ragged-tpu"]
    assert jobs == fresh and rests == 0  # a rest or a chunk after cached positions: a fresh prompt's program
    jobs, fresh, rests = programs["xla-tpu"]
    assert rests > 0 and jobs > fresh


def test_a_model_whose_kv_heads_overflow_the_kernels_vmem_stays_on_xlas_attention(caplog, monkeypatch, tiny_model_dir):
    """The ragged kernel's VMEM grows with kv_heads x head_dim (its buffers, a block's rows): Llama
    2 7B's 32 x 128 ran out of a v5e's scoped VMEM compiled by Mosaic, so such a model's engine
    selects its backend without the kernel (said in a warning: XLA's attention, or JAX's paged
    kernel under attention=paged); the Llama 3 shapes keep the kernel."""
    import dataclasses
    import logging

    from serving.checkpoints.model_source import load_model
    from serving.config import DevicesConfig, ServingConfig, load_model_config
    from serving.engine import engine as engine_module
    from serving.kernels.ragged_paged import RaggedPagedOps
    from serving.models.ops import TPU_XLA
    from serving.runtime import make_mesh

    ops = RaggedPagedOps()
    for shape in ("llama3.2-1b", "llama3.1-8b"):
        assert ops.serves(load_model_config(shape), True, jnp.bfloat16, 32)
        assert ops.serves(load_model_config(shape), False, jnp.bfloat16, 32)
    mha = load_model_config("llama3.2-1b").model_copy(update={"num_kv_heads": 32, "num_heads": 32, "head_dim": 128})
    with caplog.at_level(logging.WARNING):
        assert not ops.serves(mha, True, jnp.bfloat16, 32)
    assert "selected without it" in caplog.text and "32 kv heads of 128" in caplog.text

    # the engine's choice: the backend selected again with use_ragged_attention off
    cfg = ServingConfig(use_ragged_attention=True, quantize_kvcache=True, cpu_kernels="off", enable_model_warmup=False)
    model = load_model(str(tiny_model_dir), cfg)
    asked = []

    def select(config, mesh):
        asked.append(config.use_ragged_attention)
        return ops if config.use_ragged_attention else TPU_XLA

    monkeypatch.setattr(engine_module, "select_ops", select)
    mesh = make_mesh(DevicesConfig(), jax.devices()[:1])
    assert engine_module.model_ops(model, cfg.engine, mesh) is ops  # the tiny model fits
    wide = dataclasses.replace(model, config=mha)
    assert engine_module.model_ops(wide, cfg.engine, mesh) is TPU_XLA and asked == [True, True, False]


def test_a_mixed_batch_served_on_the_ragged_kernel_gives_xlas_tokens_and_logprobs(
    tiny_model_dir, monkeypatch, tmp_path
):
    """The device loop (orchestrator, its own thread) on RaggedPagedOps (the kernel in interpret
    mode) against TpuXlaOps, the same requests arriving together: greedy, a prompt in chunks, its
    repeat (a prefix hit), a repetition penalty, a seeded sampled one, n = 2 choices, top-2
    logprobs, the prompt's logprobs (scored chunks), a JSON grammar, a LoRA adapter's rows beside
    the base model's, with n-gram speculation verifying proposals: the same tokens, logprobs
    within 1e-4, the same cached prompt tokens, over the TPU profile's int8 KV cache (float32 on
    the CPU; float pages: the offline test above)."""
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine import engine as engine_module
    from serving.kernels.ragged_paged import RaggedPagedOps
    from serving.lora.serving import make_registry
    from serving.models.ops import TPU_XLA
    from serving.orchestrator.orchestrator import Orchestrator
    from serving.request import Grammar, SamplingParams
    from tests.lora.adapters import make_adapter

    make_adapter(tiny_model_dir, tmp_path / "adapter", 4, 8, ["q_proj", "v_proj", "down_proj"], False, seed=1)
    cfg = ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=128, prefill_chunk_size=32,
        decode_steps_per_call=2, cpu_kernels="off", enable_model_warmup=False, quantize_kvcache=True,
        speculative_method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, speculative_cost_ratio=0.0,
        lora_input_adapters_path=str(tmp_path), max_loras=1, max_lora_rank=4,
    )
    model = load_model(str(tiny_model_dir), cfg)
    long = [5, 6, 7, 8] * 10  # 40 tokens, repeating: two chunks, and n-grams for the proposals
    asks = [
        (long, SamplingParams(max_tokens=8)),
        ([9, 10, 11, 9, 10, 11, 9], SamplingParams(max_tokens=6, repetition_penalty=1.3)),
        ([12, 13, 14, 15], SamplingParams(max_tokens=6, temperature=1.0, seed=7)),
        ([16, 17, 18, 16, 17], SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=2)),
        ([19, 20, 21, 22, 19, 20], SamplingParams(max_tokens=5, logprobs=2)),
        ([30, 31, 32], SamplingParams(max_tokens=6, grammar=Grammar("json"))),
        ([5, 6, 7, 8] * 3, SamplingParams(max_tokens=6, adapter="adapter")),
        ([5, 6, 7, 8] * 3, SamplingParams(max_tokens=6)),  # the same prompt on the base model
        ([23, 24, 25, 26, 27, 28, 29] * 6, SamplingParams(max_tokens=4, prompt_logprobs=2)),  # echo: scored chunks
    ]
    got = {}
    for ops in (TPU_XLA, RaggedPagedOps(pages_per_block=2, interpret=True)):
        monkeypatch.setattr(engine_module, "select_ops", lambda config, mesh, ops=ops: ops)
        engine = engine_module.Engine(model, cfg.engine)
        assert engine.ops is ops
        orchestrator = Orchestrator(
            engine, engine.load_params(), model.tokenizer, cfg.orchestrator, adapters=make_registry(cfg.lora, model.config)
        ).start()
        try:
            handles = [h for prompt, sampling in asks for h in orchestrator.submit_choices(prompt, sampling)]
            done = [h.result() for h in handles]
            repeat = orchestrator.submit(long, SamplingParams(max_tokens=8)).result()  # its pages cached now
            assert orchestrator.metrics.spec_rounds > 0  # proposals were verified
        finally:
            orchestrator.stop(timeout=60)
        got[ops.name] = [*done, repeat]
    xla, ragged = got["xla-tpu"], got["ragged-tpu"]
    assert [c.token_ids for c in ragged] == [c.token_ids for c in xla]
    assert [c.cached_tokens for c in ragged] == [c.cached_tokens for c in xla] and ragged[-1].cached_tokens == 32
    assert ragged[-1].token_ids == ragged[0].token_ids
    assert ragged[-4].token_ids != ragged[-3].token_ids  # the adapter's rows applied it
    for a, b in zip(ragged[-6].logprobs, xla[-6].logprobs, strict=True):  # the logprobs request
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    scored = ragged[-2].prompt_logprobs  # the prompt's logprobs, its two chunks scored
    assert len(scored) == 42 and scored[0] is None is xla[-2].prompt_logprobs[0]
    for a, b in zip(scored[1:], xla[-2].prompt_logprobs[1:], strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
