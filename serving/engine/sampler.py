"""The sampler an engine is built with: what turns a row's logits into its next token, in one
object the engine's compiled bodies call (the whole prefill, the chunks' first tokens, generate
and speculative verify), so that the sampling rule is one part passed in, not read from the engine.

Its steps, in order: the logits of the tokens the tokenizer can decode (`decodable`, a grammar's
mask applied), the logit processing (`process`: bad words, min_tokens, logit bias, penalties over
the slot's token history: serving.engine.penalties), the draw (`sample`: temperature, top-k,
top-p, min-p: serving.engine.sampling) and, where asked, the chosen token's logprob with the best
alternatives (`logprobs_if`), or the prompt's own (`prompt_scores`). Pure functions of arrays: traced inside the engine's jits.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from serving.engine import penalties
from serving.engine.sampling import apply_mask, sample, token_logprobs, token_logprobs_if
from serving.engine.state import Logprobs, SlotSampling, TokenHistory


@dataclass(frozen=True)
class Sampler:
    """`num_decodable`: the tokens the tokenizer can decode (the model's vocabulary may be padded
    past them): the rest are never sampled nor reported."""

    num_decodable: int

    def decodable(self, logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """[rows, vocab] logits of the decodable tokens, -inf where `mask` (int32 [rows, words], a
        grammar's bits) forbids."""
        logits = logits[:, : self.num_decodable]
        return logits if mask is None else apply_mask(logits, mask)

    # The rows' logit processing: bad words, min_tokens, logit bias, penalties (its arguments there)
    process = staticmethod(penalties.process)

    def sample(self, logits: jax.Array, keys: jax.Array, sampling: SlotSampling) -> jax.Array:
        """Each row's token [rows] int32, drawn with its key under its temperature, top-k, top-p
        and min-p (greedy at temperature 0)."""
        return sample(logits, keys, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)

    def logprobs_if(
        self, wants: jax.Array, logits: jax.Array, tokens: jax.Array, temperature: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The tokens' logprobs and the best alternatives where `wants` (some row asked), else zeros."""
        return token_logprobs_if(wants, logits, tokens, temperature)

    def prompt_scores(self, logits: jax.Array, targets: jax.Array) -> Logprobs:
        """The prompt's logprobs (OpenAI's echo): each row's target token [rows] scored by its logits
        [rows, vocab] over the whole vocabulary (no temperature, no mask), with the top
        MAX_LOGPROBS and its rank (1 + the tokens likelier)."""
        chosen, top_ids, top = token_logprobs(logits, targets, jnp.ones(targets.shape, jnp.float32))
        rank = 1 + jnp.sum(jax.nn.log_softmax(logits, axis=-1) > chosen[:, None], axis=-1, dtype=jnp.int32)
        return Logprobs(targets, chosen, top_ids, top, rank)

    def init_history(self, slots: int) -> TokenHistory:
        """An empty token history for `slots` slots over the decodable vocabulary."""
        return penalties.init_history(slots, self.num_decodable)
