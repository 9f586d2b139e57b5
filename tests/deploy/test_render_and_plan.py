"""Rendering and planning without a cluster: CRD schemas, manifests/ in sync, plan arithmetic, refusals."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serving.deploy.cli import to_yaml
from serving.deploy.config import load_deployment
from serving.deploy.crds import CRD_FILES, validate_object
from serving.deploy.errors import DeployError
from serving.deploy.manifests import render
from serving.deploy.plan import make_plan
from tests.cli import call_cli
from tests.deploy.conftest import CONFIGS, REPO

DEPLOYMENTS = sorted(CONFIGS.glob("*.yml"))
V6E_405B = CONFIGS / "llama3.1-405b-int8-v6e-16.yml"
V6E_405B_SIDECAR = CONFIGS / "llama3.1-405b-int8-v6e-16-jetstream-http.yml"


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.stem)
def test_rendered_custom_objects_validate_against_the_crds(path):
    for obj in render(load_deployment(path)):
        if (obj["apiVersion"].rpartition("/")[0], obj["kind"]) in CRD_FILES:
            validate_object(obj)


def test_schema_validation_catches_unknown_fields_and_wrong_types():
    lws = render(load_deployment(V6E_405B))[0]
    unknown = copy.deepcopy(lws)
    unknown["spec"]["leaderWorkerTemplate"]["sise"] = 5
    with pytest.raises(DeployError, match="sise"):
        validate_object(unknown)
    wrong_type = copy.deepcopy(lws)
    wrong_type["spec"]["replicas"] = "one"
    with pytest.raises(DeployError, match=r"spec\.replicas"):
        validate_object(wrong_type)
    bad_container = copy.deepcopy(lws)
    bad_container["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagee"] = "x"
    with pytest.raises(DeployError, match="imagee"):
        validate_object(bad_container)
    job = render(load_deployment(CONFIGS / "llama3.1-8b-batch-v6e-4.yml"))[0]
    job["spec"]["controller"]["deploymentMode"] = "sideways"
    with pytest.raises(DeployError, match="deploymentMode"):
        validate_object(job)


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.stem)
def test_manifests_directory_is_up_to_date(path):
    committed = REPO / "manifests" / f"{path.stem}.yaml"
    assert committed.is_file(), f"run: make manifests (missing {committed})"
    documents = [d for d in yaml.safe_load_all(committed.read_text()) if d]
    assert documents == render(load_deployment(path)), f"{committed} is stale: run `make manifests`"
    assert committed.read_text().endswith(to_yaml(render(load_deployment(path))))


def test_leader_worker_set_for_405b_on_v6e_16():
    lws, svc = render(load_deployment(V6E_405B))
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 4 + 1  # 16 chips on 4 hosts, plus the leader
    assert (
        lws["metadata"]["annotations"]["leaderworkerset.sigs.k8s.io/exclusive-topology"]
        == "cloud.google.com/gke-nodepool"
    )
    worker = template["workerTemplate"]["spec"]
    assert worker["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    assert worker["containers"][0]["resources"]["limits"]["google.com/tpu"] == 4
    assert worker["tolerations"][0]["key"] == "google.com/tpu"
    assert "--resource_manager_address=$(LWS_LEADER_ADDRESS):38677" in worker["containers"][0]["args"]
    # the leader lands in the TPU node pool too (the seed's): the exclusive topology keeps a group in
    # one pool, so a leader without these kept its workers Pending
    leader_spec = template["leaderTemplate"]["spec"]
    assert (leader_spec["nodeSelector"], leader_spec["tolerations"]) == (worker["nodeSelector"], worker["tolerations"])
    leader = {c["name"]: c for c in leader_spec["containers"]}
    assert set(leader) == {"pathways-rm", "pathways-proxy", "engine"}
    assert "--instance_type=tpuv6e:4x4" in leader["pathways-rm"]["args"]
    assert (  # the seed's resource manager flag for v6e
        "--temporary_flags_for_debugging=temporary_flag_for_debugging_worker_expected_tpu_chip_config=megachip_tccontrol"
        in leader["pathways-rm"]["args"]
    )
    assert {"name": "HOST_ADDRESS", "value": "$(LWS_LEADER_ADDRESS)"} in leader["pathways-rm"]["env"]
    assert "--gcs_scratch_location=gs://my-bucket/pathways-scratch" in leader["pathways-proxy"]["args"]
    engine = leader["engine"]
    assert engine["command"] == ["pathserve"] and engine["args"][0] == "serve"
    assert "quantization=int8" in engine["args"] and "ici_tensor_parallelism=8" in engine["args"]
    assert "ici_autoregressive_parallelism=2" in engine["args"]
    assert "load_parameters_path=gs://my-bucket/checkpoints/llama3.1-405b-int8" in engine["args"]
    assert {"name": "JAX_PLATFORMS", "value": "proxy"} in engine["env"]
    assert {p["containerPort"] for p in engine["ports"]} == {8000, 9000}
    assert engine["startupProbe"]["httpGet"]["path"] == "/startupz"
    assert engine["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert svc["kind"] == "Service" and svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/name"] == "llama-405b"


def test_the_builtin_engine_serves_grpc_on_the_declared_port():
    lws, _ = render(load_deployment(V6E_405B))
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    engine = next(c for c in leader if c["name"] == "engine")
    assert "grpc_port=9000" in engine["args"] and "--port=8000" in engine["args"]
    assert {p["name"]: p["containerPort"] for p in engine["ports"]} == {"http": 8000, "grpc": 9000}


def test_jetstream_http_frontend_renders_the_seeds_sidecar_layout():
    lws, svc = render(load_deployment(V6E_405B_SIDECAR))
    leader = {
        c["name"]: c for c in lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    }
    assert list(leader) == ["pathways-rm", "pathways-proxy", "engine", "jetstream-http"]
    engine, sidecar = leader["engine"], leader["jetstream-http"]
    assert sidecar["image"] == "us-docker.pkg.dev/cloud-tpu-images/inference/jetstream-http:v0.2.4"
    assert sidecar["ports"] == [{"name": "http", "containerPort": 8000}]
    # the engine: gRPC on 9000 for the sidecar, its own HTTP moved off the sidecar's port
    assert "grpc_port=9000" in engine["args"] and "--port=8001" in engine["args"]
    assert {p["name"]: p["containerPort"] for p in engine["ports"]} == {"engine-http": 8001, "grpc": 9000}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # as in the seed
        assert engine[probe]["httpGet"] == {"path": "/healthcheck", "port": 8000}
    assert "startupProbe" not in sidecar
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [
        ("http", 8000),
        ("grpc", 9000),
        ("engine-http", 8001),
    ]


def test_the_sidecar_image_is_configurable_and_needs_no_jax_tag(tmp_path):
    image = "registry.example.com/jetstream-http:v0.2.2"
    path = _write_variant(tmp_path, V6E_405B_SIDECAR, images__jetstream_http=image)
    lws, _ = render(load_deployment(path))
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    assert leader[-1]["image"] == image
    assert make_plan(load_deployment(path)).chips == 16


def test_batch_config_renders_a_colocated_pathways_job():
    (job,) = render(load_deployment(CONFIGS / "llama3.1-8b-batch-v6e-4.yml"))
    assert job["kind"] == "PathwaysJob"
    assert job["spec"]["controller"]["deploymentMode"] == "colocate_head_with_workers"
    assert job["spec"]["workers"] == [
        {"type": "ct6e-standard-4t", "topology": "2x2", "numSlices": 1, "maxSliceRestarts": 3}
    ]
    assert job["spec"]["pathwaysVersion"] == "jax-0.10.2"
    main = job["spec"]["controller"]["template"]["spec"]["containers"][0]
    assert {"name": "ENABLE_PATHWAYS_PERSISTENCE", "value": "1"} in main["env"]  # Orbax restores through Pathways
    assert main["args"][:3] == [
        "batch",
        "--input=gs://my-bucket/batch/in/",
        "--output=gs://my-bucket/batch/out/",
    ]


# Llama 3.1 405B: 126 layers, embed 16384, 128 heads / 8 kv heads of 128, mlp 53248, vocab 128256.
L, E, H, KV, D, MLP, V = 126, 16384, 128, 8, 128, 53248, 128256


def test_plan_for_405b_int8_on_v6e_16_matches_a_hand_calculation():
    """The guide's recipe (MaxText/configs/v5e/inference/llama3_405b_v5e-64.yml, its rules there),
    with MaxText's quantization=int8: the layers' matmuls in int8, the embedding and the head in
    bfloat16 (as MaxText's int8 checkpoints hold them)."""
    plan = make_plan(load_deployment(V6E_405B))
    per_layer = 2 * E * H * D + 2 * E * KV * D + 3 * E * MLP  # q, o; k, v; gate, up, down
    matmul_int8 = L * per_layer  # one byte each
    scales = 4 * L * (H * D + KV * D + KV * D + E + MLP + MLP + E)
    embed_and_head_bf16 = 2 * 2 * V * E
    norms_bf16 = 2 * (2 * L + 1) * E
    weights = matmul_int8 + scales + embed_and_head_bf16 + norms_bf16
    assert plan.weight_bytes == weights
    assert plan.chips == 16 and plan.hosts == 4
    assert plan.mesh == {"fsdp": 1, "autoregressive": 2, "tensor": 8}
    # The recipe's rules by hand: q heads, heads, mlp and vocab over tensor x autoregressive (16);
    # kv heads over tensor (8) and their head_dim over autoregressive (2): 16 ways too. Every int8
    # value and both vocab tables split 16 ways; the scales (replicate_quant_scale) and the norms
    # (norm: []) are whole.
    per_chip = (matmul_int8 + embed_and_head_bf16) / 16 + scales + norms_bf16
    assert plan.weight_bytes_per_chip == pytest.approx(per_chip, rel=1e-12)
    assert plan.weight_bytes_per_chip / 1e9 == pytest.approx(25.71, abs=0.01)
    # The KV cache: a pool of pages of 32 positions, by default every slot's 2048 at once: 160 x 64
    # pages and the scratch page, rounded up to a multiple of the 16 chips (10256). The pages over
    # autoregressive (5128 a chip), the 8 kv heads over tensor (1 a chip), int8 + a float32 scale
    # per head: 5.46 GB, no copy.
    assert plan.page_size == 32 and plan.num_pages == 10256 and plan.pages_per_chip == 5128
    kv_per_chip = 5128 * 32 * L * 2 * 1 * (D + 4)
    assert plan.kv_heads_per_chip == 1 and plan.slots == 160
    assert plan.kv_capacity_tokens == 10255 * 32 >= 160 * 2048
    assert plan.kv_bytes_per_chip == kv_per_chip
    limit = 33_550_237_696  # a v6e chip's bytes_limit
    used = per_chip + kv_per_chip + plan.temporaries_bytes_per_chip
    assert plan.bytes_limit_per_chip == limit and plan.headroom_bytes_per_chip == pytest.approx(limit - used)
    assert 0 < plan.temporaries_bytes_per_chip < 0.5e9 and used / 1e9 == pytest.approx(31.30, abs=0.01)
    kv_token_chip = kv_per_chip / (5128 * 32)
    assert plan.kv_tokens_that_fit_per_chip == int(
        (limit - plan.weight_bytes_per_chip - plan.temporaries_bytes_per_chip) // kv_token_chip
    )
    step = (per_chip + kv_per_chip) / 1.64e12
    assert plan.step_time_s == pytest.approx(step, rel=1e-12) and plan.bound == "memory"
    assert plan.tokens_per_s == pytest.approx(160 / step, rel=1e-12)
    assert plan.shardings["wq [embed, heads]"] == "[-, tensor x autoregressive]"
    assert plan.shardings["wk, wv [embed, kv_heads]"] == "[-, tensor x autoregressive]"
    assert plan.shardings["kv cache [pages, page_size, kv_heads, head_dim]"] == "[autoregressive, -, tensor, -]"
    assert plan.replication == []


# The engine flags of the product docs' 405B recipe, as one types them after `serve` (without the
# recipe file: base.yml's rules).
SEED_TEXT = """
model_name=llama3.1-405b max_prefill_predict_length=1024 max_target_length=2048
ici_fsdp_parallelism=1 ici_autoregressive_parallelism=2 ici_tensor_parallelism=8
scan_layers=false weight_dtype=bfloat16 per_device_batch_size=10
quantization=int8 quantize_kvcache=true checkpoint_is_quantized=true enable_model_warmup=true
"""
SEED_FLAGS = SEED_TEXT.split()


def test_the_seeds_flags_without_the_recipe_file_are_refused_with_the_numbers_and_what_fits(tmp_path):
    """Without the recipe's rules (base.yml's: cache_heads over (autoregressive, tensor), pages
    whole), 160 slots' pages need 10.9 GB of KV cache per chip (8 kv heads split 8 ways, each held
    twice) on top of 25.9 GB of weights: over the v6e's bytes_limit. The recipe file is what makes
    them fit; a smaller pool (kv_cache_bytes_per_chip) is the other way out, and the refusal says
    how small."""
    data = yaml.safe_load(V6E_405B.read_text())
    data["serving"] = {k: v for k, v in data["serving"].items() if k != "base_config"}
    variant = tmp_path / "no-recipe.yml"
    variant.write_text(yaml.safe_dump(data))
    result = call_cli("deploy", "plan", str(variant), *SEED_FLAGS, "dtype=bfloat16")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    for text in (
        "params 25.91 GB + KV cache 10.92 GB + temporaries",  # 10256 pages of 32: 160 x 2048 and one
        "exceed its bytes_limit of 33.55 GB",
        "slots of 2048 tokens would fit (per_device_batch_size <= ",
        "or a KV pool of kv_cache_bytes_per_chip <= ",
        "8 cache_heads do not divide over autoregressive x tensor = 16: split over tensor, replicated 2x",
        "per_device_batch_size",
        "max_target_length",
    ):
        assert text in result.stderr, result.stderr
    assert call_cli("deploy", "plan", str(V6E_405B), *SEED_FLAGS).returncode == 0
    data["serving"]["model_name"] = "llama3.1-405b"
    variant.write_text(yaml.safe_dump(data))
    result = call_cli("deploy", "plan", str(variant))
    assert result.returncode == 2 and "serving.model_name: set model_name instead" in result.stderr


def test_overrides_of_serving_mean_what_they_mean_for_serve(tmp_path):
    """`deploy plan|render CONFIG key=value ...` = the config with those keys in `serving:`, parsed as
    `pathserve serve` parses its overrides (YAML scalars)."""
    overrides = ("per_device_batch_size=1", "max_target_length=4096", "scan_layers=true")
    variant = _write_variant(
        tmp_path,
        V6E_405B,
        serving__per_device_batch_size=1,
        serving__max_target_length=4096,
        serving__scan_layers=True,
    )
    assert make_plan(load_deployment(V6E_405B, overrides)) == make_plan(load_deployment(variant))
    plan = json.loads(call_cli("deploy", "plan", str(V6E_405B), "--json", *overrides).stdout)
    assert plan["slots"] == 16 and plan["max_target_length"] == 4096
    result = call_cli("deploy", "render", str(V6E_405B), *overrides)
    assert result.returncode == 0, result.stderr
    lws = next(yaml.safe_load_all(result.stdout))
    validate_object(lws)
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    args = next(c for c in leader if c["name"] == "engine")["args"]
    assert {"per_device_batch_size=1", "max_target_length=4096", "scan_layers=true"} <= set(args)
    assert "per_device_batch_size=10" not in args
    assert args[1] == "MaxText/configs/v5e/inference/llama3_405b_v5e-64.yml"  # the recipe file first
    for bad, named in (
        ("per_device_batch_sise=2", "did you mean 'per_device_batch_size'"),
        ("scan_layers", "key=value"),
    ):
        result = call_cli("deploy", "render", str(V6E_405B), bad)
        assert result.returncode == 2 and named in result.stderr, result.stderr


def test_405b_in_bfloat16_on_v6e_16_is_refused_naming_the_numbers_and_the_flags():
    result = call_cli(
        "deploy",
        "plan",
        str(V6E_405B),
        "quantization=",
        "checkpoint_is_quantized=false",
        "quantize_kvcache=false",
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    for text in (
        "llama3.1-405b on tpu-v6e-slice 4x4 does not fit: params 50.74 GB + KV cache",
        "exceed its bytes_limit of 33.55 GB",
        "the weights alone do not fit",
        "quantization=int8",
        "quantize_kvcache=true",
        "ici_tensor_parallelism",
        "or more chips",
    ):
        assert text in result.stderr, result.stderr


def test_a_tensor_16_variant_has_no_reason_to_exist():
    """tensor=16 alone: 8 kv heads cannot split 16 ways, so wk / wv and the KV cache sit whole on every
    chip, and even one slot per chip does not fit."""
    result = call_cli(
        "deploy",
        "plan",
        str(V6E_405B),
        "ici_tensor_parallelism=16",
        "ici_autoregressive_parallelism=1",
        "per_device_batch_size=1",
    )
    assert result.returncode == 2
    assert "params 29.68 GB" in result.stderr and "replicated 16x" in result.stderr


def _write_variant(tmp_path: Path, base: Path, **changes) -> Path:
    data = yaml.safe_load(base.read_text())
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    out = tmp_path / "variant.yml"
    out.write_text(yaml.safe_dump(data))
    return out


@pytest.mark.parametrize(
    ("changes", "must_mention"),
    [
        ({"serving__ici_tensor_parallelism": 4}, ["ici_tensor_parallelism", "= 8", "16 chips"]),
        (
            {"serving__quantization": "", "serving__checkpoint_is_quantized": False},
            ["does not fit", "exceed its bytes_limit", "quantization=int8"],
        ),
        ({"tpu__accelerator": "tpu-v9-slice"}, ["tpu.accelerator", "tpu-v9-slice"]),
        ({"tpu__topology": "4x4x4"}, ["tpu.topology", "4x4x4"]),
        ({"tpu__topology": "2x8"}, ["tpu.topology", "GKE offers no 2x8 slice", "4x4"]),
        ({"ports__http": 38681}, ["ports.http", "Pathways proxy"]),
        ({"ports__grpc": 38677}, ["ports.grpc", "Pathways resource manager"]),
        ({"frontend": "jetstream-http", "runtime": "multicontroller", "ports__http": 8000}, ["multicontroller"]),
        ({"tpu__chips_per_host": 8}, ["tpu.chips_per_host", "4x4, which GKE offers with 4 chips per host"]),
        (
            {"images__pathways_proxy": "us-docker.pkg.dev/x/proxy_server:jax-0.9.0"},
            ["images", "jax tags differ", "pathways_proxy=jax-0.9.0"],
        ),
        ({"images__engine": "us-docker.pkg.dev/x/pathserve:latest"}, ["images.engine", "jax-<version>"]),
        ({"serving__weight_dtype": "float64"}, ["weight_dtype", "bfloat16"]),
        ({"scratch": "/tmp/scratch"}, ["scratch", "gs://"]),
        ({"replicaz": 2}, ["replicaz", "did you mean 'replicas'"]),
        ({"frontend": "envoy"}, ["frontend", "jetstream-http"]),
        ({"serving__grpc_port": 9100}, ["serving.grpc_port", "ports.grpc"]),
        ({"ports__grpc": 8000}, ["ports.http and ports.grpc"]),
        ({"frontend": "jetstream-http", "ports__http": 8080}, ["jetstream-http", "ports.http", "8080"]),
        ({"frontend": "jetstream-http", "ports__engine_http": 9000}, ["ports.engine_http"]),
    ],
)
def test_bad_configs_exit_2_naming_the_field(tmp_path, changes, must_mention):
    path = _write_variant(tmp_path, V6E_405B, **changes)
    for action in ("plan", "render"):
        result = call_cli("deploy", action, str(path))
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        for text in must_mention:
            assert text in result.stderr


def test_plan_and_render_cli(tmp_path):
    result = call_cli("deploy", "plan", str(V6E_405B))
    assert result.returncode == 0, result.stderr
    assert "16 / 4" in result.stdout and "memory-bound" in result.stdout
    result = call_cli("deploy", "render", str(V6E_405B), "-o", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / f"{V6E_405B.stem}.yaml").read_text() == (
        REPO / "manifests" / f"{V6E_405B.stem}.yaml"
    ).read_text()


def test_deploy_commands_do_not_import_jax():
    code = (
        "import sys; from serving.cli.main import main; "
        f"main(['deploy', 'plan', {str(V6E_405B)!r}]); main(['deploy', 'render', {str(V6E_405B)!r}]); "
        "import serving.deploy.kube; assert 'jax' not in sys.modules, 'jax was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_dockerfile_jax_version_matches_the_deployment_image_tags():
    dockerfile = (REPO / "Dockerfile").read_text()
    # every COPY source is in the repository (a moved directory broke the build once)
    for line in dockerfile.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            *sources, _ = line.split()[1:]
            assert all((REPO / s).exists() for s in sources), line
    (version,) = [
        line.split("=", 1)[1] for line in dockerfile.splitlines() if line.startswith("ARG JAX_VERSION=")
    ]
    for path in DEPLOYMENTS:
        assert set(load_deployment(path).images.jax_versions().values()) == {version}, path.name
    assert 'ENTRYPOINT ["pathserve"]' in dockerfile and "pathwaysutils" in dockerfile


def test_lora_adapters_render_into_the_engine_args_and_the_plan_counts_their_slots(tmp_path):
    """lora_input_adapters_path and max_loras go to the engine container as flags; the plan adds
    max_loras + 1 slots of every layer matmul's a [in, r] and b [r, out] to the memory, out of the
    headroom, split over tensor=4 as the weights are (heads, kv heads, mlp; embed whole)."""
    base = CONFIGS / "llama3.1-8b-v6e-4.yml"
    adapters = ("lora_input_adapters_path=gs://my-bucket/adapters", "max_loras=4", "max_lora_rank=16")
    deployment = load_deployment(base, adapters)
    lws = next(o for o in render(deployment) if o["kind"] == "LeaderWorkerSet")
    assert all(flag in json.dumps(lws) for flag in adapters)
    plain, plan = make_plan(load_deployment(base)), make_plan(deployment)
    e, q, kv, mlp, layers = 4096, 4096, 1024, 14336, 32  # Llama 3.1 8B
    # per chip: wq, wo; wk, wv; gate, up, down (embed never split, the other side over 4 chips)
    per_slot = 16 * ((e + q // 4) * 2 + (e + kv // 4) * 2 + (e + mlp // 4) * 3)
    expected = layers * 5 * per_slot * 2  # 4 adapters + the base model's zeros, bfloat16
    assert plain.lora_bytes_per_chip == 0 and plan.lora_bytes_per_chip == expected
    assert plan.headroom_bytes_per_chip == pytest.approx(plain.headroom_bytes_per_chip - expected)
    with pytest.raises(DeployError, match=r"serving\.max_loras"):
        make_plan(load_deployment(base, ("max_loras=4000", "max_lora_rank=64")))


def test_deploy_render_into_a_folder_it_cannot_make_is_exit_2(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    result = call_cli("deploy", "render", "configs/deployments/llama3.1-8b-v6e-4.yml", "-o", str(a_file / "out"))
    assert result.returncode == 2 and f"-o {a_file / 'out'}: cannot write" in result.stderr, result.stderr
