"""Replicas behind an InferencePool (serving.deploy.gateway): N LeaderWorkerSet groups, the pool
selecting exactly their leader pods, the endpoint picker configured with our metric names;
validated against the InferencePool CRD and applied to the real kube-apiserver."""

from __future__ import annotations

import copy

import pytest
import yaml

from serving import metric_names
from serving.deploy.config import load_deployment
from serving.deploy.crds import validate_object
from serving.deploy.errors import DeployError
from serving.deploy.gateway import ENGINE_TYPE, ENGINE_TYPE_LABEL
from serving.deploy.manifests import render
from tests.cli import call_cli
from tests.deploy.conftest import CONFIGS, install_crd
from tests.deploy.test_cluster import variant

REPLICAS = CONFIGS / "llama3.1-8b-v6e-4-replicas.yml"
SIDECAR = CONFIGS / "llama3.1-405b-int8-v6e-16-jetstream-http.yml"


def by_kind(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def selects(selector: dict[str, str], pod_labels: dict[str, str]) -> bool:
    return all(pod_labels.get(k) == v for k, v in selector.items())


def test_replicas_render_n_groups_and_a_pool_of_exactly_their_leaders():
    cfg = load_deployment(REPLICAS)
    objects = by_kind(render(cfg))
    lws = objects[("LeaderWorkerSet", cfg.name)]
    pool = objects[("InferencePool", cfg.name)]
    validate_object(pool)
    assert lws["spec"]["replicas"] == cfg.replicas == 4
    template = lws["spec"]["leaderWorkerTemplate"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selects(selector, template["leaderTemplate"]["metadata"]["labels"])
    assert not selects(selector, template["workerTemplate"]["metadata"]["labels"])
    epp = objects[("Deployment", f"{cfg.name}-epp")]
    assert not selects(selector, epp["spec"]["template"]["metadata"]["labels"])
    assert pool["spec"]["targetPorts"] == [{"number": cfg.ports.http}]
    engine = next(c for c in template["leaderTemplate"]["spec"]["containers"] if c["name"] == "engine")
    assert {"name": "http", "containerPort": cfg.ports.http} in engine["ports"]
    # The pool names the picker's Service and one of its ports; the Service selects the picker.
    ref = pool["spec"]["endpointPickerRef"]
    service = objects[("Service", ref["name"])]
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert selects(service["spec"]["selector"], epp["spec"]["template"]["metadata"]["labels"])
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == ref["name"]


def test_the_picker_reads_our_metric_names_for_the_leaders_engine_type():
    cfg = load_deployment(REPLICAS)
    objects = by_kind(render(cfg))
    (config_text,) = objects[("ConfigMap", f"{cfg.name}-epp")]["data"].values()
    config = yaml.safe_load(config_text)
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    assert engine == {
        "name": ENGINE_TYPE,
        "queuedRequestsSpec": metric_names.QUEUED_REQUESTS,
        "runningRequestsSpec": metric_names.RUNNING_REQUESTS,
        "kvUsageSpec": metric_names.KV_CACHE_USAGE,
        "cacheInfoSpec": metric_names.CACHE_CONFIG_INFO,
    }  # no loraSpec: this deployment has no LoRA adapters
    assert extractor["parameters"]["engineLabelKey"] == ENGINE_TYPE_LABEL
    leader = objects[("LeaderWorkerSet", cfg.name)]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert leader["metadata"]["labels"][ENGINE_TYPE_LABEL] == ENGINE_TYPE
    args = objects[("Deployment", f"{cfg.name}-epp")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == cfg.name
    profile_refs = {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert profile_refs <= {p["type"] for p in config["plugins"]}


def test_behind_the_sidecar_the_pool_targets_the_engines_own_http(tmp_path):
    cfg = load_deployment(variant(tmp_path, base=SIDECAR, replicas=2))
    pool = by_kind(render(cfg))[("InferencePool", cfg.name)]
    assert pool["spec"]["targetPorts"] == [{"number": cfg.ports.engine_http}]  # OpenAI routes, /metrics


def test_one_replica_renders_no_pool_unless_asked_and_batch_refuses_one(tmp_path):
    assert {o["kind"] for o in render(load_deployment(CONFIGS / "llama3.1-8b-v6e-4.yml"))} == {
        "LeaderWorkerSet",
        "Service",
    }
    asked = load_deployment(variant(tmp_path, gateway={"enabled": True}))
    assert "InferencePool" in {o["kind"] for o in render(asked)}
    batch = variant(tmp_path, base=CONFIGS / "llama3.1-8b-batch-v6e-4.yml", gateway={"enabled": True})
    with pytest.raises(DeployError, match=r"gateway\.enabled"):
        load_deployment(batch)


def test_plan_states_the_replicas_totals():
    result = call_cli("deploy", "plan", str(REPLICAS))
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("4 replica(s)"))
    assert "16 chips, 128 slots" in line and "tokens/s in all" in line


def test_the_pool_and_picker_apply_to_the_api_server(lws_installed, apiserver, tmp_path):
    client = lws_installed
    path = variant(tmp_path, base=REPLICAS, name="pool-apply")
    refused = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver))
    assert refused.returncode == 2 and "Gateway API Inference Extension" in refused.stderr
    assert "created" not in refused.stdout  # nothing half-applied before the missing CRD
    install_crd(client, "inference.networking.k8s.io", "InferencePool")
    first = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver))
    assert first.returncode == 0, first.stderr
    objects = render(load_deployment(path))
    for obj in objects:
        assert f"{obj['kind']}/{obj['metadata']['name']} " in first.stdout
    pools = client.resources.get(api_version="inference.networking.k8s.io/v1", kind="InferencePool")
    stored = client.get(pools, name="pool-apply", namespace="default").to_dict()
    assert stored["spec"]["selector"] == objects[-1]["spec"]["selector"]
    again = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver))
    assert again.stdout.count(" unchanged") == len(objects), again.stdout
    # The server checks the CRD's schema too: a pool without target ports is refused.
    broken = copy.deepcopy(objects[-1])
    broken["metadata"]["name"] = "no-ports"
    broken["spec"]["targetPorts"] = []
    from kubernetes.dynamic.exceptions import UnprocessibleEntityError

    with pytest.raises(UnprocessibleEntityError):
        client.create(pools, body=broken, namespace="default", dry_run="All")
    deleted = call_cli("deploy", "delete", str(path), "--kubeconfig", str(apiserver))
    assert deleted.stdout.count(" deleted") == len(objects), deleted.stdout


def test_batch_replicas_render_n_pathways_jobs_on_one_output_each_its_own_worker(tmp_path):
    from serving.cli.main import build_parser

    base = CONFIGS / "llama3.1-8b-batch-v6e-4.yml"
    jobs = render(load_deployment(variant(tmp_path, base=base, replicas=3)))
    assert [j["metadata"]["name"] for j in jobs] == ["llama-8b-batch-0", "llama-8b-batch-1", "llama-8b-batch-2"]
    workers, outputs = set(), set()
    for job in jobs:
        validate_object(job)
        (main,) = job["spec"]["controller"]["template"]["spec"]["containers"]
        ns, _ = build_parser().parse_known_args(main["args"])
        workers.add(ns.worker_id)
        outputs.add(ns.output)
    assert workers == {j["metadata"]["name"] for j in jobs} and len(outputs) == 1


def test_the_picker_reads_lora_info_only_when_lora_is_configured():
    from serving.deploy.gateway import picker_config

    cfg = load_deployment(REPLICAS)
    with_lora = cfg.model_copy(update={"serving": {**cfg.serving, "max_loras": 2}})
    for deployment, expected in ((cfg, False), (with_lora, True)):
        (extractor,) = [p for p in picker_config(deployment)["plugins"] if p["type"] == "core-metrics-extractor"]
        (engine,) = extractor["parameters"]["engineConfigs"]
        assert ("loraSpec" in engine) == expected


def test_the_pickers_account_may_read_objectives_and_review_metrics_callers():
    cfg = load_deployment(REPLICAS)
    objects = by_kind(render(cfg))
    role = objects[("Role", f"{cfg.name}-epp")]
    assert any("inferenceobjectives" in r["resources"] for r in role["rules"])
    (cluster_role,) = [o for (kind, _), o in objects.items() if kind == "ClusterRole"]
    resources = {res for rule in cluster_role["rules"] for res in rule["resources"]}
    assert resources == {"tokenreviews", "subjectaccessreviews"}
    (binding,) = [o for (kind, _), o in objects.items() if kind == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{cfg.name}-epp", "namespace": cfg.namespace}]
