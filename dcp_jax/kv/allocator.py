"""Pages of the paged KV pool, handed out with reference counts.

Why `dcp_jax/kv/` and not `dcp_jax/serving/`: the allocator knows pages, not requests. It belongs to the
KV pool's concern with the placement math (`dcp_jax/layout.py`, to move here as `kv/layout.py` once no
one edits it concurrently) and the prefix table to come (`kv/prefix.py`, which shares pages through
`share`); the serving scheduler is one client among several (prefix caching, disaggregated transfer).

A page is one block-table entry: the same page index on every dcp rank, holding `page_size` slots per
rank, i.e. `page_size · dcp` tokens of one logical block (see `PagedLayout`). Plain Python over ints.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class PageAllocator:
    """A fixed pool of `num_pages` pages; pages [0, reserved) are never handed out.

    `reserved` exists for the null page: block-table entries that name no page hold 0, and device
    programs with fixed shapes write their padding there, so page 0 must belong to no sequence.
    Every other page is either free (refcount 0, on the free list) or owned (refcount >= 1).
    """

    def __init__(self, num_pages: int, *, reserved: int = 0):
        if not (isinstance(num_pages, int) and isinstance(reserved, int) and 0 <= reserved < num_pages):
            raise ValueError(f"need integers 0 <= reserved < num_pages, got reserved={reserved!r}, "
                             f"num_pages={num_pages!r}")
        self.num_pages, self.reserved = num_pages, reserved
        self.refcount = [0] * num_pages
        # FIFO: a page just freed is reused last, which keeps freed prefix pages findable longer.
        self._free = deque(range(reserved, num_pages))

    @property
    def num_usable(self) -> int:
        """Pages that can ever be handed out (all but the reserved ones)."""
        return self.num_pages - self.reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_usable - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """`n` fresh pages with refcount 1, or None (and nothing taken) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more owner for each of `pages` (prefix caching); every page must already be owned."""
        pages = list(pages)
        for p in pages:
            self._check_owned(p, 1)
        for p in pages:
            self.refcount[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference per listed page (a page listed twice drops two); pages reaching 0 go back
        to the free list. Checked before anything changes: freeing an unowned page raises."""
        counts = Counter(pages)
        for p, c in counts.items():
            self._check_owned(p, c)
        for p, c in counts.items():
            self.refcount[p] -= c
            if self.refcount[p] == 0:
                self._free.append(p)

    def _check_owned(self, p, times: int) -> None:
        if not (isinstance(p, int) and self.reserved <= p < self.num_pages):
            raise ValueError(f"page {p!r} is not a page of this pool ({self.reserved}..{self.num_pages - 1})")
        if self.refcount[p] < times:
            raise ValueError(f"page {p} has {self.refcount[p]} reference(s), cannot release {times}: "
                             "double free or a page that was never allocated")

    def check(self, owners: Iterable[Iterable[int]] | None = None) -> None:
        """Assert the invariants (for tests and debugging): the free list holds exactly the pages with
        refcount 0, no duplicates, reserved pages untouched; with `owners` (one page list per owner),
        each page's refcount is exactly the number of times owners hold it."""
        free = list(self._free)
        assert len(set(free)) == len(free), "a page is on the free list twice"
        assert all(self.refcount[p] == 0 for p in range(self.reserved)), "a reserved page was handed out"
        zero = {p for p in range(self.reserved, self.num_pages) if self.refcount[p] == 0}
        assert set(free) == zero, f"free list {sorted(free)} != pages with refcount 0 {sorted(zero)}"
        assert all(c >= 0 for c in self.refcount), "negative refcount"
        if owners is not None:
            held = Counter(p for pages in owners for p in pages)
            for p in range(self.num_pages):
                assert self.refcount[p] == held.get(p, 0), \
                    f"page {p}: refcount {self.refcount[p]} but held {held.get(p, 0)} time(s)"
