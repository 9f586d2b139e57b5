"""Structured outputs: grammars (JSON, JSON Schema) compiled against a tokenizer, and per-request
matchers whose next-token masks the engine applies in its compiled step.

The grammar library is xgrammar (PyPI). Chosen by measured cost on SmolLM2's 49,152-token
vocabulary (README, "Structured outputs"): a mask plus one token advance costs ~20-30 us with
xgrammar, ~130-190 us with llguidance; outlines-core spends ~0.6 s building each schema's index.
Imported lazily: the library brings torch, which takes seconds to import.
"""

from serving.structured.grammar import GrammarCompiler, Matcher, schema_grammar

__all__ = ["GrammarCompiler", "Matcher", "schema_grammar"]
