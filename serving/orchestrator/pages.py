"""The KV cache's pages, in plain Python: which are free, which each sequence holds, which hold a
cached prompt prefix (the prefix cache is the pool itself: nothing is copied to keep or reuse one).

The engine's pool has `num_pages` pages; page 0 is scratch and never handed out. A page is held by
the sequences whose block tables name it (a reference count): a prompt prefix two requests share
is one set of pages in both tables. A full page of prompt KV is registered under its block key
(serving.orchestrator.prefix_cache.block_keys: a chained digest of every token through it, the
adapter's salt first), so a later prompt with that prefix finds it.

Freed pages queue least recently used first and keep their key: a cached prefix stays findable
until the pool needs its page for something else, when `take` hands out the oldest free page and
drops its key. A sequence's pages are freed in reverse, so its deepest pages go before its first
ones and a chain is cut from its end (a lookup stops at the first miss, so a page whose
predecessor was evicted is never found, let alone read).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

SCRATCH = 0


class PagePool:
    """Free pages (oldest first), reference counts, and the key of each cached page."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"a pool of {num_pages} pages: page 0 is scratch, so at least 2")
        self.num_pages = num_pages
        self._free: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self._refs = [0] * num_pages
        self._key_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self.hits = 0  # pages found by a lookup
        self.misses = 0  # pages looked up and not found

    @property
    def num_free(self) -> int:
        """Pages `take` can hand out (free ones holding a cached prefix included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages some sequence holds."""
        return self.num_pages - 1 - len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages registered under a prompt-prefix key (held or free)."""
        return len(self._key_of)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def take(self, count: int) -> list[int] | None:
        """`count` pages for one holder, the least recently freed first (their keys dropped), or
        None, taking nothing, when fewer are free."""
        if count > len(self._free):
            return None
        pages = []
        for _ in range(count):
            page, _ = self._free.popitem(last=False)
            key = self._key_of.pop(page, None)
            if key is not None:
                del self._page_of[key]
            self._refs[page] = 1
            pages.append(page)
        return pages

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of `keys` cached from the first, each now held once more
        by the caller. Every key counts: the run as hits, the rest as misses."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            if self._refs[page] == 0:
                del self._free[page]
            self._refs[page] += 1
        self.hits += len(pages)
        self.misses += len(keys) - len(pages)
        return pages

    def contains(self, key: bytes) -> bool:
        return key in self._page_of

    def register(self, page: int, key: bytes) -> None:
        """Page `page` (held) holds the full prompt block `key`; a key already cached elsewhere
        keeps its page (this one stays unkeyed)."""
        if self._refs[page] < 1:
            raise ValueError(f"page {page} registered while nobody holds it")
        if key in self._page_of or page in self._key_of:
            return
        self._key_of[page] = key
        self._page_of[key] = page

    def release(self, pages: Sequence[int]) -> None:
        """One holder lets go of `pages` (its table, in order); those nobody holds any more are
        free, the table's last first."""
        for page in reversed(pages):
            if page == SCRATCH:
                continue
            if self._refs[page] < 1:
                raise ValueError(f"page {page} released more often than taken")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None
