"""KV placement along the sequence: the one module that owns position <-> (rank, slot) math.

Interleaved placement with size I (vLLM's `cp_kv_cache_interleave_size`) over N context shards:

    global position t  ->  rank  (t // I) % N,   local slot  (t // (I·N))·I + t % I

I = 1 is round-robin (balanced while decoding); I = slots_per_shard is contiguous. The paged pool of the
serving engine (`PagedLayout`) keeps this placement and cuts each shard's local slots into pages; its
formulas are this module's, never restated elsewhere. Every function works
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

__all__ = ["KVLayout", "PagedLayout", "ReshardPlan", "kv_cache_bytes", "kv_head_ranges", "kv_head_sources",
           "reshard_plan"]


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


@dataclasses.dataclass(frozen=True)
class PagedLayout:
    """Placement of a sequence over a paged pool: `KVLayout`'s interleave, cut into logical blocks.

    The pool holds pages of `page_size` slots on every context shard. A logical block covers
    `tokens_per_block = page_size · num_shards` consecutive tokens, and one block-table entry names the
    page that EVERY shard uses for its share of that block (so the table is one replicated row per
    sequence, not one per shard). Within a shard, tokens sit exactly where the dense `KVLayout` puts them
    (rank (t // I) % N, logical local slot j = (t // (I·N))·I + t % I); the logical local slots are then
    cut into pages: slot j lives in block j // page_size at page slot j % page_size. `page_size` must be
    a multiple of I so a run of I tokens never straddles a page, which makes

        block_of(t) = j // page_size = t // (page_size · N)

    (each block holds whole runs of I from every shard: the same tokens a dense layout of one block
    would hold). A kernel reads logical local slot j from page `table[j // page_size]` at
    `j % page_size`, and the positions of the logical slots are `slice_positions(rank)`, as dense.
    Like `KVLayout`, every method works on Python ints, NumPy arrays and traced JAX arrays.
    """

    num_shards: int
    interleave: int
    page_size: int

    def __post_init__(self):
        for name in ("num_shards", "interleave", "page_size"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"PagedLayout.{name} must be an integer >= 1, got {v!r}")
        if self.page_size % self.interleave:
            raise ValueError(f"page_size ({self.page_size}) must be a multiple of the interleave size "
                             f"({self.interleave}) so a run of interleaved tokens never straddles a page")

    @property
    def dense(self) -> KVLayout:
        """The dense layout of one block: the per-shard math of a paged sequence is this one's.

        (Its `max_seq_len` is one block; none of the functions used here depend on it.)
        """
        return KVLayout(self.num_shards, self.interleave, self.tokens_per_block)

    @property
    def tokens_per_block(self) -> int:
        """Tokens one block-table entry covers, over all shards: page_size · num_shards."""
        return self.page_size * self.num_shards

    def same_blocks(self, num_shards: int) -> "PagedLayout":
        """The layout of a cache sharded over `num_shards` context ranks that keeps this layout's blocks
        (the same tokens per block-table entry, so one block table and one set of page ids serve both:
        a draft model whose KV is sharded differently from the target's, MLA's latent over
        ("tp","dcp") against GQA's over "dcp")."""
        tpb = self.tokens_per_block
        if tpb % num_shards or (tpb // num_shards) % self.interleave:
            raise ValueError(f"blocks of {tpb} tokens do not split over {num_shards} shards in whole runs of "
                             f"{self.interleave} tokens")
        return PagedLayout(num_shards, self.interleave, tpb // num_shards)

    # --- position -> placement -------------------------------------------------------------------
    def rank_of(self, t):
        """The context shard that owns global position t (as `KVLayout.rank_of`)."""
        return self.dense.rank_of(t)

    def local_slot_of(self, t):
        """The logical local slot of position t on its owner (as `KVLayout.slot_of`, unbounded)."""
        return self.dense.slot_of(t)

    def block_of(self, t):
        """The logical block (block-table column) of position t; equals t // tokens_per_block."""
        return self.local_slot_of(t) // self.page_size

    def page_slot_of(self, t):
        """The slot inside its page that position t occupies on its owner."""
        return self.local_slot_of(t) % self.page_size

    def page_of(self, table, t, valid=True, missing=0, rows=None):
        """The page that holds position t, through a block table: one row [NB] (t any shape), one row
        per sequence [B, NB] (t [B, T]), or with `rows` (t's shape) the table row of each position (a
        ragged batch). `missing` where `valid` is False or t lies past the table's NB blocks (a position
        with no block must be dropped, never folded into the last block)."""
        xp = jnp if isinstance(table, jax.Array) or isinstance(t, jax.Array) else np
        table, block = xp.asarray(table), xp.asarray(self.block_of(t))
        nb = table.shape[-1]
        clipped = xp.minimum(block, nb - 1)
        if rows is not None:
            page = table[rows, clipped]
        else:
            page = table[clipped] if table.ndim == 1 else xp.take_along_axis(table, clipped, axis=-1)
        return xp.where(valid & (block < nb), page, missing)

    # --- placement -> position -------------------------------------------------------------------
    def slice_positions(self, rank) -> SlotPositions:
        """Positions of shard `rank`'s logical local slots, the same as the dense layout's."""
        return self.dense.slice_positions(rank)

    # --- lengths and sizes -----------------------------------------------------------------------
    def blocks_for(self, length):
        """Blocks (= pages, one per block, shared by all shards) that `length` tokens need."""
        return -(-length // self.tokens_per_block)

    def local_length(self, length, rank):
        """How many of the positions [0, length) shard `rank` owns; always from the global length."""
        return self.dense.local_length(length, rank)

    def local_lengths(self, length):
        """Valid-token count of every shard for `length` (NumPy [num_shards])."""
        return self.dense.local_lengths(length)

    def capacity_tokens(self, num_pages):
        """Tokens `num_pages` pages hold over all shards: num_pages · page_size · num_shards."""
        return num_pages * self.tokens_per_block


# --- prefill/decode disaggregation: one paged placement to another ----------------------------------


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """How the first `length` tokens of a sequence move from a source paged placement to a
    destination one: the source stages every slot of the sequence's `src_blocks` blocks
    (`staged_tokens` positions) and sends, per (source rank, destination rank), the positions that
    source rank holds and that destination rank owns (`piece_positions`), which the destination
    writes through its own `page_of` / `page_slot_of`. Positions >= length are padding: the source
    zeroes them and the destination drops them, so no stale row is ever written."""

    src: PagedLayout
    dst: PagedLayout
    length: int

    @property
    def src_blocks(self) -> int:
        """Blocks (pages per rank) the source holds the sequence in."""
        return int(self.src.blocks_for(self.length))

    @property
    def staged_tokens(self) -> int:
        """Slots the source's `src_blocks` blocks hold over all its ranks (>= length): the positions
        [0, staged_tokens) that `piece_positions` splits. Depends on `src_blocks` only."""
        return self.src_blocks * self.src.tokens_per_block

    def piece_positions(self) -> list[list[np.ndarray]]:
        """[src rank][dst rank] -> the positions p < `staged_tokens` that source rank holds and destination
        rank owns, ascending (= the destination's local-slot order, the order it writes them in).

        One piece of KV per (source rank, destination rank): every slot of the sequence's source blocks,
        so the sizes depend on `src_blocks` only (a program per number of blocks, not per length);
        positions >= length are padding (the source zeroes them, the destination drops them). Each
        position < staged_tokens is in exactly one piece, so the pieces together are the staged slots."""
        t = np.arange(self.staged_tokens, dtype=np.int64)
        s, d = self.src.rank_of(t), self.dst.rank_of(t)
        return [[t[(s == i) & (d == j)] for j in range(self.dst.num_shards)] for i in range(self.src.num_shards)]

    def piece_sizes(self) -> np.ndarray:
        """Tokens of each piece (NumPy [N_src, N_dst]); row sums are the source ranks' staged slots."""
        return np.array([[len(p) for p in row] for row in self.piece_positions()], dtype=np.int64).reshape(
            self.src.num_shards, self.dst.num_shards)


def reshard_plan(src: PagedLayout, dst: PagedLayout, length: int) -> ReshardPlan:
    """The plan moving the first `length` tokens from placement `src` to placement `dst` (any numbers
    of shards, interleaves and page sizes on either side)."""
    if not isinstance(length, (int, np.integer)) or isinstance(length, bool) or length < 0:
        raise ValueError(f"length must be an integer >= 0, got {length!r}")
    return ReshardPlan(src, dst, int(length))


def kv_head_sources(stored_heads: int, replication: int) -> np.ndarray:
    """The model's kv head held by each of `stored_heads` cache heads when every head is stored
    `replication` times (so each tp rank holds whole heads): stored head j holds head j // replication.
    Two sides with different tp re-split heads through it: each destination head takes its source."""
    return np.arange(stored_heads) // replication


def kv_head_ranges(stored_heads: int, replication: int, groups: int) -> list[tuple[int, int]]:
    """The model's kv heads [lo, hi) held by each of `groups` equal head shards of `stored_heads` cache
    heads (heads stored `replication` times, as `kv_head_sources`): with replication a shard holds one
    head (and several shards the same one), without it a run of stored_heads // groups heads."""
    if stored_heads % groups:
        raise ValueError(f"{stored_heads} stored kv heads do not split into {groups} equal shards")
    heads = kv_head_sources(stored_heads, replication)
    per = stored_heads // groups
    return [(int(heads[g * per]), int(heads[(g + 1) * per - 1]) + 1) for g in range(groups)]
