"""Logprobs in OpenAI's shapes, from the engine's `TokenLogprob`s.

- completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per token;
  `top_logprobs` maps token text to logprob for the best `logprobs` tokens and the chosen one (as
  vLLM does); with echo the prompt's tokens come first, the first of them with None.
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": None}`.
- vLLM's prompt_logprobs: one entry per prompt token, None for the first, else a map from token
  id to `{"logprob", "rank", "decoded_token"}` holding the prompt's token and the best
  `prompt_logprobs` alternatives (rank 1: the most likely; a prompt token's rank counts the whole
  vocabulary).
A token that is not whole UTF-8 is written `bytes:\\xNN...` (its `bytes` field has the real
bytes). A logprob of -inf (a token a grammar forbids) is left out of the alternatives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from serving.request import TokenLogprob

if TYPE_CHECKING:
    from serving.text.tokenizer import Tokenizer

FLOOR = -9999.0  # stands for -inf, which JSON cannot carry (vLLM's choice too)


def token_bytes(tokenizer: Tokenizer, token: int) -> bytes:
    if not 0 <= token < tokenizer.vocab_size:  # a model vocabulary wider than its tokenizer's
        return f"<|token_{token}|>".encode()
    return tokenizer.token_bytes(token)


def token_text(tokenizer: Tokenizer, token: int) -> str:
    raw = token_bytes(tokenizer, token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class CompletionLogprobs:
    """Builds completions' logprobs chunk by chunk; text offsets run on across chunks."""

    def __init__(self, tokenizer: Tokenizer, num_top: int):
        self.tokenizer, self.num_top = tokenizer, num_top
        self.decoder = tokenizer.incremental_decoder()
        self.offset = 0

    def chunk(self, entries: Sequence[TokenLogprob | None], ids: Sequence[int]) -> dict[str, Any]:
        """The logprobs object for `ids` (entries[i] for ids[i]; None: not scored)."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(ids, entries, strict=True):
            out["tokens"].append(token_text(self.tokenizer, token))
            out["text_offset"].append(self.offset)
            self.offset += len(self.decoder.push(token))
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(entry.logprob))
            top = {
                token_text(self.tokenizer, t): v for t, v in entry.top[: self.num_top] if math.isfinite(v)
            }
            top.setdefault(token_text(self.tokenizer, token), _finite(entry.logprob))
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(tokenizer: Tokenizer, entries: Sequence[TokenLogprob], num_top: int) -> dict[str, Any]:
    """The chat logprobs object of `entries` (one per generated token)."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(tokenizer, token)
        return {"token": token_text(tokenizer, token), "logprob": _finite(logprob), "bytes": list(raw)}

    content = [
        item(e.token, e.logprob)
        | {"top_logprobs": [item(t, v) for t, v in e.top[:num_top] if math.isfinite(v)]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


def prompt_logprobs(
    tokenizer: Tokenizer, entries: Sequence[TokenLogprob | None], ids: Sequence[int], num_top: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs of a prompt `ids` (entries[i] for ids[i], the first None)."""

    def item(token: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": token_text(tokenizer, token)}

    out: list[dict[str, dict[str, Any]] | None] = []
    for token, entry in zip(ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        position = {str(token): item(token, entry.logprob, entry.rank)}
        for i, (t, v) in enumerate(entry.top[:num_top]):
            if math.isfinite(v):
                position.setdefault(str(t), item(t, v, i + 1))
        out.append(position)
    return out
