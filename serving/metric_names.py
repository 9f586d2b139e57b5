"""Which of our /metrics names carry the Gateway API Inference Extension's model-server protocol.

An endpoint picker (the extension's EPP, llm-d's router, GKE's Inference Gateway) scrapes each
server for these signals and routes each request to the least loaded one. The protocol fixes the
types and meanings, not the names: a deployment tells the picker ours
(serving.deploy.gateway renders them into its configuration). Data only: the HTTP layer emits
these names and the deploy renderer names them, and neither imports the other.
"""

from __future__ import annotations

# Gauge: requests waiting for a decode slot (the protocol's TotalQueuedRequests). JetStream's name.
QUEUED_REQUESTS = "jetstream_prefill_backlog_size"
# Gauge: sequences in decode slots, prefilling or decoding (TotalRunningRequests).
RUNNING_REQUESTS = "pathserve_active_slots"
# Gauge: KV cache positions in use as a 0-1 fraction of the engine's KV capacity (KVCacheUtilization).
KV_CACHE_USAGE = "pathserve_kv_cache_usage_ratio"
# Gauge, value = time.time() of its last update; labels max_lora, running_lora_adapters (resident
# on the device), waiting_lora_adapters (named by waiting requests), comma-separated.
LORA_INFO = "pathserve_lora_requests_info"
# Gauge, value 1; labels block_size (tokens per prefix block) and num_gpu_blocks (the blocks the prefix
# cache retains at most: the KV pool's pages, where cached prefixes stay).
CACHE_CONFIG_INFO = "pathserve_cache_config_info"
LORA_LABELS = ("max_lora", "running_lora_adapters", "waiting_lora_adapters")
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks")
