"""Request fields the wire types do not define: refused, or ignored and counted.

OpenAI answers 400 "Unrecognized request argument supplied" for a field it does not know; a client's
typo (`temprature`) would otherwise run with the default and nobody would notice. So by default
(`unknown_request_fields=reject`) a request naming an unknown field, at the top level or inside a
message, a tool or response_format, is refused with a 400 that names every such field. Deployments
whose clients send vendor extras set `unknown_request_fields=warn`: the fields are ignored, each name
is logged once, and `/metrics` counts them by name (a bounded set of names).

The wire types (serving.openai.protocol) keep unknown fields (`extra="allow"`) so that they can be
named here; nothing reads them.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter
from typing import Any

from pydantic import BaseModel

from serving.openai.errors import APIError

log = logging.getLogger(__name__)

MODES = ("reject", "warn")
MAX_NAMES = 32  # distinct field names counted (and logged) one by one; the rest as OTHER
MAX_NAME_LENGTH = 64
OTHER = "_other"


def unknown_fields(body: BaseModel) -> list[str]:
    """Every field of `body` that its wire type does not define, as a path from the top:
    `temprature`, `messages[0].nmae`, `response_format.json_schema.schemaa`."""
    found: list[str] = []
    _walk(body, "", found)
    return found


_NESTED = (BaseModel, list, tuple)  # what may hold a model (and so an unknown field) inside
_SCALARS = frozenset({int, str, float, bool, type(None)})  # passed by their type alone (no ABC check)


def _walk(value: Any, path: str, found: list[str]) -> None:
    """Only into models and sequences (a prompt of token ids is a list of ints: each is looked at
    once by its type, no path made for it: 574 µs a request of 1,000 ids before, 43 now; 15 and 2
    for a prompt of text)."""
    if isinstance(value, BaseModel):
        found.extend(f"{path}.{name}" if path else name for name in (value.model_extra or {}))
        for name, item in value.__dict__.items():  # the fields' values (extras live apart)
            if _nested(item):
                _walk(item, f"{path}.{name}" if path else name, found)
    else:
        for i, item in enumerate(value):
            if _nested(item):
                _walk(item, f"{path}[{i}]", found)


def _nested(item: Any) -> bool:
    return type(item) not in _SCALARS and isinstance(item, _NESTED)


def message(fields: list[str]) -> str:
    """OpenAI's wording, naming every field."""
    plural = "s" if len(fields) > 1 else ""
    return f"Unrecognized request argument{plural} supplied: {', '.join(fields)}"


class UnknownFieldPolicy:
    """What a server (or a batch job) does with unknown request fields: `reject` (an APIError 400
    naming them) or `warn` (ignore; log each name once; count by name). Thread-safe."""

    def __init__(self, mode: str = "reject"):
        if mode not in MODES:
            raise ValueError(f"unknown_request_fields: one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()  # name (indices dropped) -> requests that sent it

    def check(self, body: BaseModel) -> None:
        """Raise APIError 400 for a body with unknown fields (reject), or note them (warn)."""
        fields = unknown_fields(body)
        if not fields:
            return
        if self.mode == "reject":
            raise APIError(400, message(fields), param=fields[0], code="unknown_field")
        for name in dict.fromkeys(_label(f) for f in fields):
            self._note(name)

    def counts(self) -> dict[str, int]:
        """Ignored fields by name, for /metrics."""
        with self._lock:
            return dict(self._counts)

    def _note(self, name: str) -> None:
        with self._lock:
            if name not in self._counts and len(self._counts) >= MAX_NAMES:
                first, name = OTHER not in self._counts, OTHER
            else:
                first = name not in self._counts
            self._counts[name] += 1
        if first:
            what = (
                f"{name!r}" if name != OTHER else f"more than {MAX_NAMES} distinct names (counted as {OTHER})"
            )
            log.warning("ignoring unknown request field %s (unknown_request_fields=warn; logged once)", what)


def _label(path: str) -> str:
    """A path without its list indices (`messages[3].x` -> `messages.x`), cut to a bounded length."""
    return re.sub(r"\[\d+\]", "", path)[:MAX_NAME_LENGTH]
