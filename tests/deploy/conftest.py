"""A real kube-apiserver + etcd on loopback for the deployment tests, with the real CRDs installed.

The server is built once (tools/kube-apiserver/build.sh, cached under ~/.cache) and started for the
test session. The CRDs come from $PATHSERVE_CRD_DIR (default ../shared/crds): without them these
tests fail with a message saying where to get them; they never skip.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from serving.deploy.crds import CRD_FILES, WHERE_TO_GET, crd_dir, for_old_apiserver, load_crd

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools" / "kube-apiserver"
CONFIGS = REPO / "configs" / "deployments"


def _free_port_pair() -> int:
    """A port p such that p and p + 10 are free (etcd's client and peer ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10 < 65535:
            with socket.socket() as peer:
                try:
                    peer.bind(("127.0.0.1", port + 10))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def crds_present():
    missing = [name for name in CRD_FILES.values() if not (crd_dir() / name).is_file()]
    if missing:
        pytest.fail(f"CRD files {missing} not found in {crd_dir()}; {WHERE_TO_GET}", pytrace=False)


@pytest.fixture(scope="session")
def apiserver(tmp_path_factory) -> Path:
    """Start etcd and kube-apiserver; yield the kubeconfig path."""
    build = subprocess.run(["bash", str(TOOLS / "build.sh")], capture_output=True, text=True, timeout=1800)
    if build.returncode:
        pytest.fail(
            f"building kube-apiserver failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}", pytrace=False
        )
    run_dir = tmp_path_factory.mktemp("kube")
    env = {**os.environ, "ETCD_PORT": str(_free_port_pair()), "APISERVER_PORT": str(_free_port())}
    start = subprocess.run(
        ["bash", str(TOOLS / "start.sh"), str(run_dir)], capture_output=True, text=True, env=env, timeout=300
    )
    if start.returncode:
        logs = (run_dir / "apiserver.log").read_text()[-3000:] if (run_dir / "apiserver.log").exists() else ""
        subprocess.run(["bash", str(TOOLS / "stop.sh"), str(run_dir)], check=False)
        pytest.fail(f"kube-apiserver did not start:\n{start.stderr}\n{logs}", pytrace=False)
    kubeconfig = Path(start.stdout.strip().splitlines()[-1])
    try:
        yield kubeconfig
    finally:
        subprocess.run(["bash", str(TOOLS / "stop.sh"), str(run_dir)], check=False, timeout=60)


@pytest.fixture(scope="session")
def kube(apiserver):
    from serving.deploy.kube import connect

    return connect(str(apiserver))


def install_crd(client, group: str, kind: str) -> None:
    """Create a CRD (adapted for the 1.20 API server) and wait until it is Established."""
    crd = for_old_apiserver(load_crd(group, kind))
    crds = client.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
    client.server_side_apply(
        crds, body=crd, name=crd["metadata"]["name"], field_manager="tests", force_conflicts=True
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        conditions = (client.get(crds, name=crd["metadata"]["name"]).to_dict().get("status") or {}).get(
            "conditions"
        ) or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
            return
        time.sleep(0.2)
    raise RuntimeError(f"CRD {crd['metadata']['name']} not established")


@pytest.fixture(scope="session")
def lws_installed(kube):
    install_crd(kube, "leaderworkerset.x-k8s.io", "LeaderWorkerSet")
    return kube


def _strict_swagger(node):
    """Swagger 2 definitions -> JSON Schema: int-or-string types, and no unknown fields."""
    if isinstance(node, list):
        return [_strict_swagger(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("format") == "int-or-string":
        return {"anyOf": [{"type": "integer"}, {"type": "string"}]}
    out = {k: _strict_swagger(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="session")
def kubernetes_schema(kube):
    """validate(obj, definition) against the API server's own OpenAPI v2 document."""
    import json

    import jsonschema

    api = kube.client
    headers: dict = {}
    api.update_params_for_auth(headers, [], ["BearerToken"], "GET", "/openapi/v2", None)
    response = api.call_api("GET", api.configuration.host + "/openapi/v2", header_params=headers)
    response.read()
    definitions = _strict_swagger(json.loads(response.data)["definitions"])
    quantity = "io.k8s.apimachinery.pkg.api.resource.Quantity"
    definitions[quantity] = {"anyOf": [{"type": "integer"}, {"type": "string"}]}

    def validate(obj: dict, definition: str) -> list[str]:
        schema = {"$ref": f"#/definitions/{definition}", "definitions": definitions}
        errors = jsonschema.Draft4Validator(schema).iter_errors(obj)
        return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]

    return validate
