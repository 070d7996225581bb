"""Pure-jnp attention of a query block over one KV slice: the oracle and the CPU path.

The slice is walked in blocks of `block_k` slots with an online softmax (float32), so temporaries are
block-sized and do not grow with the cache; the loop stops after the last block holding a slot that
any query may see (slot positions increase along a slice), so a step costs what the filled part of
the cache costs, not its capacity. With one block this is plain dense softmax attention.

Layout for XLA:CPU: the queries of the G heads sharing a kv head are folded into the rows of one
matrix [B, K, G·T, Dk] (transposed and scaled once, outside the loop), so each block is two plain
batched GEMMs whose outputs need no transpose. Blocks every query sees whole (below the smallest row
limit: in a prefill chunk, all blocks before its diagonal) run in `block_k` slots through a loop body
without the mask; the rest, up to the last visible slot, in `block_k_masked` slots with it (smaller:
on a dcp shard a chunk's new slots fill only part of a block). A masked block that would read past
the slice is shifted back to end at its end, and the slots it shares with earlier blocks are masked
out, so any block size works. A slice that one `block_k` block would cover whole is walked in
blocks of at most `block_k_masked` slots (tiling it exactly when blocks of at least half that size can),
since one whole-slice block would make every query read all of it; only `block_k_masked >= S` gives the
single dense block.

Decode rows over a paged cache (T <= PAGE_WALK_TOKENS queries per row: the decode loop, a verify step, a
ragged step's decode tiles) walk pages instead: the pages every row may see are laid end to end, row by
row, and taken `pages_per_step` at a time, each page against its own row's queries, with a partial
softmax per page merged into its row's running one. A step of rows of unequal lengths then reads what
each row sees, not the longest row's span times the rows (the block walk reads every row up to the
batch's furthest slot, and gathers a block of every row at once).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention import kv_quant as kvq
from pallas_kernels.attention.common import row_limits

# The oracle computes in float32 on every backend: XLA's GPU dots would otherwise run float32 as TF32
# (rel. error ~4e-4); XLA:CPU's float32 dots are float32 either way.
HIGHEST = lax.Precision.HIGHEST

# Tests set this to a function f(masked, slots, start) to count the blocks a call visits (as
# `triton.block_probe`; the page walk reports each page it reads as a masked block of one page); read at
# trace time, so a program traced while it is None carries nothing.
block_probe = None

PAGE_WALK_TOKENS = 8  # query tokens per row up to which a paged call walks pages (decode and verify rows)


def attention(q, k, v, q_pos, kv_pos, kv_len, *, scale: float, block_k: int = 512, block_k_masked: int = 128,
              pages_per_step: int = 32, v_dim: int | None = None, block_table=None, layer=None,
              kv_quant: str | None = None):
    """q [B,T,H,Dk], k [B,K,S,Dk], v [B,K,S,Dv] -> (o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32).

    kv_pos: the slice's SlotPositions. GQA groups query heads per kv head; no repeated KV is materialised.
    v None: the values are k[..., :v_dim] (read from each key block, never copied whole).
    block_table [B, NB] (paged): k [P, K, page, Dk] and v [P, K, page, Dv] are page pools, and sequence
    b's slot j lives in page block_table[b, j // page] at j % page (S = NB·page slots). Blocks are then
    whole pages, gathered one block at a time: nothing sequence-sized is assembled.
    layer (a scalar, may be traced): k and v carry a leading layer axis (the stacked caches of scanned
    layers) and layer `layer` is read, block by block, without slicing it out first.
    kv_quant ("int8" / "fp8"): k and v hold packed 8-bit rows (`kv_quant.pack`, D + 4 stored features),
    dequantized block by block as they are read (no dequantized copy of the cache).
    pages_per_step: pages one step of the page walk reads (paged calls of at most PAGE_WALK_TOKENS query
    tokens per row; 0: the block walk, with block_k and block_k_masked, whatever T).
    """
    b, t, h, dk = q.shape
    lead = () if layer is None else (layer,)
    kshape = k.shape[len(lead):]
    kh = kshape[1]
    if block_table is None:
        s, unit = kshape[2], 1
    else:
        unit = kshape[2]  # blocks are whole pages
        s = block_table.shape[1] * unit
    dv = v_dim if v is None else v.shape[-1] - (0 if kv_quant is None else kvq.SCALE_BYTES)
    widen = (lambda x: x.astype(jnp.float32)) if kv_quant is None else (lambda x: kvq.unpack(x, kv_quant))
    g = h // kh
    rows = g * t
    out_dtype = q.dtype
    # XLA:CPU has no bf16 x bf16 -> f32 dot; compute in float32 (a no-op for float32 inputs).
    qg = (q.astype(jnp.float32) * scale).reshape(b, t, kh, g, dk)
    qg = jnp.transpose(qg, (0, 2, 3, 1, 4)).reshape(b, kh, rows, dk)  # row r = (group r // T, query r % T)
    limit = row_limits(q_pos, kv_len)  # [B, T]
    # The loop carry starts as a zero that derives from every input, so that inside shard_map it varies
    # over the same mesh axes as the blocks folded into it (a constant would not); nothing of the inputs
    # is read beyond one element each. A block that sees nothing leaves the running state unchanged.
    inputs = [jnp.asarray(x) for x in (qg, k, v, limit, block_table, layer, kv_pos.at(0)) if x is not None]
    zero = jnp.where(False, sum(x[(0,) * x.ndim].astype(jnp.float32) for x in inputs), 0.0)
    init = (
        jnp.full((b, kh, rows), -jnp.inf, jnp.float32) + zero,
        jnp.zeros((b, kh, rows), jnp.float32) + zero,
        jnp.zeros((b, kh, rows, dv), jnp.float32) + zero,
    )
    def kv(read):  # (keys, values) of one block, widened, read by `read(pool)`; MLA's values are the keys'
        kb = widen(read(k))
        return kb, (kb[..., :dv] if v is None else widen(read(v)))

    if block_table is not None and t <= PAGE_WALK_TOKENS and pages_per_step > 0:
        def pages(ids):  # pages ids [C]: keys and values [C, K, page, D]
            return kv(lambda x: x[(*lead, ids)])

        carry = _walk_pages(pages, qg, limit, kv_pos, block_table, unit, init, t, min(pages_per_step, b * s // unit))
        return _finish(*carry, b, t, h, kh, g, dv, out_dtype)
    bs = min(max(block_k // unit, 1) * unit, s)
    # blocks that need the mask: few, often only partly visible, so smaller
    bm = min(max(block_k_masked // unit, 1) * unit, bs)
    if bs == s > bm:  # one unmasked block would be the whole slice, read whole by queries that see a little:
        # walk it in masked blocks, tiling it when blocks of at least half the size can (no overlapping last one)
        tiling = max(n for n in range(unit, bm + 1, unit) if s % n == 0)
        bm = bs = tiling if 2 * tiling >= bm else bm
    # Blocks to visit: up to the last slot that the most advanced query may see; blocks wholly below the
    # first slot that some query may not see need no mask.
    visible = jnp.minimum(kv_pos.count_upto(jnp.max(limit)), s)
    seen_by_all = jnp.minimum(kv_pos.count_upto(jnp.min(limit)), s)
    # blocks of bs slots from slot 0: inside the slice, never shifted (none when one masked block is all)
    num_unmasked = seen_by_all // bs if bm < s else 0
    unmasked_end = num_unmasked * bs  # then blocks of bm slots from there up to the last visible slot
    num_masked = jnp.maximum(visible - unmasked_end + bm - 1, 0) // bm

    def read(x, start, n):  # slots [start, start + n) of every sequence: [B, K, n, D]
        d = x.shape[-1]
        if block_table is None:
            starts = (*lead, 0, 0, start, 0)
            return lax.dynamic_slice(x, starts, (1,) * len(lead) + (b, kh, n, d)).reshape(b, kh, n, d)
        pages = lax.dynamic_slice_in_dim(block_table, start // unit, n // unit, axis=1)  # [B, n / page]
        return jnp.moveaxis(x[(*lead, pages)], 2, 1).reshape(b, kh, n, d)

    def block(start, n, masked):
        if block_probe is not None:
            jax.debug.callback(functools.partial(block_probe, masked, n), start)
        kb, vb = kv(lambda x: read(x, start, n))
        # (XLA:CPU writes the ones in the copy that lays the gathered value block out: no pass
        # of its own)
        ones = jnp.ones((*vb.shape[:-1], 1), vb.dtype)
        sc = jnp.einsum("bkrd,bksd->bkrs", qg, kb, precision=HIGHEST)
        return sc, jnp.concatenate([vb, ones], -1)

    def update(carry, sc, vb1, m_safe_fn):
        # vb1: the block's values and a column of ones, so the P·V product also sums P (the softmax
        # denominator) instead of a pass of its own over the scores
        m, l, acc = carry  # [B, K, R], [B, K, R], [B, K, R, Dv]
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        m_safe = m_safe_fn(m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(sc - m_safe[..., None])
        pv = jnp.einsum("bkrs,bksd->bkrd", p, vb1, precision=HIGHEST)
        return m_new, l * alpha + pv[..., dv], acc * alpha[..., None] + pv[..., :dv]

    def masked_step(j, carry):
        first = unmasked_end + j * bm
        start = jnp.minimum(first, s - bm)  # the last block ends at the slice's end
        sc, vb = block(start, bm, True)
        slot = start + jnp.arange(bm, dtype=jnp.int32)
        pos = kv_pos.at(slot)
        mask = (pos[None, None, :] <= limit[:, :, None]) & (slot >= first)  # [B, T, bm]
        sc = jnp.where(mask[:, None, None], sc.reshape(b, kh, g, t, bm), -jnp.inf).reshape(b, kh, rows, bm)
        return update(carry, sc, vb, lambda m: jnp.where(jnp.isfinite(m), m, 0.0))

    def unmasked_step(i, carry):
        sc, vb = block(i * bs, bs, False)
        return update(carry, sc, vb, lambda m: m)  # every score is finite: so is the running max

    if bm < s:  # blocks up to the last visible slot only: a query block that sees nothing costs no block
        carry = lax.fori_loop(0, num_unmasked, unmasked_step, init)
        carry = lax.fori_loop(0, num_masked, masked_step, carry)
    else:  # one block, no loop: the single-block form stays reverse-differentiable
        carry = masked_step(0, init)
    return _finish(*carry, b, t, h, kh, g, dv, out_dtype)


def _finish(m, l, acc, b, t, h, kh, g, dv, out_dtype):
    """The running softmax state [B, K, G·T(, Dv)] -> (o [B, T, H, Dv], lse [B, T, H])."""
    has = l > 0
    safe_l = jnp.where(has, l, 1.0)
    o = acc / safe_l[..., None]
    lse = jnp.where(has, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(safe_l), -jnp.inf)
    o = jnp.transpose(o.reshape(b, kh, g, t, dv), (0, 3, 1, 2, 4)).reshape(b, t, h, dv)
    lse = jnp.transpose(lse.reshape(b, kh, g, t), (0, 3, 1, 2)).reshape(b, t, h)
    return o.astype(out_dtype), lse


def _walk_pages(pages, qg, limit, kv_pos, block_table, unit: int, init, t: int, c: int):
    """The page walk (module docstring): each row's softmax state over the pages it may see.

    qg [B, K, R, Dk] (row r = (group r // T, query r % T)), limit [B, T], pages of `unit` slots;
    pages(ids [C]) -> (keys [C, K, unit, Dk], values [C, K, unit, Dv]); `c` pages per step. Row b's
    pages are its first ceil(visible_b / unit) block-table entries, laid end to end after those of the
    rows before it; a step reads c of them (past the last, the null page, masked out), each against its
    own row's queries, and merges each row's pages into that row's running (max, sum, output)."""
    b, kh, rows, _ = qg.shape
    g = rows // t
    nb = block_table.shape[1]
    visible = jnp.minimum(kv_pos.count_upto(jnp.max(limit, axis=1)), nb * unit)  # [B] slots row b may see
    count = (visible + unit - 1) // unit
    ends = jnp.cumsum(count)
    total = ends[-1]

    def step(i, carry):
        m, l, acc = carry
        f = i * c + jnp.arange(c, dtype=jnp.int32)  # the pages of this step, in the rows' order
        ok = f < total
        row = jnp.minimum(jnp.sum(ends[None] <= f[:, None], axis=1, dtype=jnp.int32), b - 1)  # rows ending by f
        j = jnp.where(ok, f - (ends - count)[row], 0)  # the page's index in its row
        if block_probe is not None:
            jax.debug.callback(lambda js, oks: [block_probe(True, unit, int(x) * unit) for x, o in zip(js, oks) if o],
                               j, ok)
        kb, vb = pages(jnp.where(ok, block_table[row, j], 0))
        sc = jnp.einsum("ckrd,cksd->ckrs", qg[row], kb, precision=HIGHEST)  # [C, K, R, unit]
        pos = kv_pos.at(j[:, None] * unit + jnp.arange(unit, dtype=jnp.int32))  # [C, unit]
        mask = (pos[:, None, :] <= limit[row][:, :, None]) & ok[:, None, None]  # [C, T, unit]
        sc = jnp.where(mask[:, None, None], sc.reshape(c, kh, g, t, unit), -jnp.inf).reshape(sc.shape)
        # each row's max over its pages in this step, then one rescale per row; one-hot sums add its pages only
        mine = row[:, None] == jnp.arange(b, dtype=jnp.int32)  # [C, B]
        m_new = jnp.maximum(m, jnp.max(jnp.where(mine[:, :, None, None], jnp.max(sc, axis=-1)[:, None], -jnp.inf),
                                       axis=0))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(sc - m_safe[row][..., None])  # masked slots: 0
        alpha = jnp.exp(m - m_safe)
        onehot = mine.astype(jnp.float32)
        l = l * alpha + jnp.einsum("cb,ckr->bkr", onehot, jnp.sum(p, axis=-1), precision=HIGHEST)
        pv = jnp.einsum("ckrs,cksd->ckrd", p, vb, precision=HIGHEST)
        acc = acc * alpha[..., None] + jnp.einsum("cb,ckrd->bkrd", onehot, pv, precision=HIGHEST)
        return m_new, l, acc

    return lax.fori_loop(0, (total + c - 1) // c, step, init)
