"""DeploymentConfig: everything a deployment needs, in one YAML file (configs/deployments/)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serving.config import ConfigError, ServingConfig, build, load_config, parse_overrides, read_yaml
from serving.deploy.accelerators import Slice, tpu_slice
from serving.deploy.errors import DeployError
from serving.maxtext_config import is_config_file

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_JAX_TAG = re.compile(r"jax-(\d+\.\d+\.\d+\S*)")
# The seed's HTTP sidecar: JetStream's /generate and /healthcheck on :8000, as gRPC calls to :9000.
JETSTREAM_HTTP_IMAGE = "us-docker.pkg.dev/cloud-tpu-images/inference/jetstream-http:v0.2.4"
JETSTREAM_HTTP_PORT, JETSTREAM_GRPC_PORT = 8000, 9000  # fixed in that image
# Pathways' own ports (the seed's): the resource manager and the proxy share the leader pod with the
# engine, the server listens on each TPU host.
RM_PORT, PROXY_PORT, WORKER_PORT = 38677, 38681, 38679
PATHWAYS_PORTS = {"Pathways resource manager": RM_PORT, "Pathways proxy": PROXY_PORT, "Pathways server": WORKER_PORT}


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class TPU(_Strict):
    accelerator: str  # GKE name: tpu-v6e-slice, tpu-v5-lite-podslice, tpu-v5p-slice, tpu-v4-podslice
    topology: str  # 4x4 (v5e/v6e) or 2x2x4 (v4/v5p)
    num_slices: int = Field(default=1, ge=1)
    # Where GKE offers two host shapes for a topology (v6e 2x4: one 8-chip host, or two of 4 chips,
    # as the JetStream guide's disaggregated slices): which one. None: one host where it can.
    chips_per_host: int | None = Field(default=None, ge=1)

    def slice(self) -> Slice:
        """One slice's chips and hosts; a DeployError names the field that does not fit."""
        return tpu_slice(self.accelerator, self.topology, self.chips_per_host)


class Images(_Strict):
    """Container images; the engine's and Pathways' tags must be `jax-<version>` and agree."""

    engine: str
    pathways_server: str
    pathways_proxy: str
    jetstream_http: str = JETSTREAM_HTTP_IMAGE  # the sidecar of `frontend: jetstream-http` (no JAX)

    def jax_versions(self) -> dict[str, str]:
        """Image field -> jax version from its tag; names the field whose tag is not jax-<version>."""
        out = {}
        for field, image in self.model_dump(exclude={"jetstream_http"}).items():
            tag = image.rsplit("/", 1)[-1].partition(":")[2]
            match = _JAX_TAG.fullmatch(tag)
            if not match:
                raise DeployError(
                    f"images.{field}: tag {tag or '(none)'!r} of {image!r} is not jax-<version>"
                )
            out[field] = match.group(1)
        return out


class Ports(_Strict):
    http: int = Field(default=8000, ge=1, le=65535)  # the Service's HTTP: the engine, or the sidecar
    grpc: int = Field(default=9000, ge=1, le=65535)  # JetStream's gRPC API on the engine
    # With `frontend: jetstream-http` the sidecar takes `http`; the engine's own HTTP (OpenAI
    # routes, /metrics, /livez) moves here.
    engine_http: int = Field(default=8001, ge=1, le=65535)


class Probes(_Strict):
    """Probe timing on the engine's /startupz, /readyz and /livez."""

    period_s: int = Field(default=10, ge=1)
    startup_timeout_s: int = Field(default=3600, ge=10)  # loading a 405B checkpoint and compiling
    readiness_failure_threshold: int = Field(default=3, ge=1)
    liveness_failure_threshold: int = Field(default=6, ge=1)


class Resources(_Strict):
    """CPU and memory of the leader's containers (workers take whole TPU hosts)."""

    engine_cpu: str = "8"
    engine_memory: str = "32Gi"
    pathways_cpu: str = "4"
    pathways_memory: str = "16Gi"
    jetstream_http_cpu: str = "1"
    jetstream_http_memory: str = "2Gi"


class Batch(_Strict):
    """Inputs of a batch PathwaysJob (`kind: batch`)."""

    input: str
    output: str
    max_restarts: int = Field(default=3, ge=0)


class Gateway(_Strict):
    """The InferencePool and endpoint picker in front of the replicas (serving.deploy.gateway)."""

    enabled: bool | None = None  # default: rendered when replicas > 1
    endpoint_picker_image: str = "ghcr.io/llm-d/llm-d-router-endpoint-picker:0.0.3"
    cpu: str = "2"
    memory: str = "4Gi"


class DeploymentConfig(_Strict):
    """One serving deployment (LeaderWorkerSet + Service) or one batch job (PathwaysJob)."""

    name: str
    namespace: str = "default"
    kind: Literal["serve", "batch"] = "serve"
    # builtin: the engine serves HTTP on ports.http (and gRPC). jetstream-http: the seed's layout,
    # the engine serving gRPC on ports.grpc behind the jetstream-http sidecar on ports.http.
    frontend: Literal["builtin", "jetstream-http"] = "builtin"
    # pathways: a Pathways head on the leader, Pathways servers on the TPU hosts (the default).
    # multicontroller: JAX's own distributed runtime, `pathserve serve` on every TPU host
    # (serving.deploy.multicontroller).
    runtime: Literal["pathways", "multicontroller"] = "pathways"
    # The object that deploys a disaggregated server (serving.inference_server=
    # ExperimentalMaxtextDisaggregatedServer...; serving.deploy.disaggregated): leaderworkerset, the
    # JetStream guide's one LeaderWorkerSet whose groups hold both slices as two subgroups;
    # disaggregatedset, LWS's DisaggregatedSet with a prefill role and a decode role.
    disaggregation: Literal["leaderworkerset", "disaggregatedset"] = "leaderworkerset"
    model_name: str
    checkpoint: str
    serving: dict[str, Any] = Field(default_factory=dict)
    tpu: TPU
    images: Images
    scratch: str
    replicas: int = Field(default=1, ge=0)  # LeaderWorkerSet groups, each a whole model copy
    gateway: Gateway = Gateway()
    ports: Ports = Ports()
    probes: Probes = Probes()
    resources: Resources = Resources()
    batch: Batch | None = None

    @field_validator("name", "namespace")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if len(value) > 40 or not _DNS_LABEL.fullmatch(value):
            raise ValueError("must be a DNS label: lower-case letters, digits and '-', at most 40 characters")
        return value

    @field_validator("scratch")
    @classmethod
    def _gcs(cls, value: str) -> str:
        if not value.startswith("gs://") or len(value) <= 5:
            raise ValueError("must be a gs:// location (Pathways keeps its scratch files there)")
        return value

    @model_validator(mode="after")
    def _batch_needs_io(self) -> DeploymentConfig:
        if self.kind == "batch" and self.batch is None:
            raise ValueError("kind: batch needs a batch section with input and output")
        return self

    @model_validator(mode="after")
    def _gateway_serves(self) -> DeploymentConfig:
        if self.gateway.enabled and self.kind != "serve":
            raise ValueError("gateway.enabled: an InferencePool fronts serving replicas; kind: batch has none")
        return self

    @model_validator(mode="after")
    def _ports_fit_the_frontend(self) -> DeploymentConfig:
        ports = self.ports
        if ports.http == ports.grpc:
            raise ValueError(f"ports.http and ports.grpc are both {ports.http}")
        taken = {PATHWAYS_PORTS[name]: name for name in PATHWAYS_PORTS} if self.runtime == "pathways" else {}
        for name in ("http", "grpc", "engine_http"):
            if getattr(ports, name) in taken:
                raise ValueError(
                    f"ports.{name}: {getattr(ports, name)} is the {taken[getattr(ports, name)]}'s port, in the "
                    "same pod as the engine; choose another"
                )
        if self.frontend == "jetstream-http" and self.runtime == "multicontroller":
            raise ValueError(
                "frontend: jetstream-http runs beside the Pathways leader's engine; runtime: multicontroller "
                "serves the builtin front-end only (its pods have no sidecar)"
            )
        if self.frontend == "jetstream-http":
            if (ports.http, ports.grpc) != (JETSTREAM_HTTP_PORT, JETSTREAM_GRPC_PORT):
                raise ValueError(
                    f"frontend: jetstream-http listens on {JETSTREAM_HTTP_PORT} and calls gRPC on "
                    f"{JETSTREAM_GRPC_PORT}: ports.http and ports.grpc must be those "
                    f"(got {ports.http} and {ports.grpc})"
                )
            if ports.engine_http in (ports.http, ports.grpc):
                raise ValueError(f"ports.engine_http ({ports.engine_http}) must differ from http and grpc")
        return self

    def serving_config(self) -> ServingConfig:
        """The engine's ServingConfig, exactly as the engine will read its arguments (`serving_args`):
        a MaxText config file (`serving.base_config`) with the other keys as its overrides."""
        self._check_serving_keys()
        base, overrides = self._split_base()
        try:
            return load_config(base, [f"{k}={_yaml_scalar(v)}" for k, v in overrides.items()])
        except ConfigError as exc:
            raise DeployError(f"serving: {exc}") from None

    def serving_args(self) -> list[str]:
        """The engine's arguments as the JetStream guide writes them: the MaxText config file
        (`serving.base_config`) first, then MaxText-style key=value flags."""
        self._check_serving_keys()
        base, overrides = self._split_base()
        return [*([base] if base else []), *(f"{k}={_yaml_scalar(v)}" for k, v in overrides.items())]

    def _split_base(self) -> tuple[str | None, dict[str, Any]]:
        """`serving.base_config` (the MaxText config file) and the rest: model and checkpoint first,
        the user's keys in their order, the gRPC port the Service names last."""
        rest = {k: v for k, v in self.serving.items() if k != "base_config"}
        base = self.serving.get("base_config")
        if base is not None and not isinstance(base, str):
            raise DeployError(f"serving.base_config: expected a MaxText config file path, got {base!r}")
        engine = self._engine_keys()
        grpc = {"grpc_port": engine.pop("grpc_port")} if "grpc_port" in engine else {}
        return base, {**engine, **rest, **grpc}

    def _engine_keys(self) -> dict[str, Any]:
        """Serving keys that come from elsewhere in this config."""
        keys: dict[str, Any] = {"model_name": self.model_name, "load_parameters_path": self.checkpoint}
        if self.kind == "serve":
            keys["grpc_port"] = self.ports.grpc
        return keys

    def _check_serving_keys(self) -> None:
        for key, instead in (
            ("model_name", "model_name"),
            ("load_parameters_path", "checkpoint"),
            ("grpc_port", "ports.grpc"),
        ):
            if key in self.serving:
                raise DeployError(
                    f"serving.{key}: set {instead} instead (the rest of the deployment uses it)"
                )


def _yaml_scalar(value: Any) -> str:
    """A value as a key=value flag writes it (YAML; lists and mappings in flow style)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return yaml.safe_dump(value, default_flow_style=True).strip()
    return str(value)


def load_deployment(path: str | Path, overrides: Iterable[str] = ()) -> DeploymentConfig:
    """Read and validate a deployment YAML; errors name the field.

    `overrides` are the engine's arguments over its `serving:` section, parsed exactly as `pathserve
    serve` parses its own: a MaxText config file first (it becomes `serving.base_config`), then
    `key=value` (serving.config.parse_overrides); model_name and load_parameters_path among them
    set the deployment's model_name and checkpoint."""
    overrides = list(overrides)
    try:
        data = dict(read_yaml(Path(path)))
        if overrides:
            serving = data.get("serving") or {}
            if not isinstance(serving, dict):
                raise ConfigError(f"{path}: serving: expected a mapping of serving keys")
            base = {"base_config": overrides.pop(0)} if is_config_file(overrides[0]) else {}
            given = parse_overrides(overrides)
            for key, field in (("model_name", "model_name"), ("load_parameters_path", "checkpoint")):
                if key in given:
                    data[field] = str(given.pop(key))
            data["serving"] = {**serving, **base, **given}
        return build(DeploymentConfig, data, source=str(path))
    except ConfigError as exc:
        raise DeployError(str(exc)) from None
