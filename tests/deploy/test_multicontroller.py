"""`runtime: multicontroller`: an LWS without Pathways, `pathserve serve` on every TPU host, the
coordinator at the leader; validated against the CRD, the Kubernetes schema and a real API server."""

from __future__ import annotations

import yaml

from serving.deploy.config import load_deployment
from serving.deploy.crds import validate_object
from serving.deploy.manifests import render
from tests.cli import call_cli
from tests.deploy.conftest import CONFIGS

V6E_405B = CONFIGS / "llama3.1-405b-int8-v6e-16.yml"  # v6e 4x4: 16 chips on 4 hosts


def multicontroller(tmp_path, **changes):
    data = yaml.safe_load(V6E_405B.read_text())
    data.update({"runtime": "multicontroller", "name": "llama-405b-mc", **changes})
    path = tmp_path / f"{data['name']}-{data.get('kind', 'serve')}.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_host_runs_pathserve_on_its_chips_and_only_the_leader_serves(tmp_path):
    lws, svc = render(load_deployment(multicontroller(tmp_path)))
    validate_object(lws)
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 4  # one pod per host, the leader being one of them
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    pods = {role: template[f"{role}Template"]["spec"] for role in ("leader", "worker")}
    for role, pod in pods.items():
        (engine,) = pod["containers"]  # no pathways-rm, pathways-proxy or pathways-worker
        assert engine["command"] == ["pathserve"] and engine["args"][0] == "serve"
        assert "runtime=multicontroller" in engine["args"]
        assert engine["resources"]["limits"]["google.com/tpu"] == 4
        assert {"name": "JAX_COORDINATOR_ADDRESS", "value": "$(LWS_LEADER_ADDRESS):8476"} in engine["env"]
        assert not any(e["name"] == "JAX_PLATFORMS" for e in engine["env"])
        assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
        probes = {k for k in engine if k.endswith("Probe")}
        assert probes == ({"startupProbe", "readinessProbe", "livenessProbe"} if role == "leader" else set())
    assert pods["leader"]["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_pod_templates_match_the_kubernetes_schema(kubernetes_schema, tmp_path):
    lws, svc = render(load_deployment(multicontroller(tmp_path)))
    assert kubernetes_schema(svc, "io.k8s.api.core.v1.Service") == []
    for key in ("leaderTemplate", "workerTemplate"):
        assert kubernetes_schema(lws["spec"]["leaderWorkerTemplate"][key], "io.k8s.api.core.v1.PodTemplateSpec") == []


def test_applies_to_the_api_server(lws_installed, apiserver, tmp_path):
    path = multicontroller(tmp_path)
    first = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver))
    assert first.returncode == 0, first.stderr
    assert "LeaderWorkerSet/llama-405b-mc created" in first.stdout
    resource = lws_installed.resources.get(api_version="leaderworkerset.x-k8s.io/v1", kind="LeaderWorkerSet")
    stored = lws_installed.get(resource, name="llama-405b-mc", namespace="default").to_dict()
    assert stored["spec"]["leaderWorkerTemplate"]["size"] == 4
    again = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver))
    assert again.returncode == 0 and "LeaderWorkerSet/llama-405b-mc unchanged" in again.stdout, again.stderr


def test_batch_is_refused_naming_the_runtime(tmp_path):
    path = multicontroller(tmp_path, kind="batch", batch={"input": "gs://b/in/", "output": "gs://b/out/"})
    result = call_cli("deploy", "render", str(path))
    assert result.returncode == 2
    assert "runtime: multicontroller" in result.stderr and "Traceback" not in result.stderr
