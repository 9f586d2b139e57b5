"""MaxText's meaning of the mesh axes on 16 virtual CPU devices: every params and cache leaf's
PartitionSpec, greedy tokens equal to one device's (prefill, insert, multi-step generate), and
`deploy plan`'s bytes per chip equal to what each device really holds.

One subprocess runs every case (tests/sharding_run.py): the device count is fixed when JAX starts.
Two tiny random Llamas: 16 heads with 8 kv heads (kv heads divide tensor 8, not tensor 16), and with
2 kv heads (split over autoregressive alone, replicated over tensor). MaxText base.yml's rules by
default; the 8-kv-head model also under the Llama 3.1 405B recipe's own rules (the JetStream guide's
file at its old path, and today's), read from the recipe file as `pathserve serve` reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serving.deploy.config import load_deployment
from serving.deploy.plan import make_plan
from tests.conftest import make_hf_tokenizer
from tests.deploy.conftest import CONFIGS
from tests.xla_flags import cpu_devices

pytestmark = pytest.mark.slow  # one 16-device process runs every case (docs/development.md)

REPO = Path(__file__).resolve().parents[1]
MODEL = """name: {name}
num_layers: 2
embed_dim: 64
num_heads: 16
num_kv_heads: {kv_heads}
head_dim: 8
mlp_dim: 128
vocab_size: 320
rope_theta: 10000.0
norm_eps: 1.0e-5
max_position: 512
"""
ONE = {"fsdp": 1, "autoregressive": 1, "tensor": 1}
AR2_T8 = {"fsdp": 1, "autoregressive": 2, "tensor": 8}
F2_AR2_T4 = {"fsdp": 2, "autoregressive": 2, "tensor": 4}
T16 = {"fsdp": 1, "autoregressive": 1, "tensor": 16}
# The recipe files (configs/maxtext/): the guide's old path and today's.
GUIDE_RECIPE = "MaxText/configs/v5e/inference/llama3_405b_v5e-64.yml"
TODAY_RECIPE = "src/maxtext/configs/inference/multihost/interleaved/llama3_405b_v5e-64.yml"
CASES = [
    {"model": "tiny-kv8", "mesh": ONE},
    {"model": "tiny-kv8", "mesh": AR2_T8, "maxtext": GUIDE_RECIPE},
    {"model": "tiny-kv8", "mesh": AR2_T8, "maxtext": TODAY_RECIPE},
    {"model": "tiny-kv8", "mesh": AR2_T8},
    {"model": "tiny-kv8", "mesh": F2_AR2_T4},
    {"model": "tiny-kv8", "mesh": T16, "generate": False},  # placement and bytes only
    {"model": "tiny-kv2", "mesh": ONE},
    {"model": "tiny-kv2", "mesh": AR2_T8},
]


def flags(mesh: dict[str, int]) -> dict:
    """The engine's flags on `mesh`: 16 slots on any mesh, int8 weights and KV, layers unrolled."""
    devices = mesh["fsdp"] * mesh["autoregressive"] * mesh["tensor"]
    return dict(
        ici_fsdp_parallelism=mesh["fsdp"],
        ici_autoregressive_parallelism=mesh["autoregressive"],
        ici_tensor_parallelism=mesh["tensor"],
        per_device_batch_size=16 / devices,
        max_prefill_predict_length=32,
        max_target_length=64,
        scan_layers=False,  # the seed's flag: every layer's own arrays
        quantization="int8",
        quantize_kvcache=True,
        decode_steps_per_call=4,
        cpu_kernels="off",
        dtype="float32",  # a MaxText file's base.yml says bfloat16: the same numerics on every case
        weight_dtype="float32",
    )


def _key(model: str, mesh: dict, maxtext: str | None = None) -> tuple:
    return model, mesh["fsdp"], mesh["autoregressive"], mesh["tensor"], maxtext


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    """A config directory with the two tiny presets (PATHSERVE_CONFIG_DIR), and a tokenizer."""
    root = tmp_path_factory.mktemp("sharding-configs")
    (root / "models").mkdir()
    for name, kv_heads in (("tiny-kv8", 8), ("tiny-kv2", 2)):
        (root / "models" / f"{name}.yml").write_text(MODEL.format(name=name, kv_heads=kv_heads))
    # the recipes name llama3.1-405b: its preset must be there (a model_name with none is refused);
    # the runs place the tiny model under the recipe's mesh and rules
    shutil.copy(REPO / "configs" / "models" / "llama3.1-405b.yml", root / "models")
    (root / "tokenizer").mkdir()
    make_hf_tokenizer(root / "tokenizer", vocab=300)
    return root


@pytest.fixture(scope="module")
def runs(config_dir) -> dict[tuple, dict]:
    env = {
        **os.environ,
        **cpu_devices(16),
        "PATHSERVE_CONFIG_DIR": str(config_dir),
    }
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests" / "sharding_run.py"),
            str(config_dir / "tokenizer"),
            json.dumps([{**case, "flags": flags(case["mesh"])} for case in CASES]),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(CASES), result.stdout[-2000:]
    return {_key(r["model"], r["mesh"], r.get("maxtext")): r for r in out}


@pytest.mark.parametrize(
    ("model", "meshes"),
    [
        ("tiny-kv8", ((AR2_T8, None), (F2_AR2_T4, None), (AR2_T8, GUIDE_RECIPE), (AR2_T8, TODAY_RECIPE))),
        ("tiny-kv2", ((AR2_T8, None),)),
    ],
)
def test_greedy_tokens_on_16_devices_equal_one_devices(runs, model, meshes):
    one = runs[_key(model, ONE)]
    assert one["slots"] == 16 and len(one["tokens"]) == 6
    assert all(len(t) == 12 for t in one["tokens"])  # prefill's token, then 11 from 3 generate calls
    for mesh, maxtext in meshes:
        sharded = runs[_key(model, mesh, maxtext)]
        assert sharded["slots"] == 16
        assert sharded["tokens"] == one["tokens"], mesh


TA = ["tensor", "autoregressive"]


def _weights(
    embed: list,
    heads: list,
    kv: list,
    mlp: list,
    vocab: list,
    norm: list,
    q: list | None = None,
    lm_head_in: list | None = None,
    scales_replicated: bool = False,
) -> dict[str, list]:
    """Expected specs of every params leaf (per layer: scan_layers=false unstacks them), written out:
    the layers' int8 values [in, out] and per-channel scales [1, out] (quantization=int8, MaxText's:
    the embedding and the head stay float, one leaf each).
    `q`: wq's out (q_heads x kv) where it differs from wo's in (heads x kv); `lm_head_in`:
    embed_vocab's axes where they differ from embed's; `scales_replicated`: replicate_quant_scale."""
    q = heads if q is None else q
    lm_head_in = embed if lm_head_in is None else lm_head_in
    values = {
        "embed": [vocab, embed],
        "wq": [embed, q],
        "wk": [embed, kv],
        "wv": [embed, kv],
        "wo": [heads, embed],
        "w_gate": [embed, mlp],
        "w_up": [embed, mlp],
        "w_down": [mlp, embed],
        "lm_head": [lm_head_in, vocab],
    }
    out: dict[str, list] = {"final_norm": [norm], "layers/attn_norm": [norm], "layers/mlp_norm": [norm]}
    for name, spec in values.items():
        if name in ("embed", "lm_head"):
            out[name] = spec
            continue
        out[f"layers/{name}/values"] = spec
        out[f"layers/{name}/scales"] = [[], []] if scales_replicated else [[], spec[1]]
    return out


def _cache(heads: list, slots: list | None = None) -> dict[str, list]:
    """[layers, slots, length, kv_heads, head_dim]: the kv heads' axes, and the slots' (cache_batch)."""
    return {f"cache/{n}": [[], slots or [], [], heads, []] for n in ("k", "v", "k_scale", "v_scale")}


T, AR = ["tensor"], ["autoregressive"]
EXPECTED = {
    # base.yml's rules. 8 kv heads over tensor 8 x autoregressive 2 = 16: over tensor alone,
    # replicated 2x; norms over tensor; slots whole.
    _key("tiny-kv8", AR2_T8): {**_weights([], TA, T, TA, TA, T), **_cache(T)},
    # Everything divides 8 ways; fsdp splits embed (and embed_vocab); the cache's heads over
    # (autoregressive, tensor).
    _key("tiny-kv8", F2_AR2_T4): {
        **_weights(["fsdp"], TA, TA, TA, TA, ["tensor"]),
        **_cache(["autoregressive", "tensor"]),
    },
    # 8 kv heads cannot split 16 ways on one axis: wk, wv and the cache are whole on every chip.
    _key("tiny-kv8", T16): {**_weights([], T, [], T, T, T), **_cache([])},
    # 2 kv heads: over autoregressive (2) only, replicated 8x.
    _key("tiny-kv2", AR2_T8): {**_weights([], TA, AR, TA, TA, T), **_cache(AR)},
    _key("tiny-kv8", ONE): {**_weights([], [], [], [], [], []), **_cache([])},
    # The guide's recipe (its old path's rules, which replace base.yml's): embed and norm whole,
    # q_heads over (tensor, autoregressive), kv_heads over tensor and kv_head_dim over autoregressive
    # (wk's kv_heads x head_dim is tensor x autoregressive), embed_vocab without a rule, scales
    # replicated (replicate_quant_scale), slots over autoregressive and kv heads over tensor.
    _key("tiny-kv8", AR2_T8, GUIDE_RECIPE): {
        **_weights([], TA, TA, TA, TA, [], scales_replicated=True),
        **_cache(T, AR),
    },
    # Today's recipe: q_heads and kv_heads over tensor, head_dim whole.
    _key("tiny-kv8", AR2_T8, TODAY_RECIPE): {
        **_weights([], TA, T, TA, TA, [], q=T, scales_replicated=True),
        **_cache(T, AR),
    },
}


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: f"{k[0]}-f{k[1]}-ar{k[2]}-t{k[3]}-{bool(k[4])}")
def test_every_params_and_cache_leaf_has_maxtexts_partition_spec(runs, key):
    assert runs[key]["specs"] == EXPECTED[key]


def test_replication_is_logged_where_heads_do_not_divide(runs):
    assert runs[_key("tiny-kv8", F2_AR2_T4)]["placement_notes"] == []
    assert runs[_key("tiny-kv8", AR2_T8, GUIDE_RECIPE)]["placement_notes"] == []  # the recipe divides
    assert runs[_key("tiny-kv8", AR2_T8, TODAY_RECIPE)]["placement_notes"] == []
    assert runs[_key("tiny-kv8", AR2_T8)]["placement_notes"] == [
        "8 kv_heads do not divide over tensor x autoregressive = 16: split over tensor, replicated 2x",
        "8 cache_heads do not divide over autoregressive x tensor = 16: split over tensor, replicated 2x",
    ]
    assert (
        "2 kv_heads do not divide over tensor x autoregressive = 16: split over autoregressive, replicated 8x"
        in (runs[_key("tiny-kv2", AR2_T8)]["placement_notes"])
    )


@pytest.mark.parametrize(
    ("model", "mesh", "maxtext"),
    [
        ("tiny-kv8", AR2_T8, None),
        ("tiny-kv8", T16, None),
        ("tiny-kv8", F2_AR2_T4, None),
        ("tiny-kv2", AR2_T8, None),
        ("tiny-kv8", AR2_T8, GUIDE_RECIPE),
        ("tiny-kv8", AR2_T8, TODAY_RECIPE),
    ],
    ids=["kv8-ar2-t8", "kv8-t16", "kv8-f2-ar2-t4", "kv2-ar2-t8", "kv8-guide-recipe", "kv8-today-recipe"],
)
def test_plan_bytes_per_chip_equal_the_shards_each_device_holds(
    runs, config_dir, monkeypatch, model, mesh, maxtext
):
    monkeypatch.setenv("PATHSERVE_CONFIG_DIR", str(config_dir))
    base = load_deployment(CONFIGS / "llama3.1-405b-int8-v6e-16.yml")  # a v6e 4x4 slice: 16 chips
    serving = {**flags(mesh), **({"base_config": maxtext} if maxtext else {})}
    cfg = base.model_copy(update={"model_name": model, "serving": serving})
    plan = make_plan(cfg)
    run = runs[_key(model, mesh, maxtext)]
    assert plan.chips == 16 and plan.slots == run["slots"] == 16
    assert len(run["param_bytes"]) == len(run["cache_bytes"]) == 16
    assert set(run["param_bytes"].values()) == {plan.weight_bytes_per_chip}
    assert set(run["cache_bytes"].values()) == {plan.kv_bytes_per_chip}
