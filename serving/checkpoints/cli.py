"""`pathserve convert | inspect | verify`."""

from __future__ import annotations

import argparse
from pathlib import Path

from serving.checkpoints.errors import CheckpointError


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_parsers(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "convert", help="convert a HF / Meta / GGUF checkpoint into a pathserve checkpoint"
    )
    p.add_argument("src", type=Path, help="Hugging Face directory, Meta directory or GGUF file")
    p.add_argument("dst", help="destination directory: a local path or gs://bucket/path")
    p.add_argument("--format", choices=["hf", "meta", "gguf", "maxtext"], help="default: detected")
    p.add_argument(
        "--model-config",
        metavar="NAME",
        help="a preset in configs/models/ (or a YAML file of its keys) instead of the source's own config",
    )
    p.add_argument(
        "--quantize", choices=["int8"], default="", help="int8 matmul weights with per-channel scales"
    )
    p.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="dtype of the float tensors"
    )
    p.add_argument(
        "--scan-layers", type=_bool, default=True, metavar="true|false", help="stack layers (default true)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=cmd_convert)

    p = commands.add_parser("inspect", help="print a checkpoint's metadata")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_inspect)

    p = commands.add_parser("verify", help="re-read every tensor and check its checksum")
    p.add_argument("checkpoint")
    p.set_defaults(handler=cmd_verify)


def cmd_convert(ns: argparse.Namespace) -> int:
    from serving.checkpoints.convert import convert
    from serving.config import build, load_model_config, read_yaml
    from serving.models.config import ModelConfig

    model_config = None
    if ns.model_config and Path(ns.model_config).is_file():
        model_config = build(ModelConfig, read_yaml(Path(ns.model_config)), source=ns.model_config)
    elif ns.model_config:
        model_config = load_model_config(ns.model_config)
    metadata = convert(
        ns.src,
        ns.dst,
        fmt=ns.format,
        model_config=model_config,
        quantize=ns.quantize,
        dtype=ns.dtype,
        scan_layers=ns.scan_layers,
        overwrite=ns.overwrite,
        progress=not ns.quiet,
    )
    print(
        f"wrote {ns.dst}: {metadata.config.name}, {len(metadata.tensors)} tensors, quantization {metadata.quantization or 'none'}"
    )
    return 0


def cmd_inspect(ns: argparse.Namespace) -> int:
    from serving.checkpoints.checkpoint import read_metadata
    from serving.checkpoints.verify import describe

    if (layout := _maxtext_layout(ns.checkpoint)) is not None:
        import json

        from serving.checkpoints.maxtext_restore import describe_maxtext, describe_table

        info = describe_maxtext(ns.checkpoint, layout)
        print(json.dumps(info, indent=1) if ns.json else describe_table(info))
        return 0

    metadata = read_metadata(ns.checkpoint)
    print(metadata.to_json() if ns.json else describe(metadata))
    return 0


def _maxtext_layout(path: str):
    """The layout of a MaxText checkpoint at `path` (not one of ours), else None."""
    from serving.checkpoints.checkpoint import is_checkpoint
    from serving.checkpoints.maxtext_restore import items_dir, read_layout

    if is_checkpoint(path) or items_dir(path) is None:
        return None
    layout = read_layout(path)
    if layout is None:
        raise CheckpointError(f"{path}: an Orbax checkpoint, but not a MaxText Llama checkpoint")
    return layout


def _verify_maxtext(path: str, layout) -> int:
    from serving.checkpoints.maxtext_restore import verify_maxtext

    checked, bad = verify_maxtext(path, layout)
    for line in bad:
        print(f"BAD {line}")
    if bad:
        raise CheckpointError(f"{path}: {len(bad)} of {checked} tensors failed verification")
    print(f"{path}: MaxText {layout.kind}: all {checked} tensors read back (MaxText writes no checksums)")
    return 0


def cmd_verify(ns: argparse.Namespace) -> int:
    if (layout := _maxtext_layout(ns.checkpoint)) is not None:
        return _verify_maxtext(ns.checkpoint, layout)
    from serving.checkpoints.verify import verify

    result = verify(ns.checkpoint)
    for line in result.notes:
        print(f"NOTE {line}")
    if result.bad:
        for line in result.bad:
            print(f"BAD {line}")
        names = ", ".join(line.split(": ", 1)[0] for line in result.bad[:5])
        more = f" and {len(result.bad) - 5} more" if len(result.bad) > 5 else ""
        raise CheckpointError(f"{ns.checkpoint}: verification failed: {names}{more}")
    files = f"all {result.files_checked} files and " if result.files_checked else ""
    print(f"{ns.checkpoint}: {files}all {result.checked} tensors verified")
    return 0
