"""The prefix cache's keys: a prompt's full pages of KV are found again by these (the pages
themselves, their sharing and eviction: serving.orchestrator.pages).

A block is the KV of `block` prompt tokens, block i covering positions [i * block, (i + 1) * block).
Its key is a chained digest of every token id through the block's end (blake2b over the previous
block's key and this block's ids), so equal keys mean equal prefixes, and the keys are the same in
every process of a slice (Python's `hash()` is salted per process; a digest is not). A request
under a LoRA adapter starts its chain from the adapter's salt: the same prompt under two adapters
(or one and the base model) shares no block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 16


def block_keys(prompt_ids: Sequence[int], block: int, salt: bytes = b"") -> tuple[bytes, ...]:
    """The key of every whole block of `prompt_ids` (a trailing partial block has none). `salt`
    starts the chain: prompts under different salts (LoRA adapters, `adapter_salt`) share no key."""
    keys, previous = [], salt
    for start in range(0, len(prompt_ids) - block + 1, block):
        ids = prompt_ids[start : start + block]
        digest = hashlib.blake2b(previous, digest_size=KEY_BYTES)
        digest.update(struct.pack(f"<{block}q", *ids))
        previous = digest.digest()
        keys.append(previous)
    return tuple(keys)


def adapter_salt(adapter: str | None, version: int) -> bytes:
    """The chain's start for a request's LoRA adapter (its KV is the adapter's, not the base
    model's) at that load of it: b"" for the base model."""
    if adapter is None:
        return b""
    return hashlib.blake2b(f"lora/{adapter}/{version}".encode(), digest_size=KEY_BYTES).digest()
