"""The weight-only int8 matmul kernel for TPU (serving.kernels.int8_matmul), in Pallas' interpret
mode on the CPU: x @ (values * scales) against float64, a layer of a stack read by its index, the
shapes it serves; and an engine whose TPU ops take it gives the greedy tokens and logits of XLA's
int8w matmuls, its layer loop's weights read in place (compiled for a v5e by Mosaic on a CPU host
as well: docs/tpu.md)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.kernels.int8_matmul import (
    BLOCK_BYTES,
    MAX_ROWS,
    VMEM_BUDGET,
    Int8MatmulKernel,
    blocks,
    int8_matmul,
    vmem_bytes,
)


def _weights(rng, layers: int, k: int, n: int):
    values = rng.integers(-127, 128, (layers, k, n)).astype(np.int8)
    scales = (rng.random((layers, 1, n)) * 0.01 + 0.001).astype(np.float32)
    return values, scales


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_the_kernel_multiplies_by_the_dequantized_weight_of_the_layer_asked(dtype, rows):
    rng = np.random.default_rng(rows)
    k, n = 512, 384  # blocks of 512 x 128: three column blocks, one of K
    values, scales = _weights(rng, 3, k, n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    for layer in (0, 2):
        got = int8_matmul(jnp.asarray(x, dtype), jnp.asarray(values), jnp.asarray(scales), layer, interpret=True)
        want = np.asarray(jnp.asarray(x, dtype), np.float64) @ (values[layer].astype(np.float64) * scales[layer])
        assert got.shape == (rows, n) and got.dtype == dtype
        tolerance = 1e-5 if dtype == jnp.float32 else 1e-2  # bfloat16: x's and the result's rounding
        assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= tolerance * np.max(np.abs(want))
    one = int8_matmul(  # an unstacked weight, x with leading dims
        jnp.asarray(x[None], dtype), jnp.asarray(values[1]), jnp.asarray(scales[1]), interpret=True
    )
    assert one.shape == (1, rows, n)
    np.testing.assert_allclose(
        np.asarray(one[0], np.float64), np.asarray(int8_matmul(jnp.asarray(x, dtype), *map(jnp.asarray, (values, scales)), 1, interpret=True), np.float64)
    )


def test_a_transposed_weight_is_an_embedding_table_as_the_lm_head():
    """values [N, K] (a tied embedding [vocab, embed]), its per-row scales the outputs'."""
    rng = np.random.default_rng(1)
    k, n = 256, 640
    table = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scales = (rng.random((n, 1)) * 0.01 + 0.001).astype(np.float32)
    x = rng.standard_normal((3, k)).astype(np.float32)
    kernel = Int8MatmulKernel(interpret=True)
    assert kernel.serves(jnp.asarray(x), jnp.asarray(table), transposed=True)
    assert not kernel.serves(jnp.asarray(x), jnp.asarray(table))  # [640, 256] read as [K, N]: K differs
    got = kernel(jnp.asarray(x), jnp.asarray(table), jnp.asarray(scales.reshape(1, n)), transposed=True)
    want = x.astype(np.float64) @ (table.astype(np.float64) * scales).T
    assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= 1e-5 * np.max(np.abs(want))


def test_a_tied_int8_heads_logits_through_the_kernel_are_float32_as_xlas():
    """The head's logits are float32 whatever x's dtype (XLA's tied head sums and scales in float32
    and keeps them so): the kernel's output in float32 too, not rounded to bfloat16 first."""
    from serving.models.ops import TpuXlaOps
    from serving.models.quantization import QuantizedWeight

    rng = np.random.default_rng(2)
    table = QuantizedWeight(
        jnp.asarray(rng.integers(-127, 128, (640, 256)), jnp.int8), jnp.asarray(rng.random((640, 1)) * 0.01 + 0.001, jnp.float32)
    )
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    got = TpuXlaOps(Int8MatmulKernel(interpret=True)).tied_head(x, table)
    want = TpuXlaOps().tied_head(x, table)
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_the_blocks_chosen_fit_the_vmem_budget_at_every_row_count_and_dtype():
    """Every block `blocks` picks for the 1B and 8B shapes' weights (and heads) fits VMEM_BUDGET with
    its rows (up to MAX_ROWS) in x's dtype, float32 outputs (the head's) included."""
    weights = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (2048, 128256),
               (4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]
    for k, n in weights:
        for rows in (1, 16, 64, 128, 256):
            for x_bytes, out_bytes in ((2, 2), (2, 4), (4, 4)):
                found = blocks(k, n, rows, x_bytes, out_bytes)
                assert found is not None, (k, n, rows, x_bytes)
                assert vmem_bytes(rows, *found, x_bytes, out_bytes) <= VMEM_BUDGET


def test_the_kernel_sums_over_several_blocks_of_k():
    rng = np.random.default_rng(0)
    k, n = 4096, 1024  # 2 MiB blocks: 2048 x 1024, two of them along K
    assert blocks(k, n) == (2048, 1024)
    values, scales = _weights(rng, 1, k, n)
    x = rng.standard_normal((2, k)).astype(np.float32)
    got = np.asarray(int8_matmul(jnp.asarray(x), jnp.asarray(values), jnp.asarray(scales), 0, interpret=True), np.float64)
    want = x.astype(np.float64) @ (values[0].astype(np.float64) * scales[0])
    assert np.max(np.abs(got - want)) <= 1e-5 * np.max(np.abs(want))


def test_blocks_serve_whole_tiles_of_small_calls_only():
    assert blocks(2048, 8192) == (1024, 2048)  # 2 MiB of int8 a block at most
    assert all(bk * bn <= BLOCK_BYTES for bk, bn in (blocks(2048, 8192), blocks(14336, 4096), blocks(4096, 128256)))
    assert blocks(4096, 128256) == (2048, 256)  # Llama 3's vocabulary: 501 blocks of 256
    assert blocks(64, 256) is None and blocks(256, 192) is None  # no side of 128 or more divides them
    assert blocks(2048, 2048, MAX_ROWS) is not None and blocks(2048, 2048, MAX_ROWS + 1) is None  # a prefill: XLA's
    kernel = Int8MatmulKernel(interpret=True)
    assert kernel.serves(jnp.zeros((4, 2048)), jnp.zeros((16, 2048, 512), jnp.int8))
    assert not kernel.serves(jnp.zeros((4, 1024)), jnp.zeros((2048, 512), jnp.int8))  # K differs
    with pytest.raises(ValueError, match="no block"):
        int8_matmul(jnp.zeros((1, 64)), jnp.zeros((64, 256), jnp.int8), jnp.ones((1, 256)), interpret=True)


class _Counting(Int8MatmulKernel):
    """The kernel in interpret mode, counting the matmuls it was handed (at trace time)."""

    def __init__(self):
        super().__init__(interpret=True)
        self.ranks: list[int] = []  # of the weights handed over

    def __call__(self, x, values, scales, layer=0, transposed=False, out_dtype=None):
        self.ranks.append(values.ndim)
        self.transposed = getattr(self, "transposed", False) or transposed
        return super().__call__(x, values, scales, layer, transposed, out_dtype)


def kernel_sized_model(out, tokenizer_dir, tied: bool):
    """A tiny random Llama whose matmuls the kernel's blocks divide (embed 128, mlp 256, a
    vocabulary of 384; k and v's 64 columns stay XLA's), written with numpy (a TPU VM has no torch)."""
    from loadtest.random_model import write_random_model
    from serving.config import load_model_config

    shape = load_model_config("llama3.2-1b").model_copy(update={
        "name": "int8-kernel-test", "num_layers": 2, "embed_dim": 128, "num_heads": 2, "num_kv_heads": 1,
        "head_dim": 64, "mlp_dim": 256, "vocab_size": 384, "tie_embeddings": tied, "rope_scaling": None,
    })
    return write_random_model(out, shape, tokenizer_dir, dtype="float32")


@pytest.mark.parametrize("tied", [False, True])
def test_an_engine_whose_tpu_ops_take_the_kernel_gives_xlas_int8w_tokens(tmp_path, tiny_model_dir, monkeypatch, tied):
    """int8w weights of dims the kernel's blocks divide (128 and 256; k and v's 64 stay XLA's), on
    TpuXlaOps over the lanes pool, with the kernel and without: the same greedy tokens of a batch
    of prompts (prefill in chunks, decode steps), a prompt's logits within float32's rounding; the
    head an int8 lm_head, or the tied int8 embedding read transposed (Llama 3.2's)."""
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine import engine as engine_module
    from serving.models import prefill
    from serving.models.ops import TpuXlaOps
    from serving.orchestrator.offline import run_to_completion
    from serving.request import SamplingParams

    model_dir = kernel_sized_model(tmp_path / "model", tiny_model_dir, tied)
    cfg = ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=32, max_target_length=64, prefill_chunk_size=16,
        decode_steps_per_call=2, cpu_kernels="off", enable_model_warmup=False, quantization="int8w",
    )
    model = load_model(str(model_dir), cfg)
    requests = [(list(range(3, 3 + n)), SamplingParams(max_tokens=6)) for n in (5, 20, 9)]
    got, logits, counting = {}, {}, _Counting()
    tokens = jnp.asarray([list(range(3, 23))], jnp.int32)
    for name, ops in (("xla", TpuXlaOps()), ("kernel", TpuXlaOps(counting))):
        monkeypatch.setattr(engine_module, "select_ops", lambda config, mesh, ops=ops: ops)
        engine = engine_module.Engine(model, cfg.engine)
        params = engine.load_params()
        got[name] = run_to_completion(engine, params, requests)
        logits[name] = np.asarray(prefill(params, tokens, jnp.asarray([20]), model.config, ops=ops)[0])
    # wq, wo, w_gate, w_up, w_down as their stacks at the layer's index (no slice copied out), the head whole
    assert set(counting.ranks) == {2, 3} and counting.transposed == tied
    assert [r.token_ids for r in got["kernel"]] == [r.token_ids for r in got["xla"]]
    assert np.max(np.abs(logits["kernel"] - logits["xla"])) <= 1e-5 * np.max(np.abs(logits["xla"]))


def test_the_kernel_is_selected_on_one_tpu_with_int8w_and_said_to_do_nothing_elsewhere(caplog):
    from types import SimpleNamespace

    from serving.kernels import backend
    from serving.kernels.ragged_paged import RaggedPagedOps
    from serving.models.ops import TPU_XLA, TpuXlaOps

    tpu = SimpleNamespace(platform="tpu")
    ops = backend.select("auto", "int8w", "bfloat16", [tpu], int8_matmul_kernel=True)
    assert type(ops) is TpuXlaOps and isinstance(ops.int8_matmul, Int8MatmulKernel)
    ragged = backend.select("auto", "int8w", "bfloat16", [tpu], ragged_pages=8, int8_matmul_kernel=True)
    assert isinstance(ragged, RaggedPagedOps) and isinstance(ragged.int8_matmul, Int8MatmulKernel)
    assert "Pallas kernel" in ragged.describe()
    assert backend.select("auto", "int8w", "bfloat16", [tpu]) is TPU_XLA  # off by default
    for quantization, devices in (("", [tpu]), ("int8", [tpu]), ("int8w", [tpu, tpu]), ("int8w", jax.devices()[:1])):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            ops = backend.select("off", quantization, "bfloat16", devices, int8_matmul_kernel=True)
        assert getattr(ops, "int8_matmul", None) is None
        assert "int8_matmul_kernel: the int8 matmul kernel runs int8w weights on one TPU" in caplog.text
