"""Pallas GPU (Triton lowering) attention over one KV slice: flash decoding and query-tiled prefill.

Rows: the T query tokens × G query heads sharing a kv head are folded into R = T·G rows (token-major),
pre-scaled by scale·log2(e) so the softmax runs on `exp2`. The grid is (batch, kv head, query block,
KV split): one program takes `block_q` rows and walks its split of the slots they may see, `block_k`
slots at a time, with an online softmax in float32. Shared memory depends on the block sizes alone
(`configs.pick`), never on the chunk or the cache length.

The walk is cut in two: blocks below the smallest row limit of the query block (every row sees every
slot: in a prefill chunk, all of the cached prefix; in decode, all but the last block) run without a
mask; the rest, up to the largest limit, with it. A program's KV split is a share of the *visible*
blocks (computed in the kernel from the lengths), so a half-filled cache is split as evenly as a full
one, and a query block that sees nothing does nothing. Splits are merged by LSE (`merge_partials`,
the same exact merge as the cross-device combine).

Nothing cache-sized is copied: the kernel reads K and V where they lie. Head dims that are not a power
of two are loaded and multiplied in power-of-two pieces (576 = 512 + 64, 80 = 64 + 16), and the slice's
tail block is a masked load, so neither the head dim nor the sequence is ever padded. MLA's values are
the keys' first Dv features: the loaded key pieces are reused, nothing is loaded twice.
8-bit pages (`kv_quant`): a stored row is D value bytes and its float32 scale's 4 bytes; the kernel
loads the value pieces, widens them to the query dtype for the dot, loads the scale's bytes as four
one-byte columns and rebuilds it in registers, and applies it to the scores (K: s · scale per slot) and
to the probabilities (V: p · scale per slot), so nothing dequantized is ever written; fp8 widens
through float16 (Hopper has no direct e4m3 -> bfloat16 conversion; both steps are exact).
Slot positions are computed in registers from the slice's `SlotPositions` (no position array).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention import configs
from pallas_kernels.attention.common import SlotPositions, merge_partials, row_limits

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Tests set this to a function f(masked, batch, kv_head, q_block, split, start) to count the KV blocks
# each program visits in interpret mode (the claims "only the last block is masked" and "a step walks
# the filled part of the cache, not its capacity"). It is read when the kernel is traced: a kernel
# traced while it is None, as every compiled one is, carries nothing.
block_probe = None
# Likewise f(which, batch, kv_head, q_block, split, start, offset, width) for every K/V tile load
# ("k" or "v"): the claim "MLA reads each latent tile once per head block, for both products".
load_probe = None


def _kernel(start_ref, q_ref, lim_ref, *refs, block_k, precision, run, stride, num_slots, num_splits,
            k_pieces, v_pieces, shared_v, page_size, layered, kv_quant=None, k_width=0, v_width=0):
    # start_ref []; q_ref [BQ, Dk] (pre-scaled, log2 domain); lim_ref [BQ]; table_ref [NB] (paged only);
    # k_ref [S, Dk] or, paged, [P, page, Dk]; v_ref likewise with Dv (absent when the values are k's
    # first Dv columns); o_ref [BQ, Dv]; lse_ref [BQ]
    refs = list(refs)
    layer_ref = refs.pop(0) if layered else None  # [] (stacked caches: k_ref/v_ref lead with layers)
    table_ref = refs.pop(0) if page_size else None
    k_ref = refs.pop(0)
    v_ref = None if shared_v else refs.pop(0)
    o_ref, lse_ref = refs
    positions = SlotPositions(start_ref[()], run, stride)
    lim = lim_ref[...]
    qs = [q_ref[:, pl.ds(off, w)] for off, w in k_pieces]
    # Slots [0, seen_by_all) are seen by every row, [0, visible) by some row.
    visible = jnp.minimum(positions.count_upto(jnp.max(lim)), num_slots)
    seen_by_all = jnp.minimum(positions.count_upto(jnp.min(lim)), num_slots)
    per_split = pl.cdiv(pl.cdiv(visible, block_k), num_splits) * block_k
    first = pl.program_id(3) * per_split
    end = jnp.minimum(first + per_split, visible)
    num_unmasked = jnp.maximum(jnp.minimum(seen_by_all, end) - first, 0) // block_k
    num_blocks = pl.cdiv(jnp.maximum(end - first, 0), block_k)

    lead = (layer_ref[()],) if layered else ()
    probe, loads = block_probe, load_probe
    program = [pl.program_id(a) for a in range(4)] if probe or loads else None

    def load(ref, start, off, w, masked):
        if loads is not None and w > 1:  # (not the scale's byte columns)
            jax.debug.callback(loads, "v" if ref is v_ref else "k", *program, start, off, w)
        if page_size:  # a block lies inside one page (page_size % block_k == 0); slots never pass the table
            return ref[(*lead, table_ref[start // page_size], pl.ds(start % page_size, block_k), pl.ds(off, w))]
        idx = (*lead, pl.ds(start, block_k), pl.ds(off, w))
        if not masked:
            return ref[idx]
        inside = start + lax.broadcasted_iota(jnp.int32, (block_k, w), 0) < num_slots  # the slice's tail
        return plgpu.load(ref.at[idx], mask=inside, other=0)

    def widen(x):  # 8-bit values -> the queries' dtype, exactly (int8; e4m3's 4 significant bits)
        if kv_quant == "fp8":  # through float16: Hopper converts e4m3 to f16 in one instruction
            x = lax.bitcast_convert_type(x, jnp.float8_e4m3fn).astype(jnp.float16)
        return x.astype(qs[0].dtype)

    def row_scale(ref, start, width, masked):  # the slots' scales [1, block_k] float32, from 4 byte columns
        word = functools.reduce(jnp.bitwise_or, [
            (load(ref, start, width + j, 1, masked).astype(jnp.int32) & 0xFF) << (8 * j) for j in range(4)])
        return lax.bitcast_convert_type(word, jnp.float32).T

    def step(i, carry, masked):
        m, l, accs = carry
        start = first + i * block_k
        if probe is not None:
            jax.debug.callback(probe, masked, *program, start)
        ks = [load(k_ref, start, off, w, masked) for off, w in k_pieces]
        if kv_quant is not None:
            ks = [widen(k) for k in ks]
        s = functools.reduce(jnp.add, [
            plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32) for q, k in zip(qs, ks)])
        if kv_quant is not None:
            k_scale = row_scale(k_ref, start, k_width, masked)
            s = s * k_scale
        if masked:
            slots = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            seen = (positions.at(slots)[None, :] <= lim[:, None]) & (slots[None, :] < num_slots)
            s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new  # unmasked: all finite
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        pv = p  # what multiplies the values (8-bit: times each slot's value scale)
        if shared_v:  # MLA: the values are the keys' first Dv features; reuse the loaded pieces
            loaded = dict(zip(k_pieces, ks))
            vs = [loaded[pc] if pc in loaded else load(k_ref, start, *pc, masked) for pc in v_pieces]
            if kv_quant is not None:
                vs = [v if pc in loaded else widen(v) for pc, v in zip(v_pieces, vs)]
                pv = p * k_scale
        else:
            vs = [load(v_ref, start, off, w, masked) for off, w in v_pieces]
            if kv_quant is not None:
                vs = [widen(v) for v in vs]
                pv = p * row_scale(v_ref, start, v_width, masked)
        accs = [acc * alpha[:, None] + plgpu.dot(pv.astype(v.dtype), v, precision=precision).astype(jnp.float32)
                for acc, v in zip(accs, vs)]
        return m_new, l * alpha + jnp.sum(p, axis=1), accs

    rows = lim.shape[0]
    carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
             [jnp.zeros((rows, w), jnp.float32) for _, w in v_pieces])
    if block_k <= num_slots:  # (else no block is whole; the interpreter could not even trace one)
        carry = lax.fori_loop(0, num_unmasked, functools.partial(step, masked=False), carry)
    else:
        num_unmasked = 0
    m, l, accs = lax.fori_loop(num_unmasked, num_blocks, functools.partial(step, masked=True), carry)
    has = l > 0
    safe_l = jnp.where(has, l, 1.0)
    for (off, w), acc in zip(v_pieces, accs):
        o_ref[:, pl.ds(off, w)] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (jnp.where(m == -jnp.inf, 0.0, m) + jnp.log2(safe_l)) * LN2, -jnp.inf)


def attention(
    q, k, v, q_pos, kv_pos, kv_len, *, scale: float, block_q: int | None = None, block_k: int | None = None,
    num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    interpret: bool = False, v_dim: int | None = None, block_table=None, layer=None, kv_quant: str | None = None,
):
    """Same contract as `reference.attention`: (o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32).

    Block sizes, warps and stages default to `configs.pick`'s; `num_splits` to `configs.num_splits`.
    block_table [B, NB] (paged): k/v are page pools [P, K, page, D]; the kernel reads each block's page
    number from the table (a ref: the GPU lowering has no scalar prefetch). The KV block divides the page.
    layer (scalar, may be traced): k/v lead with a layer axis; the kernel reads layer `layer` in place
    (its index is a ref too), so scanned layers' stacked caches are never sliced.
    kv_quant ("int8" / "fp8"): k/v hold packed 8-bit rows (`kv_quant.pack`: D values + 4 scale bytes).
    """
    b, t, h, dk = q.shape
    layered = layer is not None
    kshape = k.shape[1:] if layered else k.shape
    kh = kshape[1]
    page_size = 0 if block_table is None else kshape[2]
    s = kshape[2] if block_table is None else block_table.shape[1] * page_size
    shared_v = v is None
    extra = 0 if kv_quant is None else 4  # (a stored 8-bit row ends with its scale's bytes)
    k_width = kshape[-1] - extra  # the keys' features; a row is stored k_width (+ 4) wide
    dv = v_dim if shared_v else v.shape[-1] - extra
    g = h // kh
    rows = t * g
    k_pieces, v_pieces = configs.head_pieces(dk), configs.head_pieces(dv)
    if not interpret and min(w for _, w in k_pieces + v_pieces) < configs.MIN_BLOCK:
        raise ValueError(f"the Pallas GPU kernel needs head dims that are multiples of {configs.MIN_BLOCK} "
                         f"(got {dk} and {dv}); use impl='reference'")
    _, cfg = configs.pick(rows, dk, dv, q.dtype.itemsize, shared_v)
    bq = configs.pow2(block_q, configs.MIN_BLOCK) if block_q else cfg.block_q
    bk = configs.pow2(block_k, configs.MIN_BLOCK) if block_k else cfg.block_k
    if page_size:
        bk = configs.page_block(bk, page_size, minimum=1 if interpret else configs.MIN_BLOCK)
    q_blocks = math.ceil(rows / bq)
    rows_pad = q_blocks * bq
    cfg = configs.KernelConfig(bq, bk, num_warps or cfg.num_warps, num_stages or cfg.num_stages)
    ctas = configs.ctas_per_sm(cfg, dk, dv, q.dtype.itemsize, shared_v)
    splits = num_splits or configs.num_splits(b * kh * q_blocks, math.ceil(s / bk), ctas=ctas)
    splits = max(1, min(splits, math.ceil(s / bk)))

    # Query rows of one kv head, (token, head-in-group), pre-scaled for exp2. Only q and the limits are
    # padded (small: T·G rows); padded rows repeat the last row's limit, so they neither narrow the
    # unmasked range nor widen the walk, and are dropped at the end.
    qg = (q.astype(jnp.float32) * (scale * LOG2E)).astype(q.dtype)
    qg = qg.reshape(b, t, kh, g, dk).transpose(0, 2, 1, 3, 4).reshape(b, kh, rows, dk)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
    lim = jnp.repeat(row_limits(q_pos, kv_len), g, axis=1)  # [B, T·G]
    lim = jnp.pad(lim, ((0, 0), (0, rows_pad - rows)), mode="edge")
    start = jnp.asarray(kv_pos.start, jnp.int32)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel, block_k=bk, precision=precision, run=kv_pos.run, stride=kv_pos.stride, num_slots=s,
        num_splits=splits, k_pieces=k_pieces, v_pieces=v_pieces, shared_v=shared_v, page_size=page_size,
        layered=layered, kv_quant=kv_quant, k_width=k_width, v_width=dv)
    lead = (k.shape[0],) if layered else ()  # every layer: the kernel indexes its own
    if page_size:  # the whole pool of this kv head; and the sequence's row of the block table
        whole_slice = lambda d: pl.BlockSpec((*lead, kshape[0], None, page_size, d),  # noqa: E731
                                             lambda i, j, r, c: (*(0,) * len(lead), 0, j, 0, 0))
        table = [pl.BlockSpec((None, block_table.shape[1]), lambda i, j, r, c: (i, 0))]
    else:
        whole_slice = lambda d: pl.BlockSpec((*lead, None, None, s, d),  # noqa: E731
                                             lambda i, j, r, c: (*(0,) * len(lead), i, j, 0, 0))
        table = []
    layers = [pl.BlockSpec((), lambda i, j, r, c: ())] if layered else []
    out_dtype = q.dtype if splits == 1 else jnp.float32  # one split needs no merge: write the result
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kh, q_blocks, splits),
        in_specs=[
            pl.BlockSpec((), lambda i, j, r, c: ()),
            pl.BlockSpec((None, None, bq, dk), lambda i, j, r, c: (i, j, r, 0)),
            pl.BlockSpec((None, bq), lambda i, j, r, c: (i, r)),
            *layers,
            *table,
            whole_slice(kshape[-1]),
            *([] if shared_v else [whole_slice(v.shape[-1])]),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, bq, dv), lambda i, j, r, c: (i, j, c, r, 0)),
            pl.BlockSpec((None, None, None, bq), lambda i, j, r, c: (i, j, c, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, splits, rows_pad, dv), out_dtype),
            jax.ShapeDtypeStruct((b, kh, splits, rows_pad), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="dcp_flash_attention",
    )(start, qg, lim, *([jnp.asarray(layer, jnp.int32)] if layered else []),
      *([] if block_table is None else [block_table.astype(jnp.int32)]), k,
      *([] if shared_v else [v]))

    if splits == 1:
        o, lse = o[:, :, 0], lse[:, :, 0]
    else:
        o, lse = merge_partials(o, lse, axis=2)  # [B, K, R_pad, Dv], [B, K, R_pad]
    o = o[:, :, :rows].reshape(b, kh, t, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, h, dv)
    lse = lse[:, :, :rows].reshape(b, kh, t, g).transpose(0, 2, 1, 3).reshape(b, t, h)
    return o.astype(q.dtype), lse
