"""OpenAI fields that have no effect on a self-hosted server: accepted, ignored, and said so.

Each is named, with why, in the `Pathserve-Ignored-Fields` response header and logged once per
name, so that a client can see it was not acted on (docs/request-fields.md has the whole table).
"""

from __future__ import annotations

import logging
import threading

from pydantic import BaseModel

log = logging.getLogger(__name__)

HEADER = "Pathserve-Ignored-Fields"
# field -> why ignoring it is OpenAI's own meaning here
IGNORED = {
    "user": "an end-user id for OpenAI's abuse monitoring; this server does no monitoring",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring; this server does no monitoring",
    "metadata": "tags for completions stored on OpenAI's platform; this server stores none",
    "service_tier": "OpenAI's processing tiers; this server has one",
    "prediction": "a latency hint that never changes the output; this server does not use it",
    "prompt_cache_key": "OpenAI's prompt-cache routing key; this server's prefix cache needs none",
    # JetStream's HTTP sidecar's /generate
    "server": "the gRPC server JetStream's HTTP sidecar forwards to; this server is that engine",
    "port": "the gRPC port JetStream's HTTP sidecar forwards to; this server is that engine",
}

_logged: set[str] = set()
_lock = threading.Lock()


def ignored_fields(body: BaseModel) -> list[str]:
    """The IGNORED fields `body` sets (to anything but null), in IGNORED's order."""
    return [name for name in IGNORED if name in body.model_fields_set and getattr(body, name, None) is not None]


def note(body: BaseModel) -> list[str]:
    """The IGNORED fields `body` sets; each name is logged the first time a request sends it (a
    batch line has no response header: this log says it)."""
    names = ignored_fields(body)
    with _lock:
        new = [n for n in names if n not in _logged]
        _logged.update(new)
    for name in new:
        log.info("ignoring request field %r (logged once): %s", name, IGNORED[name])
    return names


def headers(body: BaseModel, unread: dict[str, str] | None = None) -> dict[str, str]:
    """The response header naming what `body` sent that is ignored, with why (none: no header);
    `unread`: more such fields, with why (the model's chat template leaves them out)."""
    reasons = {name: IGNORED[name] for name in note(body)} | (unread or {})
    return {HEADER: "; ".join(f"{name}: {why}" for name, why in reasons.items())} if reasons else {}
