"""Prefix caching: a table from chained block keys to the pages that hold those blocks' KV.

The unit is the LOGICAL block of `PagedLayout` (`tokens_per_block = page_size · dcp` tokens): one
block-table entry names the page every dcp rank uses for its share of the block, so a block is cached,
shared and evicted as one page index on all ranks at once, and the sharding never shows up here.

Keys. A full block's key is sha256(parent key ‖ its token ids): the key of block b names all tokens
[0, (b + 1) · tokens_per_block), so the same tokens after a different prefix get a different key (the
KV of a token depends on everything before it). The key does NOT carry the model, dtype, placement
(dcp, interleave, page size) or rope settings: one table serves one engine, whose pool holds one
model's KV in one placement, so those are fixed for the table's whole life. A cryptographic digest
keeps collisions (which would silently serve another prompt's KV) out of the question; a chain of
nested tuples would be exact too but re-hashes the whole prefix at every lookup.

Ownership (refcounts live in `PageAllocator`, one source of truth). The table holds ONE allocator
reference on every page it registers; each request whose block-table row names the page holds one
more. So a registered page with allocator refcount 1 is used by no request: it stays cached and is
evictable, least-recently-released first (`evictable`, an ordered dict used as an LRU list). Eviction
drops the key and the table's reference, which returns the page to the allocator's free list.
`allocate` hands out truly free pages first and evicts only when the pool needs more.

Writes. Only FULL blocks whose KV is in the cache are registered, and a request's KV writes land at
positions >= its num_computed, i.e. in its partial last block or later ones, which are never
registered and never shared (a hit always stops at a block boundary before the last prompt token).
`Scheduler.check` asserts it: every page a request may still write has refcount 1 and no key.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from dcp_jax.kv.allocator import PageAllocator

ROOT_KEY = b""  # the parent key of block 0


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block: chains its parent's key and its token ids (see the module docstring)."""
    return hashlib.sha256(parent + np.asarray(token_ids, np.int64).tobytes()).digest()


def chain_keys(token_ids: Sequence[int], tokens_per_block: int, keys: list[bytes] | None = None) -> list[bytes]:
    """Keys of every FULL block of `token_ids`, extending `keys` (the keys already known for a prefix
    of the same tokens, reused so a growing sequence hashes each block once). Returns the list."""
    keys = [] if keys is None else keys
    for b in range(len(keys), len(token_ids) // tokens_per_block):
        keys.append(block_key(keys[-1] if keys else ROOT_KEY,
                              token_ids[b * tokens_per_block:(b + 1) * tokens_per_block]))
    return keys


class PrefixCache:
    """Pages of `allocator` with a key table over them; see the module docstring for the rules."""

    def __init__(self, allocator: PageAllocator, on_evict=None):
        self.allocator = allocator
        self.on_evict = on_evict  # f(key, page) before an evicted page goes back to the pool (the host tier)
        self.table: dict[bytes, int] = {}  # key -> page
        self.key_of: dict[int, bytes] = {}  # page -> key (registered pages)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, no request: LRU first
        self.num_evictions = 0

    # --- sizes ---
    @property
    def num_cached(self) -> int:
        """Blocks in the table (used by requests or not)."""
        return len(self.table)

    @property
    def num_available(self) -> int:
        """Pages `allocate` can hand out now: free ones plus evictable cached ones."""
        return self.allocator.num_free + len(self.evictable)

    @property
    def num_in_use(self) -> int:
        """Pages some request holds (cached pages no request uses are not counted)."""
        return self.allocator.num_used - len(self.evictable)

    # --- pages in and out ---
    def allocate(self, n: int) -> list[int] | None:
        """`n` pages with refcount 1, truly free ones first, then evicting LRU cached ones; None (and
        nothing changed) if fewer than n are available."""
        if n > self.num_available:
            return None
        for _ in range(n - self.allocator.num_free):
            self.evict_one()
        return self.allocator.allocate(n)

    def evict_one(self) -> int:
        """Drop the least recently released cached block: its key leaves the table, its page the pool's
        free list. Returns the page."""
        page, _ = self.evictable.popitem(last=False)
        key = self.key_of.pop(page)
        del self.table[key]
        if self.on_evict is not None:
            self.on_evict(key, page)
        self.allocator.free([page])
        self.num_evictions += 1
        return page

    def clear(self) -> int:
        """Evict every cached block no request uses (e.g. the pool's memory is being given back; not
        offered to `on_evict`); returns how many."""
        n, hook, self.on_evict = len(self.evictable), self.on_evict, None
        try:
            while self.evictable:
                self.evict_one()
        finally:
            self.on_evict = hook
        return n

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """Pages of the longest run of `keys` (from block 0) that are cached."""
        pages = []
        for k in keys:
            p = self.table.get(k)
            if p is None:
                break
            pages.append(p)
        return pages

    def acquire(self, pages: Iterable[int]) -> None:
        """A request starts using cached `pages` (from `lookup`): one more reference each."""
        pages = list(pages)
        self.allocator.share(pages)
        for p in pages:
            self.evictable.pop(p, None)

    def register(self, key: bytes, page: int) -> bool:
        """Cache a full block a request holds (its KV is written). False if the key is cached already
        (the same tokens computed twice: the first page stays the cached one, this one stays private)."""
        if key in self.table or page in self.key_of:
            return False
        self.allocator.share([page])  # the table's own reference
        self.table[key], self.key_of[page] = page, key
        return True

    def release(self, pages: Sequence[int]) -> None:
        """A request drops its `pages` (in block order). Cached pages left to the table alone become
        evictable, most recently used last; the tail blocks are released first so that, of one
        sequence, the shared head outlives the tail under eviction."""
        self.allocator.free(pages)
        for p in reversed(pages):
            if p in self.key_of and self.allocator.refcount[p] == 1:
                self.evictable[p] = None
                self.evictable.move_to_end(p)

    def is_shared_or_cached(self, page: int) -> bool:
        """Whether a page must not be written: cached in the table or held by several owners."""
        return page in self.key_of or self.allocator.refcount[page] > 1

    # --- invariants ---
    def cached_pages(self) -> list[int]:
        """The table's references, one per registered page (for `PageAllocator.check(owners=...)`)."""
        return list(self.key_of)

    def check(self, owners: Iterable[Iterable[int]] | None = None) -> None:
        """Assert: table and reverse map agree; evictable = registered pages no request holds; with
        `owners` (the requests' page lists), every refcount equals requests + the table's reference."""
        assert len(self.table) == len(self.key_of)
        assert all(self.key_of.get(p) == k for k, p in self.table.items()), "table and key_of disagree"
        idle = {p for p in self.key_of if self.allocator.refcount[p] == 1}
        assert set(self.evictable) == idle, f"evictable {sorted(self.evictable)} != idle cached {sorted(idle)}"
        if owners is not None:
            self.allocator.check(owners=[*owners, self.cached_pages()])
        else:
            self.allocator.check()
