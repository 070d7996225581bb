"""The KV manager: the one way into the page allocator and the prefix table.

As vLLM's `KVCacheManager` over its `BlockPool`: the scheduler decides WHO runs; this module decides
WHERE their KV lives. It owns the block table (one replicated row per decode slot), the pages each
request holds (`Request.pages`, in block order), the prefix table (`PrefixCache`, dcp_jax/kv/prefix.py)
and its hit counters. Plain Python over integers: no devices, no requests' stop rules.

    lookup(r)         pages of the longest cached run of r's full blocks (never its last token's)
    lookup_host(r, n) how many blocks after those the host tier holds (`dcp_jax.kv.host`)
    admit(r, hit, h)  r takes a slot, the hit's pages (shared by reference count) and h fresh pages
                      for host hits (copied back by the engine: `take_copies`)
    grow(r, n)        n more private pages at the end of r's row
    register(r)       cache r's blocks that became full
    release(r)        r's pages and slot back; its full blocks stay cached

Block-table entries that name no page hold `NULL_PAGE` (0): page 0 of the pool is reserved, never holds
a sequence's KV, and takes the writes of padded rows.
"""

from __future__ import annotations

import numpy as np

from dcp_jax.kv.allocator import PageAllocator
from dcp_jax.kv.host import HostBlock, HostTier
from dcp_jax.kv.prefix import PrefixCache, chain_keys
from dcp_jax.layout import PagedLayout

NULL_PAGE = 0  # block-table filler; page 0 of the pool is reserved for it


class KVCacheManager:
    """Pages, block table and prefix table of one pool of `num_pages` pages (the null page included)."""

    def __init__(self, layout: PagedLayout, num_pages: int, max_num_seqs: int, max_blocks_per_seq: int,
                 enable_prefix_caching: bool = False, host_blocks: int = 0):
        self.layout, self.enable_prefix_caching = layout, enable_prefix_caching
        self.max_num_seqs = max_num_seqs
        self.allocator = PageAllocator(num_pages, reserved=NULL_PAGE + 1)
        # The host tier (`dcp_jax.kv.host`): evicted blocks are offered to it, and the copies it needs
        # wait in `offloads` / `restores` until the engine runs them, offloads first, before the step.
        self.host = HostTier(host_blocks) if host_blocks else None
        self.offloads: list[tuple[HostBlock, int]] = []
        self.restores: list[tuple[HostBlock, int]] = []
        self.host_hit_tokens = 0
        # Every page goes through the prefix cache; with caching off nothing is ever registered, so it
        # is the plain allocator (one code path for both).
        self.pool = PrefixCache(self.allocator, on_evict=None if self.host is None else self.offer)
        self.block_table = np.full((max_num_seqs, max_blocks_per_seq), NULL_PAGE, np.int32)
        self.free_slots: set[int] = set(range(max_num_seqs))
        self.prefix_query_tokens = self.prefix_hit_tokens = 0

    # --- sizes ---
    @property
    def num_available(self) -> int:
        """Pages that can be handed out now (free, or cached by no request: evicted on demand)."""
        return self.pool.num_available

    @property
    def num_usable(self) -> int:
        """Pages the pool can ever hand out (all but the null page)."""
        return self.allocator.num_usable

    def blocks_needed(self, r, tokens: int) -> int:
        """More pages `r` needs to hold `tokens` tokens."""
        return self.layout.blocks_for(tokens) - len(r.pages)

    # --- prefix caching ---
    def lookup(self, r) -> list[int]:
        """Pages of the longest run of cached full blocks of `r`'s prompt + output so far, stopping
        before its last token: the device must still run that token to sample the next one, and the
        block it lands in will be written, so it must be a private page (never a cached one). A request
        that scores its prompt (prompt logprobs) computes every token: no hit."""
        if not self.enable_prefix_caching or r.scores_prompt:
            return []
        tpb = self.layout.tokens_per_block
        chain_keys(r.token_ids(0, r.num_tokens), tpb, r.block_keys)
        return self.pool.lookup(r.block_keys[:(r.num_tokens - 1) // tpb])

    def lookup_host(self, r, device_hits: int) -> int:
        """How many full blocks of `r` after its `device_hits` cached ones the host tier holds (stopping,
        as `lookup`, before the block of its last token)."""
        if self.host is None or r.scores_prompt:
            return 0
        last = (r.num_tokens - 1) // self.layout.tokens_per_block
        return self.host.lookup(r.block_keys[device_hits:last])

    def offer(self, key: bytes, page: int) -> None:
        """A cached block leaves the device: keep it in the host tier (its copy runs before the page's
        next use)."""
        block = self.host.store(key)
        if block is not None:
            self.offloads.append((block, page))

    def take_copies(self) -> tuple[list, list]:
        """The (block, page) copies to the host and back that this iteration's schedule needs, in that
        order; the lists are emptied."""
        out = (self.offloads, self.restores)
        self.offloads, self.restores = [], []
        return out

    def num_taken_by(self, hit: list[int]) -> int:
        """How many of `hit`'s pages stop being available once taken (cached, held by no request)."""
        return sum(1 for p in hit if p in self.pool.evictable)

    def register(self, r) -> None:
        """Cache `r`'s blocks that became full (all their KV written), prefill or decode alike."""
        if not self.enable_prefix_caching:
            return
        tpb = self.layout.tokens_per_block
        full = min(r.num_computed // tpb, len(r.pages))
        if full <= r.num_registered:
            return
        chain_keys(r.token_ids(0, full * tpb), tpb, r.block_keys)
        for b in range(r.num_registered, full):
            self.pool.register(r.block_keys[b], r.pages[b])
        r.num_registered = full

    def reset_prefix_cache(self, host: bool = True) -> int:
        """Forget every cached prefix block no request holds, and (`host`) the host tier's; returns how
        many were dropped."""
        n = self.pool.clear()
        if self.host is not None and host:
            n += self.host.clear()
        return n

    # --- slots and pages ---
    def admit(self, r, hit: list[int] = (), host_hits: int = 0) -> None:
        """`r` takes the lowest free slot, the cached pages `hit` (from `lookup`) and, for the next
        `host_hits` blocks (from `lookup_host`), fresh pages their KV is copied back into (cached again
        at once: the copy runs before any step); counts the lookup (prefix hits: the device's and
        the host's blocks; host hits: the host's alone) and, at `r`'s first admission, records its
        hit in `r.num_cached_tokens`."""
        r.slot = min(self.free_slots)
        self.free_slots.remove(r.slot)
        pages = list(hit)
        if hit:
            self.pool.acquire(hit)
        if host_hits:
            keys = r.block_keys[len(hit):len(hit) + host_hits]
            fresh = self.pool.allocate(host_hits)
            assert fresh is not None, "caller must check num_available"
            for block, page in zip(self.host.take(keys), fresh):
                self.pool.register(block.key, page)
                self.restores.append((block, page))
            pages += fresh
            self.host_hit_tokens += self.layout.capacity_tokens(host_hits)
        if pages:
            self.block_table[r.slot, :len(pages)] = pages
            r.pages, r.num_registered = pages, len(pages)
        self.prefix_query_tokens += r.num_tokens
        # a hit is a hit wherever its KV was: the device's and the host tier's (host_hit_tokens)
        hit_tokens = self.layout.capacity_tokens(len(hit) + host_hits)
        self.prefix_hit_tokens += hit_tokens
        if r.num_cached_tokens is None:  # its first admission: the prompt tokens it did not compute
            r.num_cached_tokens = min(hit_tokens, r.num_prompt_tokens)

    def grow(self, r, n: int) -> None:
        """Give running request `r` n more pages (the caller checked `num_available`)."""
        if n <= 0:
            return
        pages = self.pool.allocate(n)
        assert pages is not None, "caller must check num_available"
        self.block_table[r.slot, len(r.pages):len(r.pages) + n] = pages
        r.pages.extend(pages)

    def release(self, r) -> None:
        """Free `r`'s pages and slot (the block-table row goes back to NULL_PAGE). Its full blocks are
        registered first, so a finished or preempted request leaves its prefix cached."""
        self.register(r)
        if r.pages:
            self.pool.release(r.pages)
            r.pages = []
        r.num_registered = 0
        if r.slot is not None:
            self.block_table[r.slot] = NULL_PAGE
            self.free_slots.add(r.slot)
            r.slot = None

    # --- introspection ---
    def stats(self) -> dict:
        used, total = self.pool.num_in_use, self.allocator.num_usable
        q, h = self.prefix_query_tokens, self.prefix_hit_tokens
        return dict(pages_used=used, pages_total=total, kv_capacity_tokens=self.layout.capacity_tokens(total),
                    kv_used_tokens=self.layout.capacity_tokens(used), prefix_query_tokens=q,
                    prefix_hit_tokens=h, prefix_hit_rate=h / q if q else 0.0,
                    cached_blocks=self.pool.num_cached, evictions=self.pool.num_evictions,
                    **({} if self.host is None else dict(
                        host_blocks=len(self.host), host_capacity_blocks=self.host.capacity,
                        host_hit_tokens=self.host_hit_tokens, host_stored_blocks=self.host.num_stored,
                        host_dropped_blocks=self.host.num_dropped)))

    def check(self, running) -> None:
        """Assert the pages' and slots' invariants for the `running` requests."""
        self.pool.check(owners=[r.pages for r in running])
        slots = [r.slot for r in running]
        assert len(set(slots)) == len(slots) and None not in slots
        assert self.free_slots == set(range(self.max_num_seqs)) - set(slots)
        for s in self.free_slots:
            assert (self.block_table[s] == NULL_PAGE).all()
        tpb = self.layout.tokens_per_block
        for r in running:
            row = self.block_table[r.slot]
            assert row[:len(r.pages)].tolist() == r.pages and (row[len(r.pages):] == NULL_PAGE).all()
            assert len(r.pages) >= self.layout.blocks_for(r.num_computed)
            # the pages it may still write (from its first block not fully computed) are private
            for p in r.pages[r.num_computed // tpb:]:
                assert not self.pool.is_shared_or_cached(p), f"page {p} may be written but is shared/cached"
            assert r.num_registered <= r.num_computed // tpb
