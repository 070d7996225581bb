"""KV placement along the sequence: the one module that owns position <-> (rank, slot) math.

Interleaved placement with size I (vLLM's `cp_kv_cache_interleave_size`) over N context shards:

    global position t  ->  rank  (t // I) % N,   local slot  (t // (I·N))·I + t % I

I = 1 is round-robin (balanced while decoding); I = slots_per_shard is contiguous. Every function works
on Python ints, NumPy arrays and traced JAX arrays alike (only integer arithmetic), so the engine's
jitted code and the tests share it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.common import SlotPositions


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Placement of `max_seq_len` token slots over `num_shards` context shards.

    `max_seq_len` is rounded up to a multiple of `num_shards · interleave`, so every shard holds the same
    number of slots (`slots_per_shard`, a multiple of `interleave`).
    """

    num_shards: int
    interleave: int
    max_seq_len: int

    def __post_init__(self):
        for name in ("num_shards", "interleave", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"KVLayout.{name} must be an integer >= 1, got {v!r}")
        block = self.num_shards * self.interleave
        object.__setattr__(self, "max_seq_len", math.ceil(self.max_seq_len / block) * block)

    @classmethod
    def create(cls, max_seq_len: int, num_shards: int, interleave: int | str = 1) -> "KVLayout":
        """`interleave` is an int, or "contiguous" for one run of slots per shard."""
        if interleave == "contiguous":
            if not isinstance(max_seq_len, int) or max_seq_len < 1:
                raise ValueError(f"max_seq_len must be an integer >= 1, got {max_seq_len!r}")
            interleave = math.ceil(max_seq_len / num_shards)
        return cls(num_shards=num_shards, interleave=interleave, max_seq_len=max_seq_len)

    @property
    def slots_per_shard(self) -> int:
        return self.max_seq_len // self.num_shards

    @property
    def is_contiguous(self) -> bool:
        return self.interleave == self.slots_per_shard

    # --- position -> placement -------------------------------------------------------------------
    def rank_of(self, t):
        """The context shard that owns global position t."""
        return (t // self.interleave) % self.num_shards

    def slot_of(self, t):
        """The local slot of global position t on its owner."""
        i = self.interleave
        return (t // (i * self.num_shards)) * i + t % i

    def cache_index(self, t):
        """Index of position t along the global (concatenated-shards) sequence axis of the cache."""
        return self.rank_of(t) * self.slots_per_shard + self.slot_of(t)

    # --- placement -> position -------------------------------------------------------------------
    def slice_positions(self, rank) -> SlotPositions:
        """The positions shard `rank`'s slots hold, in the form kernels take (runs of `interleave`)."""
        return SlotPositions(start=rank * self.interleave, run=self.interleave,
                             stride=self.interleave * self.num_shards)

    def position_of(self, rank, slot):
        """Global position held by `slot` of shard `rank`."""
        return self.slice_positions(rank).at(slot)

    def slot_positions(self, rank):
        """Global positions of all local slots of shard `rank` (int32 [slots_per_shard])."""
        return self.position_of(rank, jnp.arange(self.slots_per_shard, dtype=jnp.int32))

    # --- lengths ---------------------------------------------------------------------------------
    def local_length(self, length, rank):
        """How many of the positions [0, length) shard `rank` owns."""
        i, n = self.interleave, self.num_shards
        full, rem = length // (i * n), length % (i * n)
        return full * i + _clip(rem - rank * i, 0, i)

    def local_lengths(self, length):
        """Valid-token count of every shard for `length` (NumPy [num_shards])."""
        return np.array([self.local_length(int(length), r) for r in range(self.num_shards)])


def _clip(x, lo, hi):
    """np.clip for host values, jnp.clip for (possibly traced) JAX arrays."""
    return jnp.clip(x, lo, hi) if isinstance(x, jax.Array) else np.clip(x, lo, hi)


def kv_cache_bytes(
    *, batch: int, num_layers: int, kv_heads: int, max_seq_len: int, k_dim: int, v_dim: int, dtype
) -> int:
    """Bytes of a whole (unsharded) K+V cache."""
    itemsize = np.dtype(dtype).itemsize
    return batch * num_layers * kv_heads * max_seq_len * (k_dim + v_dim) * itemsize
