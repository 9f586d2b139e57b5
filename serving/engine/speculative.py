"""Speculative decoding's device side: score every slot's proposed tokens in one compiled call and
keep what the target model would have produced.

`verify(params, state, proposals, num_proposed, max_position, num_slots, slots)`: slot s feeds its last
token and its `num_proposed[s]` proposals (k = proposals.shape[1] columns, padding past them) at
positions p .. p + k over its own cache, a prefill chunk with history (serving.models.prefill):
logits [slots, k + 1, vocab] in one forward pass. The rule (`verify_tokens`) then keeps, per slot,
the longest accepted prefix of the proposals and one token of the target's own after it, so that a
call emits 1 .. k + 1 tokens per slot:

- greedy rows (temperature 0) accept proposal j when it is the argmax of position j's logits; the
  token after the accepted prefix is that argmax: exactly the tokens plain decoding produces.
- sampled rows use the rejection rule of speculative sampling with the proposer's q a point mass
  (the n-gram lookup, and the draft model, which proposes its greedy tokens): proposal d is
  accepted with probability min(1, p(d) / q(d)) = p(d); after a rejection the token is drawn from
  the normalized residual max(0, p - q), i.e. p without d. p is the distribution the plain sampler
  draws from (serving.engine.sampling: temperature, then top-k and top-p; `kept` gives its tokens).
  When every proposal is accepted the next token is drawn by the plain sampler itself, with the key
  plain decoding would use there (so a slot with no proposals gets plain decoding's token).

The KV of all k + 1 positions is written; the slot's position moves past the emitted tokens only,
so rejected positions lie beyond it: never attended to, overwritten by the next call. Stop ids,
max_tokens and max_target_length end a slot inside the emitted run as they do in `generate`, and
logprobs come from the same logits. Results are `ResultTokens` of k + 1 steps (`valid` marks the
emitted ones), so everything above the engine reads them as a generate call's.

`Verifier` is the part the engine is built with (serving.engine.engine.Engine's `verifier`): its
`step` is the body of the engine's compiled verify call, over the engine's model forward and sampler.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from serving.engine import penalties
from serving.engine.api import ResultTokens
from serving.engine.sampler import Sampler
from serving.engine.sampling import argmax, kept, sample, token_logprobs_if
from serving.engine.state import RECENT, DecodeState, SlotSampling, TokenHistory, is_stop
from serving.models.cache import SCRATCH_PAGE, store_chunks

# the model over [slots, k + 1] tokens with history: (fed, counted, starts, pages, lora_slot) -> (logits, kv)
Forward = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, object]]


def verify_tokens(
    logits: jax.Array, proposals: jax.Array, num_proposed: jax.Array, keys: jax.Array, sampling: SlotSampling
) -> tuple[jax.Array, jax.Array]:
    """The speculative rule (module docstring) for every row.

    logits [batch, k + 1, vocab] float32: position j's logits, after the row's first j proposals;
    proposals [batch, k] int32; num_proposed [batch] int32 (0..k: the real ones); keys [batch, k + 1]
    PRNG keys, keys[:, j] the one plain decoding uses for the row's token j of this call; sampling's
    temperature, top_k, top_p, min_p [batch]. The logits are the processed ones (penalties, bias,
    bad words: serving.engine.penalties), so p is the distribution plain decoding draws from. Returns tokens [batch, k + 1] (proposals, then the
    correction or bonus token at column `accepted`; past it meaningless) and accepted [batch].
    """
    batch, columns, vocab = logits.shape
    k = columns - 1
    temperature, top_k, top_p, min_p = sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p
    sampled = temperature > 0

    def each(x: jax.Array) -> jax.Array:  # [batch] -> [batch * k], one per proposal
        return jnp.repeat(x, k, axis=0)

    flat = logits[:, :k].reshape(batch * k, vocab)
    drafts = proposals.reshape(batch * k)

    def target_probability() -> jax.Array:  # p(d) under the plain sampler's distribution
        keep = kept(flat, each(temperature), each(top_k), each(top_p), each(min_p))
        scaled = jnp.where(keep, flat / jnp.maximum(each(temperature), 1e-6)[:, None], -jnp.inf)
        chosen = jnp.take_along_axis(scaled, drafts[:, None], axis=-1)[:, 0]
        return jnp.exp(chosen - jax.nn.logsumexp(scaled, axis=-1))

    p = lax.cond(jnp.any(sampled), target_probability, lambda: jnp.zeros((batch * k,), jnp.float32))
    uniform = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), (), jnp.float32))(
        keys[:, :k].reshape(batch * k, *keys.shape[2:])
    )
    accept = jnp.where(each(sampled), uniform < p, drafts == argmax(flat)).reshape(batch, k)
    accept &= jnp.arange(k)[None, :] < num_proposed[:, None]
    accepted = jnp.sum(jnp.cumprod(accept, axis=1), axis=1).astype(jnp.int32)  # [batch]

    rows = jnp.arange(batch)
    at = logits[rows, accepted]  # [batch, vocab]: the position after the accepted prefix
    key = keys[rows, accepted]
    plain = sample(at, key, temperature, top_k, top_p, min_p)
    rejected = sampled & (accepted < num_proposed)
    draft = proposals[rows, jnp.minimum(accepted, k - 1)]

    def residual() -> jax.Array:  # p without the rejected draft, renormalized
        keep = kept(at, temperature, top_k, top_p, min_p)
        without = keep & (jnp.arange(vocab)[None, :] != draft[:, None])
        without = jnp.where(jnp.any(without, axis=-1, keepdims=True), without, keep)
        ones = jnp.ones_like(top_p)
        return sample(jnp.where(without, at, -jnp.inf), key, temperature, jnp.zeros_like(top_k), ones)

    last = jnp.where(rejected, lax.cond(jnp.any(rejected), residual, lambda: plain), plain)
    tokens = jnp.concatenate([proposals, jnp.zeros((batch, 1), proposals.dtype)], axis=1)
    return tokens.at[rows, accepted].set(last), accepted


class Verifier:
    """Speculative decoding's verify, a part the engine is built with (module docstring): `step`
    is the compiled call's body, which the engine runs over its model's forward and its sampler.

    `warmup`: (k, the most decoding slots that speculate), the verify shapes the engine's warmup
    compiles (every slot bucket up to the one holding them, at every history window); None: none
    (a server that does not speculate; a verify call compiles at first use)."""

    def __init__(self, warmup: tuple[int, int] | None = None):
        if warmup is not None and (warmup[0] < 1 or warmup[1] < 1):
            raise ValueError(f"verify warmup (k, slots) must both be at least 1, got {warmup}")
        self.warmup = warmup

    @classmethod
    def of(cls, config) -> Verifier:
        """The verifier a server's speculative settings ask for (a ServingConfig or its
        SpeculativeConfig): the verify shapes of k = num_speculative_tokens up to
        speculative_max_slots slots where it speculates at all (a method, and slots that may),
        none otherwise (speculative_max_slots=0 turns speculation off)."""
        if config.speculative_method == "none" or config.speculative_max_slots < 1:
            return cls()
        return cls((config.num_speculative_tokens, config.speculative_max_slots))

    def step(
        self, forward: Forward, sampler: Sampler, full: DecodeState, proposals, num_proposed, rows,
        max_target_length: int,
    ) -> tuple[DecodeState, ResultTokens]:
        """The decode state after slots `rows` [slots] scored their `proposals` [total, k]
        (`num_proposed` [total] of each row real) and kept what the rule accepts, and the call's
        results [k + 1 steps, total]. `forward(fed [slots, k + 1], counted [slots], starts [slots],
        pages [slots, max_pages], lora_slot [slots])`: the model over those tokens at positions
        starts + 0..k of each row's cache (logits [slots, k + 1, vocab], the KV written by
        store_chunks); `sampler` turns logits into tokens as every other call does."""
        max_len, total = max_target_length, full.tokens.shape[0]
        k, num_slots = proposals.shape[1], rows.shape[0]
        state = jax.tree.map(lambda x: x[rows], full._replace(cache=None, history=None))
        proposals, num_proposed = proposals[rows], num_proposed[rows]
        # an inactive row starts at 0: it attends to no cached position (its writes go to scratch)
        starts = jnp.where(state.active, jnp.minimum(state.positions, max_len - 1), 0)
        fed = jnp.concatenate([state.tokens[:, None], proposals], axis=1)  # [slots, k + 1]
        # Each row counts its token and its real proposals: the logits past them are never read
        # (a backend may skip their matmuls, serving.models.ops.XlaOps.counting), and their KV goes
        # where a rejected proposal's does, to positions written again before they are read. A
        # call with one slot of S proposing computes S + k positions, not S x (k + 1).
        # An inactive row counts 1, not 0: a row with no position counted would leave XLA's
        # attention a row of queries with every key masked (NaN).
        counted = jnp.where(state.active, 1 + jnp.clip(num_proposed, 0, k), 1).astype(jnp.int32)
        logits, kv = forward(fed, counted, starts, state.pages, state.sampling.lora_slot)
        vocab = logits.shape[-1]
        logits = sampler.decodable(logits.reshape(num_slots * (k + 1), vocab), None).reshape(num_slots, k + 1, -1)
        sampling = state.sampling._replace(temperature=jnp.where(state.active, state.sampling.temperature, 0.0))
        logits = _processed(logits, proposals, state, sampling, full.history, rows)
        column = jnp.arange(k + 1)
        keys = jax.vmap(lambda key, g: jax.vmap(lambda j: jax.random.fold_in(key, g + j))(column))(
            sampling.key, state.generated
        )
        tokens, accepted = verify_tokens(logits, proposals, num_proposed, keys, sampling)

        valid, done = _emitted(tokens, accepted, state, starts, max_len)
        count = jnp.sum(valid, axis=1).astype(jnp.int32)
        last = tokens[jnp.arange(num_slots), jnp.maximum(count - 1, 0)]
        # an inactive row's KV goes to the scratch page; an active row's k + 1 positions are in
        # pages the scheduler gave it (rejected proposals' positions are written again later)
        writes = jnp.where(state.active[:, None], state.pages, SCRATCH_PAGE)
        wants = jnp.any(state.active & state.sampling.logprobs)
        chosen, top_ids, top = _logprobs(logits, tokens, sampling.temperature, wants)
        result = ResultTokens(*(_steps_first(x, total, rows) for x in (tokens, valid, done, chosen, top_ids, top)))

        def back(whole, part):
            return whole.at[rows].set(part)

        new_state = DecodeState(
            cache=store_chunks(full.cache, kv, writes, starts),
            pages=full.pages,
            tokens=back(full.tokens, jnp.where(count > 0, last, state.tokens)),
            positions=back(full.positions, jnp.where(state.active, starts + count, state.positions)),
            generated=back(full.generated, state.generated + count),
            active=back(full.active, state.active & ~jnp.any(done, axis=1)),
            sampling=full.sampling,
            history=penalties.record(
                full.history, rows, tokens, valid, penalties.reads_history(state.sampling)
            ),
        )
        return new_state, result


def _processed(
    logits: jax.Array, proposals: jax.Array, state: DecodeState, sampling: SlotSampling, history: TokenHistory,
    rows: jax.Array,
) -> jax.Array:
    """logits [slots, k + 1, vocab] after each slot's logit processing (serving.engine.penalties),
    column j as plain decoding would process it after the first j proposals were generated. The
    arguments are the gathered slots `rows` [slots] but `history`, which holds every slot."""
    slots, columns, vocab = logits.shape
    column = jnp.arange(columns)

    def each(x: jax.Array) -> jax.Array:  # [slots, ...] -> [slots * (k + 1), ...]
        return jnp.repeat(x, columns, axis=0)

    seq = jnp.concatenate([history.recent[rows], proposals], axis=1)  # [slots, RECENT + k]
    recent = jax.vmap(lambda j: lax.dynamic_slice_in_dim(seq, j, RECENT, axis=1), out_axes=1)(column)

    def counts_so_far() -> tuple[jax.Array, jax.Array]:  # [slots * (k + 1), vocab] each
        proposed = jnp.cumsum(jax.nn.one_hot(proposals, vocab, dtype=jnp.int32), axis=1)  # [slots, k, vocab]
        before = jnp.pad(proposed, ((0, 0), (1, 0), (0, 0)))  # column j: the first j proposals
        counts = history.counts[rows][:, None] + before
        return counts.reshape(-1, vocab), each(history.prompt[rows])

    flat = penalties.process(
        logits.reshape(-1, vocab),
        jax.tree.map(each, sampling),
        (state.generated[:, None] + column).reshape(-1),
        recent.reshape(-1, RECENT),
        counts_so_far,
        each(state.active),
    )
    return flat.reshape(slots, columns, vocab)


def _emitted(
    tokens: jax.Array, accepted: jax.Array, state: DecodeState, starts: jax.Array, max_len: int
) -> tuple[jax.Array, jax.Array]:
    """valid, done [slots, k + 1]: the tokens each active slot emits (its accepted proposals and
    the one after), cut after the first that ends it (a stop id, max_tokens, max_target_length)."""
    column = jnp.arange(tokens.shape[1])
    ends = (
        is_stop(tokens, state.sampling.stop_ids[:, None, :])
        | (state.generated[:, None] + column + 1 >= state.sampling.max_tokens[:, None])
        | (starts[:, None] + column + 1 >= max_len)
    )
    emitted = state.active[:, None] & (column[None, :] <= accepted[:, None])
    ended_before = (jnp.cumsum(emitted & ends, axis=1) - (emitted & ends)) > 0
    valid = emitted & ~ended_before
    return valid, valid & ends


def _logprobs(
    logits: jax.Array, tokens: jax.Array, temperature: jax.Array, wants: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The emitted tokens' logprobs as `generate` gives them ([slots, k + 1] and [slots, k + 1,
    top]); zeros unless some slot `wants` them. logits [slots, k + 1, vocab]."""
    slots, columns, vocab = logits.shape
    flat = token_logprobs_if(
        wants, logits.reshape(slots * columns, vocab), tokens.reshape(-1), jnp.repeat(temperature, columns)
    )
    return tuple(x.reshape(slots, columns, *x.shape[1:]) for x in flat)


def _steps_first(x: jax.Array, total: int, rows: jax.Array) -> jax.Array:
    """[slots, steps, ...] of the slots `rows` -> [steps, total, ...], zero (not valid) elsewhere."""
    x = jnp.swapaxes(x, 0, 1)
    return jnp.zeros((x.shape[0], total, *x.shape[2:]), x.dtype).at[:, rows].set(x)
