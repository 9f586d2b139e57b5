"""Typed builders: DeploymentConfig -> LeaderWorkerSet, Service and PathwaysJob (plain dicts).

The leader pod of each LeaderWorkerSet group holds the Pathways resource manager, the Pathways
proxy and the engine; the workers run the Pathways server on TPU hosts. The engine serves HTTP and
JetStream's gRPC API itself (`frontend: builtin`), or, in the seed's layout (`frontend:
jetstream-http`), gRPC behind a `jetstream-http` sidecar that answers HTTP, probes included.
"""

from __future__ import annotations

from typing import Any

from serving.deploy import disaggregated, gateway, multicontroller
from serving.deploy.accelerators import Slice
from serving.deploy.config import PROXY_PORT, RM_PORT, WORKER_PORT, DeploymentConfig
from serving.deploy.errors import DeployError
from serving.deploy.pod_parts import (
    LEADER,
    LWS_NAME_LABEL,
    LWS_WORKER_INDEX_LABEL,
    Manifest,
    labels,
    metadata,
    probes,
    sidecar,
    tpu_node_selector,
)
from serving.deploy.pod_parts import leader_worker_set as lws_manifest

PATHWAYS_JOB_API = "pathways-job.pathways.domain/v1"


def render(cfg: DeploymentConfig) -> list[Manifest]:
    """Every object of the deployment, in apply order."""
    disaggregated.split(cfg)  # a disaggregated server's sides must be the deployment's two slices
    if cfg.kind == "batch" and cfg.runtime != "multicontroller":
        return [pathways_job(cfg, index) for index in range(cfg.replicas)]
    if cfg.runtime == "multicontroller":
        workload = multicontroller.leader_worker_set(cfg)
    elif disaggregated.uses_disaggregated_set(cfg):
        workload = disaggregated_set(cfg)
    else:
        workload = leader_worker_set(cfg)
    return [workload, service(cfg), *(gateway.render(cfg) if gateway.enabled(cfg) else [])]


def _jax_tag(cfg: DeploymentConfig) -> str:
    return "jax-" + next(iter(cfg.images.jax_versions().values()))


def engine_container(cfg: DeploymentConfig) -> dict[str, Any]:
    """`pathserve serve` with the config's overrides as key=value arguments, on the Pathways proxy."""
    http = cfg.ports.engine_http if sidecar(cfg) else cfg.ports.http
    return {
        "name": "engine",
        "image": cfg.images.engine,
        "command": ["pathserve"],
        "args": ["serve", *cfg.serving_args(), "--host=0.0.0.0", f"--port={http}"],
        "env": [
            {"name": "JAX_PLATFORMS", "value": "proxy"},
            {"name": "JAX_BACKEND_TARGET", "value": f"grpc://localhost:{PROXY_PORT}"},
            {"name": "ENABLE_PATHWAYS_PERSISTENCE", "value": "1"},
        ],
        "ports": [
            {"name": "engine-http" if sidecar(cfg) else "http", "containerPort": http},
            {"name": "grpc", "containerPort": cfg.ports.grpc},
        ],
        **probes(cfg),
        "resources": {
            "requests": {"cpu": cfg.resources.engine_cpu, "memory": cfg.resources.engine_memory},
            "limits": {"memory": cfg.resources.engine_memory},
        },
    }


def jetstream_http_container(cfg: DeploymentConfig) -> dict[str, Any]:
    """The seed's sidecar: JetStream's /generate and /healthcheck on ports.http, calling the
    engine's gRPC API on localhost (the pod's containers share one network namespace)."""
    r = cfg.resources
    return {
        "name": "jetstream-http",
        "image": cfg.images.jetstream_http,
        "ports": [{"name": "http", "containerPort": cfg.ports.http}],
        "resources": {
            "requests": {"cpu": r.jetstream_http_cpu, "memory": r.jetstream_http_memory},
            "limits": {"memory": r.jetstream_http_memory},
        },
    }


def _pathways_resources(cfg: DeploymentConfig) -> dict[str, Any]:
    r = cfg.resources
    return {
        "requests": {"cpu": r.pathways_cpu, "memory": r.pathways_memory},
        "limits": {"memory": r.pathways_memory},
    }


def _pathways_container(
    cfg: DeploymentConfig, name: str, image: str, port: int, args: list[str], resources: dict[str, Any]
) -> dict[str, Any]:
    """A Pathways component: its own port, its flags, and the shared scratch location."""
    return {
        "name": name,
        "image": image,
        "args": [f"--server_port={port}", *args, f"--gcs_scratch_location={cfg.scratch}"],
        "ports": [{"containerPort": port}],
        "resources": resources,
    }


def resource_manager_container(cfg: DeploymentConfig, tpu: Slice) -> dict[str, Any]:
    args = [
        "--node_type=resource_manager",
        f"--instance_count={cfg.tpu.num_slices}",
        f"--instance_type={tpu.instance_type}",
        *tpu.accelerator.resource_manager_flags,
    ]
    container = _pathways_container(
        cfg, "pathways-rm", cfg.images.pathways_server, RM_PORT, args, _pathways_resources(cfg)
    )
    container["env"] = [
        {"name": "HOST_ADDRESS", "value": LEADER},
        {"name": "TPU_SKIP_MDS_QUERY", "value": "true"},
    ]
    return container


def proxy_container(cfg: DeploymentConfig) -> dict[str, Any]:
    args = [f"--resource_manager_address={LEADER}:{RM_PORT}"]
    return _pathways_container(
        cfg, "pathways-proxy", cfg.images.pathways_proxy, PROXY_PORT, args, _pathways_resources(cfg)
    )


def worker_container(cfg: DeploymentConfig, tpu: Slice, resource_manager: str = LEADER) -> dict[str, Any]:
    """The Pathways server of one TPU host, registering with the resource manager at `resource_manager`."""
    args = [f"--resource_manager_address={resource_manager}:{RM_PORT}"]
    tpus = {"limits": {"google.com/tpu": tpu.chips_per_host}}
    return _pathways_container(cfg, "pathways-worker", cfg.images.pathways_server, WORKER_PORT, args, tpus)


def tpu_scheduling(tpu: Slice) -> dict[str, Any]:
    """The node selector and toleration of a pod in a TPU slice's node pool. The leader takes them
    too, as in the seed: a LeaderWorkerSet's exclusive topology puts every pod of a group, leader
    included, in one node pool, and a leader that cannot land on the TPU pool keeps its workers
    Pending with it."""
    return {
        "nodeSelector": tpu_node_selector(tpu),
        "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
    }


def leader_pod(cfg: DeploymentConfig, tpu: Slice) -> dict[str, Any]:
    """The leader: the Pathways resource manager (one instance per slice), its proxy and the engine."""
    return {
        "metadata": {"labels": {**gateway.leader_labels(cfg), **gateway.engine_type_labels(cfg)}},
        "spec": {
            **tpu_scheduling(tpu),
            "containers": [
                resource_manager_container(cfg, tpu),
                proxy_container(cfg),
                engine_container(cfg),
                *([jetstream_http_container(cfg)] if sidecar(cfg) else []),
            ],
        },
    }


def worker_pod(cfg: DeploymentConfig, tpu: Slice, container: dict[str, Any] | None = None) -> dict[str, Any]:
    """A TPU host's pod: its Pathways server (`container`, default the one of its own group's leader)."""
    return {
        "metadata": {"labels": {**labels(cfg), "role": "worker"}},
        "spec": {
            **tpu_scheduling(tpu),
            "containers": [container or worker_container(cfg, tpu)],
        },
    }


def leader_worker_set(cfg: DeploymentConfig) -> Manifest:
    """One group per replica: a leader (RM, proxy, engine) plus one worker pod per TPU host; over
    several slices (the disaggregated server's two, or a multi-slice engine) one subgroup per slice,
    the leader in the first."""
    tpu = cfg.tpu.slice()
    size = tpu.hosts * cfg.tpu.num_slices + 1
    subgroup = tpu.hosts if cfg.tpu.num_slices > 1 else None
    return lws_manifest(cfg, size, leader_pod(cfg, tpu), worker_pod(cfg, tpu), subgroup)


def disaggregated_set(cfg: DeploymentConfig) -> Manifest:
    """The DisaggregatedSet of serving.deploy.disaggregated from the LeaderWorkerSet's own pods: the
    decode role's Pathways servers join their prefill leader's resource manager."""
    tpu = cfg.tpu.slice()
    decode = worker_container(cfg, tpu, disaggregated.prefill_leader_address(cfg))
    decode["env"] = disaggregated.pairing_env()
    return disaggregated.disaggregated_set(
        cfg, tpu, leader_pod(cfg, tpu), worker_pod(cfg, tpu), worker_pod(cfg, tpu, decode)
    )


def service(cfg: DeploymentConfig) -> Manifest:
    """ClusterIP Service in front of the leaders: HTTP (the engine's or the sidecar's) and gRPC;
    behind the sidecar also the engine's own HTTP (OpenAI routes, /metrics). A DisaggregatedSet's
    LWS names carry its revision, so its leaders are selected by our own labels."""
    names = {"http": cfg.ports.http, "grpc": cfg.ports.grpc}
    if sidecar(cfg):
        names["engine-http"] = cfg.ports.engine_http
    if disaggregated.uses_disaggregated_set(cfg):
        selector = gateway.leader_labels(cfg)
    else:
        selector = {LWS_NAME_LABEL: cfg.name, LWS_WORKER_INDEX_LABEL: "0"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(cfg),
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {"name": name, "port": port, "targetPort": port, "protocol": "TCP"}
                for name, port in names.items()
            ],
        },
    }


def pathways_job(cfg: DeploymentConfig, index: int = 0) -> Manifest:
    """A batch worker: `pathserve batch` as the main container, colocated with the Pathways head.

    PathwaysJob has no replicas of its own (one job is one Pathways cluster), so `replicas: N`
    renders N jobs, `NAME-0` .. `NAME-{N-1}` (one: `NAME`), on the same input and output: they
    share the work through shard claims (serving.batch.claims). Each job's worker id is its name,
    stable across the job's restarts, so a restarted worker takes back its own claims at once."""
    if cfg.batch is None:
        raise DeployError("batch: a PathwaysJob needs the batch section (input, output)")
    tpu = cfg.tpu.slice()
    name = cfg.name if cfg.replicas == 1 else f"{cfg.name}-{index}"
    main = {
        "name": "batch",
        "image": cfg.images.engine,
        "command": ["pathserve"],
        "args": [
            "batch",
            f"--input={cfg.batch.input}",
            f"--output={cfg.batch.output}",
            f"--worker-id={name}",
            *cfg.serving_args(),
        ],
        # as the serving engine's: Orbax restores through Pathways' persistence handler (the seed)
        "env": [{"name": "JAX_PLATFORMS", "value": "proxy"}, {"name": "ENABLE_PATHWAYS_PERSISTENCE", "value": "1"}],
        "resources": {
            "requests": {"cpu": cfg.resources.engine_cpu, "memory": cfg.resources.engine_memory},
            "limits": {"memory": cfg.resources.engine_memory},
        },
    }
    return {
        "apiVersion": PATHWAYS_JOB_API,
        "kind": "PathwaysJob",
        "metadata": {**metadata(cfg), "name": name},
        "spec": {
            "maxRestarts": cfg.batch.max_restarts,
            "pathwaysVersion": _jax_tag(cfg),
            "pathwaysDir": cfg.scratch,
            "workers": [
                {
                    "type": tpu.machine_type,
                    "topology": cfg.tpu.topology,
                    "numSlices": cfg.tpu.num_slices,
                    "maxSliceRestarts": cfg.batch.max_restarts,
                }
            ],
            "customComponents": [
                {"componentType": "pathways_server", "image": cfg.images.pathways_server},
                {"componentType": "worker", "image": cfg.images.pathways_server},
                {"componentType": "proxy_server", "image": cfg.images.pathways_proxy},
            ],
            "controller": {
                "deploymentMode": "colocate_head_with_workers",
                "mainContainerName": "batch",
                "template": {"spec": {"containers": [main], "restartPolicy": "Never"}},
            },
        },
    }
