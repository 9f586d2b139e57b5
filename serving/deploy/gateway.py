"""Replicas behind the Gateway API Inference Extension: an InferencePool over the leader pods of
the LeaderWorkerSet's groups, and the endpoint picker (EPP) that routes each request by the
servers' queue, KV cache use, LoRA adapters and prefixes.

The picker reads each server's /metrics with the names of serving.metric_names: its configuration
(an EndpointPickerConfig, llm-d.ai/v1alpha1, in a ConfigMap) declares an engine type `pathserve`
whose metric specs are ours, and the leader pods carry the engine-type label that selects it.
Rendered: ServiceAccount, Role and RoleBinding (the picker watches pods and the pool), ConfigMap,
Deployment and Service of the picker, then the InferencePool (inference.networking.k8s.io/v1).
The Gateway and HTTPRoute that send traffic to the pool belong to the cluster's gateway class.
"""

from __future__ import annotations

from typing import Any

import yaml

from serving import metric_names
from serving.deploy.config import DeploymentConfig
from serving.deploy.pod_parts import Manifest, labels, sidecar

INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"  # the picker's metrics extractor picks our names by it
ENGINE_TYPE = "pathserve"
EPP_GRPC_PORT = 9002  # ext-proc, called by the gateway
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_CONFIG_FILE = "pathserve-epp.yaml"


def enabled(cfg: DeploymentConfig) -> bool:
    """A pool and its picker are rendered for a serving deployment of more than one replica, or
    one that asks for them (`gateway.enabled: true`)."""
    if cfg.kind != "serve":
        return False
    return cfg.gateway.enabled if cfg.gateway.enabled is not None else cfg.replicas > 1


def leader_labels(cfg: DeploymentConfig) -> dict[str, str]:
    """The labels the pool selects: on every group's leader pod, on no worker pod."""
    return {**labels(cfg), "role": "leader"}


def engine_type_labels(cfg: DeploymentConfig) -> dict[str, str]:
    """Added to the leader pods when the pool is rendered."""
    return {ENGINE_TYPE_LABEL: ENGINE_TYPE} if enabled(cfg) else {}


def model_server_port(cfg: DeploymentConfig) -> int:
    """The engine's own HTTP port (OpenAI routes and /metrics), where the picker sends requests
    and scrapes: behind the jetstream-http sidecar that is ports.engine_http."""
    return cfg.ports.engine_http if sidecar(cfg) else cfg.ports.http


def _epp_name(cfg: DeploymentConfig) -> str:
    return f"{cfg.name}-epp"


def _meta(cfg: DeploymentConfig, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": cfg.namespace, "labels": labels(cfg)}


def picker_config(cfg: DeploymentConfig) -> dict[str, Any]:
    """The EndpointPickerConfig: scrape /metrics, read our names, score by queue, KV use and
    prefix cache (the picker's default profile), pick the best."""
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer"},
            {"type": "max-score-picker"},
            {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
            {
                "type": "core-metrics-extractor",
                "parameters": {
                    "engineLabelKey": ENGINE_TYPE_LABEL,
                    "defaultEngine": ENGINE_TYPE,
                    "engineConfigs": [
                        {
                            "name": ENGINE_TYPE,
                            "queuedRequestsSpec": metric_names.QUEUED_REQUESTS,
                            "runningRequestsSpec": metric_names.RUNNING_REQUESTS,
                            "kvUsageSpec": metric_names.KV_CACHE_USAGE,
                            **({"loraSpec": metric_names.LORA_INFO} if cfg.serving_config().lora.max_loras > 0 else {}),
                            "cacheInfoSpec": metric_names.CACHE_CONFIG_INFO,
                        }
                    ],
                },
            },
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def _rbac(cfg: DeploymentConfig) -> list[Manifest]:
    """The picker's service account: in its namespace it reads pods, the pool and the
    InferenceObjectives it watches; cluster-wide it creates token and access reviews, which its
    authenticated /metrics checks callers with (as the extension's own chart grants)."""
    name = _epp_name(cfg)
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "list"]},
        {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": ["get", "watch", "list"]},
        {"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"], "verbs": ["get", "watch", "list"]},
    ]
    auth_rules = [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
    ]
    subjects = [{"kind": "ServiceAccount", "name": name, "namespace": cfg.namespace}]
    cluster_name = f"{cfg.namespace}-{name}-metrics-auth"  # cluster-scoped: unique across namespaces
    cluster_meta = {"name": cluster_name, "labels": labels(cfg)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(cfg, name)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(cfg, name), "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(cfg, name),
            "subjects": subjects,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        },
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": cluster_meta, "rules": auth_rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": cluster_meta,
            "subjects": subjects,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_name},
        },
    ]


def _picker_deployment(cfg: DeploymentConfig) -> Manifest:
    name = _epp_name(cfg)
    selector = {"app.kubernetes.io/name": name}
    # A TCP probe on the picker's health port: gRPC probes need Kubernetes 1.24+.
    probe = {"tcpSocket": {"port": EPP_HEALTH_PORT}, "periodSeconds": 10}
    container = {
        "name": "epp",
        "image": cfg.gateway.endpoint_picker_image,
        "args": [
            "--pool-name", cfg.name,
            "--pool-namespace", cfg.namespace,
            "--pool-group", "inference.networking.k8s.io",
            "--config-file", f"/config/{EPP_CONFIG_FILE}",
        ],
        "ports": [
            {"name": "grpc", "containerPort": EPP_GRPC_PORT},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT},
        ],
        "livenessProbe": probe,
        "readinessProbe": probe,
        "resources": {"requests": {"cpu": cfg.gateway.cpu, "memory": cfg.gateway.memory}, "limits": {"memory": cfg.gateway.memory}},
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(cfg, name),
        "spec": {
            "replicas": 1,  # the prefix-cache scorer keeps state: one active picker
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": {**selector, "app.kubernetes.io/managed-by": "pathserve"}},
                "spec": {
                    "serviceAccountName": name,
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": name}}],
                },
            },
        },
    }


def render(cfg: DeploymentConfig) -> list[Manifest]:
    """The picker's objects, then the pool (which names the picker's Service)."""
    name = _epp_name(cfg)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cfg, name),
        "data": {EPP_CONFIG_FILE: yaml.safe_dump(picker_config(cfg), sort_keys=False)},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cfg, name),
        "spec": {
            "type": "ClusterIP",
            "selector": {"app.kubernetes.io/name": name},
            "ports": [
                {"name": "grpc-ext-proc", "port": EPP_GRPC_PORT, "targetPort": EPP_GRPC_PORT, "protocol": "TCP",
                 "appProtocol": "http2"},
                {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": EPP_METRICS_PORT, "protocol": "TCP"},
            ],
        },
    }
    pool = {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": _meta(cfg, cfg.name),
        "spec": {
            "selector": {"matchLabels": leader_labels(cfg)},
            "targetPorts": [{"number": model_server_port(cfg)}],
            "endpointPickerRef": {"name": name, "port": {"number": EPP_GRPC_PORT}, "failureMode": "FailClose"},
        },
    }
    return [*_rbac(cfg), config_map, _picker_deployment(cfg), service, pool]
