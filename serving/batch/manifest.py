"""How a batch job is cut into shards, and the manifest that records which shards are finished.

A shard is a line range of one input file (with its byte range, so it can be read without reading
what comes before). The plan is made once and kept in the manifest with the job's fingerprint (the
arguments that decide the outputs); a rerun with the same fingerprint continues the same plan.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from serving.batch import files
from serving.batch.custom_ids import CustomIds
from serving.batch.errors import BatchError
from serving.config import ServingConfig

MANIFEST = "_manifest.json"
SUMMARY = "_summary.json"
RESULTS_PREFIX = "results-"
# The config keys that change only how fast or where rows are served, not what their records say:
# a rerun may change them. Every other ServingConfig key decides a row's output and a rerun that
# changes one is refused naming it: the model, its shape (override_model_config, base_*, head_dim,
# vocab_size, rope and norm constants), dtypes, quantization and the KV cache's (kv_quant_axis),
# the tokenizer, the length limits, unknown_request_fields (whether such a row fails), the LoRA
# adapters (lora_input_adapters_path, and max_lora_rank: which of them load). A key added to
# ServingConfig counts as output-deciding until it is listed here: a resume refused by mistake says
# which key, one accepted by mistake mixes outputs silently.
RUNTIME_KEYS = frozenset({
    # Placement and sharding.
    "per_device_batch_size", "ici_fsdp_parallelism", "ici_autoregressive_parallelism",
    "ici_tensor_parallelism", "logical_axis_rules", "override_logical_axis_rules",
    "replicate_quant_scale", "scan_layers", "runtime", "inference_server", "prefill_slice",
    "generate_slice", "stack_prefill_result_cache", "coordinator_address", "num_processes",
    "process_id", "distributed_timeout_s",
    # Kernels and the shapes of device calls (float rounding may differ, not the request's meaning).
    "cpu_kernels", "attention", "use_ragged_attention", "ragged_block_size", "int8_matmul_kernel",
    "pagedattn_num_pages", "pagedattn_tokens_per_page", "pagedattn_pages_per_compute_block",
    "pagedattn_max_pages_per_group", "decode_steps_per_call", "decode_slot_buckets",
    "prefill_chunk_size", "max_prefill_batch", "prefill_batch_tokens", "history_batch_tokens",
    "prefix_cache", "prefix_block_size", "kv_cache_bytes_per_chip", "max_loras", "max_cpu_loras",
    # Speculative decoding: the same output distribution (greedy: the same tokens).
    "speculative_method", "num_speculative_tokens", "speculative_model", "prompt_lookup_min",
    "prompt_lookup_max", "speculative_max_slots", "speculative_min_acceptance",
    "speculative_cost_ratio", "speculative_draft_cost_ratio",
    # Scheduling, compilation, profiling, and the HTTP and gRPC servers (batch runs neither).
    "max_queued_requests", "async_scheduling", "admission_wait_ms", "admission_gap_ms",
    "enable_model_warmup", "enable_background_warmup", "jax_compilation_cache_dir",
    "profiler_steps", "profile_dir", "profiler_port", "api_key", "liveness_timeout_s",
    "drain_timeout_s", "max_request_body_bytes", "grpc_port", "prometheus_port",
    # what JetStream's Decode (gRPC, HTTP /generate without sampling fields) samples with; a batch
    # row's sampling is its own body's
    "decode_sampling_strategy", "decode_sampling_nucleus_p", "decode_sampling_top_k", "decode_sampling_temperature",
})  # fmt: skip
OUTPUT_KEYS = tuple(key for key in ServingConfig.model_fields if key not in RUNTIME_KEYS)


@dataclass(frozen=True)
class Shard:
    id: str
    file: str  # input URL
    file_index: int
    first_line: int  # 1-based
    lines: int
    start: int  # byte range in the file
    end: int

    @property
    def output_name(self) -> str:
        return f"{RESULTS_PREFIX}{self.id}.jsonl"


@dataclass
class Manifest:
    fingerprint: dict[str, Any]
    shards: list[Shard]
    finished: dict[str, dict[str, int]] = field(default_factory=dict)  # shard id -> its counts
    # Names this job's shard claims (serving.batch.claims); "" in a manifest of before claims.
    job: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {
                "job": self.job,
                "fingerprint": self.fingerprint,
                "shards": [asdict(s) for s in self.shards],
                "finished": self.finished,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        try:
            data = json.loads(text)
            return cls(
                data["fingerprint"], [Shard(**s) for s in data["shards"]], data["finished"], data.get("job", "")
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise BatchError(
                f"{where}: not a pathserve batch manifest ({exc}); use --restart to start over"
            ) from None


def fingerprint(
    input_url: str, inputs: list[files.InputFile], source: str | None, cfg: ServingConfig, shard_size: int
) -> dict[str, Any]:
    return {
        "input": input_url,
        "files": [[f.url, f.size, f.version] for f in inputs],
        "source": source or "",
        "config": {key: getattr(cfg, key) for key in OUTPUT_KEYS},
        "shard_size": shard_size,
    }


def differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human names of what changed between the fingerprint in a manifest and this run's; none: the
    run continues that job.

    A manifest written by an earlier pathserve holds less: files as [url, size] (no version), and
    fewer config keys. Those are compared on what it holds and accepted when that matches, as that
    pathserve did, rather than refused: refusing would make every job in progress over an upgrade
    start over, for a change its own check could not have seen either."""
    out = []
    old_config = old.get("config", {})
    for key in new:
        if key == "config":
            out += [
                f"{k}: {old_config[k]!r} -> {v!r}"
                for k, v in new["config"].items()
                if k in old_config and old_config[k] != v
            ]
        elif key == "files":
            if not _same_files(old.get("files", []), new["files"]):
                out.append("the input files changed: added, removed, or written since the job was planned")
        elif old.get(key) != new[key]:
            out.append(f"{key}: {old.get(key)!r} -> {new[key]!r}")
    return out


def _same_files(old: list[list], new: list[list]) -> bool:
    return len(old) == len(new) and all(list(o) == list(n[: len(o)]) for o, n in zip(old, new, strict=True))


def plan(inputs: list[files.InputFile], shard_size: int) -> list[Shard]:
    """Shards of up to `shard_size` lines, file by file; raises BatchError when a custom_id is on
    more than one line (serving.batch.custom_ids)."""
    shards = []
    seen = CustomIds()
    for index, url in enumerate(f.url for f in inputs):
        offsets = _line_offsets(url, seen)
        count = len(offsets) - 1
        for first in range(0, count, shard_size):
            last = min(first + shard_size, count)
            shards.append(
                Shard(
                    id=f"{index:05d}-{first + 1:09d}",
                    file=url,
                    file_index=index,
                    first_line=first + 1,
                    lines=last - first,
                    start=offsets[first],
                    end=offsets[last],
                )
            )
    seen.check([f.url for f in inputs])
    return shards


def _line_offsets(url: str, seen: CustomIds) -> list[int]:
    """Byte offset of the start of every line, then the file size; `seen` takes each line's id."""
    offsets, position = [], 0
    for line in files.lines(url):
        offsets.append(position)
        position += len(line)
        seen.add(line)
    return [*offsets, position]


def load(output_url: str) -> Manifest | None:
    where = files.join(output_url, MANIFEST)
    data = files.read_bytes(where)
    return None if data is None else Manifest.from_json(data.decode(), where)


def save(output_url: str, manifest: Manifest) -> None:
    files.write_atomic(files.join(output_url, MANIFEST), manifest.to_json().encode())


def create(output_url: str, manifest: Manifest) -> bool:
    """Write the manifest only if there is none: of workers starting together, one plans the job
    and the others read its plan. False when another worker's was there first."""
    from serving.batch.conditional import create_new

    return create_new(files.join(output_url, MANIFEST), manifest.to_json().encode())
