"""Disaggregated prefill and decode on a cluster: the engine's device split checked against the
deployment's slices, and LWS's DisaggregatedSet that is one of its two shapes.

MaxText's `inference_server=ExperimentalMaxtextDisaggregatedServer...` (serving.disaggregation)
runs a prefill engine and a generate engine in one controller, each on a slice of its own; a
prompt's KV moves from one to the other inside that process (`jax.device_put` onto the generate
engine's shardings). So one Pathways cluster spans both slices (the resource manager's
`--instance_count=2`) and one engine container takes every request. `disaggregation:` picks the
object that deploys it:

1. `leaderworkerset` (the JetStream guide's): one LeaderWorkerSet whose groups hold the leader and
   both slices' hosts, a subgroup per slice (`subGroupSize` = hosts of a slice, the leader in the
   first), each subgroup on a node pool of its own (`subgroup-exclusive-topology`);
   serving.deploy.manifests renders it.
2. `disaggregatedset`: a DisaggregatedSet (disaggregatedset.x-k8s.io/v1) whose two roles are LWS
   templates. `prefill`: the leader (resource manager, proxy, engine) and one slice's Pathways
   servers, as an interleaved group. `decode`: the other slice's Pathways servers and nothing
   else; they join the resource manager of the prefill leader with the same revision and group
   index. The DisaggregatedSet's controller names each role's LWS `NAME-REVISION-ROLE` and labels
   its pods with the revision, LWS labels them with their group index, so a decode pod finds that
   leader at `NAME-$(REVISION)-prefill-$(GROUP).NAME-$(REVISION)-prefill.NAMESPACE` (the downward
   API gives it both labels). The CRD has no routing field; requests reach the engine through the Service
   in front of the prefill leaders, and reach the decode slice only as KV inside the engine.
"""

from __future__ import annotations

from typing import Any

from serving.config import ServingConfig
from serving.deploy.accelerators import Slice
from serving.deploy.config import DeploymentConfig
from serving.deploy.errors import DeployError
from serving.deploy.pod_parts import EXCLUSIVE_TOPOLOGY, NODE_POOL, Manifest, labels, lws_spec, metadata
from serving.disaggregation import DISAGGREGATED, Disaggregation

DISAGGREGATED_SET_API = "disaggregatedset.x-k8s.io/v1"
PREFILL_ROLE, DECODE_ROLE = "prefill", "decode"
REVISION_LABEL = "disaggregatedset.x-k8s.io/revision"  # on every pod of a DisaggregatedSet revision
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # on every pod of an LWS group
REVISION_ENV, GROUP_INDEX_ENV = "DISAGGREGATEDSET_REVISION", "LWS_GROUP_INDEX"


def split(cfg: DeploymentConfig) -> Disaggregation | None:
    """The engine's prefill / generate split (None: interleaved), refused with the field's name
    unless each side is one whole slice of the deployment's two, as JetStream requires of its
    slices (every device on one side)."""
    return check_split(cfg, cfg.serving_config())


def check_split(cfg: DeploymentConfig, serving: ServingConfig) -> Disaggregation | None:
    """`split` with the engine's config already read (the plan's)."""
    sides = serving.disaggregation
    if sides is None:
        if cfg.disaggregation == "disaggregatedset":
            raise DeployError(
                f"disaggregation: disaggregatedset deploys a disaggregated server, but serving.inference_server "
                f"is {serving.inference_server}; set it to {DISAGGREGATED}_<devices per side> or leave "
                "disaggregation out"
            )
        return None
    server = f"serving.inference_server={serving.inference_server}"
    if cfg.runtime != "pathways":
        raise DeployError(
            f"runtime: {cfg.runtime} with {server}: the disaggregated server is one controller driving both "
            "slices, deployed on Pathways (runtime: pathways)"
        )
    if cfg.kind != "serve" and cfg.disaggregation == "disaggregatedset":
        raise DeployError("disaggregation: disaggregatedset deploys a server; kind: batch runs in one PathwaysJob")
    if cfg.tpu.num_slices != 2:
        raise DeployError(
            f"tpu.num_slices: {server} runs prefill on one slice and generate on another: set 2, "
            f"not {cfg.tpu.num_slices}"
        )
    one = cfg.tpu.slice()
    for side, devices in (("prefill", sides.prefill_devices), ("generate", sides.generate_devices)):
        if devices != one.chips:
            raise DeployError(
                f"{_side_field(serving, side)}: {server} puts {devices} devices on {side}, but one "
                f"{cfg.tpu.accelerator} {cfg.tpu.topology} slice (tpu.topology) has {one.chips} chips; each side "
                f"is one whole slice ({one.chips} + {one.chips} = the {2 * one.chips} chips of the two)"
            )
    return sides


def _side_field(serving: ServingConfig, side: str) -> str:
    """The key that sets a side's devices: the slice flag, or the server's _<N> suffix."""
    if serving.inference_server == DISAGGREGATED:
        return f"serving.{side}_slice={getattr(serving, f'{side}_slice')}"
    return "serving.inference_server"


def uses_disaggregated_set(cfg: DeploymentConfig) -> bool:
    """Whether `render` deploys a DisaggregatedSet (after `split` has checked the config)."""
    return cfg.kind == "serve" and cfg.disaggregation == "disaggregatedset"


def prefill_leader_address(cfg: DeploymentConfig) -> str:
    """Where a decode pod finds its prefill leader: the leader pod's name in its LWS's headless
    Service, from the revision and group index `pairing_env` reads off the pod's own labels."""
    prefill_lws = f"{cfg.name}-$({REVISION_ENV})-{PREFILL_ROLE}"
    return f"{prefill_lws}-$({GROUP_INDEX_ENV}).{prefill_lws}.{cfg.namespace}"


def pairing_env() -> list[dict[str, Any]]:
    """A decode pod's revision and group index, from its own labels (the downward API)."""
    return [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}}}
        for name, label in ((REVISION_ENV, REVISION_LABEL), (GROUP_INDEX_ENV, GROUP_INDEX_LABEL))
    ]


def disaggregated_set(
    cfg: DeploymentConfig, tpu: Slice, leader: dict[str, Any], worker: dict[str, Any], decode_worker: dict[str, Any]
) -> Manifest:
    """Two roles of `cfg.replicas` groups each, one slice per group: `prefill` (the `leader` pod
    and the slice's `worker` pods) and `decode` (`decode_worker` pods only); each group on a node
    pool of its own, as the interleaved LeaderWorkerSet's."""
    role_meta = {"labels": labels(cfg), "annotations": {EXCLUSIVE_TOPOLOGY: NODE_POOL}}
    return {
        "apiVersion": DISAGGREGATED_SET_API,
        "kind": "DisaggregatedSet",
        "metadata": metadata(cfg),
        "spec": {
            "roles": [
                {"name": PREFILL_ROLE, "metadata": role_meta, "spec": lws_spec(cfg, tpu.hosts + 1, leader, worker)},
                {"name": DECODE_ROLE, "metadata": role_meta, "spec": lws_spec(cfg, tpu.hosts, None, decode_worker)},
            ]
        },
    }
