"""Attention over a ragged batch: the query tokens of many sequences in one flat array [N].

A step of a serving engine holds decode rows (one token, or k+1 under speculation) and prefill chunks of
several sequences, laid end to end with no padding between them. Each row r owns the flat tokens
[start_r, start_r + len_r), its own KV (block-table row `row`) and its own causal limit (its tokens'
positions and its length). Attention runs over *tiles*: a tile is up to T consecutive tokens of one row,
never two, so every tile is a block of the batched primitive (`api.attention`: B = tiles, T = tile
tokens, one block-table row per tile) and the kernels need nothing new.

Tiles come in groups of one width each (a static tuple): the decode group (T = 1, or k+1: a decode row
is one tile, the kernel's decode configuration), the short-chunk group (T = `tile`: a chunk is cut into
tiles of T tokens, the last one partial) and, in a step of at least LONG_TILE tokens, the long-chunk
group (T = LONG_TILE: a long chunk's KV is read once per LONG_TILE queries). A group is a fixed number of tiles W (a function of N and the
rows, so a program's shapes depend on its bucket only), sorted by how far each tile sees and run in
bands of consecutive tiles, so a band walks about its own tiles' span; the unused tiles read no token
(position -1: they see nothing) and come first. Within a tile, the entries past the row's end repeat its
last token.

    index [W, T]  flat token of each tile entry (-1: none) row [W]  the tile's row (block table, length)
    where [N]     the entry, in the groups' outputs concatenated ([Σ W·T]), that holds token i's output
    token_row [N] the row of each token (where its KV is written)

`plan` builds these on the host (NumPy); `attention` gathers q and positions into tiles, runs the
batched implementation per group and gathers each token's output back: nothing KV-sized is copied.

Group 0 is the decode group; the others hold prefill tiles. Split (RPA v3's decode / prefill
ranges; the serving path where an implementation takes the diagonal blocks): the decode rows are one
launch of the paged decode configuration; a prefill tile's attention is its cached prefix (the pages
below its first token, every query seeing all of it: `attention(split=True)`) and its diagonal
block (the tile's queries over its own new keys and values, causal: `self_attention`, which cuDNN
serves on GPUs), merged by LSE.
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
    # the tiles run in this many batched calls of consecutive tiles (sorted by how far they see, so each
    # call walks about its own tiles' span, not the group's longest)
    bands: int = dataclasses.field(default=1, metadata=dict(static=True))


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
        return cls(tuple(TileGroup(i32(w, t), i32(w), b) for w, t, b in shapes), i32(n), i32(n))


LONG_TILE = 256  # chunk rows of at least this many tokens are cut into tiles this long


def group_shapes(n: int, rows: int, tile: int, decode_width: int = 1, bands: int = 4,
                 long_tile: int = LONG_TILE) -> tuple[tuple[int, int, int], ...]:
    """The static (W, T, bands) of the tile groups of a batch of n tokens in at most `rows` rows.

    decode: every row of at most decode_width tokens is one tile (W = min(rows, n), one band);
    short chunks: rows of more tokens and fewer than `long_tile` (at most min(rows, n // (decode_width
        + 1)) of them, each with one partial tile at most): n / T + that many tiles of T = `tile` tokens
        (fewer in a small step, T >= 8, so partial tiles stay a small share), in up to `bands` bands;
    long chunks (n >= long_tile): rows of at least `long_tile` tokens, at most n // long_tile of them, in
        tiles of long_tile tokens, a band per n / long_tile tiles (about one per tile that can be real):
        a long row's KV is read once per long_tile queries, not once per `tile`, which is what a long
        context costs, and each tile walks about its own causal span.
    """
    out = [(max(1, min(rows, n)), decode_width, 1)]
    t = max(min(tile, n // 16), min(8, tile))
    w = max(1, min(math.ceil(n / t) + min(rows, n // (decode_width + 1)), n))
    out.append((w, t, max(1, min(bands, w, n // 64))))
    if n >= long_tile > t:
        w = math.ceil(n / long_tile) + min(rows, n // long_tile)
        out.append((w, long_tile, min(math.ceil(n / long_tile), w)))
    return tuple(out)


def band_bounds(w: int, bands: int) -> list[int]:
    """Where the `bands` consecutive bands of w tiles start (and the last ends)."""
    return [w * i // bands for i in range(bands + 1)]


def plan(starts, lens, rows, num_tokens: int, shapes, positions=None) -> RaggedTiles:
    """Host-side tiles (NumPy) for rows laid end to end in a flat batch of `num_tokens` (padding after the
    last row is never read back). starts/lens/rows [R]: each row's first flat token, its token count
    (0: the row runs nothing) and its block-table row; positions [R] (optional): each row's first position,
    by which the tiles of a group are sorted (how far their last token sees). shapes: `group_shapes`'.
    A row of at most T_0 tokens is a decode tile; a longer one is cut into tiles of the widest group
    whose T it reaches. Unused tiles come first and read no token (index -1: position -1, they see
    nothing), so the first band holds them and walks next to nothing. Raises ValueError if a group
    overflows (the caller sized N or the groups wrongly)."""
    positions = np.zeros(len(starts), np.int64) if positions is None else positions
    chosen = [[] for _ in shapes]  # per group: (extent, flat index [T], row)
    td = shapes[0][1]
    for s, n, r, p in zip(starts, lens, rows, positions):
        s, n, r, p = int(s), int(n), int(r), int(p)
        if n <= 0:
            continue
        if n <= td:
            chosen[0].append((p + n - 1, s + np.minimum(np.arange(td), n - 1), r))
            continue
        g = max(i for i, (_, t, _) in enumerate(shapes) if i == 1 or n >= t)
        t = shapes[g][1]
        for j in range(0, n, t):
            m = min(t, n - j)
            chosen[g].append((p + j + m - 1, s + j + np.minimum(np.arange(t), m - 1), r))
    for tiles, (w, t, _) in zip(chosen, shapes):
        if len(tiles) > w:
            raise ValueError(f"{len(tiles)} tiles of {t} tokens do not fit their group of {w}")
    where, token_row = np.zeros(num_tokens, np.int32), np.zeros(num_tokens, np.int32)
    for s, n, r in zip(starts, lens, rows):
        token_row[int(s):int(s) + max(int(n), 0)] = int(r)
    groups, base = [], 0
    for tiles, (w, t, b) in zip(chosen, shapes):
        index = np.full((w, t), -1, np.int32)  # unused tiles first: they read no token
        rowv = np.zeros(w, np.int32)
        if tiles:
            tiles = sorted(tiles, key=lambda x: x[0])
            pad = w - len(tiles)
            index[pad:] = [x[1] for x in tiles]
            rowv[pad:] = [x[2] for x in tiles]
            # each token's output: the first entry that holds it (entries past a row's end repeat its last)
            tokens, first = np.unique(index[pad:].reshape(-1), return_index=True)
            where[tokens] = base + pad * t + first
        groups.append(TileGroup(index, rowv, b))
        base += w * t
    return RaggedTiles(tuple(groups), where, token_row)


def attention(attend, q, q_pos, kv_len, block_table, tiles: RaggedTiles, split: bool = False):
    """Attention of a ragged batch through a batched implementation.

    attend(q [W,T,H,Dk], q_pos [W,T], kv_len [W], block_table [W,NB]) -> (o [W,T,H,Dv], lse [W,T,H]):
    the batched primitive with the KV, its positions and the options bound. q [N, H, Dk], q_pos [N];
    kv_len [R] and block_table [R, NB] per row. Returns (o [N, H, Dv], lse [N, H] float32). Each
    group runs as `bands` batched calls over consecutive tiles: the decode group is one launch of the
    decode configuration, the prefill groups their own.
    split: the prefill tiles read only the slots before their first token (every query of a tile
    sees the same slots, and a tile with no cached prefix reads nothing); `self_attention` gives the
    rest (the tile's diagonal block), to be merged by LSE.
    """
    outs, lses = [], []
    for gi, g in enumerate(tiles.groups):
        w, t = g.index.shape
        bounds = band_bounds(w, g.bands)
        for lo, hi in zip(bounds, bounds[1:]):
            idx, row = g.index[lo:hi], g.row[lo:hi]
            safe = jnp.maximum(idx, 0)
            pos = q_pos[safe]
            if split and gi > 0:  # (a prefill tile's first entry is its first token)
                pos = jnp.broadcast_to(pos[:, :1] - 1, pos.shape)
            o, lse = attend(q[safe], jnp.where(idx >= 0, pos, -1), kv_len[row], block_table[row])
            outs.append(o.reshape((hi - lo) * t, *o.shape[2:]))
            lses.append(lse.reshape((hi - lo) * t, lse.shape[-1]))
    return _gather(outs, lses, tiles.where)


def tile_lengths(index):
    """Tokens of each tile [W] from its entries [W, T]: the first entries are its tokens, the rest
    repeat its last (0 for an unused tile)."""
    steps = jnp.sum(index[:, 1:] != index[:, :-1], axis=1)
    return jnp.where(index[:, 0] >= 0, 1 + steps, 0).astype(jnp.int32)


def self_attention(attend_self, q, k_new, v_new, tiles: RaggedTiles):
    """The diagonal blocks of the prefill tiles: each tile's queries over its own tokens' keys and
    values, causal within the tile (the part `attention(split=True)` leaves out).

    attend_self(q [W,T,H,Dk], k [W,T,K,Dk], v [W,T,K,Dv] or None, lengths [W])
        -> (o [W,T,H,Dv], lse [W,T,H]);
    q [N, H, Dk], k_new [N, K, Dk], v_new [N, K, Dv] or None (values shared with the keys).
    Returns (o [N, H, Dv], lse [N, H]); the decode group's tokens get o = 0, lse = -inf (their whole
    attention is `attention`'s). One call per prefill group.
    """
    outs, lses, done = [], [], {}
    for gi, g in enumerate(tiles.groups[1:], start=1):
        safe = jnp.maximum(g.index, 0)
        done[gi] = attend_self(q[safe], k_new[safe], None if v_new is None else v_new[safe],
                               tile_lengths(g.index))
    ref_o, _ = done[1]
    for gi, g in enumerate(tiles.groups):
        w, t = g.index.shape
        if gi == 0:
            o = jnp.zeros((w * t, *ref_o.shape[2:]), ref_o.dtype)
            lse = jnp.full((w * t, ref_o.shape[2]), -jnp.inf, jnp.float32)
        else:
            o, lse = done[gi]
            o, lse = o.reshape(w * t, *o.shape[2:]), lse.reshape(w * t, lse.shape[-1])
        outs.append(o)
        lses.append(lse)
    return _gather(outs, lses, tiles.where)


def _gather(outs, lses, where):
    """Each token's output from the groups' outputs laid end to end."""
    o = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=0) if len(lses) > 1 else lses[0]
    return o[where], lse[where]
