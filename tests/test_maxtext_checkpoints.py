"""MaxText's own inference checkpoints, served as they are.

The fixtures under tests/data/maxtext/ were written by MaxText's conversion and quantization code
(tests/data/maxtext/README.md says which versions and commands), from tiny random Llamas whose
Hugging Face twins sit beside them (`hf/`, float32 weights that are exactly bfloat16): transformers
on those is the reference. `llama3` went through MaxText's rotate-half reordering, `llama31` kept
Meta's interleaved q/k pairs (MaxText's Llama 3.1 layout).
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from serving.config import load_config
from tests.cli import call_cli, run_cli
from tests.conftest import DATA, make_hf_tokenizer
from tests.xla_flags import cpu_devices

FIXTURES = DATA / "maxtext"
MODEL_NAME = {"llama3": "llama3-8b", "llama31": "llama3.1-8b"}
# The tiny model as it was described to MaxText (over the named model's preset).
TINY = [
    "override_model_config=true", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2",
    "head_dim=16", "base_mlp_dim=112", "base_num_decoder_layers=2", "vocab_size=320",
]
FLOAT = {
    "llama3-scanned": "llama3/bf16/scanned/0/items",
    "llama3-unscanned": "llama3/bf16/unscanned/checkpoints/0/items",
    "llama31-scanned": "llama31/bf16/scanned/0/items",
    "llama31-unscanned": "llama31/bf16/unscanned/checkpoints/0/items",
    "llama31-linen-unscanned": "llama31/linen_bf16/unscanned/checkpoints/0/items",  # maxtext 0.1.0
}
INT8 = {
    "llama3-int8": "llama3/int8",
    "llama31-int8": "llama31/int8",
    "llama31-int8-f32": "llama31/int8_weight_dtype_float32",  # MaxText's default weight_dtype
    "llama31-linen-int8": "llama31/linen_aqt_int8",  # the guide's era: Flax Linen + AQT (maxtext 0.1.0)
}
LAYOUTS = {
    "llama3-scanned": "bf16-scanned",
    "llama3-unscanned": "bf16-unscanned",
    "llama31-scanned": "bf16-scanned",
    "llama31-unscanned": "bf16-unscanned",
    "llama31-linen-unscanned": "bf16-unscanned",
    "llama3-int8": "int8-nnx",
    "llama31-int8": "int8-nnx",
    "llama31-int8-f32": "int8-nnx",
    "llama31-linen-int8": "int8-linen",
}
IDS = [5, 17, 250, 3, 99, 42, 7, 300, 128, 64, 1, 77]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    return make_hf_tokenizer(tmp_path_factory.mktemp("maxtext-tok"), vocab=300) / "tokenizer.json"


def flags(name: str, tokenizer: Path, *extra: str) -> list[str]:
    variant = name.split("-")[0]
    return [
        f"model_name={MODEL_NAME[variant]}", *TINY, f"tokenizer_path={tokenizer}", "max_target_length=64",
        "max_prefill_predict_length=32", "weight_dtype=float32", "dtype=float32", "cpu_kernels=off", *extra,
    ]


def fixture_path(name: str) -> str:
    return str(FIXTURES / {**FLOAT, **INT8}[name])


def load(name: str, tokenizer: Path, *extra: str):
    from serving.checkpoints.model_source import load_model

    cfg = load_config(None, flags(name, tokenizer, *extra))
    return load_model(fixture_path(name), cfg), cfg


def our_logits(model, ids: list[int]) -> np.ndarray:
    from serving.models import prefill

    tokens = jnp.asarray([ids], jnp.int32)
    logits, _ = prefill(model.params, tokens, jnp.asarray([len(ids)]), model.config)
    return np.asarray(logits[0], np.float32)


@functools.cache
def hf_model(variant: str):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(FIXTURES / variant / "hf"), dtype=torch.float32).eval()


def hf_logits(variant: str, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(variant)(torch.tensor([ids])).logits[0].numpy()


def greedy(step, ids: list[int], count: int) -> list[int]:
    """`count` greedy tokens after `ids`, from a function of the whole sequence to its logits."""
    out = list(ids)
    for _ in range(count):
        out.append(int(np.argmax(step(out)[-1])))
    return out[len(ids) :]


@pytest.mark.parametrize("name", sorted(FLOAT))
def test_a_float_maxtext_checkpoint_gives_transformers_logits_and_tokens(name, tokenizer_file):
    variant = name.split("-")[0]
    model, _ = load(name, tokenizer_file)
    assert model.format == f"maxtext {LAYOUTS[name]}"
    ours, reference = our_logits(model, IDS), hf_logits(variant, IDS)
    assert np.max(np.abs(ours - reference)) <= 1e-4 * np.max(np.abs(reference))
    assert greedy(lambda s: our_logits(model, s), IDS, 8) == greedy(lambda s: hf_logits(variant, s), IDS, 8)


def _raw_leaves(path: str) -> dict[tuple[str, ...], np.ndarray]:
    """Every leaf of an Orbax tree as numpy, read with Orbax alone (not through our loader)."""
    import jax
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    shapes = checkpointer.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shapes)
    tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    out: dict[tuple[str, ...], np.ndarray] = {}

    def visit(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                visit(v, (*prefix, str(k)))
        elif isinstance(node, list | tuple):
            for i, v in enumerate(node):
                visit(v, (*prefix, str(i)))
        elif hasattr(node, "shape"):
            out[prefix] = np.asarray(node)

    visit(tree, ())
    return out


MODULES = {
    "wq": ("self_attention", "query"), "wk": ("self_attention", "key"), "wv": ("self_attention", "value"),
    "wo": ("self_attention", "out"), "w_gate": ("mlp", "wi_0"), "w_up": ("mlp", "wi_1"), "w_down": ("mlp", "wo"),
}


def _maxtext_dequantized(raw: dict, layer: int, module: tuple[str, str]) -> np.ndarray:
    """MaxText's qvalue x scale of one kernel, in MaxText's shape (found wherever its tree puts it)."""
    tail = (f"layers_{layer}", *module, "AqtDotGeneral_0", "qrhs", "frozen")

    def find(part: str) -> np.ndarray:
        hits = [v for k, v in raw.items() if _contains(k, tail) and part in k[-2:]]
        assert len(hits) == 1, (tail, part, [k for k in raw if _contains(k, tail)])
        return hits[0]

    return find("qvalue").astype(np.float32) * find("scale").astype(np.float32)


def _contains(path: tuple[str, ...], run: tuple[str, ...]) -> bool:
    return any(path[i : i + len(run)] == run for i in range(len(path) - len(run) + 1))


@pytest.mark.parametrize("name", sorted(INT8))
def test_an_int8_maxtext_checkpoints_weights_are_maxtexts_qvalue_times_scale_exactly(name, tokenizer_file):
    """No float copy and no requantization: our int8 values x scales are MaxText's, moved into our
    layout (query x sqrt(head_dim) = 4 exactly, Llama 3.1's pairs reordered, heads flattened)."""
    from serving.models import QuantizedWeight

    model, _ = load(name, tokenizer_file)
    assert model.format == f"maxtext {LAYOUTS[name]}"
    raw = _raw_leaves(fixture_path(name))
    cfg = model.config
    for ours_name, module in MODULES.items():
        ours = model.params["layers"][ours_name]
        assert isinstance(ours, QuantizedWeight) and ours.values.dtype == jnp.int8 and ours.activations
        for layer in range(cfg.num_layers):
            theirs = _maxtext_dequantized(raw, layer, module)
            if ours_name == "wq":
                theirs = theirs * 4.0  # sqrt(head_dim): MaxText's conversion folded 1/4 in
            if ours_name in ("wq", "wk") and name.startswith("llama31"):
                theirs = np.concatenate([theirs[..., 0::2], theirs[..., 1::2]], axis=-1)
            dequantized = np.asarray(ours.values[layer], np.float32) * np.asarray(ours.scales[layer])
            assert np.array_equal(dequantized, theirs.reshape(dequantized.shape)), (ours_name, layer)
    assert not isinstance(model.params["embed"], QuantizedWeight)  # MaxText keeps them float
    assert not isinstance(model.params["lm_head"], QuantizedWeight)


@pytest.mark.parametrize("name", sorted(INT8))
def test_an_int8_maxtext_checkpoint_served_w8a8_is_as_close_to_float_as_our_own_w8a8(name, tokenizer_file, tmp_path):
    """quantization=int8 (implied by the checkpoint) is W8A8: MaxText's int8 weights with activations
    quantized per token. Against transformers in float32 it stays within the error of our own W8A8
    path on the same float weights (x 1.5: AQT rounds its scales as absmax / 127.5, we as / 127)."""
    from serving.checkpoints.model_source import load_model

    variant = name.split("-")[0]
    model, cfg = load(name, tokenizer_file)
    assert cfg.quantization == "" and model.params["layers"]["wq"].activations  # implied on load
    reference = hf_logits(variant, IDS)
    hf_dir = tmp_path / "hf"
    shutil.copytree(FIXTURES / variant / "hf", hf_dir)
    shutil.copy(tokenizer_file, hf_dir / "tokenizer.json")
    ours_w8a8 = load_model(str(hf_dir), cfg.model_copy(update={"quantization": "int8"}))
    tolerance = np.max(np.abs(our_logits(ours_w8a8, IDS) - reference))
    error = np.max(np.abs(our_logits(model, IDS) - reference))
    assert 0 < error <= 1.5 * tolerance, (error, tolerance)


@pytest.mark.parametrize("variant", ["llama3", "llama31"])
def test_served_w8a8_is_as_close_to_float_as_maxtexts_own_int8_forward(variant, tokenizer_file):
    """MaxText's own forward on its int8 checkpoint (maxtext_int8_logits.npz, 64 tokens; bfloat16
    activations, AQT's per-token activation quantization) is 0.20 (llama3) / 0.29 (llama31) from
    float at most; ours on the same checkpoint is no further, and picks the same top token almost
    everywhere (measured 1.00 / 0.95: one ulp of bfloat16 in MaxText's activations flips a near tie)."""
    saved = np.load(FIXTURES / variant / "maxtext_int8_logits.npz")
    ids, theirs = saved["tokens"][0].tolist(), saved["maxtext_int8_logits"][0]
    model, _ = load(f"{variant}-int8", tokenizer_file)
    ours, reference = our_logits(model, ids), hf_logits(variant, ids)
    assert np.max(np.abs(ours - reference)) <= 1.05 * np.max(np.abs(theirs - reference))
    assert np.max(np.abs(ours - theirs)) <= 0.25
    assert np.mean(ours.argmax(-1) == theirs.argmax(-1)) >= 0.9


def test_generate_and_inspect_on_a_maxtext_checkpoint(tokenizer_file):
    path = fixture_path("llama31-int8")
    inspected = call_cli("inspect", path, "--json")
    assert inspected.returncode == 0, inspected.stderr
    info = json.loads(inspected.stdout)
    assert info["format"] == "maxtext int8-nnx" and info["scanned"] is False and info["num_layers"] == 2
    assert info["int8_entries"] == ["w_down", "w_gate", "w_up", "wk", "wo", "wq", "wv"]
    assert info["bytes"] == sum(
        math.prod(t["shape"]) * {"int8": 1, "bfloat16": 2}.get(t["dtype"], 4) for t in info["tensors"].values()
    )
    assert "int8-nnx" in call_cli("inspect", path).stdout
    verified = call_cli("verify", path)
    assert verified.returncode == 0 and "all" in verified.stdout, verified.stderr
    result = run_cli("generate", path, "--prompt", "the keeper", "--max-tokens", "6", "--json",
                     *flags("llama31-int8", tokenizer_file))
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert out["quantization"] == "int8" and len(out["token_ids"]) == 6


def test_a_checkpoint_that_does_not_match_the_model_is_refused_naming_the_path(tokenizer_file):
    path = fixture_path("llama3-unscanned")
    wider = [f for f in flags("llama3-unscanned", tokenizer_file) if not f.startswith("base_mlp_dim=")]
    result = run_cli("generate", path, "--prompt", "x", *wider, "base_mlp_dim=128")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "mlp/wi_0/kernel" in result.stderr and "(64, 112)" in result.stderr, result.stderr
    result = run_cli("generate", path, "--prompt", "x", *flags("llama3-unscanned", tokenizer_file)[1:],
                     "model_name=llama3-8b", "base_num_decoder_layers=3")
    assert result.returncode == 2 and "layers_2" in result.stderr, result.stderr


def test_a_truncated_checkpoint_is_refused_naming_the_tensor(tmp_path, tokenizer_file):
    broken = tmp_path / "int8"
    shutil.copytree(fixture_path("llama3-int8"), broken)
    data = max((p for p in broken.rglob("*") if p.is_file() and "d" in p.parent.name), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    verified = call_cli("verify", str(broken))
    assert verified.returncode == 2 and "BAD " in verified.stdout, verified.stdout + verified.stderr
    result = run_cli("generate", str(broken), "--prompt", "x", *flags("llama3-int8", tokenizer_file))
    # (Orbax's own threads may print their closed event loops' tracebacks as the process exits.)
    error = next(line for line in result.stderr.splitlines() if line.startswith("pathserve generate: error:"))
    assert result.returncode == 2 and "cannot restore the MaxText checkpoint" in error, result.stderr[-2000:]
    assert str(broken) in error and ("decoder." in error or "token_embedder." in error), error  # the tensor


def test_convert_a_maxtext_checkpoint_into_ours(tmp_path, tokenizer_file):
    """convert streams the MaxText entries into our layout: the same logits as serving it directly."""
    import yaml

    from serving.checkpoints.model_source import load_model

    model, cfg = load("llama31-scanned", tokenizer_file)
    described = tmp_path / "model.yml"
    described.write_text(yaml.safe_dump(model.config.model_dump()))
    out = tmp_path / "converted"
    result = call_cli("convert", fixture_path("llama31-scanned"), str(out), "--model-config", str(described),
                     "--dtype", "float32", "--quiet")
    assert result.returncode == 0, result.stderr[-2000:]
    converted = load_model(str(out), cfg)
    np.testing.assert_array_equal(our_logits(converted, IDS), our_logits(model, IDS))


def test_a_maxtext_checkpoint_in_a_bucket_serves_the_same_tokens(tmp_path, tokenizer_file):
    """gs:// (fake-gcs-server): inspect, and generate the same tokens as from the local copy."""
    import os

    from tests.gcs_emulator import create_bucket, emulator_env, fake_gcs_server

    path = fixture_path("llama31-int8")
    args = ("--prompt", "the keeper", "--max-tokens", "6", "--json", *flags("llama31-int8", tokenizer_file))
    with fake_gcs_server(tmp_path / "gcs") as url:
        create_bucket(url, "maxtext-fixtures")
        env = {**os.environ, **emulator_env(url)}
        upload = (
            "import gcsfs, sys; fs = gcsfs.GCSFileSystem(endpoint_url=sys.argv[1], token='anon'); "
            "fs.put(sys.argv[2], 'maxtext-fixtures/int8', recursive=True)"
        )
        subprocess.run([sys.executable, "-c", upload, url, path], env=env, check=True, timeout=120)

        def cli(*a: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "serving.cli", *a], env=env, capture_output=True,
                                  text=True, timeout=300)

        inspected = cli("inspect", "gs://maxtext-fixtures/int8", "--json")
        assert inspected.returncode == 0, inspected.stderr[-2000:]
        assert json.loads(inspected.stdout)["format"] == "maxtext int8-nnx"
        from_bucket = cli("generate", "gs://maxtext-fixtures/int8", *args)
    from_disk = run_cli("generate", path, *args)
    assert from_bucket.returncode == 0, from_bucket.stderr[-2000:]
    assert json.loads(from_bucket.stdout) == json.loads(from_disk.stdout)


def test_serve_says_which_maxtext_layout_it_serves(tokenizer_file):
    """The guide's deployment shape: a MaxText int8 checkpoint by load_parameters_path, no other
    flag about it; the ready line names the layout and the implied W8A8 quantization."""
    import httpx

    from tests.server_process import ServerProcess

    server = ServerProcess.pathserve(
        f"load_parameters_path={fixture_path('llama31-linen-int8')}", *flags("llama31-linen-int8", tokenizer_file),
        "enable_model_warmup=false", "per_device_batch_size=2",
    )
    try:
        server.wait_ready()
        reply = httpx.post(f"{server.url}/generate", json={"prompt": "the keeper", "max_tokens": 4}, timeout=120)
        assert reply.status_code == 200 and isinstance(reply.json()["response"], str)
    finally:
        assert server.stop() == 0, server.output()
    ready = [line for line in server.output().splitlines() if "ready:" in line]
    assert ready and "(maxtext int8-linen)" in ready[0] and "quantization=int8," in ready[0], server.output()


def test_one_controller_over_8_devices_restores_onto_the_mesh_and_generates_one_devices_tokens(tokenizer_file):
    """As on a Pathways slice (one process, every chip): each array goes straight onto its shards
    (the whole model never sits on one device), and the tokens equal one device's."""
    import os

    path = fixture_path("llama31-int8")
    args = ("--prompt", "the keeper", "--max-tokens", "6", "--json", *flags("llama31-int8", tokenizer_file))
    env = {**os.environ, **cpu_devices(8)}
    mesh = ("ici_tensor_parallelism=4", "ici_autoregressive_parallelism=2", "per_device_batch_size=1")
    sharded = subprocess.run([sys.executable, "-m", "serving.cli", "generate", path, *args, *mesh],
                             capture_output=True, text=True, timeout=300, env=env)
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    assert "each array restored onto its shards over 8 devices" in sharded.stderr
    one = run_cli("generate", path, *args)
    assert json.loads(sharded.stdout)["token_ids"] == json.loads(one.stdout)["token_ids"]


@pytest.mark.parametrize("server", ["MaxtextInterleavedServer", "ExperimentalMaxtextDisaggregatedServer_1"])
def test_serving_keeps_one_copy_of_the_weights(tokenizer_file, server):
    """scan_layers=false (the guide's flag) places every layer's own arrays, new ones: the loaded,
    stacked params must not stay alive beside them (twice the weights in device memory). A
    disaggregated server (one device each side) holds one copy per side and nothing loaded."""
    code = """
import gc, json, sys
import jax
from serving.config import load_config
from serving.launch import bring_up
cfg = load_config(None, sys.argv[2:])
up = bring_up(cfg, sys.argv[1])
model, engine, params, prefill = up.model, up.engine, up.params, up.prefill
gc.collect()
placed = sum(a.nbytes for a in jax.tree.leaves(params))
if prefill is not None:
    placed += sum(a.nbytes for a in jax.tree.leaves(prefill.params))
live = sum(a.nbytes for a in jax.live_arrays())
loaded = len(engine.model.params) + (0 if prefill is None else len(prefill.engine.model.params))
print(json.dumps({"placed": placed, "live": live, "loaded": loaded, "sides": 1 + (prefill is not None)}))
"""
    args = [*flags("llama31-int8", tokenizer_file), "scan_layers=false", "enable_model_warmup=false",
            f"inference_server={server}"]
    env = dict(os.environ)
    if "Disaggregated" in server:  # one CPU device each side
        env.update(cpu_devices(2))
    result = subprocess.run([sys.executable, "-c", code, fixture_path("llama31-int8"), *args],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["sides"] == (2 if "Disaggregated" in server else 1)
    assert out["placed"] <= out["live"] <= 1.1 * out["placed"], out
    assert out["loaded"] == 0
