"""A plain single-sequence loop straight over the model functions (no engine, no slots, no
buckets beyond powers of two): the reference the engine and the servers are tested against.
Test code only: every product command runs its requests through the engine.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from serving.checkpoints.model_source import LoadedModel
from serving.config import ServingConfig
from serving.engine.limits import MIN_BUCKET
from serving.engine.sampling import sample
from serving.errors import GenerationError
from serving.kernels import backend
from serving.models import KVCache, decode_step, init_pool, prefill, store_prefix
from serving.models.cache import dedicated_pages
from serving.models.llama import unstack_layers
from serving.request import SamplingParams

_store_prefix = jax.jit(store_prefix, donate_argnums=(0,))


def row_cache(
    cfg, batch: int, length: int, quantized: bool = False, page_size: int = 16, dtype=jnp.float32,
    scale_per_head: bool = True,
) -> tuple[KVCache, jax.Array]:
    """A page pool in which row b owns its `length` positions in pages of `page_size` (after
    serving.models.cache.dedicated_pages), and those block tables int32 [batch, pages per row]."""
    pages = dedicated_pages(batch, length, page_size)
    return init_pool(cfg, 1 + pages.size, page_size, dtype, quantized, scale_per_head), jnp.asarray(pages)


def bucket_length(n: int, limit: int) -> int:
    """Smallest power of two >= n (at least MIN_BUCKET), capped at `limit`."""
    return min(max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length()), limit)


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"


class ReferenceDecoder:
    """Greedy or sampled decoding, and scoring, for one sequence at a time."""

    def __init__(self, model: LoadedModel, cfg: ServingConfig):
        self.model = model
        self.cfg = cfg
        ops = backend.select(
            cfg.cpu_kernels, cfg.quantization, cfg.weight_dtype, jax.devices()[:1]
        )
        self.params = ops.prepare(model.params)
        if not cfg.scan_layers:
            self.params = jax.jit(unstack_layers)(self.params)
        dtype = jnp.dtype(cfg.dtype)
        static = dict(cfg=model.config, scan_layers=cfg.scan_layers, dtype=dtype, ops=ops)
        # The prompt attends to its keys and values as the cache holds them (int8 when quantized).
        self._per_head = cfg.kv_quant_axis != "heads_and_dkv"
        self._prefill = jax.jit(
            partial(prefill, **static, quantized_kv=cfg.quantize_kvcache, kv_scale_per_head=self._per_head)
        )
        self._decode = jax.jit(partial(decode_step, **static), donate_argnums=(3,))
        self._sample = jax.jit(sample)
        # A model's vocabulary may be padded past the tokenizer's; never sample an id it can't decode.
        self._num_decodable = min(model.config.vocab_size, model.tokenizer.vocab_size)

    def check_prompt(self, prompt_ids: list[int], max_tokens: int) -> None:
        if not prompt_ids:
            raise GenerationError("the prompt is empty")
        if len(prompt_ids) > self.cfg.max_prefill_predict_length:
            raise GenerationError(
                f"the prompt has {len(prompt_ids)} tokens, more than max_prefill_predict_length="
                f"{self.cfg.max_prefill_predict_length}"
            )
        if len(prompt_ids) + max_tokens > self.cfg.max_target_length:
            raise GenerationError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_target_length={self.cfg.max_target_length}"
            )

    def stream(self, prompt_ids: list[int], sampling: SamplingParams) -> Iterator[int]:
        """Yield generated token ids; stops after a stop id (yielded) or max_tokens."""
        self.check_prompt(prompt_ids, sampling.max_tokens)
        n = len(prompt_ids)
        padded_len = bucket_length(n, self.cfg.max_prefill_predict_length)
        tokens = np.zeros((1, padded_len), np.int32)
        tokens[0, :n] = prompt_ids
        logits, kv = self._prefill(self.params, jnp.asarray(tokens), jnp.array([n], jnp.int32))
        cache = self._cache_with_prompt(
            kv, bucket_length(n + sampling.max_tokens, self.cfg.max_target_length)
        )
        pages = jnp.ones((1, 1), jnp.int32)  # the sequence is page 1, one page of its whole length
        key = jax.random.PRNGKey(sampling.seed)
        knobs = (
            jnp.array([sampling.temperature], jnp.float32),
            jnp.array([sampling.top_k], jnp.int32),
            jnp.array([sampling.top_p], jnp.float32),
        )
        next_logits = logits[:, n - 1]
        stop = set(sampling.stop_ids)
        for step in range(sampling.max_tokens):
            token = self._sample(
                next_logits[:, : self._num_decodable], jax.random.fold_in(key, step)[None], *knobs
            )
            token_id = int(token[0])
            yield token_id
            if token_id in stop or step == sampling.max_tokens - 1:
                return
            next_logits, cache = self._decode(
                self.params, token, jnp.array([n + step], jnp.int32), cache, pages=pages
            )

    def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Generated:
        ids = list(self.stream(prompt_ids, sampling))
        finished = bool(ids) and ids[-1] in sampling.stop_ids
        return Generated(ids, self.model.tokenizer.decode(ids), "stop" if finished else "length")

    def _cache_with_prompt(self, kv: KVCache, length: int) -> KVCache:
        """A pool of the scratch page and one page of `length` positions holding the prompt: the
        contiguous cache of one sequence, whatever page size the engine under test uses."""
        cfg = self.model.config
        cache = init_pool(
            cfg, 2, length, jnp.dtype(self.cfg.dtype), quantized=self.cfg.quantize_kvcache, scale_per_head=self._per_head
        )
        return _store_prefix(cache, kv, jnp.ones((1,), jnp.int32))

    def negative_log_likelihood(self, token_ids: list[int], window: int) -> tuple[float, int]:
        """Sum of -log p(token | earlier tokens) over non-overlapping windows, and the count."""
        total, count = 0.0, 0
        for start in range(0, len(token_ids), window):
            chunk = token_ids[start : start + window]
            if len(chunk) < 2:
                continue
            padded = np.zeros((1, bucket_length(len(chunk), window)), np.int32)
            padded[0, : len(chunk)] = chunk
            nll = _chunk_nll(self._prefill, self.params, jnp.asarray(padded), len(chunk))
            total += float(nll)
            count += len(chunk) - 1
        return total, count

    def perplexity(self, token_ids: list[int], window: int) -> float:
        total, count = self.negative_log_likelihood(token_ids, window)
        if count == 0:
            raise GenerationError("the text has fewer than 2 tokens; perplexity is undefined")
        return math.exp(total / count)


def _chunk_nll(prefill_fn, params: dict, tokens: jax.Array, length: int) -> jax.Array:
    logits, _ = prefill_fn(params, tokens, jnp.array([length], jnp.int32))
    logprobs = jax.nn.log_softmax(logits[0, : length - 1], axis=-1)
    targets = tokens[0, 1:length]
    return -jnp.sum(jnp.take_along_axis(logprobs, targets[:, None], axis=-1))
