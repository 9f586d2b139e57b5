"""`pathserve deploy render|plan|apply|status|delete CONFIG`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from serving.deploy.config import DeploymentConfig, load_deployment
from serving.deploy.errors import DeployError
from serving.deploy.manifests import Manifest, render
from serving.deploy.plan import make_plan
from serving.deploy.plan_table import format_plan


def add_parser(commands: argparse._SubParsersAction) -> None:
    deploy = commands.add_parser("deploy", help="render, plan and apply Kubernetes deployments")
    actions = deploy.add_subparsers(dest="action", required=True)

    p = actions.add_parser("render", help="print the manifests (or write them to -o DIR)")
    _add_config_args(p)
    p.add_argument("-o", "--output-dir", type=Path)
    p.set_defaults(handler=cmd_render)

    p = actions.add_parser("plan", help="chips, mesh, HBM per chip, KV capacity and a decode roofline")
    _add_config_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_plan)

    for name, handler, text in (
        ("apply", cmd_apply, "create or update the objects (server-side apply)"),
        ("status", cmd_status, "the LeaderWorkerSet's (or DisaggregatedSet's) conditions and the leader's readiness"),
        ("delete", cmd_delete, "delete the objects"),
    ):
        p = actions.add_parser(name, help=text)
        if name == "apply":
            _add_config_args(p)
        else:
            p.add_argument("config", type=Path)
        p.add_argument("--kubeconfig", help="default: $KUBECONFIG or ~/.kube/config")
        p.add_argument("--context")
        if name == "apply":
            p.add_argument(
                "--wait", type=float, metavar="SECONDS", help="wait for the workload's Available condition"
            )
        p.set_defaults(handler=handler)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path)
    # Named `args` so that the CLI's main() also collects key=value given after the options.
    parser.add_argument(
        "args",
        nargs="*",
        metavar="[MAXTEXT_CONFIG.yml] key=value",
        help="the engine's arguments over the config's serving: section, as `pathserve serve` takes "
        "them (a MaxText config file first, as the JetStream guide writes them)",
    )


def _load(ns: argparse.Namespace) -> DeploymentConfig:
    return load_deployment(ns.config, getattr(ns, "args", ()))


def checked_manifests(cfg: DeploymentConfig) -> list[Manifest]:
    """Render after every check: plan (topology, mesh, fit, tags) and the CRD schemas when present."""
    from serving.deploy.crds import CRD_FILES, validate_object

    make_plan(cfg)
    objects = render(cfg)
    for obj in objects:
        if (obj["apiVersion"].rpartition("/")[0], obj["kind"]) in CRD_FILES:
            validate_object(obj)
    return objects


def to_yaml(objects: list[Manifest]) -> str:
    return "---\n".join(yaml.safe_dump(o, sort_keys=False, width=120) for o in objects)


def cmd_render(ns: argparse.Namespace) -> int:
    text = to_yaml(checked_manifests(_load(ns)))
    if ns.output_dir is None:
        sys.stdout.write(text)
        return 0
    out = ns.output_dir / f"{ns.config.stem}.yaml"
    try:
        ns.output_dir.mkdir(parents=True, exist_ok=True)
        out.write_text(
            f"# Rendered from {ns.config.name} by `pathserve deploy render` (make manifests); do not edit.\n"
            + text
        )
    except OSError as exc:
        raise DeployError(f"-o {ns.output_dir}: cannot write {out.name} there ({exc.strerror})") from None
    print(out)
    return 0


def cmd_plan(ns: argparse.Namespace) -> int:
    plan = make_plan(_load(ns))
    print(json.dumps(plan.to_dict(), indent=2) if ns.json else format_plan(plan))
    return 0


def _client(ns: argparse.Namespace):
    from serving.deploy.kube import connect

    return connect(ns.kubeconfig, ns.context)


def cmd_apply(ns: argparse.Namespace) -> int:
    from serving.deploy.kube import apply, wait_available

    cfg = _load(ns)
    objects = checked_manifests(cfg)
    client = _client(ns)
    for result in apply(client, objects):
        print(f"{result.kind}/{result.name} {result.action}")
    if ns.wait and cfg.kind == "serve":
        kind = objects[0]["kind"]  # the workload: a LeaderWorkerSet or a DisaggregatedSet
        wait_available(
            client, cfg.name, cfg.namespace, ns.wait, on_progress=lambda s: print(s.format(), flush=True), kind=kind
        )
        print(f"{kind}/{cfg.name} available")
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    from serving.deploy.kube import status

    cfg = load_deployment(ns.config)
    if cfg.kind != "serve":
        raise DeployError("status reads a LeaderWorkerSet or a DisaggregatedSet; this config is kind: batch")
    print(status(_client(ns), cfg.name, cfg.namespace, render(cfg)[0]["kind"]).format())
    return 0


def cmd_delete(ns: argparse.Namespace) -> int:
    from serving.deploy.kube import delete

    cfg = load_deployment(ns.config)
    for result in delete(_client(ns), render(cfg)):
        print(f"{result.kind}/{result.name} {result.action}")
    return 0
