"""loadtest.tpu_probe's measurements run on the tiny model (on the CPU: the figures mean nothing
here; on the chip they are the issue's prefill and mixed-step targets), and its reading of a
device trace (a made-up one in the perfetto JSON jax.profiler writes)."""

from __future__ import annotations

import gzip
import json

import pytest

pytest.importorskip("jax")


def test_prefill_rates_and_the_mixed_step_measure_on_the_tiny_model(tiny_model_dir):
    from loadtest.tpu_probe import mixed_rate, prefill_flops, prefill_rates
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine.engine import Engine

    cfg = ServingConfig(
        per_device_batch_size=4, max_prefill_predict_length=64, max_target_length=128, prefill_chunk_size=32,
        max_prefill_batch=4, prefill_batch_tokens=64, decode_steps_per_call=2, cpu_kernels="off", enable_model_warmup=False,
    )
    model = load_model(str(tiny_model_dir), cfg)
    engine = Engine(model, cfg.engine)
    params = engine.load_params()
    prompt = list(range(5, 17))
    rates = prefill_rates(engine, params, prompt)
    assert (rates["whole_tokens"], rates["chunk_rows"], rates["chunk_tokens"]) == (64, 2, 32)  # 2 x 32 within 64
    assert rates["whole_s"] > 0 and rates["chunks_flop_per_s"] > 0
    assert prefill_flops(model.config, 2, 0) == 2 * prefill_flops(model.config, 1, 0)  # matmuls: linear in tokens
    mixed = mixed_rate(engine, params, prompt, 8, 6)
    assert mixed["batch"] == 3  # one slot left for the chunks
    assert mixed["calls"] >= 3 and mixed["mixed_tok_s"] > 0 and mixed["alone_tok_s"] > 0



def test_the_engine_alone_beside_an_executor_holds_one_kv_pool(tiny_model_dir):
    """engine_alone given the offline driver's executor lets its decode state go meanwhile and
    makes it anew (the TPU profile's pool fills the chip: two did not fit, RESOURCE_EXHAUSTED), and
    the executor drives requests after it."""
    from loadtest.tpu_probe import engine_alone, offline
    from serving.checkpoints.model_source import load_model
    from serving.config import ServingConfig
    from serving.engine.engine import Engine
    from serving.orchestrator.executor import Executor

    cfg = ServingConfig(
        per_device_batch_size=2, max_prefill_predict_length=32, max_target_length=64, cpu_kernels="off",
        enable_model_warmup=False,
    )
    engine = Engine(load_model(str(tiny_model_dir), cfg), cfg.engine)
    params = engine.load_params()
    executor = Executor(engine, params)
    before = executor.state
    assert engine_alone(engine, params, list(range(5, 17)), 2, 4, executor) > 0
    assert executor.state is not before and executor.state is not None
    assert offline(engine, params, executor, list(range(5, 17)), 2, 4) > 0


def test_a_sweep_loads_each_configs_own_weights(tiny_model_dir, tmp_path):
    """A sweep of int8w beside bfloat16 runs each on its own weights: the first config's load served
    every config once (a chip's 'bfloat16' row measured int8w weights)."""
    import json

    from loadtest.tpu_probe import sweep

    common = "per_device_batch_size=2 max_prefill_predict_length=32 max_target_length=64 enable_model_warmup=false cpu_kernels=off"
    sweep(str(tiny_model_dir), [f"quantization=int8w {common}", common], [1], 2, tmp_path, prompt_tokens=16)
    int8w, plain = json.loads((tmp_path / "sweep.json").read_text())
    assert "error" not in int8w and "error" not in plain
    assert (int8w["quantization"], plain["quantization"]) == ("int8w", "none")
    # the generate program's arguments hold the weights: int8 values are a quarter of float32's
    assert int8w["memory"]["argument_size_in_bytes"] < plain["memory"]["argument_size_in_bytes"]


def _trace(tmp_path, events):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "perfetto_trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    return tmp_path


def test_device_ops_sums_by_op_and_lays_out_the_device_timeline(tmp_path):
    from loadtest.tpu_probe import device_ops

    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "XLA Modules"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
    ]
    calls = [  # two generate calls and a prefill between them, 1 ms idle before the prefill (µs)
        {"ph": "X", "pid": 1, "tid": 7, "name": "jit_generate", "ts": 1000, "dur": 4000},
        {"ph": "X", "pid": 1, "tid": 7, "name": "jit_prefill", "ts": 6000, "dur": 2000},
        {"ph": "X", "pid": 1, "tid": 7, "name": "jit_generate", "ts": 8000, "dur": 4000},
        {"ph": "X", "pid": 1, "tid": 8, "name": "fusion.1", "ts": 1000, "dur": 3000},
        {"ph": "X", "pid": 2, "tid": 9, "name": "host work", "ts": 0, "dur": 50000},  # not the device's
    ]
    report = device_ops(_trace(tmp_path, meta + calls))
    assert report["XLA Modules"]["total_ms"] == 10.0
    assert report["XLA Modules"]["top"][0] == ("jit_generate", 8.0, 2)
    assert report["XLA Ops"]["top"] == [("fusion.1", 3.0, 1)]
    assert report["span_ms"] == 11.0 and report["busy_ms"] == 10.0
    assert report["timeline"] == [(0.0, 4.0, "jit_generate"), (5.0, 2.0, "jit_prefill"), (7.0, 4.0, "jit_generate")]
    assert "host work" not in json.dumps(report)
