"""Attention over a ragged batch: the query tokens of many sequences in one flat array [N].

A step of a serving engine holds decode rows (one token, or k+1 under speculation) and prefill chunks of
several sequences, laid end to end with no padding between them. Each row r owns the flat tokens
[start_r, start_r + len_r), its own KV (block-table row `row`) and its own causal limit (its tokens'
positions and its length). Attention runs over *tiles*: a tile is up to T consecutive tokens of one row,
never two, so every tile is a block of the batched primitive (`api.attention`: B = tiles, T = tile
tokens, one block-table row per tile) and the kernels need nothing new.

Tiles come in groups of one width each (a static tuple): the decode group (T = 1, or k+1: a decode row
is one tile, the kernel's decode configuration) and the prefill group (T = `tile`: a chunk is cut into
tiles of T tokens, the last one partial). A group is a fixed number of tiles W (a function of N and the
rows, so a program's shapes depend on its bucket only); the unused tiles repeat the group's first tile
(the same work, thrown away) so that they change neither the longest nor the shortest visible span the
batched walk is sized by. Within a tile, the entries past the row's end repeat its last token.

    index [W, T]  flat token of each tile entry          row [W]  the tile's row (block table, length)
    where [N]     the entry, in the groups' outputs concatenated ([Σ W·T]), that holds token i's output
    token_row [N] the row of each token (where its KV is written)

`plan` builds these on the host (NumPy); `attention` gathers q and positions into tiles, runs the
batched implementation per group and gathers each token's output back: nothing KV-sized is copied.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TileGroup:
    index: jax.Array  # int32 [W, T]
    row: jax.Array  # int32 [W]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.index.shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedTiles:
    """How a flat batch of N tokens is cut into tiles (see the module docstring)."""

    groups: tuple[TileGroup, ...]
    where: jax.Array  # int32 [N]
    token_row: jax.Array  # int32 [N]: the row of each token (its KV is written through it); 0 for padding

    @classmethod
    def spec(cls, n: int, shapes) -> "RaggedTiles":
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
        return cls(tuple(TileGroup(i32(w, t), i32(w)) for w, t in shapes), i32(n), i32(n))


def group_shapes(n: int, rows: int, tile: int, decode_width: int = 1) -> tuple[tuple[int, int], ...]:
    """The static (W, T) of the decode and prefill groups for a batch of n tokens in at most `rows` rows:
    every row may decode (W = min(rows, n // decode_width) tiles of decode_width), and prefill rows need
    at most n / tile + (one partial tile per row) tiles of `tile`."""
    decode = (max(1, min(rows, n // decode_width)), decode_width)
    prefill = (max(1, min(math.ceil(n / tile) + rows, n)), tile)
    return decode, prefill


def plan(starts, lens, rows, num_tokens: int, shapes) -> RaggedTiles:
    """Host-side tiles (NumPy) for rows laid end to end in a flat batch of `num_tokens` (padding after the
    last row is never read back). starts/lens/rows [R]: each row's first flat token, its token count
    (0: the row runs nothing) and its block-table row. shapes: `group_shapes`' ((W_d, T_d), (W_p, T_p)).
    A row of at most T_d tokens is a decode tile while the decode group has room; the rest are cut into
    prefill tiles. Raises ValueError if a group overflows (the caller sized N or the groups wrongly)."""
    (wd, td), (wp, tp) = shapes
    dec_idx, dec_row, pre_idx, pre_row = [], [], [], []
    for s, n, r in zip(starts, lens, rows):
        s, n, r = int(s), int(n), int(r)
        if n <= 0:
            continue
        if n <= td and len(dec_idx) < wd:
            dec_idx.append(s + np.minimum(np.arange(td), n - 1))
            dec_row.append(r)
            continue
        for j in range(0, n, tp):
            m = min(tp, n - j)
            pre_idx.append(s + j + np.minimum(np.arange(tp), m - 1))
            pre_row.append(r)
    if len(pre_idx) > wp:
        raise ValueError(f"{len(pre_idx)} prefill tiles do not fit the group of {wp}")
    # an empty group's tiles repeat the other group's first token (nothing is empty when nothing runs)
    some = (dec_idx or pre_idx or [np.zeros(1, np.int64)])[0][0], (dec_row or pre_row or [0])[0]
    where, token_row = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    for s, n, r in zip(starts, lens, rows):
        token_row[int(s):int(s) + max(int(n), 0)] = int(r)
    groups, base = [], 0
    for idx, row, (w, t) in ((dec_idx, dec_row, (wd, td)), (pre_idx, pre_row, (wp, tp))):
        index = np.full((w, t), some[0], np.int32)
        rowv = np.full(w, some[1], np.int32)
        if idx:
            index[:len(idx)] = idx
            rowv[:len(idx)] = row
            index[len(idx):] = index[0]  # unused tiles repeat the first: same spans, result thrown away
            rowv[len(idx):] = rowv[0]
            # each token's output: the first entry that holds it (entries past a row's end repeat its last)
            tokens, first = np.unique(index[:len(idx)].reshape(-1), return_index=True)
            where[tokens] = base + first
        groups.append(TileGroup(index, rowv))
        base += w * t
    return RaggedTiles(tuple(groups), where, token_row)


def attention(attend, q, q_pos, kv_len, block_table, tiles: RaggedTiles):
    """Attention of a ragged batch through a batched implementation.

    attend(q [W,T,H,Dk], q_pos [W,T], kv_len [W], block_table [W,NB]) -> (o [W,T,H,Dv], lse [W,T,H]):
    the batched primitive with the KV, its positions and the options bound. q [N, H, Dk], q_pos [N];
    kv_len [R] and block_table [R, NB] per row. Returns (o [N, H, Dv], lse [N, H] float32).
    """
    outs, lses = [], []
    for g in tiles.groups:
        w, t = g.index.shape
        o, lse = attend(q[g.index], q_pos[g.index], kv_len[g.row], block_table[g.row])
        outs.append(o.reshape(w * t, *o.shape[2:]))
        lses.append(lse.reshape(w * t, lse.shape[-1]))
    o = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=0) if len(lses) > 1 else lses[0]
    return o[tiles.where], lse[tiles.where]
