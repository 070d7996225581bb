"""The host-memory tier under the prefix cache (what SGLang calls HiCache): evicted blocks kept in host RAM.

When the device pool evicts a cached block (`PrefixCache.evict_one`), its KV is not dropped: the block's
key enters this tier and the engine copies the block's pages to host memory before the page is used
again (`ModelRunner.offload`, dispatched ahead of the step that reuses the page, so the copy reads the
old KV in device order). Each rank's share stays its own: the copy is rank-local (no collective) and a
process keeps only the shards of its own devices, so host bytes per process fall as 1/dcp like the
device's. On admission the prefix lookup walks device blocks, then host blocks (`lookup`); host hits
get freshly allocated pages and are copied back (`ModelRunner.restore`) before the step that
prefills after them. A block leaves this tier when it is copied back (it is then cached on the
device again) or when the tier is full (least recently stored first).

Plain Python: the tier holds opaque payloads that the runner makes and reads (`HostBlock.payload`), and
counts what moves. Keys are the prefix cache's chained block keys (`dcp_jax.kv.prefix.block_key`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class HostBlock:
    """One block in host memory: its key, and the payload the runner filled in (None until the copy
    to the host has been dispatched; a block copied back in the same iteration it was evicted in is
    filled first: offloads run before restores)."""

    __slots__ = ("key", "payload")

    def __init__(self, key: bytes):
        self.key, self.payload = key, None


class HostTier:
    """At most `capacity` blocks by key, least recently stored evicted first."""

    def __init__(self, capacity: int):
        if not (isinstance(capacity, int) and capacity >= 1):
            raise ValueError(f"a host tier holds at least one block, got capacity {capacity!r}")
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, HostBlock] = OrderedDict()
        self.num_stored = self.num_dropped = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def store(self, key: bytes) -> HostBlock | None:
        """A block evicted from the device enters the tier (its payload to be filled by the copy);
        None if the key is held already (its KV is the same: nothing to copy). A full tier drops its
        least recently stored block first."""
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return None
        while len(self.blocks) >= self.capacity:
            self.blocks.popitem(last=False)
            self.num_dropped += 1
        block = self.blocks[key] = HostBlock(key)
        self.num_stored += 1
        return block

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the tier holds."""
        n = 0
        for k in keys:
            if k not in self.blocks:
                break
            n += 1
        return n

    def take(self, keys: Sequence[bytes]) -> list[HostBlock]:
        """Remove `keys`' blocks (from `lookup`) to copy them back to the device."""
        return [self.blocks.pop(k) for k in keys]

    def clear(self) -> int:
        n = len(self.blocks)
        self.blocks.clear()
        return n

    def drop_unfilled(self) -> int:
        """Forget blocks whose copy never ran (a failed iteration); returns how many."""
        bad = [k for k, b in self.blocks.items() if b.payload is None]
        for k in bad:
            del self.blocks[k]
        return len(bad)
