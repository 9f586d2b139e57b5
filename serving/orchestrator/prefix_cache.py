"""The prefix cache's index, in plain Python: which prompt-prefix KV blocks are kept, under which
keys, and which to evict (least recently used first) so that they fit a byte budget.

A block is the KV of `block` prompt tokens, block i covering positions [i * block, (i + 1) * block).
Its key is a chained digest of every token id through the block's end (blake2b over the previous
block's key and this block's ids), so equal keys mean equal prefixes, and the keys are the same in
every process of a slice (Python's `hash()` is salted per process; a digest is not). A request
under a LoRA adapter starts its chain from the adapter's salt: the same prompt under two adapters
(or one and the base model) shares no block.

Recency is kept per chain: a lookup's hits and a store's ancestors become the most recently used
with the first block newest, so a prompt's deepest blocks go first and a chain is never cut at its
root while its tail is kept (a block whose ancestors are gone could never be found again).

The index only decides; the executor keeps the blocks themselves (key -> the engine's copy), and
executes the scheduler's stores and evictions in plan order, so index and store hold the same keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterator, Sequence

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


class PrefixCache:
    """Keys of the blocks kept, least recently used first, within `budget_bytes` (each block
    `block_bytes`); hit and miss counts for the metrics."""

    def __init__(self, block: int, block_bytes: int, budget_bytes: int):
        if block < 1 or block_bytes < 1:
            raise ValueError(f"prefix cache: block={block} tokens of {block_bytes} bytes")
        self.block = block
        self.block_bytes = block_bytes
        self.capacity = max(budget_bytes, 0) // block_bytes  # blocks
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0  # blocks found at a lookup
        self.misses = 0  # blocks looked up and not found

    def __contains__(self, key: bytes) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[bytes]:
        """The keys, least recently used first."""
        return iter(list(self._keys))

    @property
    def bytes_used(self) -> int:
        return len(self._keys) * self.block_bytes

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` (a prompt's blocks that could be reused, in order) are cached as one
        run from the first; those become the most recently used. Every key counts: the run as hits,
        the rest as misses."""
        found = 0
        while found < len(keys) and keys[found] in self._keys:
            found += 1
        self._refresh(keys[:found])
        self.hits += found
        self.misses += len(keys) - found
        return found

    def add(self, key: bytes, ancestors: Sequence[bytes]) -> tuple[bytes, ...] | None:
        """Index `key`, the block after `ancestors` (its prompt's blocks before it, in order);
        returns the keys evicted to make room (least recently used first), or None when it is not
        kept: an ancestor is gone, or the budget cannot hold the chain."""
        if key in self._keys:
            raise ValueError("prefix cache: a block added twice")
        if len(ancestors) >= self.capacity or any(a not in self._keys for a in ancestors):
            return None
        self._refresh(ancestors)  # the newest now: fewer than the capacity, never evicted below
        evicted = []
        while len(self._keys) >= self.capacity:
            evicted.append(self._keys.popitem(last=False)[0])
        self._keys[key] = None
        self._refresh(ancestors)  # newer than `key`: a chain loses its deepest block first
        return tuple(evicted)

    def _refresh(self, chain: Sequence[bytes]) -> None:
        """Make `chain` the most recently used, its first block newest."""
        for key in reversed(chain):
            self._keys.move_to_end(key)
