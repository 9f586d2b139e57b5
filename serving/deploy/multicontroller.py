"""The LeaderWorkerSet of `runtime: multicontroller`: JAX's own distributed runtime, no Pathways.

One pod per TPU host (LWS `size` = hosts), each running `pathserve serve` on its own chips
(`google.com/tpu`). The leader (worker index 0) is JAX process 0: it hosts the coordinator
(JAX_COORDINATOR_ADDRESS = $(LWS_LEADER_ADDRESS):COORDINATOR_PORT), serves HTTP and gRPC and
decides every step; the workers follow it (serving.orchestrator.lockstep) and serve nothing, so
only the leader has probes and the Service selects it. Process count and index come from the
LWS_GROUP_SIZE and LWS_WORKER_INDEX the LWS controller injects (serving.runtime.distributed_args).
A dead or stalled pod fails the group; `RecreateGroupOnPodRestart` starts it again as a whole.
"""

from __future__ import annotations

from typing import Any

from serving.deploy import gateway
from serving.deploy.accelerators import Slice
from serving.deploy.config import DeploymentConfig
from serving.deploy.errors import DeployError
from serving.deploy.pod_parts import (
    LEADER,
    Manifest,
    labels,
    probes,
    tpu_node_selector,
)
from serving.deploy.pod_parts import (
    leader_worker_set as lws_manifest,
)
from serving.runtime import DEFAULT_COORDINATOR_PORT

COORDINATOR_PORT = DEFAULT_COORDINATOR_PORT


def engine_container(cfg: DeploymentConfig, tpu: Slice, leader: bool) -> dict[str, Any]:
    """`pathserve serve runtime=multicontroller` on one host's chips; ports and probes on the leader."""
    ports = [{"name": "coordinator", "containerPort": COORDINATOR_PORT}]
    if leader:
        ports = [
            {"name": "http", "containerPort": cfg.ports.http},
            {"name": "grpc", "containerPort": cfg.ports.grpc},
            *ports,
        ]
    return {
        "name": "engine",
        "image": cfg.images.engine,
        "command": ["pathserve"],
        "args": [
            "serve", *cfg.serving_args(), "runtime=multicontroller", "--host=0.0.0.0", f"--port={cfg.ports.http}",
        ],
        "env": [{"name": "JAX_COORDINATOR_ADDRESS", "value": f"{LEADER}:{COORDINATOR_PORT}"}],
        "ports": ports,
        **(probes(cfg) if leader else {}),
        "resources": {
            "requests": {"cpu": cfg.resources.engine_cpu, "memory": cfg.resources.engine_memory},
            "limits": {"memory": cfg.resources.engine_memory, "google.com/tpu": tpu.chips_per_host},
        },
    }


def _pod_labels(cfg: DeploymentConfig, role: str) -> dict[str, str]:
    """A leader's: the labels the pool selects (gateway.leader_labels) and the engine type; a
    worker's: the deployment's labels and its role."""
    if role == "leader":
        return {**gateway.leader_labels(cfg), **gateway.engine_type_labels(cfg)}
    return {**labels(cfg), "role": role}


def _pod(cfg: DeploymentConfig, tpu: Slice, role: str) -> dict[str, Any]:
    return {
        "metadata": {"labels": _pod_labels(cfg, role)},
        "spec": {
            "nodeSelector": tpu_node_selector(tpu),
            "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
            "containers": [engine_container(cfg, tpu, leader=role == "leader")],
        },
    }


def leader_worker_set(cfg: DeploymentConfig) -> Manifest:
    """One group per replica: one pod per TPU host, the leader being JAX process 0."""
    if cfg.kind != "serve":
        raise DeployError("runtime: multicontroller renders a serving LeaderWorkerSet; kind: batch runs on Pathways")
    if "runtime" in cfg.serving:
        raise DeployError("serving.runtime: set runtime (the deployment's) instead")
    tpu = cfg.tpu.slice()
    if cfg.tpu.num_slices != 1:
        raise DeployError("tpu.num_slices: runtime: multicontroller serves one slice (Pathways spans several)")
    return lws_manifest(cfg, tpu.hosts, _pod(cfg, tpu, "leader"), _pod(cfg, tpu, "worker"))
