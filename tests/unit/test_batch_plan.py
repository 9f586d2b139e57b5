"""A batch job's plan and fingerprint on the mock engine: what a rerun takes as the same job and what
it refuses (an input edited in place, a changed output-deciding key), and an output placed under the
input (local files and fake-gcs-server; no model, no JAX)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from serving.batch import files, manifest
from serving.batch.errors import BatchError
from serving.batch.runner import run_batch
from serving.config import ServingConfig
from tests.batch_mock import records, start_mock
from tests.gcs_emulator import emulated_bucket

CFG = ServingConfig(max_target_length=128, max_prefill_predict_length=64)
BUCKET = "plan-bucket"


def _lines(ids: list[str], prompt: str = "ab") -> bytes:
    return "".join(json.dumps({"id": i, "prompt": prompt, "max_tokens": 2}) + "\n" for i in ids).encode()


def _run(source, out, **kwargs):
    return run_batch(
        str(source),
        str(out),
        "mock",
        kwargs.pop("cfg", CFG),
        shard_size=2,
        progress=False,
        start=start_mock([]),
        **kwargs,
    )


def _interrupt(out: Path) -> None:
    """As if the run was killed before its last shard was written."""
    (last,) = sorted(out.glob("results-*.jsonl"))[-1:]
    last.unlink()


def test_an_input_rewritten_to_the_same_size_is_refused(tmp_path):
    """The plan's byte offsets belong to the content it read: a rerun over other content of the
    same size used to resume silently, reading rows across the old line boundaries."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out"
    source.write_bytes(_lines(["r0", "r1", "r2", "r3"]))
    _run(source, out)
    _interrupt(out)
    time.sleep(0.05)  # past the file system's clock tick
    edited = _lines(["r00", "r1", "r2", "r3"], prompt="a")  # one byte longer, then four shorter...
    edited = edited.replace(b'"r3", "prompt": "a"', b'"r3", "prompt": "abcd"')  # ...and three longer
    assert len(edited) == source.stat().st_size
    source.write_bytes(edited)
    with pytest.raises(BatchError, match=r"the input files changed.*--restart"):
        _run(source, out)
    restarted = _run(source, out, restart=True)
    assert restarted.rows_ok == 4 and set(records(out)) == {"r00", "r1", "r2", "r3"}


def test_a_manifest_of_before_file_versions_resumes_when_the_sizes_match(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out"
    source.write_bytes(_lines(["r0", "r1", "r2", "r3"]))
    _run(source, out)
    _interrupt(out)
    manifest = json.loads((out / "_manifest.json").read_text())
    manifest["fingerprint"]["files"] = [
        entry[:2] for entry in manifest["fingerprint"]["files"]
    ]  # [url, size]
    (out / "_manifest.json").write_text(json.dumps(manifest))
    resumed = _run(source, out)
    assert (resumed.shards_run, resumed.rows_ok) == (1, 4)
    _interrupt(out)
    source.write_bytes(_lines(["r0", "r1", "r2", "r3", "r4"]))  # another size: refused as before
    with pytest.raises(BatchError, match="the input files changed"):
        _run(source, out)


def test_an_output_under_the_input_directory_is_left_out_of_the_input(tmp_path):
    """`--input data --output data/out`: the output's results are *.jsonl under the input; listed
    as input, they made every rerun refuse and --restart fail (FileNotFoundError: the listed
    results were deleted before the plan read them)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "part-0.jsonl").write_bytes(_lines(["r0", "r1", "r2"]))
    first = _run(data, data / "out")
    assert (first.rows_ok, first.shards) == (3, 2)
    again = _run(data, data / "out")
    assert (again.shards_run, again.shards_skipped) == (0, 2)
    restarted = _run(data, data / "out", restart=True)
    assert (restarted.shards_run, restarted.rows_ok) == (2, 3)
    assert set(records(data / "out")) == {"r0", "r1", "r2"}
    with pytest.raises(BatchError, match="the input directory itself"):
        _run(data, data)


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"tokenizer_path": "/other/tokenizer.json"}, "tokenizer_path: '' -> '/other/tokenizer.json'"),
        ({"override_model_config": True, "base_num_decoder_layers": 2}, "base_num_decoder_layers: None -> 2"),
        ({"kv_quant_axis": "heads_and_dkv"}, "kv_quant_axis: 'dkv' -> 'heads_and_dkv'"),
        ({"lora_input_adapters_path": "/some/adapters"}, "lora_input_adapters_path: '' -> '/some/adapters'"),
        ({"max_lora_rank": 64}, "max_lora_rank: 16 -> 64"),
    ],
)
def test_a_resume_with_an_output_deciding_key_changed_is_refused_naming_it(tmp_path, changed, named):
    """These keys were missing from the fingerprint: a resume with another tokenizer or model shape
    mixed two models' outputs in one job."""
    source, out = tmp_path / "in.jsonl", tmp_path / "out"
    source.write_bytes(_lines(["r0", "r1", "r2", "r3"]))
    _run(source, out)
    _interrupt(out)
    with pytest.raises(BatchError, match=re.escape(named)):
        _run(source, out, cfg=CFG.model_copy(update=changed))


def test_a_resume_with_only_runtime_keys_changed_continues(tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out"
    source.write_bytes(_lines(["r0", "r1", "r2", "r3"]))
    _run(source, out)
    _interrupt(out)
    faster = {
        "max_queued_requests": 8,
        "prefix_cache": "off",
        "decode_steps_per_call": 2,
        "speculative_method": "ngram",
    }
    resumed = _run(source, out, cfg=CFG.model_copy(update=faster))
    assert (resumed.shards_run, resumed.rows_ok) == (1, 4)


def test_the_runtime_keys_are_config_keys_and_the_rest_decide_the_output():
    assert manifest.RUNTIME_KEYS.issubset(ServingConfig.model_fields)  # no misspelt key
    assert {
        "model_name",
        "tokenizer_path",
        "base_emb_dim",
        "kv_quant_axis",
        "lora_input_adapters_path",
    } <= set(manifest.OUTPUT_KEYS)


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    with emulated_bucket(tmp_path_factory.mktemp("gcs"), BUCKET) as url:
        yield url


def _upload(url: str, name: str, data: bytes) -> None:
    request = urllib.request.Request(
        f"{url}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={name}", data=data, method="POST"
    )
    urllib.request.urlopen(request, timeout=10).read()


def test_a_gcs_object_rewritten_to_the_same_size_is_refused_by_its_generation(gcs, tmp_path):
    prefix = tmp_path.name
    _upload(gcs, f"{prefix}/in/part-0.jsonl", _lines(["r0", "r1", "r2"]))
    (listed,) = files.list_inputs(f"gs://{BUCKET}/{prefix}/in", f"gs://{BUCKET}/{prefix}/in/out")
    assert listed.version.startswith("generation ") and listed.version != "generation "
    # The output under the input, as test_an_output_under_the_input_directory_is_left_out_of_the_input.
    inp, out = f"gs://{BUCKET}/{prefix}/in", f"gs://{BUCKET}/{prefix}/in/out"
    assert run_batch(inp, out, "mock", CFG, shard_size=2, progress=False, start=start_mock([])).rows_ok == 3
    again = run_batch(inp, out, "mock", CFG, shard_size=2, progress=False, start=start_mock([]))
    assert again.shards_run == 0
    _upload(gcs, f"{prefix}/in/part-0.jsonl", _lines(["r0", "r1", "r9"]))
    (rewritten,) = files.list_inputs(inp, out)
    assert rewritten.size == listed.size and rewritten.version != listed.version
    with pytest.raises(BatchError, match="the input files changed"):
        run_batch(inp, out, "mock", CFG, shard_size=2, progress=False, start=start_mock([]))


def test_a_custom_id_on_two_lines_refuses_the_job_up_front_naming_it_and_its_lines(tmp_path):
    """OpenAI's batch API requires custom_ids unique; two records under one id were written silently."""
    data = tmp_path / "in"
    data.mkdir()
    request = {"method": "POST", "url": "/v1/completions", "body": {"prompt": "ab", "max_tokens": 2}}
    (data / "a.jsonl").write_bytes(
        b"".join(
            json.dumps(line).encode() + b"\n"
            for line in [{"custom_id": "x", **request}, {"id": 5, "prompt": "ab"}]
        )
    )
    (data / "b.jsonl").write_bytes(
        b"\n".join(
            [
                b"{not json",
                b"",
                json.dumps({"id": "5", "prompt": "ab"}).encode(),
                json.dumps({"custom_id": "x", **request}).encode(),
            ]
        )
        + b"\n"
    )
    started: list = []
    with pytest.raises(BatchError) as refused:
        run_batch(str(data), str(tmp_path / "out"), "mock", CFG, progress=False, start=start_mock(started))
    message = str(refused.value)
    assert f"'x' on {data}/a.jsonl line 1, {data}/b.jsonl line 4" in message
    assert f"'5' on {data}/a.jsonl line 2, {data}/b.jsonl line 3" in message
    assert (
        started == [] and not (tmp_path / "out" / "_manifest.json").exists()
    )  # nothing planned, nothing run


def test_lines_without_ids_of_their_own_and_ids_that_share_a_hash_are_not_duplicates(tmp_path, monkeypatch):
    from serving.batch import custom_ids

    monkeypatch.setattr(custom_ids, "hash", lambda _: 7, raising=False)  # every id the same hash
    source = tmp_path / "in.jsonl"
    unreadable = [b"{not json", b"[1]", json.dumps({"custom_id": 3, "body": {}}).encode()] * 2
    plain = [json.dumps({"prompt": "ab", "max_tokens": 2}).encode()] * 2  # their record ids stand in
    source.write_bytes(b"\n".join([*unreadable, *plain, *_lines(["a", "b"]).splitlines()]) + b"\n")
    summary = _run(source, tmp_path / "out")
    assert (summary.rows_ok, summary.rows_failed) == (4, 6)
