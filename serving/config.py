"""The serving configuration: one typed object, loaded from YAML and `key=value` overrides.

Keys use MaxText's flag names where MaxText has one, so that its users feel at home. Everything is
validated once, here, before any work starts; errors name the key and what it accepts.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from serving.disaggregation import Disaggregation, disaggregation
from serving.errors import ConfigError
from serving.kernels.support import weights_unsupported
from serving.maxtext_config import MODEL_KEYS, RULES, base_rules, merge_rules, normalize_rules, split_keys
from serving.models.config import ModelConfig
from serving.quantization_mode import Quantization, decide_quantization

CONFIG_DIR_ENV = "PATHSERVE_CONFIG_DIR"
_Part = TypeVar("_Part")


class ServingConfig(BaseModel):
    """Model choice and serving settings (MaxText flag names)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    model_name: str = "smollm2-135m"
    load_parameters_path: str = ""
    max_prefill_predict_length: int = Field(default=1024, gt=0)
    max_target_length: int = Field(default=2048, gt=0)
    per_device_batch_size: float = Field(default=1.0, gt=0)
    # -1 (on one axis at most): the devices the other axes leave, as in MaxText.
    ici_fsdp_parallelism: int = Field(default=1, ge=-1)
    ici_autoregressive_parallelism: int = Field(default=1, ge=-1)
    ici_tensor_parallelism: int = Field(default=1, ge=-1)
    # MaxText's logical axis rules ([name, [mesh axes]] pairs, serving.engine.partitioning); empty:
    # base.yml's. A recipe file brings its own (serving.maxtext_config says how they combine).
    logical_axis_rules: list[list[Any]] = Field(default_factory=list)
    override_logical_axis_rules: bool = False
    replicate_quant_scale: bool = False  # int8 weights' scales whole on every chip
    # The model as MaxText describes one: over model_name's preset with override_model_config=true,
    # or alone for a model without one (serving.config.model_description).
    override_model_config: bool = False
    base_emb_dim: int | None = Field(default=None, gt=0)
    base_num_query_heads: int | None = Field(default=None, gt=0)
    base_num_kv_heads: int | None = Field(default=None, gt=0)
    base_num_decoder_layers: int | None = Field(default=None, gt=0)
    base_mlp_dim: int | None = Field(default=None, gt=0)
    head_dim: int | None = Field(default=None, gt=0)
    vocab_size: int | None = Field(default=None, gt=0)
    rope_max_timescale: float | None = Field(default=None, gt=0)
    normalization_layer_epsilon: float | None = Field(default=None, gt=0)
    logits_via_embedding: bool | None = None
    scan_layers: bool = True
    weight_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # MaxText's meaning: "int8" is AQT's dynamic-range int8 on both sides of each layer matmul
    # (W8A8: int8 weights, activations quantized per token at run time, int32 sums; the embedding
    # and the head stay float unless the checkpoint holds them in int8). "int8w" is ours:
    # weight-only int8 (every matmul weight and the embedding int8, activations float).
    quantization: Literal["", "int8", "int8w"] = ""
    quantize_kvcache: bool = False
    # MaxText's int8 KV scale layouts (serving.models.cache.quantize_kv): "dkv" one scale per token
    # and kv head, "heads_and_dkv" one per token ("" only without quantize_kvcache). MaxText's
    # default is heads_and_dkv; pathserve's, dkv (measured closer to the float cache).
    kv_quant_axis: Literal["", "dkv", "heads_and_dkv"] = "dkv"
    checkpoint_is_quantized: bool = False
    # MaxText's tokenizer file, for checkpoints that carry none (MaxText's own): a tokenizer.json,
    # a Llama 3 tiktoken file, or MaxText's asset name (assets/tokenizer_llama3.tiktoken: the
    # llama-models package's copy). A checkpoint that carries its tokenizer uses its own.
    tokenizer_path: str = ""
    # On one x86 CPU device, matmuls (and, on AVX-512, decode attention) run through
    # serving/kernels/: with AVX-512 VNNI float32, int8w (activations per row in int16) and int8
    # (W8A8: activations per row in int8, as XLA's int8 dot); with AVX2 and FMA the two int8 modes.
    # "auto" uses them where they build and the CPU can, "on" fails where they cannot, "off" keeps
    # XLA's ops. Never bfloat16 weights.
    cpu_kernels: Literal["auto", "on", "off"] = "auto"
    enable_model_warmup: bool = False
    # After the warmup, a background thread at the lowest CPU priority compiles a prefix hit's
    # partial chunks (serving.engine.warmup.BackgroundWarmup); false leaves them to compile at first
    # use (no compiling beside serving: a test, a benchmark that measures steady state differently).
    enable_background_warmup: bool = True
    # Engine and runtime (not MaxText flags).
    runtime: Literal["auto", "local", "pathways", "multicontroller"] = "auto"
    # MaxText's server choice (serving.disaggregation): MaxtextInterleavedServer runs prefill and
    # generate on every device; ExperimentalMaxtextDisaggregatedServer a prefill engine on
    # prefill_slice's devices and a generate engine on generate_slice's (JetStream's slice strings),
    # the prompt's KV moved between them; ..._<N>: N devices each. stack_prefill_result_cache is
    # MaxText's layers-in-one-buffer for that move: pathserve's prefix is one buffer either way.
    inference_server: str = "MaxtextInterleavedServer"
    prefill_slice: str = "v5e-16"
    generate_slice: str = "v5e-16"
    stack_prefill_result_cache: bool = False
    decode_steps_per_call: int = Field(default=4, ge=1, le=64)
    # Slot counts generate is compiled for; each call runs the smallest holding the active slots
    # (empty: powers of two up to the slots).
    decode_slot_buckets: list[int] = Field(default_factory=list)
    # Chunked prefill (MaxText's use_chunked_prefill): prompts enter their slots in chunks of at most
    # this many tokens (0: max_prefill_predict_length), between decode calls, so running streams keep
    # flowing; a prompt may be as long as max_target_length - max_tokens.
    prefill_chunk_size: int = Field(default=0, ge=0)
    # Batched prefill: up to this many prompts (chunks) in one compiled call, padded to a shared
    # length bucket, at most prefill_batch_tokens padded tokens in all (0: max_prefill_predict_length).
    max_prefill_batch: int = Field(default=8, ge=1)
    prefill_batch_tokens: int = Field(default=0, ge=0)
    # A call whose rows start after cached positions (a long prompt's later chunks, a prefix hit's
    # rest) attends to their window too: its attention's temporaries grow with rows x window, so it
    # takes at most this many padded tokens (0: prefill_batch_tokens).
    history_batch_tokens: int = Field(default=0, ge=0)
    # Prefix cache: the KV cache's full pages of prompt (prefix_block_size tokens each) are keyed by
    # their token ids and shared by later prompts that begin with them; freed ones stay until the
    # pool needs them (least recently used first). The pool is the cache: no budget of its own.
    prefix_cache: Literal["on", "off"] = "on"
    prefix_block_size: int = Field(default=32, ge=1)
    # The KV cache is a pool of pages of prefix_block_size positions that sequences take as they
    # grow (serving.orchestrator.pages; 32, MaxText's pagedattn_tokens_per_page: a sequence's last
    # page is half empty on average, 16 positions rather than 32 of 64): its bytes per chip (0:
    # enough for every decode slot to reach max_target_length at once). per_device_batch_size stays the most sequences decoding.
    kv_cache_bytes_per_chip: int = Field(default=0, ge=0)
    # MaxText's paged attention keys, read (as MaxText reads them) only with attention=paged: the
    # pool's pages (page 0, scratch, included; per layer in MaxText, one index for every layer
    # here), positions per page (then the prefix cache's block too), pages per compute block of
    # the TPU kernel, and the most pages of one sequence (-1: max_target_length's). Without
    # attention=paged the cache is paged all the same, sized by kv_cache_bytes_per_chip.
    # MaxText's attention kernels (a name MaxText does not know is refused, as MaxText refuses it);
    # which one runs here is the backend's choice, except paged (above).
    attention: Literal[
        "autoselected", "dot_product", "flash", "cudnn_flash_te", "cudnn_flash_jax", "vllm_rpa", "vllm_batched_rpa", "paged"
    ] = "autoselected"
    pagedattn_num_pages: int = Field(default=64, ge=0)
    pagedattn_tokens_per_page: int = Field(default=32, ge=1)
    pagedattn_pages_per_compute_block: int = Field(default=4, ge=1)
    pagedattn_max_pages_per_group: int = -1
    # MaxText's ragged attention keys: on TPUs, attention reads each sequence's pages (float or
    # int8) in place through pathserve's ragged paged kernel (serving.kernels.ragged_paged),
    # ragged_block_size positions (whole pages of prefix_block_size) copied into VMEM at once;
    # elsewhere they change nothing (logged).
    use_ragged_attention: bool = False
    ragged_block_size: int = Field(default=256, ge=1)
    # pathserve's: on one TPU, int8w matmuls of calls of up to 256 rows (decode steps, verify
    # calls, short prefill chunks, a prefill's head) through pathserve's Pallas kernel
    # (serving.kernels.int8_matmul: each int8 block dequantized in VMEM, read once at HBM's rate)
    # instead of XLA's fused convert; elsewhere, or without int8w, nothing (logged). Slower than
    # XLA on a v5e (1B shape: 385 against 404 tok/s at batch 1; docs/tpu.md), so off.
    int8_matmul_kernel: bool = False
    max_queued_requests: int = Field(default=256, ge=1)
    # Speculative decoding: each decode call of a slot that proposes scores its proposals (up to
    # num_speculative_tokens) and keeps the ones the target would have produced, in one forward
    # pass; output identical in distribution (greedy: identical tokens). "ngram": prompt lookup of
    # the longest suffix of prompt_lookup_max..prompt_lookup_min tokens. "draft": the checkpoint
    # at speculative_model proposes (it must share the tokenizer). Off while more than
    # speculative_max_slots slots decode (the crossover, measured: configs/serving/default.yml), and
    # for a request whose recent acceptance is below speculative_min_acceptance.
    speculative_method: Literal["none", "ngram", "draft"] = "none"
    num_speculative_tokens: int = Field(default=4, ge=1, le=16)
    speculative_model: str = ""
    prompt_lookup_min: int = Field(default=2, ge=1)
    prompt_lookup_max: int = Field(default=4, ge=1)
    speculative_max_slots: int = Field(default=4, ge=0)
    speculative_min_acceptance: float = Field(default=0.2, ge=0, le=1)
    # A verify call's cost in decode steps (measured: loadtest.spec_bench); a call runs only when
    # its slots are expected to emit at least this many times a decode step's tokens.
    speculative_cost_ratio: float = Field(default=2.2, ge=0)
    # A draft model's proposals' cost in decode steps, added to speculative_cost_ratio in that
    # test; -1: derived, k passes at the draft's share of the target's parameters
    # (serving.engine.draft.DraftModel.cost_in_steps).
    speculative_draft_cost_ratio: float = Field(default=-1.0, ge=-1)
    jax_compilation_cache_dir: str = ""
    # runtime=multicontroller: JAX's distributed runtime. Unset, they come from JAX_COORDINATOR_ADDRESS,
    # JAX_NUM_PROCESSES, JAX_PROCESS_ID, or on an LWS pod from LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and
    # LWS_WORKER_INDEX; on TPU VMs with none of them, jax.distributed.initialize() detects them.
    coordinator_address: str = ""  # host:port of process 0's coordinator
    num_processes: int = Field(default=0, ge=0)
    process_id: int = Field(default=-1, ge=-1)
    # A process missing its heartbeats this long fails the group (and a dead peer's collective fails
    # at once): process 0's device loop stops, /livez fails and every process exits non-zero.
    distributed_timeout_s: int = Field(default=60, ge=1)
    # The device loop makes and starts the next plan while a generate call is still on the device
    # (its tokens read after), where no decision needs those tokens (serving.orchestrator.scheduler.
    # runs_ahead): vLLM's async scheduling. false: each plan waits for the last one's tokens.
    async_scheduling: bool = True
    # A burst of requests reaching an idle device loop (clients starting together, a wave of them
    # sending their next request as the last ones end) is admitted together: with nothing running,
    # the loop waits while requests keep arriving, each within `admission_gap_ms` of the last, for at
    # most `admission_wait_ms` in all, so that their prompts prefill in one call and they decode in
    # step (admitted one call apart, a burst splits into groups that end one generate call apart,
    # each group's last call short of rows); no longer once the waiting take every free slot.
    # 0: the first arrival is scheduled at once.
    admission_wait_ms: float = Field(default=0.0, ge=0, le=1000)
    admission_gap_ms: float = Field(default=2.0, gt=0, le=1000)
    profiler_steps: int = Field(default=0, ge=0)  # trace this many generate calls at start (with profile_dir)
    profile_dir: str = ""  # local path or gs://
    profiler_port: int = Field(default=0, ge=0, le=65535)  # jax.profiler.start_server when set
    # HTTP server.
    api_key: str = ""  # bearer token required on the API routes when set (or PATHSERVE_API_KEY)
    liveness_timeout_s: float = Field(default=60.0, gt=0)  # /livez fails when work waits this long
    drain_timeout_s: float = Field(default=30.0, ge=0)  # SIGTERM: how long in-flight requests may finish
    max_request_body_bytes: int = Field(default=1 << 20, gt=0)
    # A request field no wire type defines (a typo, a vendor extra): "reject" answers 400 naming it
    # (as OpenAI does); "warn" ignores it, logs each name once and counts it in /metrics.
    unknown_request_fields: Literal["reject", "warn"] = "reject"
    # JetStream's gRPC API (jetstream_proto.Orchestrator) beside HTTP; 0 turns it off.
    grpc_port: int = Field(default=9000, ge=0, le=65535)
    # MaxText's decode sampling, what JetStream's Decode (gRPC, and HTTP /v1/generate) samples with:
    # its DecodeRequest has no sampling fields (serving.grpc.decode.sampling). greedy; weighted (the
    # temperature); nucleus (top-p, then the temperature); topk (top-k, then the temperature);
    # composite (top-k, then top-p, then the temperature).
    decode_sampling_strategy: Literal["greedy", "weighted", "nucleus", "topk", "composite"] = "greedy"
    decode_sampling_nucleus_p: float = Field(default=-1.0, le=1)  # -1: unset (base.yml's)
    decode_sampling_top_k: int = Field(default=0, ge=0)
    decode_sampling_temperature: float = Field(default=1.0, ge=0)
    # MaxText's prometheus_port (JetStream's metrics server): /metrics also on this port; 0: only
    # on the HTTP port.
    prometheus_port: int = Field(default=0, ge=0, le=65535)
    # Multi-LoRA (serving.lora): every sub-directory of lora_input_adapters_path (MaxText's key; local
    # or gs://) is a PEFT adapter named by it, loaded at start-up; more come and go at run time.
    # max_loras adapters sit on the device at once (0: none, or 4 when lora_input_adapters_path is
    # set), max_cpu_loras in host memory (0: max_loras); beyond both, least recently used first out,
    # read from storage again when asked for. Every adapter's rank is at most max_lora_rank.
    lora_input_adapters_path: str = ""
    max_loras: int = Field(default=0, ge=0)
    max_lora_rank: int = Field(default=16, ge=1)
    max_cpu_loras: int = Field(default=0, ge=0)

    @property
    def engine(self) -> EngineConfig:
        part = self._part(EngineConfig)
        return EngineConfig(**{
            **part.__dict__,
            "quantization": decide_quantization(self.quantization, self.checkpoint_is_quantized),
            "decode_slot_buckets": tuple(self.decode_slot_buckets),
            "logical_axis_rules": normalize_rules(self.logical_axis_rules),
            "max_loras": self.lora.max_loras,
        })

    @property
    def lora(self) -> LoraConfig:
        loras = self.max_loras or (4 if self.lora_input_adapters_path else 0)
        return LoraConfig(
            self.lora_input_adapters_path, loras, self.max_lora_rank, max(self.max_cpu_loras, loras)
        )

    @property
    def devices(self) -> DevicesConfig:
        return self._part(DevicesConfig)

    @property
    def server(self) -> ServerConfig:
        return replace(self._part(ServerConfig), max_loras=self.lora.max_loras)

    @property
    def orchestrator(self) -> OrchestratorConfig:
        part = self._part(OrchestratorConfig)
        return OrchestratorConfig(
            **{**part.__dict__, "speculative": self.speculative, "disaggregated": self.disaggregation is not None}
        )

    @property
    def speculative(self) -> SpeculativeConfig:
        return self._part(SpeculativeConfig)

    def _part(self, cls: type[_Part]) -> _Part:
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls) if f.name in type(self).model_fields})

    @field_validator("cpu_kernels", "prefix_cache", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: object) -> object:
        """YAML reads a bare on/off as a boolean."""
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ServingConfig:
        if self.quantize_kvcache and not self.kv_quant_axis:
            raise ValueError("quantize_kvcache=true needs kv_quant_axis: dkv or heads_and_dkv (MaxText's rule)")
        if self.attention == "paged":
            self._paged_attention_keys()
        else:
            self._log_attention_without_effect()
        if self.use_ragged_attention:
            self._ragged_attention_keys()
        self._disaggregation_keys()
        strategy = self.decode_sampling_strategy
        if strategy in ("nucleus", "composite") and not 0 < self.decode_sampling_nucleus_p <= 1:
            raise ValueError(f"decode_sampling_strategy={strategy} needs decode_sampling_nucleus_p in (0, 1]")
        if strategy in ("topk", "composite") and self.decode_sampling_top_k < 1:
            raise ValueError(f"decode_sampling_strategy={strategy} needs decode_sampling_top_k of 1 or more")
        if self.max_prefill_predict_length > self.max_target_length:
            raise ValueError(
                f"max_prefill_predict_length ({self.max_prefill_predict_length}) must not exceed "
                f"max_target_length ({self.max_target_length})"
            )
        if self.prefill_chunk_size > self.max_prefill_predict_length:
            raise ValueError(
                f"prefill_chunk_size ({self.prefill_chunk_size}) must not exceed "
                f"max_prefill_predict_length ({self.max_prefill_predict_length})"
            )
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if any(b < 1 for b in self.decode_slot_buckets):
            raise ValueError(f"decode_slot_buckets must be positive slot counts, got {self.decode_slot_buckets}")
        unsupported = weights_unsupported(self.quantization, self.weight_dtype)
        if self.cpu_kernels == "on" and unsupported:
            raise ValueError(f"cpu_kernels=on, but the CPU kernels cannot be used: {unsupported}")
        decide_quantization(self.quantization, self.checkpoint_is_quantized)  # the flags' own rule
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if (self.speculative_method == "draft") != bool(self.speculative_model):
            raise ValueError("speculative_model is required with speculative_method=draft, and only with it")
        ici = {
            "ici_fsdp_parallelism": self.ici_fsdp_parallelism,
            "ici_autoregressive_parallelism": self.ici_autoregressive_parallelism,
            "ici_tensor_parallelism": self.ici_tensor_parallelism,
        }
        if 0 in ici.values() or list(ici.values()).count(-1) > 1:
            raise ValueError(f"ici parallelism: each a size >= 1, or -1 on one axis at most (got {ici})")
        for i, rule in enumerate(self.logical_axis_rules):
            axes = rule[1] if len(rule) == 2 else None
            if not (
                isinstance(rule[0] if rule else None, str)
                and (isinstance(axes, str) or (isinstance(axes, list) and all(isinstance(a, str) for a in axes)))
            ):
                raise ValueError(f"logical_axis_rules[{i}]: expected [name, [mesh axes]], got {rule!r}")
        described = [k for k in MODEL_KEYS if getattr(self, k) is not None]
        if described and self.model_name in model_presets() and not self.override_model_config:
            raise ValueError(
                f"{', '.join(described)}: model {self.model_name!r} has a preset; "
                "override_model_config=true overrides its keys"
            )
        return self

    @property
    def disaggregation(self) -> Disaggregation | None:
        """The prefill / generate device split inference_server asks for (None: interleaved)."""
        return disaggregation(self.inference_server, self.prefill_slice, self.generate_slice)

    def _disaggregation_keys(self) -> None:
        try:
            split = self.disaggregation
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if split is None:
            return
        if self.speculative_method != "none":
            raise ValueError(
                f"speculative_method={self.speculative_method} with inference_server={self.inference_server}: "
                "speculative decoding runs on the interleaved server only"
            )

    def _log_attention_without_effect(self) -> None:
        """MaxText's other attention kernels and the pagedattn_* keys without attention=paged change
        nothing here (the cache is paged either way, attention runs on the backend's ops): said once,
        by name, as for every MaxText key without effect."""
        given = sorted(k for k in self.model_fields_set if k.startswith("pagedattn_"))
        if self.attention not in ("autoselected", "dot_product"):  # dot-product attention is what runs
            given.insert(0, f"attention={self.attention}")
        if "ragged_block_size" in self.model_fields_set and not self.use_ragged_attention:
            given.append("ragged_block_size (without use_ragged_attention)")
        if given:
            logging.getLogger(__name__).warning(
                "MaxText keys with no effect on serving (the KV cache is paged either way; only "
                "attention=paged reads the pagedattn_* keys): %s", ", ".join(given)
            )

    def _ragged_attention_keys(self) -> None:
        """use_ragged_attention: its block is whole pages; it takes precedence over attention=paged."""
        if self.ragged_block_size % self.prefix_block_size:
            raise ValueError(
                f"ragged_block_size ({self.ragged_block_size}) must be a whole number of pages of "
                f"prefix_block_size ({self.prefix_block_size}) positions: the kernel copies whole pages"
            )
        if self.attention == "paged":
            logging.getLogger(__name__).warning(
                "use_ragged_attention and attention=paged: the ragged kernel serves attention on a TPU "
                "(pagedattn_pages_per_compute_block is then unused)"
            )

    def _paged_attention_keys(self) -> None:
        """attention=paged: MaxText's pagedattn_* keys size the page pool (checked as MaxText's
        PageManager checks them); the page is the prefix cache's block."""
        page = self.pagedattn_tokens_per_page
        if "prefix_block_size" in self.model_fields_set and self.prefix_block_size != page:
            raise ValueError(
                f"prefix_block_size ({self.prefix_block_size}) and pagedattn_tokens_per_page ({page}) differ: "
                "with attention=paged the page is the prefix cache's block"
            )
        if self.kv_cache_bytes_per_chip:
            raise ValueError("kv_cache_bytes_per_chip and attention=paged's pagedattn_num_pages both size the pool: give one")
        per_sequence = -(-self.max_target_length // page)
        if 0 < self.pagedattn_max_pages_per_group < per_sequence:
            raise ValueError(
                f"pagedattn_max_pages_per_group ({self.pagedattn_max_pages_per_group}) is below the "
                f"{per_sequence} pages of max_target_length={self.max_target_length}"
            )
        if self.pagedattn_num_pages < per_sequence + 1:
            raise ValueError(
                f"pagedattn_num_pages ({self.pagedattn_num_pages}) cannot hold one sequence of max_target_length="
                f"{self.max_target_length} ({per_sequence} pages of {page}) and the reserved page 0"
            )
        object.__setattr__(self, "prefix_block_size", page)

    def parallelism(self, devices: int) -> tuple[int, int, int]:
        """(fsdp, autoregressive, tensor) over `devices`, the -1 axis (if any) taking what is left."""
        return resolve_parallelism(
            (self.ici_fsdp_parallelism, self.ici_autoregressive_parallelism, self.ici_tensor_parallelism),
            devices,
        )


# Each component gets only its own part of the config: a frozen dataclass whose fields are the
# ServingConfig keys it reads, under the same (MaxText) names. ServingConfig.<part> builds them.
# Each default is written once, on ServingConfig's field; a part's default is read from there.


def _default(key: str) -> Any:
    """ServingConfig's default for `key` (a list as a tuple: the parts are frozen)."""
    value = ServingConfig.model_fields[key].get_default(call_default_factory=True)
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class EngineConfig:
    """What the engine compiles: slots, shapes, numerics, backend."""

    per_device_batch_size: float = _default("per_device_batch_size")
    max_prefill_predict_length: int = _default("max_prefill_predict_length")
    max_target_length: int = _default("max_target_length")
    scan_layers: bool = _default("scan_layers")
    dtype: str = _default("dtype")
    weight_dtype: str = _default("weight_dtype")
    # what `quantization` means, decided once (serving.quantization_mode): the flags' mode, and
    # where start-up read a checkpoint, the entries it stores in int8 (LaunchPlan.engine)
    quantization: Quantization = field(default_factory=Quantization)
    quantize_kvcache: bool = _default("quantize_kvcache")
    kv_quant_axis: str = _default("kv_quant_axis")
    cpu_kernels: str = _default("cpu_kernels")
    enable_background_warmup: bool = _default("enable_background_warmup")
    decode_steps_per_call: int = _default("decode_steps_per_call")
    prefill_chunk_size: int = _default("prefill_chunk_size")
    max_prefill_batch: int = _default("max_prefill_batch")
    prefill_batch_tokens: int = _default("prefill_batch_tokens")
    history_batch_tokens: int = _default("history_batch_tokens")
    prefix_block_size: int = _default("prefix_block_size")
    kv_cache_bytes_per_chip: int = _default("kv_cache_bytes_per_chip")
    attention: str = _default("attention")
    pagedattn_num_pages: int = _default("pagedattn_num_pages")
    pagedattn_pages_per_compute_block: int = _default("pagedattn_pages_per_compute_block")
    use_ragged_attention: bool = _default("use_ragged_attention")
    ragged_block_size: int = _default("ragged_block_size")
    int8_matmul_kernel: bool = _default("int8_matmul_kernel")
    decode_slot_buckets: tuple[int, ...] = _default("decode_slot_buckets")
    # MaxText's placement keys (serving.engine.partitioning): () is base.yml's rules.
    logical_axis_rules: tuple = _default("logical_axis_rules")
    replicate_quant_scale: bool = _default("replicate_quant_scale")
    max_loras: int = _default("max_loras")  # LoRA adapters' device slots (0: none; serving.lora)
    max_lora_rank: int = _default("max_lora_rank")


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (serving.lora): where adapters are loaded from at start-up, how many sit
    on the device (`max_loras`) and on the host (`max_cpu_loras`) at once, their largest rank."""

    lora_input_adapters_path: str = _default("lora_input_adapters_path")
    max_loras: int = _default("max_loras")
    max_lora_rank: int = _default("max_lora_rank")
    max_cpu_loras: int = _default("max_cpu_loras")

    @property
    def enabled(self) -> bool:
        return self.max_loras > 0


@dataclass(frozen=True)
class DevicesConfig:
    """Where the engine runs: the JAX runtime, the mesh's shape, the compilation cache."""

    runtime: str = _default("runtime")
    jax_compilation_cache_dir: str = _default("jax_compilation_cache_dir")
    # runtime=multicontroller (serving.runtime): empty / 0 / -1 fall back to the environment.
    coordinator_address: str = _default("coordinator_address")
    num_processes: int = _default("num_processes")
    process_id: int = _default("process_id")
    distributed_timeout_s: int = _default("distributed_timeout_s")
    ici_fsdp_parallelism: int = _default("ici_fsdp_parallelism")
    ici_autoregressive_parallelism: int = _default("ici_autoregressive_parallelism")
    ici_tensor_parallelism: int = _default("ici_tensor_parallelism")
    inference_server: str = _default("inference_server")
    prefill_slice: str = _default("prefill_slice")
    generate_slice: str = _default("generate_slice")

    @property
    def disaggregation(self) -> Disaggregation | None:
        return disaggregation(self.inference_server, self.prefill_slice, self.generate_slice)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (serving.orchestrator.proposers, serving.engine.speculative)."""

    speculative_method: str = _default("speculative_method")
    num_speculative_tokens: int = _default("num_speculative_tokens")
    speculative_model: str = _default("speculative_model")
    prompt_lookup_min: int = _default("prompt_lookup_min")
    prompt_lookup_max: int = _default("prompt_lookup_max")
    speculative_max_slots: int = _default("speculative_max_slots")
    speculative_min_acceptance: float = _default("speculative_min_acceptance")
    speculative_cost_ratio: float = _default("speculative_cost_ratio")
    speculative_draft_cost_ratio: float = _default("speculative_draft_cost_ratio")


@dataclass(frozen=True)
class OrchestratorConfig:
    """The device loop's settings."""

    max_queued_requests: int = _default("max_queued_requests")
    prefix_cache: str = _default("prefix_cache")
    profiler_steps: int = _default("profiler_steps")  # trace this many generate calls at start (with profile_dir)
    profile_dir: str = _default("profile_dir")
    async_scheduling: bool = _default("async_scheduling")  # the next plan started before the last one's tokens are read
    admission_wait_ms: float = _default("admission_wait_ms")  # an idle loop gathers a burst of arrivals this long at most
    admission_gap_ms: float = _default("admission_gap_ms")  # ...while each comes within this of the last
    profiler_port: int = _default("profiler_port")  # jax.profiler.start_server when set
    speculative: SpeculativeConfig = SpeculativeConfig()
    # inference_server is disaggregated (serving.disaggregation): each prompt the prefill engine
    # finishes is handed to the generate engine, as the plan says
    disaggregated: bool = False


@dataclass(frozen=True)
class ServerConfig:
    """The front-ends' settings (HTTP and gRPC): probes, drain, limits, auth."""

    max_target_length: int = _default("max_target_length")  # reported by /v1/models, the default room for max_tokens
    max_queued_requests: int = _default("max_queued_requests")  # readiness fails while the queue is full
    liveness_timeout_s: float = _default("liveness_timeout_s")
    drain_timeout_s: float = _default("drain_timeout_s")
    max_request_body_bytes: int = _default("max_request_body_bytes")
    api_key: str = _default("api_key")
    grpc_port: int = _default("grpc_port")
    unknown_request_fields: str = _default("unknown_request_fields")
    decode_sampling_strategy: str = _default("decode_sampling_strategy")
    decode_sampling_nucleus_p: float = _default("decode_sampling_nucleus_p")
    decode_sampling_top_k: int = _default("decode_sampling_top_k")
    decode_sampling_temperature: float = _default("decode_sampling_temperature")
    prometheus_port: int = _default("prometheus_port")

    def decode_sampling(self) -> dict[str, Any]:
        """MaxText's decode_sampling_* keys as SamplingParams' fields (temperature, top_p, top_k and,
        when it samples, a fresh seed a request, as MaxText's engine splits its key a request):
        what a JetStream request, which has no sampling fields, is decoded with."""
        strategy = self.decode_sampling_strategy
        if strategy == "greedy":
            return {"temperature": 0.0}
        out: dict[str, Any] = {"temperature": self.decode_sampling_temperature, "seed": secrets.randbits(31)}
        if strategy in ("nucleus", "composite"):
            out["top_p"] = self.decode_sampling_nucleus_p
        if strategy in ("topk", "composite"):
            out["top_k"] = self.decode_sampling_top_k
        return out
    max_loras: int = _default("max_loras")  # LoRA adapters served: the adapter APIs (gRPC service v1) are on


def resolve_parallelism(sizes: tuple[int, int, int], devices: int) -> tuple[int, int, int]:
    """MaxText's -1: the one axis set to -1 gets `devices` over the product of the others."""
    if -1 not in sizes:
        return sizes
    known = math.prod(s for s in sizes if s != -1)
    if devices % known:
        raise ConfigError(
            f"ici parallelism {sizes}: the axes set leave {devices}/{known} devices for the -1 axis, "
            "not a whole number"
        )
    return tuple(devices // known if s == -1 else s for s in sizes)  # type: ignore[return-value]


def config_dir() -> Path:
    """Where `models/*.yml` presets live: $PATHSERVE_CONFIG_DIR or the repository's configs/."""
    env = os.environ.get(CONFIG_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parent.parent / "configs"


def model_presets() -> list[str]:
    """Names of the model presets in configs/models/."""
    return sorted(p.stem for p in (config_dir() / "models").glob("*.yml"))


def load_model_config(name: str) -> ModelConfig:
    """The preset configs/models/NAME.yml."""
    path = config_dir() / "models" / f"{name}.yml"
    if not path.is_file():
        raise ConfigError(f"model_name: unknown model {name!r}; known models: {', '.join(model_presets())}")
    return build(ModelConfig, read_yaml(path), source=str(path))


def load_config(
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
) -> ServingConfig:
    """Serving keys over `defaults`: from a YAML file (optional), then `key=value` overrides; validated.

    The file is pathserve's serving YAML (configs/serving/), or a MaxText config file (a
    `base_config:` chain, serving.maxtext_config), read as MaxText reads one with the overrides after it.
    MaxText keys with no effect on serving are dropped (and logged); unknown keys are errors."""
    values: dict[str, Any] = dict(defaults or {})
    parsed = parse_overrides(overrides)
    source = str(path) if path else "overrides"
    if path and is_maxtext_file(path):
        from serving import maxtext_config as maxtext

        values.update(maxtext.load(str(path), parsed, _preset_keys_or_none))
    else:
        if path:
            values.update(read_yaml(Path(path)))
        rules_given = RULES in parsed
        values.update(parsed)
        if rules_given and not values.get("override_logical_axis_rules"):
            values[RULES] = merge_rules([[n, list(a)] for n, a in base_rules()], parsed[RULES])
        if values.get("enable_jax_profiler") and "profiler_port" not in values:  # as maxtext_config.load maps it
            values["profiler_port"] = int(values.get("jax_profiler_port", 9999))
    _check_rope_type(values, source)
    if values.get("use_chunked_prefill") is False and "prefill_chunk_size" not in parsed:
        # MaxText reads a file's prefill_chunk_size only with use_chunked_prefill (base.yml: 256 over
        # a max_prefill_predict_length of 64); pathserve always chunks, by its own default then
        values.pop("prefill_chunk_size", None)
    for key in RETIRED_KEYS.keys() & values.keys():
        raise ConfigError(f"{source}: {key} is no longer a key: {RETIRED_KEYS[key]}")
    return build(ServingConfig, split_keys(values, ServingConfig.model_fields, source), source=source)


def _check_rope_type(values: Mapping[str, Any], source: str) -> None:
    """MaxText's rope_type: "default", or "llama3.1" where model_name's preset scales its rope so
    (pathserve scales by the preset: a "llama3.1" over a model that does not is refused)."""
    rope_type = values.get("rope_type", "default")
    if rope_type == "default":
        return
    name = str(values.get("model_name", ServingConfig.model_fields["model_name"].default))
    scaled = name in model_presets() and load_model_config(name).rope_scaling is not None
    if rope_type != "llama3.1" or not scaled:
        raise ConfigError(
            f"{source}: rope_type={rope_type!r} is not supported with model_name={name!r} (pathserve applies "
            "the rope scaling of the model's preset: llama3.1's for the Llama 3.1-3.3 presets, none otherwise)"
        )


# Keys pathserve once had, with what replaced them.
RETIRED_KEYS = {
    "quantize_activations": "quantization=int8 quantizes activations per token (W8A8, MaxText's meaning); "
    "quantization=int8w is weight-only int8",
}


def is_maxtext_file(path: str | os.PathLike) -> bool:
    """A MaxText config: pathserve's copy of a MaxText path, or a YAML file with a base_config or
    with keys only MaxText has (MaxText's own base.yml, the root of every chain, has no base_config)."""
    from serving import maxtext_config as maxtext

    if not Path(path).is_file():
        return maxtext.is_config_file(str(path))  # resolve_config_path names it if it is not ours
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    if not isinstance(data, dict):
        return False
    return maxtext.BASE_CONFIG in data or bool(set(data) & (maxtext.maxtext_keys() - set(ServingConfig.model_fields)))


def _preset_keys_or_none(name: str) -> dict[str, Any] | None:
    return preset_model_keys(name) if name in model_presets() else None


def preset_model_keys(name: str) -> dict[str, Any]:
    """A preset's architecture under MaxText's key names (serving.maxtext_config.MODEL_KEYS)."""
    model = load_model_config(name)
    return {key: getattr(model, field) for key, field in MODEL_KEYS.items()}


def model_description(cfg: ServingConfig) -> ModelConfig:
    """The model `cfg` describes: model_name's preset, with MaxText's architecture keys over it
    (override_model_config=true), or those keys alone for a model without a preset."""
    given = {MODEL_KEYS[k]: getattr(cfg, k) for k in MODEL_KEYS if getattr(cfg, k) is not None}
    if cfg.model_name in model_presets():
        preset = load_model_config(cfg.model_name)
        return build(ModelConfig, {**preset.model_dump(), **given}, source=f"model {cfg.model_name}")
    missing = [k for k in MODEL_KEYS if getattr(cfg, k) is None and MODEL_KEYS[k] != "tie_embeddings"]
    if missing:
        raise ConfigError(
            f"model_name: {cfg.model_name!r} has no preset (known: {', '.join(model_presets())}); "
            f"describe it with {', '.join(missing)}"
        )
    values = {**given, "name": cfg.model_name, "max_position": cfg.max_target_length}
    values["tie_embeddings"] = bool(values.get("tie_embeddings", False))
    values["rope_theta"] = float(values["rope_theta"])
    return build(ModelConfig, values, source=f"model {cfg.model_name}")


def parse_overrides(overrides: Iterable[str]) -> dict[str, Any]:
    """Turn ["key=value", ...] into a dict, values parsed as YAML scalars (true, 16, 1e-5, int8)."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        out[key.strip()] = raw if value is None else value
    return out


def build(cls: type[BaseModel], values: Mapping[str, Any], source: str) -> Any:
    """Validate `values` as `cls`, turning pydantic's errors into one `ConfigError` per key."""
    known = set(cls.model_fields)
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{source}: unknown config key {key!r}{hint}; known keys: {', '.join(sorted(known))}"
            )
    try:
        return cls.model_validate(dict(values))
    except ValidationError as exc:
        raise ConfigError(f"{source}: " + "; ".join(_describe(err) for err in exc.errors())) from None


def _describe(err: Mapping[str, Any]) -> str:
    key = ".".join(str(part) for part in err["loc"]) or "config"
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "missing":
        return f"{key}: required key is missing"
    if "input" in err and err["loc"]:
        return f"{key}: {message} (got {err['input']!r})"
    return f"{key}: {message}"


def read_yaml(path: Path) -> Mapping[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}" if not path.exists() else f"{path}: not a file")
    try:
        data = yaml.safe_load(path.read_text())
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data
