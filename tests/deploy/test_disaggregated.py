"""Disaggregated prefill and decode (serving.deploy.disaggregated): the JetStream guide's
LeaderWorkerSet (two slices as subgroups) and LWS's DisaggregatedSet (a prefill and a decode role),
both from one config; each side's devices checked against the slices; `deploy plan` per side;
validated against the CRDs and applied to a real kube-apiserver."""

from __future__ import annotations

import json

import pytest
import yaml

from serving.deploy.config import load_deployment
from serving.deploy.crds import validate_object
from serving.deploy.errors import DeployError
from serving.deploy.manifests import render
from serving.deploy.plan import make_plan
from tests.cli import call_cli
from tests.deploy.conftest import CONFIGS, install_crd

LWS_SHAPE = CONFIGS / "llama3.1-70b-int8-v6e-8-disaggregated.yml"  # two v6e 2x4 slices of 2 hosts
DSET_SHAPE = CONFIGS / "llama3.1-70b-int8-v6e-8-disaggregatedset.yml"  # the same, as a DisaggregatedSet
# The guide's disaggregated engine arguments, as the engine container receives them.
GUIDE_ARGS = (
    "per_device_batch_size=27",
    "compute_axis_order=0,2,1,3",
    "ar_cache_axis_order=0,2,1,3",
    "stack_prefill_result_cache=true",
    "inference_server=ExperimentalMaxtextDisaggregatedServer_8",
)
SUBGROUP_EXCLUSIVE = "leaderworkerset.sigs.k8s.io/subgroup-exclusive-topology"
EXCLUSIVE = "leaderworkerset.sigs.k8s.io/exclusive-topology"


def variant(tmp_path, base=LWS_SHAPE, **changes):
    """`base` with `a__b=value` set at data[a][b]."""
    data = yaml.safe_load(base.read_text())
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / f"variant-{len(list(tmp_path.iterdir()))}.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod["spec"]["containers"]}


def selects(selector: dict[str, str], pod_labels: dict[str, str]) -> bool:
    return all(pod_labels.get(k) == v for k, v in selector.items())


# -- the guide's LeaderWorkerSet ----------------------------------------------------------------------


def test_the_guides_leader_worker_set_holds_both_slices_as_subgroups():
    lws, svc = render(load_deployment(LWS_SHAPE))
    validate_object(lws)
    # Each slice a node pool of its own: the group spans two, so only its subgroups are exclusive.
    assert lws["metadata"]["annotations"] == {SUBGROUP_EXCLUSIVE: "cloud.google.com/gke-nodepool"}
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 + 2 + 1  # two 2-host slices and the leader: the guide's 5
    assert template["subGroupPolicy"] == {"subGroupSize": 2}  # hosts per slice; the leader joins the first
    leader = containers(template["leaderTemplate"])
    assert set(leader) == {"pathways-rm", "pathways-proxy", "engine"}
    assert {"--instance_count=2", "--instance_type=tpuv6e:2x4"} <= set(leader["pathways-rm"]["args"])
    assert set(GUIDE_ARGS) <= set(leader["engine"]["args"])
    worker = template["workerTemplate"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["google.com/tpu"] == 4  # ct6e-standard-4t hosts
    assert worker["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"
    assert svc["spec"]["selector"] == {
        "leaderworkerset.sigs.k8s.io/name": "llama-70b-disagg",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    }


@pytest.mark.parametrize(
    ("tpu", "overrides", "size", "subgroup"),
    [
        ({"topology": "2x4", "chips_per_host": 8}, [], 3, 1),
        (
            {"topology": "4x4", "chips_per_host": None},
            ["inference_server=ExperimentalMaxtextDisaggregatedServer_16", "ici_autoregressive_parallelism=2"],
            9,
            4,
        ),
    ],
    ids=["v6e-8-one-host", "v6e-16-four-hosts"],
)
def test_subgroups_follow_the_hosts_of_a_slice(tmp_path, tpu, overrides, size, subgroup):
    cfg = load_deployment(variant(tmp_path, **{f"tpu__{k}": v for k, v in tpu.items()}), overrides)
    lws, _ = render(cfg)
    validate_object(lws)
    template = lws["spec"]["leaderWorkerTemplate"]
    assert (template["size"], template["subGroupPolicy"]["subGroupSize"]) == (size, subgroup)
    assert (size - 1) % subgroup == 0  # LWS puts the leader in the first subgroup (size - 1 divides)
    assert make_plan(cfg).hosts == size - 1


# -- the DisaggregatedSet ------------------------------------------------------------------------------


def test_the_disaggregated_set_puts_the_engine_in_prefill_and_a_slice_of_servers_in_decode():
    dset, svc = render(load_deployment(DSET_SHAPE))
    validate_object(dset)
    assert dset["apiVersion"] == "disaggregatedset.x-k8s.io/v1"
    prefill, decode = dset["spec"]["roles"]
    assert (prefill["name"], decode["name"]) == ("prefill", "decode")
    # The CRD's rule (CEL, which validate_object cannot run): replicas all zero or all non-zero.
    assert prefill["spec"]["replicas"] == decode["spec"]["replicas"] == 1
    for role in (prefill, decode):  # each role's groups on node pools of their own
        assert role["metadata"]["annotations"] == {EXCLUSIVE: "cloud.google.com/gke-nodepool"}
    p, d = prefill["spec"]["leaderWorkerTemplate"], decode["spec"]["leaderWorkerTemplate"]
    assert p["size"] == 2 + 1 and d["size"] == 2  # a slice's hosts, and the prefill leader
    assert "subGroupPolicy" not in p and "leaderTemplate" not in d  # decode's leader is a TPU host too
    leader = containers(p["leaderTemplate"])
    assert set(leader) == {"pathways-rm", "pathways-proxy", "engine"}
    assert "--instance_count=2" in leader["pathways-rm"]["args"]  # one Pathways cluster, both slices
    assert set(GUIDE_ARGS) <= set(leader["engine"]["args"])
    for role in (p, d):
        (server,) = role["workerTemplate"]["spec"]["containers"]
        assert server["name"] == "pathways-worker" and server["resources"]["limits"]["google.com/tpu"] == 4
    # Requests reach the engine through the Service: it selects the prefill leaders, no TPU host.
    selector = svc["spec"]["selector"]
    assert selects(selector, p["leaderTemplate"]["metadata"]["labels"])
    assert not selects(selector, p["workerTemplate"]["metadata"]["labels"])
    assert not selects(selector, d["workerTemplate"]["metadata"]["labels"])


def test_a_decode_pod_finds_the_resource_manager_of_its_own_prefill_leader():
    """The DisaggregatedSet's controller names each role's LWS NAME-REVISION-ROLE and labels every
    pod with the revision; LWS labels it with the group index and tells the prefill pods their
    leader as LEADER_POD.LWS.NAMESPACE. A decode pod, given its own two labels, names that leader."""
    dset, _ = render(load_deployment(DSET_SHAPE))
    prefill, decode = (r["spec"]["leaderWorkerTemplate"] for r in dset["spec"]["roles"])
    (server,) = decode["workerTemplate"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in server["env"]}
    assert env == {
        "DISAGGREGATEDSET_REVISION": "metadata.labels['disaggregatedset.x-k8s.io/revision']",
        "LWS_GROUP_INDEX": "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']",
    }
    revision, group = "5c0ffee1", "3"
    prefill_lws = f"llama-70b-dset-{revision}-prefill"
    leader_address = f"{prefill_lws}-{group}.{prefill_lws}.default"  # LWS_LEADER_ADDRESS in that group

    def resolved(container: dict, values: dict[str, str]) -> str:
        (arg,) = [a for a in container["args"] if a.startswith("--resource_manager_address=")]
        for name, value in values.items():
            arg = arg.replace(f"$({name})", value)
        return arg

    decode_sees = resolved(server, {"DISAGGREGATEDSET_REVISION": revision, "LWS_GROUP_INDEX": group})
    prefill_sees = resolved(prefill["workerTemplate"]["spec"]["containers"][0], {"LWS_LEADER_ADDRESS": leader_address})
    assert decode_sees == prefill_sees == f"--resource_manager_address={leader_address}:38677"
    rm = containers(prefill["leaderTemplate"])["pathways-rm"]
    assert {"name": "HOST_ADDRESS", "value": "$(LWS_LEADER_ADDRESS)"} in rm["env"]


def test_the_two_shapes_share_their_pods(tmp_path):
    """One builder: the DisaggregatedSet's prefill role is the LeaderWorkerSet's leader and workers."""
    dset, _ = render(load_deployment(DSET_SHAPE))
    lws, _ = render(load_deployment(variant(tmp_path, DSET_SHAPE, disaggregation="leaderworkerset")))
    prefill = dset["spec"]["roles"][0]["spec"]["leaderWorkerTemplate"]
    template = lws["spec"]["leaderWorkerTemplate"]
    assert prefill["leaderTemplate"] == template["leaderTemplate"]
    assert prefill["workerTemplate"] == template["workerTemplate"]


def test_the_longest_name_leaves_room_for_the_controllers_names(tmp_path):
    name = "d" * 40  # the longest deployment name
    dset, _ = render(load_deployment(variant(tmp_path, DSET_SHAPE, name=name)))
    validate_object(dset)
    leader_pod = f"{name}-{'0' * 8}-prefill-999"  # NAME-REVISION(8)-ROLE-GROUP: a DNS label
    assert len(leader_pod) <= 63


def test_schema_validation_names_the_path_in_a_role():
    dset, _ = render(load_deployment(DSET_SHAPE))
    dset["spec"]["roles"][1]["spec"]["leaderWorkerTemplate"]["sise"] = 2
    with pytest.raises(DeployError, match=r"spec\.roles\.1\.spec\.leaderWorkerTemplate.*sise"):
        validate_object(dset)
    dset, _ = render(load_deployment(DSET_SHAPE))
    dset["spec"]["roles"] = dset["spec"]["roles"][:1]
    with pytest.raises(DeployError, match=r"spec\.roles"):
        validate_object(dset)


# -- checks before anything is applied ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "changes", "must_mention"),
    [
        (LWS_SHAPE, {"tpu__num_slices": 1}, ["tpu.num_slices", "set 2"]),
        (
            LWS_SHAPE,
            {"serving__inference_server": "ExperimentalMaxtextDisaggregatedServer_4"},
            ["serving.inference_server", "4 devices on prefill", "has 8 chips"],
        ),
        (
            LWS_SHAPE,
            {
                "serving__inference_server": "ExperimentalMaxtextDisaggregatedServer",
                "serving__prefill_slice": "v6e-16",
                "serving__generate_slice": "v6e-8",
            },
            ["serving.prefill_slice=v6e-16", "16 devices on prefill"],
        ),
        (
            LWS_SHAPE,
            {
                "serving__inference_server": "ExperimentalMaxtextDisaggregatedServer",
                "serving__prefill_slice": "v6e-8",
                "serving__generate_slice": "v6e-4",
            },
            ["serving.generate_slice=v6e-4", "4 devices on generate"],
        ),
        (LWS_SHAPE, {"runtime": "multicontroller"}, ["runtime: multicontroller", "runtime: pathways"]),
        (
            DSET_SHAPE,
            {"serving__inference_server": "MaxtextInterleavedServer", "tpu__num_slices": 1},
            ["disaggregation: disaggregatedset", "serving.inference_server"],
        ),
        (DSET_SHAPE, {"disaggregation": "decode-first"}, ["disaggregation", "disaggregatedset"]),
        (LWS_SHAPE, {"tpu__chips_per_host": 2}, ["tpu.chips_per_host", "8 or 4"]),
        (
            LWS_SHAPE,
            {"serving__ici_tensor_parallelism": 16},
            ["ici_tensor_parallelism", "one side's tpu-v6e-slice 2x4 slice has 8 chips"],
        ),
        (
            DSET_SHAPE,
            {"kind": "batch", "batch": {"input": "gs://b/in/", "output": "gs://b/out/"}},
            ["disaggregation: disaggregatedset", "kind: batch"],
        ),
    ],
    ids=[
        "one-slice", "4-per-side", "prefill-slice", "generate-slice", "multicontroller", "interleaved-dset",
        "unknown-shape", "chips-per-host", "mesh-over-both",  "batch-dset",
    ],
)
def test_bad_disaggregated_configs_exit_2_naming_the_field(tmp_path, base, changes, must_mention):
    path = variant(tmp_path, base, **changes)
    for action in ("plan", "render"):
        result = call_cli("deploy", action, str(path))
        assert result.returncode == 2, result.stdout + result.stderr
        assert "Traceback" not in result.stderr
        for text in must_mention:
            assert text in result.stderr, result.stderr


# -- deploy plan, side by side ------------------------------------------------------------------------

# Llama 3.1 70B: 80 layers, embed 8192, 64 heads / 8 kv heads of 128, mlp 28672, vocab 128256.
L, E, H, KV, D, MLP, V = 80, 8192, 64, 8, 128, 28672, 128256
LIMIT = 33_550_237_696  # a v6e chip's bytes_limit


def test_plan_sizes_each_side_by_hand(tmp_path):
    """Weights on both sides (each as an interleaved engine on one slice places them), the KV
    cache's pool on the generate side only, a prefill call's activations on the prefill side."""
    plan = make_plan(load_deployment(LWS_SHAPE))
    prefill, generate = plan.sides
    assert (prefill.role, generate.role) == ("prefill", "generate")
    assert plan.chips == 16 and plan.hosts == 4
    assert prefill.chips == generate.chips == 8 and prefill.hosts == generate.hosts == 2
    assert prefill.mesh == generate.mesh == plan.mesh == {"fsdp": 1, "autoregressive": 1, "tensor": 8}
    one_slice = make_plan(
        load_deployment(
            variant(tmp_path, tpu__num_slices=1, serving__inference_server="MaxtextInterleavedServer")
        )
    )
    assert one_slice.sides == () and one_slice.chips == 8
    weights = one_slice.weight_bytes_per_chip
    assert prefill.weight_bytes_per_chip == generate.weight_bytes_per_chip == plan.weight_bytes_per_chip == weights
    assert 9.0e9 < weights < 9.2e9  # 70B int8 over 8 chips: about 72.7 GB / 8
    # The pool: 216 slots (27 x the 8 generate chips) x 2048 positions = 64 pages of 32 each, and the
    # scratch page, rounded up to the 8 chips: 13832 pages, whole on every chip (autoregressive 1),
    # one kv head of 8 a chip (tensor), int8 and a float32 scale per head.
    assert plan.slots == 216 and plan.num_pages == 13832 and plan.pages_per_chip == 13832
    kv = 13832 * 32 * L * 2 * 1 * (D + 4)
    assert generate.kv_bytes_per_chip == plan.kv_bytes_per_chip == one_slice.kv_bytes_per_chip == kv
    # The prefill side mirrors the generate side's pool (prompts prefill into their pages there).
    assert prefill.kv_bytes_per_chip == kv
    # A prefill call of 1024 tokens (float32 activations): a layer's residual and normed input,
    # gate and up, q/k/v, the attention scores of 8 heads a chip, one row of logits (its prompt's
    # KV is written into the pool's pages).
    prompt_kv = 32 * 32 * L * 2 * (D + 4)
    per_token = 2 * E + 2 * MLP // 8 + (H + 2 * KV) * D // 8
    call = 1024 * per_token * 4 + 1024 * 1024 * (H // 8) * 4 + (V // 8) * 4
    assert prefill.activation_bytes_per_chip == call
    # The generate side: the logits of 216 slots, and a moved prompt's KV on its way into the pool.
    assert generate.activation_bytes_per_chip == plan.temporaries_bytes_per_chip == 216 * (V // 8) * 4 + prompt_kv
    assert prefill.headroom_bytes_per_chip == LIMIT - weights - kv - call
    assert generate.headroom_bytes_per_chip == plan.headroom_bytes_per_chip
    assert generate.headroom_bytes_per_chip == LIMIT - weights - kv - generate.activation_bytes_per_chip
    step = (weights + kv) / 1.64e12  # the generate side decodes
    assert plan.step_time_s == pytest.approx(step, rel=1e-12) and plan.tokens_per_s == pytest.approx(216 / step)


def test_plan_shows_both_sides_in_text_and_json():
    result = call_cli("deploy", "plan", str(LWS_SHAPE), "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["inference_server"] == "ExperimentalMaxtextDisaggregatedServer_8"
    assert [side["role"] for side in plan["sides"]] == ["prefill", "generate"]
    prefill, generate = plan["sides"]
    assert prefill["kv_bytes_per_chip"] == generate["kv_bytes_per_chip"] == plan["kv_bytes_per_chip"] > 0
    text = call_cli("deploy", "plan", str(DSET_SHAPE)).stdout
    for row in ("server", "KV cache (paged, generate side)", "prefill side, per chip", "generate side, per chip"):
        assert f"\n{row} " in text, text
    assert "a copy on each side" in text and "216, 2048 (generate side)" in text
    interleaved = json.loads(call_cli("deploy", "plan", str(CONFIGS / "llama3.1-8b-v6e-4.yml"), "--json").stdout)
    assert interleaved["sides"] == [] and interleaved["inference_server"] == "MaxtextInterleavedServer"


def test_each_side_is_refused_on_its_own_figures():
    big_batch = call_cli("deploy", "plan", str(LWS_SHAPE), "per_device_batch_size=200")
    assert big_batch.returncode == 2
    assert "the generate side (llama3.1-70b on tpu-v6e-slice 2x4) does not fit" in big_batch.stderr
    assert "per_device_batch_size <= " in big_batch.stderr
    long_prompts = call_cli(
        "deploy", "plan", str(LWS_SHAPE),
        "max_prefill_predict_length=32768", "max_target_length=65536", "per_device_batch_size=1",
    )
    assert long_prompts.returncode == 2
    assert "the prefill side (llama3.1-70b on tpu-v6e-slice 2x4) does not fit" in long_prompts.stderr
    assert "max_prefill_predict_length" in long_prompts.stderr


# -- a real API server --------------------------------------------------------------------------------


def _dset_resource(client):
    return client.resources.get(api_version="disaggregatedset.x-k8s.io/v1", kind="DisaggregatedSet")


def test_the_guides_leader_worker_set_applies(lws_installed, apiserver):
    result = call_cli("deploy", "apply", str(LWS_SHAPE), "--kubeconfig", str(apiserver))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == [
        "LeaderWorkerSet/llama-70b-disagg created",
        "Service/llama-70b-disagg created",
    ]
    resource = lws_installed.resources.get(api_version="leaderworkerset.x-k8s.io/v1", kind="LeaderWorkerSet")
    stored = lws_installed.get(resource, name="llama-70b-disagg", namespace="default").to_dict()
    assert stored["spec"]["leaderWorkerTemplate"]["subGroupPolicy"]["subGroupSize"] == 2  # not pruned
    assert stored["metadata"]["annotations"][SUBGROUP_EXCLUSIVE] == "cloud.google.com/gke-nodepool"


def test_the_disaggregated_set_needs_its_crd_then_applies_and_reports_its_status(kube, lws_installed, apiserver):
    config = ("--kubeconfig", str(apiserver))
    first = call_cli("deploy", "apply", str(DSET_SHAPE), *config)
    assert first.returncode == 2 and "install LWS's DisaggregatedSet controller" in first.stderr
    install_crd(kube, "disaggregatedset.x-k8s.io", "DisaggregatedSet")
    second = call_cli("deploy", "apply", str(DSET_SHAPE), *config)
    assert second.returncode == 0, second.stderr
    assert "DisaggregatedSet/llama-70b-dset created" in second.stdout
    assert "DisaggregatedSet/llama-70b-dset unchanged" in call_cli("deploy", "apply", str(DSET_SHAPE), *config).stdout
    stored = kube.get(_dset_resource(kube), name="llama-70b-dset", namespace="default").to_dict()
    (rendered, _) = render(load_deployment(DSET_SHAPE))
    (kept,) = stored["spec"]["roles"][1]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    (sent,) = rendered["spec"]["roles"][1]["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    assert (kept["args"], kept["env"]) == (sent["args"], sent["env"])  # nothing pruned (defaults added)

    slow = call_cli("deploy", "apply", str(DSET_SHAPE), *config, "--wait", "1")
    assert slow.returncode == 2 and "DisaggregatedSet llama-70b-dset did not become Available" in slow.stderr
    # Play the controllers: the prefill leader pod of revision 5c0ffee1, ready, and the set Available.
    pods = kube.resources.get(api_version="v1", kind="Pod")
    leader = "llama-70b-dset-5c0ffee1-prefill-0"
    labels = rendered["spec"]["roles"][0]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": leader, "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "engine", "image": "pathserve:jax-0.10.2"}]},
    }
    kube.create(pods, body=pod, namespace="default")
    kube.patch(
        pods.subresources["status"], name=leader, namespace="default",
        body={"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        content_type="application/merge-patch+json",
    )
    condition = {
        "type": "Available", "status": "True", "reason": "AllRolesReady", "message": "every role is ready",
        "lastTransitionTime": "2026-12-01T00:00:00Z",
    }
    roles = [{"name": name, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1} for name in ("prefill", "decode")]
    kube.patch(
        _dset_resource(kube).subresources["status"], name="llama-70b-dset", namespace="default",
        body={"status": {"conditions": [condition], "roleStatuses": roles}},
        content_type="application/merge-patch+json",
    )
    status = call_cli("deploy", "status", str(DSET_SHAPE), *config)
    assert status.returncode == 0, status.stderr
    assert "DisaggregatedSet llama-70b-dset: 1/1 replicas ready, Available" in status.stdout
    assert f"leader pod {leader}: ready" in status.stdout
    ready = call_cli("deploy", "apply", str(DSET_SHAPE), *config, "--wait", "30")
    assert ready.returncode == 0 and ready.stdout.strip().endswith("DisaggregatedSet/llama-70b-dset available")
