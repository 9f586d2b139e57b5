"""The CRDs we render for (LeaderWorkerSet, PathwaysJob, InferencePool, DisaggregatedSet): finding
them, validating against them, and adapting them for older API servers.

The CRD files are not in this repository: they are read from $PATHSERVE_CRD_DIR (default
`../shared/crds` beside the checkout), as published by the LWS and Pathways projects.
"""

from __future__ import annotations

import copy
import os
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from serving.deploy.errors import DeployError

CRD_DIR_ENV = "PATHSERVE_CRD_DIR"
CRD_FILES = {
    ("leaderworkerset.x-k8s.io", "LeaderWorkerSet"): "leaderworkerset.x-k8s.io_leaderworkersets.yaml",
    ("pathways-job.pathways.domain", "PathwaysJob"): "pathways-job.pathways.domain_pathwaysjobs.yaml",
    ("inference.networking.k8s.io", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("disaggregatedset.x-k8s.io", "DisaggregatedSet"): "disaggregatedset.x-k8s.io_disaggregatedsets.yaml",
}
WHERE_TO_GET = (
    "get them from the LWS release (https://github.com/kubernetes-sigs/lws, "
    "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml) and the pathways-job project "
    "(https://github.com/google/pathways-job, config/crd/bases/), InferencePool's from the Gateway API "
    "Inference Extension (https://github.com/kubernetes-sigs/gateway-api-inference-extension, "
    "config/crd/bases/), DisaggregatedSet's from LWS (v0.9.0 or later), and point PATHSERVE_CRD_DIR at them"
)


def crd_dir() -> Path:
    env = os.environ.get(CRD_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[3] / "shared" / "crds"


def load_crd(group: str, kind: str) -> dict[str, Any]:
    """The CRD document for group/kind, or a DeployError saying where to get it."""
    name = CRD_FILES.get((group, kind))
    if name is None:
        raise DeployError(f"no CRD known for {kind}.{group}")
    path = crd_dir() / name
    if not path.is_file():
        raise DeployError(f"CRD file {path} not found; {WHERE_TO_GET}")
    return _load(str(path))


@cache
def _load(path: str) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


def version_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise DeployError(f"CRD {crd['metadata']['name']} has no version {version}")


def to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Structural OpenAPI v3 -> JSON Schema, as the API server would validate and prune.

    x-kubernetes-* keys are dropped; int-or-string becomes either; objects with known properties
    reject unknown fields (the API server would silently prune them, which hides mistakes), unless
    they preserve unknown fields or are embedded resources.
    """
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key == "not":
            out[key] = to_json_schema(value)
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    keeps_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get(
        "x-kubernetes-embedded-resource"
    )
    if (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in out
        and not keeps_unknown
    ):
        out["additionalProperties"] = False
    if schema.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        for field in ("apiVersion", "kind"):
            props.setdefault(field, {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    return out


def object_json_schema(group: str, kind: str, version: str) -> dict[str, Any]:
    """JSON Schema of a whole object of this CRD (metadata checked as the API server does)."""
    schema = to_json_schema(version_schema(load_crd(group, kind), version))
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"const": f"{group}/{version}"}
    props["kind"] = {"const": kind}
    props["metadata"] = {
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
            "namespace": {"type": "string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind", "metadata", "spec"})
    return schema


def validate_object(obj: dict[str, Any]) -> None:
    """Check a rendered custom object against its CRD; DeployError names the path of each problem."""
    import jsonschema

    group, _, version = obj.get("apiVersion", "").rpartition("/")
    schema = object_json_schema(group, obj.get("kind", ""), version)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}" for e in errors[:10]]
        raise DeployError(
            f"{obj['kind']} {obj['metadata'].get('name')!r} does not match its CRD:\n  " + "\n  ".join(lines)
        )


def for_old_apiserver(crd: dict[str, Any]) -> dict[str, Any]:
    """Adapt a CRD for kube-apiserver 1.20 (no CEL): drop x-kubernetes-validations and
    `default: ""`, and make list-map keys required in the list items."""
    crd = copy.deepcopy(crd)

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            node.pop("x-kubernetes-validations", None)
            if node.get("default") == "":
                node.pop("default")
            keys = node.get("x-kubernetes-list-map-keys")
            if keys and isinstance(node.get("items"), dict):
                items = node["items"]
                items["required"] = sorted({*items.get("required", []), *keys})
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(crd)
    return crd
