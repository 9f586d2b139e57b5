"""MaxText int8 checkpoints (tests/data/maxtext, written by MaxText's own quantization) restored on 8
CPU devices in two processes (gloo collectives), as `serve` restores them on a multi-controller
slice: each process restores onto its own shards only, and the greedy tokens on the sharded params
equal one device's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.multihost.probe_pair import run_probe_pair
from tests.test_maxtext_checkpoints import FIXTURES, IDS, fixture_path, flags, load, our_logits

PROBE = Path(__file__).with_name("maxtext_probe.py")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    from tests.conftest import make_hf_tokenizer

    return make_hf_tokenizer(tmp_path_factory.mktemp("tok"), vocab=300) / "tokenizer.json"


def restore_on_two_processes(path: str, tokenizer: Path, mesh: list[str]) -> list[dict]:
    return run_probe_pair(PROBE, path, [*flags("llama31-int8", tokenizer), *mesh], env={"PROBE_IDS": json.dumps(IDS)})


def test_tensor_4_x_autoregressive_2_gives_one_devices_tokens(tokenizer):
    """The guide's layout (int8, weight_dtype=bfloat16, saved on one device) over both processes."""
    reports = restore_on_two_processes(
        fixture_path("llama31-int8"), tokenizer, ["ici_tensor_parallelism=4", "ici_autoregressive_parallelism=2"]
    )
    for report in reports:
        assert report["held"] < 0.75 * report["total"], report  # each holds about half of every split leaf
    model, _ = load("llama31-int8", tokenizer)
    one_device = np.argmax(our_logits(model, IDS), axis=-1).tolist()
    assert reports[0]["tokens"] == reports[1]["tokens"] == one_device


def test_a_checkpoint_saved_in_shards_restores_onto_another_mesh(tokenizer):
    """A checkpoint MaxText saved in shards (on 2 devices, tensor 2: heads, mlp and vocab written in
    halves) restored over tensor 8 in two processes: each process holds only its shards, and the
    tokens equal one device's.

    Bytes read are not asserted here: on a 150 KB OCDBT checkpoint tensorstore's read coalescing
    (neighbouring chunks fetched in one read) dominates, and a process read 88 to 209 KB against
    135 KB for the whole restore, run to run. tests/multihost/test_restore_bytes.py shows the
    per-shard reads on our own (zarr) checkpoints, through the same restore-onto-shardings path."""
    path = str(FIXTURES / "llama31" / "int8_tensor2")
    reports = restore_on_two_processes(path, tokenizer, ["ici_tensor_parallelism=8"])
    for report in reports:
        assert report["held"] < 0.75 * report["total"], report
    model, _ = load("llama31-int8", tokenizer)  # the same weights, saved on one device
    one_device = np.argmax(our_logits(model, IDS), axis=-1).tolist()
    assert reports[0]["tokens"] == reports[1]["tokens"] == one_device
