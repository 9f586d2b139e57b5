"""A draft model for speculative decoding: a second `Engine` (the same code, on the same mesh) with
its own decode state and small KV cache, proposing its greedy continuation of each slot.

Each turn the plan brings, per speculating slot, the tokens of its sequence the draft's cache does
not hold yet (`PrefillRow`s: from the draft's valid length to the slot's last token, in chunks; the
host decides them: serving.orchestrator.proposers). `propose` prefills them into the draft's slot
of the same index (the last chunk samples the first proposal, greedy), then one generate call of
k - 1 steps gives the others; each row's sampling stops its draft slot after k tokens. Greedy
proposals make q a point mass, which the verify rule (serving.engine.speculative) takes as such.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serving.config import EngineConfig
from serving.engine.api import PrefillRow
from serving.engine.engine import Engine
from serving.text.tokenizer import Tokenizer


def tokenizer_mismatch(target: Tokenizer, draft: Tokenizer) -> str | None:
    """Why a draft's tokenizer is not the target's (None: the same ids for the same bytes)."""
    if target.vocab_size != draft.vocab_size:
        return f"vocabulary of {draft.vocab_size} tokens, the target's has {target.vocab_size}"
    for token in range(target.vocab_size):
        if target.token_bytes(token) != draft.token_bytes(token):
            return f"token {token} is {draft.token_bytes(token)!r}, the target's is {target.token_bytes(token)!r}"
    return None


class DraftModel:
    """The draft's engine, params and decode state; `propose` runs its share of a turn."""

    def __init__(
        self, engine: Engine, params, target_tokenizer: Tokenizer, num_speculative_tokens: int, target_params: int = 0
    ):
        """`target_params`: the target model's parameter count, for `cost_in_steps` (0: unknown,
        the draft counted as free)."""
        mismatch = tokenizer_mismatch(target_tokenizer, engine.model.tokenizer)
        if mismatch is not None:
            raise ValueError(f"speculative_model: its tokenizer is not the target's: {mismatch}")
        if engine.decode_steps_per_call != max(1, num_speculative_tokens - 1):
            raise ValueError("the draft engine must run num_speculative_tokens - 1 decode steps per call")
        self.engine, self.params, self.k = engine, params, num_speculative_tokens
        # Each slot owns max_target_length positions of the draft's pool (its engine_config asks
        # for that many pages, and a fresh decode state gives each slot its own): the draft follows
        # the target's slots and needs no scheduler.
        self.state = engine.init_decode_state()
        self.target_params = target_params

    @property
    def cost_in_steps(self) -> float:
        """One turn's proposals in the target's decode steps: k forward passes of the draft (its
        rows' prefill with the first proposal, then k - 1 steps), each costing the draft's share
        of the target's weights (a decode step at the few slots that speculate reads its weights
        once: bandwidth-bound, so its time follows their bytes, both models quantized alike). A
        135M draft for a 1B target at k=4: 4 x 0.11 = 0.44 steps, which the gate would otherwise
        leave out (a draft that ran at 0.55x of plain decoding was still let through)."""
        if not self.target_params:
            return 0.0
        return self.k * self.engine.model.config.num_params / self.target_params

    @staticmethod
    def engine_config(target: EngineConfig, num_speculative_tokens: int) -> EngineConfig:
        """The draft engine's config: the target's slots and lengths, k - 1 steps per generate, a
        KV pool in which every slot owns its full length, the target's quantization mode without
        the target checkpoint's stored int8 entries (the draft's params say their own)."""
        import dataclasses

        from serving.quantization_mode import Quantization

        return dataclasses.replace(
            target, decode_steps_per_call=max(1, num_speculative_tokens - 1), kv_cache_bytes_per_chip=0,
            quantization=Quantization(target.quantization.mode),
        )

    def propose(self, rows: Sequence[PrefillRow]) -> np.ndarray:
        """The draft's k greedy tokens after each final row's sequence: int32 [slots, k] (zeros
        for slots without a row)."""
        engine, limits = self.engine, self.engine.limits
        proposals = np.zeros((limits.max_concurrent_decodes, self.k), np.int32)
        finals = [row.slot for row in rows if row.final]
        pending = list(rows)
        while pending:  # a slot's chunks in order: at most one row per slot per call
            batch, seen, rest = [], set(), []
            for row in pending:
                if row.slot in seen or len(batch) == limits.max_prefill_batch:
                    rest.append(row)
                else:
                    batch.append(row)
                    seen.add(row.slot)
            self.state, firsts, _ = engine.prefill_slots(self.params, self.state, batch)
            for row, first in zip(batch, firsts, strict=True):
                if row.final:
                    proposals[row.slot, 0] = first
            pending = rest
        if self.k > 1 and finals:
            self.state, result = engine.generate(
                self.params, self.state, max_position=max(r.start + len(r.tokens) for r in rows),
                slots=limits.decode_rows(finals),
            )
            tokens = np.asarray(result.tokens)  # [k - 1, slots]
            proposals[finals, 1:] = tokens[:, finals].T
        return proposals


def load_draft(cfg, target: EngineConfig, mesh, target_tokenizer: Tokenizer, target_params: int = 0) -> DraftModel:
    """The draft of `cfg.speculative_model` (any checkpoint pathserve loads, read with the serving
    keys of `cfg`: quantization, dtype) for a target engine of config `target` on `mesh`, built
    before the target, which takes it (`Engine(..., draft=)`); ValueError naming a tokenizer
    mismatch. `cfg`: the ServingConfig; `target_params`: the target's parameter count (its cost)."""
    from serving.checkpoints.model_source import load_model

    k = cfg.speculative.num_speculative_tokens
    model = load_model(cfg.speculative_model, cfg)
    engine = Engine(model, DraftModel.engine_config(target, k), mesh)
    params = engine.load_params()
    engine.release_loaded_params()
    return DraftModel(engine, params, target_tokenizer, k, target_params)
