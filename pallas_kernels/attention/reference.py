"""Pure-jnp attention of a query block over one KV slice: the oracle and the CPU path.

The slice is walked in blocks of `block_k` slots with an online softmax (float32), so temporaries are
block-sized and do not grow with the cache; the loop stops after the last block holding a slot that
any query may see (slot positions increase along a slice), so a step costs what the filled part of
the cache costs, not its capacity. With one block this is plain dense softmax attention.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.attention.common import row_limits


def _block_size(s: int, block_k: int) -> int:
    """The largest divisor of s that is <= block_k (so blocks never read past the slice), or s."""
    if s <= block_k:
        return s
    best = max(d for d in range(1, block_k + 1) if s % d == 0)
    return best if best >= min(64, block_k) else s


def attention(q, k, v, q_pos, kv_pos, kv_len, *, scale: float, block_k: int = 512, v_dim: int | None = None):
    """q [B,T,H,Dk], k [B,K,S,Dk], v [B,K,S,Dv] -> (o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32).

    kv_pos: the slice's SlotPositions. GQA groups query heads per kv head; no repeated KV is materialised.
    v None: the values are k[..., :v_dim] (read from each key block, never copied whole).
    """
    b, t, h, dk = q.shape
    kh, s = k.shape[1], k.shape[2]
    dv = v_dim if v is None else v.shape[-1]
    g = h // kh
    out_dtype = q.dtype
    bs = _block_size(s, block_k)
    # XLA:CPU has no bf16 x bf16 -> f32 dot; compute in float32 (a no-op for float32 inputs).
    qg = q.astype(jnp.float32).reshape(b, t, kh, g, dk)
    limit = row_limits(q_pos, kv_len)  # [B, T]
    # Blocks to visit: up to the last slot that the most advanced query may see.
    visible = jnp.minimum(kv_pos.count_upto(jnp.max(limit)), s)
    num_blocks = (visible + bs - 1) // bs

    def step(i, carry):
        m, l, acc = carry  # [B, K, G, T], [B, K, G, T], [B, K, G, T, Dv]
        kb = lax.dynamic_slice_in_dim(k, i * bs, bs, axis=2).astype(jnp.float32)
        vb = kb[..., :dv] if v is None else lax.dynamic_slice_in_dim(v, i * bs, bs, axis=2).astype(jnp.float32)
        pos = kv_pos.at(i * bs + jnp.arange(bs, dtype=jnp.int32))
        sc = jnp.einsum("btkgd,bksd->bkgts", qg, kb) * scale
        mask = pos[None, None, :] <= limit[:, :, None]  # [B, T, bs]
        sc = jnp.where(mask[:, None, None], sc, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(sc - m_safe[..., None])
        acc = acc * alpha[..., None] + jnp.einsum("bkgts,bksd->bkgtd", p, vb)
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc

    init = (
        jnp.full((b, kh, g, t), -jnp.inf, jnp.float32),
        jnp.zeros((b, kh, g, t), jnp.float32),
        jnp.zeros((b, kh, g, t, dv), jnp.float32),
    )
    # Block 0 is peeled: the loop carry then derives from the inputs (and, inside shard_map, varies over
    # the same mesh axes as they do); a block that sees nothing leaves the running state unchanged.
    m, l, acc = step(0, init)
    if bs < s:  # (one block needs no loop, which keeps the single-block form reverse-differentiable)
        m, l, acc = lax.fori_loop(1, num_blocks, step, (m, l, acc))
    has = l > 0
    safe_l = jnp.where(has, l, 1.0)
    o = acc / safe_l[..., None]
    lse = jnp.where(has, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(safe_l), -jnp.inf)
    o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, h, dv)
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, h)
    return o.astype(out_dtype), lse

