"""`pathserve deploy apply|status|delete` against a real kube-apiserver (no controllers run: the
tests write LWS and Pod status themselves, playing the controllers' part)."""

from __future__ import annotations

import threading
import time

import pytest
import yaml

from serving.deploy.config import load_deployment
from serving.deploy.errors import DeployError
from serving.deploy.kube import apply
from serving.deploy.manifests import render
from tests.cli import call_cli
from tests.deploy.conftest import CONFIGS, install_crd

BASE = CONFIGS / "llama3.1-8b-v6e-4.yml"
# The endpoint picker's objects (serving.deploy.gateway), by the API server's definition names.
BUILTIN_DEFINITIONS = {
    "Deployment": "io.k8s.api.apps.v1.Deployment",
    "ConfigMap": "io.k8s.api.core.v1.ConfigMap",
    "ServiceAccount": "io.k8s.api.core.v1.ServiceAccount",
    "Role": "io.k8s.api.rbac.v1.Role",
    "RoleBinding": "io.k8s.api.rbac.v1.RoleBinding",
    "ClusterRole": "io.k8s.api.rbac.v1.ClusterRole",
    "ClusterRoleBinding": "io.k8s.api.rbac.v1.ClusterRoleBinding",
}
BATCH = CONFIGS / "llama3.1-8b-batch-v6e-4.yml"


def variant(tmp_path, base=BASE, **changes):
    data = yaml.safe_load(base.read_text())
    for key, value in changes.items():
        if key == "serving":
            data["serving"].update(value)
        else:
            data[key] = value
    path = tmp_path / f"{data['name']}-{len(list(tmp_path.iterdir()))}.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def lws_resource(client):
    return client.resources.get(api_version="leaderworkerset.x-k8s.io/v1", kind="LeaderWorkerSet")


def get_lws(client, name: str) -> dict:
    return client.get(lws_resource(client), name=name, namespace="default").to_dict()


def write_lws_status(client, name: str, available: bool, ready: int) -> None:
    status = lws_resource(client).subresources["status"]
    condition = {
        "type": "Available",
        "status": "True" if available else "False",
        "reason": "AllGroupsReady" if available else "GroupsNotReady",
        "message": "All replicas are ready" if available else "Waiting for replicas",
        "lastTransitionTime": "2026-11-30T00:00:00Z",
    }
    client.patch(
        status,
        name=name,
        namespace="default",
        body={"status": {"conditions": [condition], "readyReplicas": ready, "replicas": ready}},
        content_type="application/merge-patch+json",
    )


def test_missing_lws_crd_tells_the_user_to_install_it(kube, apiserver, tmp_path):
    path = variant(tmp_path, name="no-crd-yet")
    result = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "install LeaderWorkerSet (LWS)" in result.stderr and "Traceback" not in result.stderr


def test_apply_creates_then_is_idempotent_then_patches(lws_installed, apiserver, tmp_path):
    client = lws_installed
    path = variant(tmp_path, name="llama-apply")
    first = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver))
    assert first.returncode == 0, first.stderr
    assert first.stdout.split("\n")[:2] == [
        "LeaderWorkerSet/llama-apply created",
        "Service/llama-apply created",
    ]
    lws = get_lws(client, "llama-apply")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    services = client.resources.get(api_version="v1", kind="Service")
    svc_version = client.get(services, name="llama-apply", namespace="default").metadata.resourceVersion

    second = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver))
    assert second.returncode == 0, second.stderr
    assert (
        "LeaderWorkerSet/llama-apply unchanged" in second.stdout
        and "Service/llama-apply unchanged" in second.stdout
    )
    assert get_lws(client, "llama-apply")["metadata"]["resourceVersion"] == lws["metadata"]["resourceVersion"]
    assert (
        client.get(services, name="llama-apply", namespace="default").metadata.resourceVersion == svc_version
    )

    # Two replicas without the pool (tests/deploy/test_gateway.py applies one): a patch of the LWS.
    changed = variant(
        tmp_path, name="llama-apply", replicas=2, gateway={"enabled": False}, serving={"per_device_batch_size": 4}
    )
    third = call_cli("deploy", "apply", str(changed), "--kubeconfig", str(apiserver))
    assert third.returncode == 0, third.stderr
    assert (
        "LeaderWorkerSet/llama-apply configured" in third.stdout
        and "Service/llama-apply unchanged" in third.stdout
    )
    patched = get_lws(client, "llama-apply")
    assert patched["spec"]["replicas"] == 2
    engine = patched["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][2]
    assert "per_device_batch_size=4" in engine["args"]


def test_status_reports_conditions_and_leader_readiness(lws_installed, apiserver, tmp_path):
    client = lws_installed
    path = variant(tmp_path, name="llama-status")
    assert call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver)).returncode == 0

    before = call_cli("deploy", "status", str(path), "--kubeconfig", str(apiserver))
    assert before.returncode == 0, before.stderr
    assert "0/1 replicas ready, not available" in before.stdout
    assert "leader pod llama-status-0: not found" in before.stdout

    pods = client.resources.get(api_version="v1", kind="Pod")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "llama-status-0", "namespace": "default"},
        "spec": {"containers": [{"name": "engine", "image": "pathserve:jax-0.10.2"}]},
    }
    client.create(pods, body=pod, namespace="default")
    write_lws_status(client, "llama-status", available=False, ready=0)
    progressing = call_cli("deploy", "status", str(path), "--kubeconfig", str(apiserver))
    assert "Available=False GroupsNotReady" in progressing.stdout
    assert "leader pod llama-status-0: not ready (Pending)" in progressing.stdout

    client.patch(
        pods.subresources["status"],
        name="llama-status-0",
        namespace="default",
        body={"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        content_type="application/merge-patch+json",
    )
    write_lws_status(client, "llama-status", available=True, ready=1)
    ready = call_cli("deploy", "status", str(path), "--kubeconfig", str(apiserver))
    assert "1/1 replicas ready, Available" in ready.stdout
    assert "leader pod llama-status-0: ready" in ready.stdout


def test_apply_wait_returns_when_available(lws_installed, apiserver, tmp_path):
    client = lws_installed
    path = variant(tmp_path, name="llama-wait")

    def play_controller():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                get_lws(client, "llama-wait")
                break
            except Exception:
                time.sleep(0.2)
        time.sleep(2)
        write_lws_status(client, "llama-wait", available=True, ready=1)

    controller = threading.Thread(target=play_controller, daemon=True)
    controller.start()
    result = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver), "--wait", "60")
    controller.join(timeout=60)
    assert result.returncode == 0, result.stderr
    assert "not available" in result.stdout
    assert result.stdout.strip().endswith("LeaderWorkerSet/llama-wait available")


def test_apply_wait_times_out_with_a_clear_message(lws_installed, apiserver, tmp_path):
    path = variant(tmp_path, name="llama-slow")
    result = call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver), "--wait", "2")
    assert result.returncode == 2
    assert "did not become Available within 2 s" in result.stderr and "Traceback" not in result.stderr


def test_delete_removes_everything(lws_installed, apiserver, tmp_path):
    client = lws_installed
    path = variant(tmp_path, name="llama-delete")
    assert call_cli("deploy", "apply", str(path), "--kubeconfig", str(apiserver)).returncode == 0
    result = call_cli("deploy", "delete", str(path), "--kubeconfig", str(apiserver))
    assert result.returncode == 0, result.stderr
    assert (
        "Service/llama-delete deleted" in result.stdout
        and "LeaderWorkerSet/llama-delete deleted" in result.stdout
    )
    from kubernetes.dynamic.exceptions import NotFoundError

    with pytest.raises(NotFoundError):
        get_lws(client, "llama-delete")
    again = call_cli("deploy", "delete", str(path), "--kubeconfig", str(apiserver))
    assert "LeaderWorkerSet/llama-delete not found" in again.stdout
    status = call_cli("deploy", "status", str(path), "--kubeconfig", str(apiserver))
    assert "LeaderWorkerSet llama-delete: not found" in status.stdout


def test_an_object_the_server_rejects_is_a_clear_error(lws_installed):
    lws = render(load_deployment(BASE))[0]
    lws["metadata"]["name"] = "rejected"
    lws["spec"]["replicas"] = "two"
    with pytest.raises(DeployError, match=r"rejected LeaderWorkerSet 'rejected' \(422\)") as info:
        apply(lws_installed, [lws])
    assert "replicas" in str(info.value)


def test_rendered_objects_pass_server_side_validation(lws_installed):
    """The API server's own validation (dry run) of the Service and the LWS: the Kubernetes schema."""
    client = lws_installed
    for name in ("llama3.1-405b-int8-v6e-16.yml", "llama3.1-405b-int8-v6e-16-jetstream-http.yml"):
        for obj in render(load_deployment(CONFIGS / name)):
            resource = client.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            client.create(resource, body=obj, namespace="default", dry_run="All")
    broken = render(load_deployment(BASE))[1]
    broken["spec"]["ports"][0]["port"] = 70000
    from kubernetes.dynamic.exceptions import UnprocessibleEntityError

    with pytest.raises(UnprocessibleEntityError):
        client.create(
            client.resources.get(api_version="v1", kind="Service"),
            body=broken,
            namespace="default",
            dry_run="All",
        )


def test_batch_job_needs_its_crd_then_applies(kube, apiserver):
    first = call_cli("deploy", "apply", str(BATCH), "--kubeconfig", str(apiserver))
    assert first.returncode == 2
    assert "install the PathwaysJob controller" in first.stderr
    install_crd(kube, "pathways-job.pathways.domain", "PathwaysJob")
    second = call_cli("deploy", "apply", str(BATCH), "--kubeconfig", str(apiserver))
    assert second.returncode == 0, second.stderr
    assert "PathwaysJob/llama-8b-batch created" in second.stdout
    third = call_cli("deploy", "apply", str(BATCH), "--kubeconfig", str(apiserver))
    assert "PathwaysJob/llama-8b-batch unchanged" in third.stdout


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yml")), ids=lambda p: p.stem)
def test_services_and_pod_templates_match_the_kubernetes_schema(kubernetes_schema, path):
    """Validated with jsonschema against the API server's OpenAPI document (unknown fields refused)."""
    for obj in render(load_deployment(path)):
        if obj["kind"] == "Service":
            assert kubernetes_schema(obj, "io.k8s.api.core.v1.Service") == []
        elif obj["kind"] == "LeaderWorkerSet":
            template = obj["spec"]["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                assert kubernetes_schema(template[key], "io.k8s.api.core.v1.PodTemplateSpec") == []
        elif obj["kind"] == "DisaggregatedSet":
            for role in obj["spec"]["roles"]:
                template = role["spec"]["leaderWorkerTemplate"]
                for key in ("leaderTemplate", "workerTemplate"):
                    if key in template:  # the decode role's leader is a worker
                        assert kubernetes_schema(template[key], "io.k8s.api.core.v1.PodTemplateSpec") == []
        elif obj["kind"] == "PathwaysJob":
            template = obj["spec"]["controller"]["template"]
            assert kubernetes_schema(template, "io.k8s.api.core.v1.PodTemplateSpec") == []
        elif obj["kind"] in BUILTIN_DEFINITIONS:
            assert kubernetes_schema(obj, BUILTIN_DEFINITIONS[obj["kind"]]) == [], obj["kind"]
        else:
            assert obj["kind"] == "InferencePool"  # validated against its CRD (test_gateway.py)
    svc = render(load_deployment(BASE))[1]
    svc["spec"]["ports"][0]["prot"] = 1
    assert any("prot" in e for e in kubernetes_schema(svc, "io.k8s.api.core.v1.Service"))
