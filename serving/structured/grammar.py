"""Grammars against one tokenizer: `GrammarCompiler.compile(Grammar)` (cached per grammar), then a
`Matcher` per choice that gives the next token's mask and takes the token sampled.

Masks are int32 [ceil(vocab / 32)]: bit i % 32 of word i // 32 allows token i (xgrammar's layout,
which `serving.engine.sampling.apply_mask` reads). JSON is generated compact but readable (", " and
": " separators, no other whitespace), so that a model cannot spend its tokens on whitespace.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from serving.errors import GenerationError
from serving.request import Grammar
from serving.text.tokenizer import Tokenizer

SEPARATORS = (", ", ": ")


def schema_grammar(schema: Any) -> Grammar:
    """A JSON Schema (a dict) as a Grammar; raises GenerationError naming response_format when it
    is not a valid schema (checked with jsonschema's metaschema)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise GenerationError("response_format: json_schema.schema must be an object", field="response_format")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise GenerationError(f"response_format: not a valid JSON Schema: {exc.message}",
                              field="response_format") from None
    return Grammar("json_schema", json.dumps(schema, sort_keys=True))


def _has_control_byte(raw: bytes) -> bool:
    return any(b < 0x20 for b in raw)


class Matcher:
    """One choice's grammar state: `mask()` for the next token, `advance(token)` after it."""

    def __init__(self, matcher, words: int):
        self._matcher = matcher
        self._bitmask = np.zeros((1, words), np.int32)

    def mask(self) -> np.ndarray:
        """int32 [words]: the tokens the grammar allows next (a fresh array)."""
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask[0].copy()

    def advance(self, token: int) -> bool:
        """Take the sampled token; False if the grammar forbids it (the state is then unchanged)."""
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(token))

    def reset(self) -> None:
        """Back to the grammar's start (benchmarks run one grammar after another)."""
        self._matcher.reset()

    @property
    def finished(self) -> bool:
        """The grammar is complete and has taken its stop token."""
        return bool(self._matcher.is_terminated())


class GrammarCompiler:
    """Compiles grammars for one tokenizer (thread-safe; compiled grammars are cached)."""

    def __init__(self, tokenizer: Tokenizer):
        import xgrammar

        self._xgr = xgrammar
        vocab = tokenizer.vocab_size
        stops = set(tokenizer.eos_ids)
        # Special tokens are never grammar text (xgrammar treats empty entries as special); the
        # end-of-sequence ones end a finished grammar. Neither are tokens holding a control byte:
        # compact JSON has none outside strings, and inside them JSON wants them escaped (xgrammar's
        # string rule would let all but CR and LF through, which json.loads refuses).
        encoded = [
            b"" if tokenizer.is_special(i) or _has_control_byte(tokenizer.token_bytes(i)) else tokenizer.token_bytes(i)
            for i in range(vocab)
        ]
        info = xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=vocab, stop_token_ids=sorted(stops) or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.words = -(-vocab // 32)
        self._lock = threading.Lock()
        self._cache: dict[Grammar, Any] = {}

    def compile(self, grammar: Grammar):
        """The compiled grammar; raises GenerationError (response_format) for one that does not compile."""
        with self._lock:
            if grammar in self._cache:
                return self._cache[grammar]
        try:
            if grammar.kind == "json":
                schema: Any = {"type": "object"}
            elif grammar.kind == "json_schema":
                schema = grammar.spec
            else:
                raise GenerationError(f"unknown grammar kind {grammar.kind!r}", field="response_format")
            compiled = self._compiler.compile_json_schema(
                schema, any_whitespace=False, separators=SEPARATORS, strict_mode=True
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            if isinstance(exc, GenerationError):
                raise
            message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise GenerationError(f"response_format: the schema cannot be compiled: {message}",
                                  field="response_format") from None
        with self._lock:
            self._cache[grammar] = compiled
        return compiled

    def matcher(self, compiled) -> Matcher:
        return Matcher(self._xgr.GrammarMatcher(compiled), self.words)
