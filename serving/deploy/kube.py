"""Apply, watch and delete rendered objects with the official `kubernetes` client.

Apply is server-side apply with field manager `pathserve`: it creates what is missing, patches what
changed, and leaves an unchanged object untouched (its resourceVersion stays the same).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.deploy.disaggregated import DISAGGREGATED_SET_API
from serving.deploy.errors import DeployError
from serving.deploy.manifests import Manifest
from serving.deploy.pod_parts import LWS_API

FIELD_MANAGER = "pathserve"
INSTALL_HINT = {
    "LeaderWorkerSet": "install LeaderWorkerSet (LWS) in the cluster first: "
    "kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/latest/download/manifests.yaml",
    "PathwaysJob": "install the PathwaysJob controller and CRD in the cluster first "
    "(https://github.com/google/pathways-job)",
    "InferencePool": "install the Gateway API Inference Extension's CRDs first: kubectl apply -f "
    "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/latest/download/manifests.yaml",
    "DisaggregatedSet": "install LWS's DisaggregatedSet controller and CRD in the cluster first "
    "(https://github.com/kubernetes-sigs/lws, v0.9.0 or later)",
}
# The workloads `status` and `apply --wait` read: their API version.
WORKLOADS = {"LeaderWorkerSet": LWS_API, "DisaggregatedSet": DISAGGREGATED_SET_API}


@dataclass(frozen=True)
class Applied:
    kind: str
    name: str
    action: str  # created, configured or unchanged


@dataclass
class DeploymentStatus:
    """What `pathserve deploy status` reports."""

    name: str
    exists: bool
    kind: str = "LeaderWorkerSet"  # or DisaggregatedSet
    replicas: int = 0
    ready_replicas: int = 0
    conditions: list[dict[str, Any]] = field(default_factory=list)
    leader: str = "not found"  # ready, not ready (reason) or not found
    leader_pod: str = ""

    @property
    def available(self) -> bool:
        return any(c.get("type") == "Available" and c.get("status") == "True" for c in self.conditions)

    def format(self) -> str:
        if not self.exists:
            return f"{self.kind} {self.name}: not found"
        lines = [
            f"{self.kind} {self.name}: {self.ready_replicas}/{self.replicas} replicas ready, "
            f"{'Available' if self.available else 'not available'}",
            f"leader pod {self.leader_pod or self.name + '-0'}: {self.leader}",
        ]
        for c in self.conditions:
            lines.append(
                f"  {c.get('type')}={c.get('status')} {c.get('reason', '')}: {c.get('message', '')}".rstrip(
                    ": "
                )
            )
        return "\n".join(lines)


def connect(kubeconfig: str | None = None, context: str | None = None):
    """A DynamicClient for the cluster of `kubeconfig` (default: $KUBECONFIG or ~/.kube/config)."""
    from kubernetes import config as kube_config
    from kubernetes.client import ApiClient
    from kubernetes.config.config_exception import ConfigException
    from kubernetes.dynamic import DynamicClient

    try:
        api = kube_config.new_client_from_config(config_file=kubeconfig, context=context)
    except (ConfigException, OSError) as exc:
        raise DeployError(f"cannot load kubeconfig {kubeconfig or '(default)'}: {exc}") from None
    try:
        return DynamicClient(api if isinstance(api, ApiClient) else ApiClient(api))
    except Exception as exc:  # discovery failed: the API server is unreachable
        raise DeployError(f"cannot reach the Kubernetes API server: {_reason(exc)}") from None


def _resource(client, obj: Manifest):
    from kubernetes.dynamic.exceptions import ResourceNotFoundError

    try:
        return client.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    except ResourceNotFoundError:
        hint = INSTALL_HINT.get(obj["kind"], "install its CRD first")
        raise DeployError(f"the cluster does not know {obj['kind']} ({obj['apiVersion']}): {hint}") from None


def _reason(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            return json.loads(body).get("message", str(body))
        except (ValueError, AttributeError):
            return str(body)
    return str(exc)


def apply(client, objects: list[Manifest]) -> list[Applied]:
    """Server-side apply every object; report created / configured / unchanged."""
    from kubernetes.dynamic.exceptions import ApiException

    results = []
    resources = [_resource(client, obj) for obj in objects]  # a missing CRD: nothing applied
    for obj, resource in zip(objects, resources, strict=True):
        try:
            action = _apply_one(client, resource, obj)
        except ApiException as exc:
            status = getattr(exc, "status", "?")
            name = obj["metadata"]["name"]
            raise DeployError(
                f"the API server rejected {obj['kind']} {name!r} ({status}): {_reason(exc)}"
            ) from None
        results.append(Applied(obj["kind"], obj["metadata"]["name"], action))
    return results


def _apply_one(client, resource, obj: Manifest) -> str:
    """Apply one object. A dry-run apply first tells whether anything would change: an unchanged
    object is not written at all (older API servers bump managedFields times on a no-op apply)."""
    from kubernetes.dynamic.exceptions import NotFoundError

    name, namespace = obj["metadata"]["name"], obj["metadata"].get("namespace")

    def server_side_apply(**dry_run: str):
        return client.server_side_apply(
            resource,
            body=obj,
            name=name,
            namespace=namespace,
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
            **dry_run,
        )

    try:
        live = client.get(resource, name=name, namespace=namespace).to_dict()
    except NotFoundError:
        server_side_apply()
        return "created"
    if _comparable(server_side_apply(dry_run="All").to_dict()) == _comparable(live):
        return "unchanged"
    server_side_apply()
    return "configured"


def _comparable(obj: dict[str, Any]) -> dict[str, Any]:
    """An object without the bookkeeping that changes on every write."""
    metadata = {
        k: v
        for k, v in obj.get("metadata", {}).items()
        if k not in ("managedFields", "resourceVersion", "generation")
    }
    return {**obj, "metadata": metadata}


def delete(client, objects: list[Manifest]) -> list[Applied]:
    """Delete every object (dependents are garbage-collected in the background); missing ones are reported, not an error."""
    from kubernetes.dynamic.exceptions import NotFoundError

    results = []
    for obj in reversed(objects):
        resource = _resource(client, obj)
        name, namespace = obj["metadata"]["name"], obj["metadata"].get("namespace")
        try:
            client.delete(resource, name=name, namespace=namespace, body={"propagationPolicy": "Background"})
            results.append(Applied(obj["kind"], name, "deleted"))
        except NotFoundError:
            results.append(Applied(obj["kind"], name, "not found"))
    return results


def status(client, name: str, namespace: str, kind: str = "LeaderWorkerSet") -> DeploymentStatus:
    """The workload's replicas and conditions (a DisaggregatedSet's ready replicas: its least ready
    role's), and its first leader pod's readiness."""
    from kubernetes.dynamic.exceptions import NotFoundError

    resource = _resource(client, {"apiVersion": WORKLOADS[kind], "kind": kind})
    try:
        workload = client.get(resource, name=name, namespace=namespace).to_dict()
    except NotFoundError:
        return DeploymentStatus(name=name, exists=False, kind=kind)
    st = workload.get("status") or {}
    if kind == "DisaggregatedSet":
        replicas = int(workload["spec"]["roles"][0].get("spec", {}).get("replicas", 1))
        roles = st.get("roleStatuses") or []
        ready = min((int(r.get("readyReplicas") or 0) for r in roles), default=0)
    else:
        replicas, ready = int(workload["spec"].get("replicas", 1)), int(st.get("readyReplicas") or 0)
    result = DeploymentStatus(
        name=name,
        exists=True,
        kind=kind,
        replicas=replicas,
        ready_replicas=ready,
        conditions=list(st.get("conditions") or []),
    )
    pod = _leader_pod(client, name, namespace, kind)
    if pod is None:
        return result
    result.leader_pod = pod["metadata"]["name"]
    ready_condition = next(
        (c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None
    )
    if ready_condition and ready_condition.get("status") == "True":
        result.leader = "ready"
    else:
        phase = (pod.get("status") or {}).get("phase", "Pending")
        reason = ready_condition.get("reason") if ready_condition else None
        result.leader = f"not ready ({phase}{': ' + reason if reason else ''})"
    return result


def _leader_pod(client, name: str, namespace: str, kind: str) -> dict[str, Any] | None:
    """The first group's leader: `NAME-0` of a LeaderWorkerSet; of a DisaggregatedSet, whose LWS
    names carry a revision, the first pod (by name) with our leader labels."""
    from kubernetes.dynamic.exceptions import NotFoundError

    pods = client.resources.get(api_version="v1", kind="Pod")
    if kind == "LeaderWorkerSet":
        try:
            return client.get(pods, name=f"{name}-0", namespace=namespace).to_dict()
        except NotFoundError:
            return None
    selector = f"app.kubernetes.io/name={name},role=leader"
    found = client.get(pods, namespace=namespace, label_selector=selector).to_dict().get("items") or []
    return min(found, key=lambda pod: pod["metadata"]["name"], default=None)


def wait_available(
    client,
    name: str,
    namespace: str,
    timeout_s: float,
    poll_s: float = 2.0,
    on_progress: Callable[[DeploymentStatus], None] | None = None,
    kind: str = "LeaderWorkerSet",
) -> DeploymentStatus:
    """Poll until the workload reports Available=True, or raise a DeployError at the deadline."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        current = status(client, name, namespace, kind)
        if on_progress and (last is None or current.format() != last.format()):
            on_progress(current)
        last = current
        if current.available:
            return current
        if time.monotonic() >= deadline:
            raise DeployError(
                f"{kind} {name} did not become Available within {timeout_s:g} s "
                f"({current.ready_replicas}/{current.replicas} replicas ready; leader {current.leader}); "
                f"see `pathserve deploy status` and the leader pod's logs"
            )
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
