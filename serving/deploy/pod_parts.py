"""Pieces every LeaderWorkerSet pod of ours shares, whichever runtime it runs: the LWS names, our
labels and metadata, TPU node selectors, and the engine's probes."""

from __future__ import annotations

from typing import Any

from serving.deploy.accelerators import Slice
from serving.deploy.config import DeploymentConfig

LWS_API = "leaderworkerset.x-k8s.io/v1"
LEADER = "$(LWS_LEADER_ADDRESS)"  # injected by the LWS controller into every pod of a group
EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"
SUBGROUP_EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/subgroup-exclusive-topology"
NODE_POOL = "cloud.google.com/gke-nodepool"  # a TPU slice is one GKE node pool
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

Manifest = dict[str, Any]


def labels(cfg: DeploymentConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": cfg.name, "app.kubernetes.io/managed-by": "pathserve"}


def metadata(cfg: DeploymentConfig, **extra: Any) -> dict[str, Any]:
    return {"name": cfg.name, "namespace": cfg.namespace, "labels": labels(cfg), **extra}


def tpu_node_selector(tpu: Slice) -> dict[str, str]:
    return {
        "cloud.google.com/gke-tpu-accelerator": tpu.accelerator.gke_name,
        "cloud.google.com/gke-tpu-topology": tpu.topology,
    }


def http_probe(path: str, port: int, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}


def sidecar(cfg: DeploymentConfig) -> bool:
    return cfg.frontend == "jetstream-http"


def probes(cfg: DeploymentConfig) -> dict[str, Any]:
    """Our /startupz, /readyz and /livez; behind the sidecar, its /healthcheck for all three (as in
    the seed), which asks the engine's gRPC HealthCheck."""
    p = cfg.probes
    paths = ("/healthcheck",) * 3 if sidecar(cfg) else ("/startupz", "/readyz", "/livez")
    failures = (
        -(-p.startup_timeout_s // p.period_s),
        p.readiness_failure_threshold,
        p.liveness_failure_threshold,
    )
    kinds = ("startupProbe", "readinessProbe", "livenessProbe")
    return {
        kind: http_probe(path, cfg.ports.http, p.period_s, n)
        for kind, path, n in zip(kinds, paths, failures, strict=True)
    }


def lws_spec(
    cfg: DeploymentConfig,
    size: int,
    leader: dict[str, Any] | None,
    worker: dict[str, Any],
    sub_group_size: int | None = None,
) -> dict[str, Any]:
    """A LeaderWorkerSet's spec: `replicas` groups of `size` pods, the whole group recreated when a
    pod restarts; `leader` and `worker` pod templates (no leader: the leader is a worker too), and
    subgroups of `sub_group_size` pods (the leader joins the first)."""
    template: dict[str, Any] = {"size": size, "restartPolicy": "RecreateGroupOnPodRestart"}
    if sub_group_size:
        template["subGroupPolicy"] = {"subGroupSize": sub_group_size}
    if leader is not None:
        template["leaderTemplate"] = leader
    template["workerTemplate"] = worker
    return {"replicas": cfg.replicas, "startupPolicy": "LeaderCreated", "leaderWorkerTemplate": template}


def leader_worker_set(
    cfg: DeploymentConfig,
    size: int,
    leader: dict[str, Any],
    worker: dict[str, Any],
    sub_group_size: int | None = None,
) -> Manifest:
    """The LeaderWorkerSet every layout shares (`lws_spec`): each group on one node pool, or with
    subgroups (one TPU slice each) each subgroup on a node pool of its own."""
    exclusive = SUBGROUP_EXCLUSIVE_TOPOLOGY if sub_group_size else EXCLUSIVE_TOPOLOGY
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": metadata(cfg, annotations={exclusive: NODE_POOL}),
        "spec": lws_spec(cfg, size, leader, worker, sub_group_size),
    }
