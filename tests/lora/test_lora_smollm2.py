"""The real SmolLM2-135M with three random PEFT adapters: logits equal transformers + peft
(unmerged) in one mixed batch; the served greedy tokens (default config: the CPU kernels' packed
weights where they run) equal peft's, adapters batched with the base model; with int8 weights, the
adapters' logits agree with float peft as closely as our int8 path agrees with float."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.config import ServingConfig
from serving.kernels import library
from serving.kernels.backend import CpuKernelOps
from serving.kernels.packing import pack_for_cpu_kernels
from serving.lora.peft import read_adapter
from serving.lora.stack import init_stack, lora_batch, write_slot
from serving.models import prefill
from serving.models.quantization import quantize_params
from tests.conftest import DATA
from tests.lora.adapters import ADAPTERS, make_adapters, peft_model, reference_greedy, reference_logits

RTOL = 1e-4  # of the largest logit
MAX_TOKENS = 8
PROMPTS = ["The lighthouse keeper opened the door and", "Three things every gardener knows:"]
NAMES = [a[0] for a in ADAPTERS]


@pytest.fixture(scope="module")
def adapters(smollm2_path, tmp_path_factory):
    return make_adapters(smollm2_path, tmp_path_factory.mktemp("smollm2-adapters"), std=0.03)


@pytest.fixture(scope="module")
def references(smollm2_path, adapters):
    return {name: peft_model(smollm2_path, adapters[name] if name else None) for name in [*NAMES, None]}


def _with_adapters(params: dict, cfg, adapters, dtype=jnp.float32) -> dict:
    params = dict(params)
    params["lora"] = init_stack(cfg, max_loras=3, max_rank=16, dtype=dtype, sharding=None)
    for slot, name in enumerate(NAMES, start=1):
        write_slot(params, slot, read_adapter(str(adapters[name]), cfg, max_rank=16))
    return params


def test_mixed_batch_logits_equal_peft_unmerged(smollm2, adapters, references):
    params = _with_adapters(smollm2.params, smollm2.config, adapters)
    ids = smollm2.tokenizer.encode_prompt(PROMPTS[0])
    rows = [*NAMES, None]
    tokens = jnp.asarray([ids] * len(rows))
    slots = jnp.array([1, 2, 3, 0], jnp.int32)
    logits, _ = prefill(params, tokens, jnp.full((len(rows),), len(ids)), smollm2.config, lora=lora_batch(params, slots))
    base = reference_logits(references[None], ids)
    for row, name in enumerate(rows):
        expected = reference_logits(references[name], ids)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(np.asarray(logits[row]), expected, atol=RTOL * scale, rtol=0, err_msg=str(name))
        if name is not None:
            assert np.abs(expected - base).max() > 100 * RTOL * scale


@pytest.mark.parametrize("mode", ["weights", "kernel"])
def test_int8_weights_with_adapters_agree_with_float_peft_as_int8_does(smollm2, adapters, references, mode):
    """tests/test_quantization.py's bound for int8 weights against float: top-1 agreement >= 90%
    and perplexity within +2% over an English text, here with each adapter against float peft."""
    if mode == "kernel" and not library.status().available:
        pytest.skip(f"the CPU kernels do not run here: {library.status().detail}")
    ids = smollm2.tokenizer.encode_prompt((DATA / "english.txt").read_text())[:128]
    quantized = quantize_params(smollm2.params)
    if mode == "kernel":
        quantized = pack_for_cpu_kernels(quantized)
    params = _with_adapters(quantized, smollm2.config, adapters)
    ops = CpuKernelOps() if mode == "kernel" else None
    tokens = jnp.asarray([ids] * 3)
    extra = {} if ops is None else {"ops": ops}
    logits, _ = prefill(
        params, tokens, jnp.full((3,), len(ids)), smollm2.config, lora=lora_batch(params, jnp.array([1, 2, 3])), **extra
    )
    for row, name in enumerate(NAMES):
        expected = reference_logits(references[name], ids)
        ours = np.asarray(logits[row])
        assert np.mean(ours.argmax(-1) == expected.argmax(-1)) >= 0.9, name

        def nll(x):
            logprobs = jax.nn.log_softmax(jnp.asarray(x[:-1]), axis=-1)
            return -float(jnp.mean(jnp.take_along_axis(logprobs, jnp.asarray(ids[1:])[:, None], axis=-1)))

        assert np.exp(nll(ours)) <= np.exp(nll(expected)) * 1.02, name


@pytest.mark.slow  # peft's batched reference on SmolLM2 (docs/development.md)
def test_served_greedy_tokens_equal_peft_batched_with_the_base_model(smollm2_path, adapters, references, tmp_path):
    from serving.checkpoints.model_source import load_model
    from serving.engine.engine import Engine
    from serving.lora.serving import make_registry
    from serving.orchestrator import Orchestrator
    from serving.request import SamplingParams

    root = tmp_path / "adapters"
    root.mkdir()
    for name in NAMES:
        (root / name).symlink_to(adapters[name])
    cfg = ServingConfig(
        per_device_batch_size=8, max_prefill_predict_length=64, max_target_length=128,
        lora_input_adapters_path=str(root), max_loras=3,
    )
    model = load_model(str(smollm2_path), cfg)
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    registry = make_registry(cfg.lora, model.config)
    orchestrator = Orchestrator(engine, params, model.tokenizer, cfg.orchestrator, adapters=registry).start()
    try:
        jobs = [(PROMPTS[0], name) for name in [*NAMES, None]] + [(PROMPTS[1], NAMES[1])]
        ids = {p: model.tokenizer.encode_prompt(p) for p in PROMPTS}
        handles = [orchestrator.submit(ids[p], SamplingParams(max_tokens=MAX_TOKENS, adapter=n)) for p, n in jobs]
        vocab = model.tokenizer.vocab_size
        for (prompt, name), handle in zip(jobs, handles, strict=True):
            expected = reference_greedy(references[name], ids[prompt], MAX_TOKENS, vocab)
            assert handle.result().token_ids == expected, (prompt, name, engine.ops.name)
    finally:
        orchestrator.stop(timeout=30)
