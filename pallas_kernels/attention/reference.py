"""Pure-jnp attention of a query block over one KV slice: the oracle and the CPU path."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.attention.common import row_limits


def attention(q, k, v, q_pos, kv_pos, kv_len, *, scale: float):
    """q [B,T,H,Dk], k [B,K,S,Dk], v [B,K,S,Dv] -> (o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32).

    GQA by grouping query heads (no repeated KV is materialised); softmax and LSE in float32.
    """
    b, t, h, dk = q.shape
    kh, dv = k.shape[1], v.shape[-1]
    g = h // kh
    out_dtype = q.dtype
    # XLA:CPU has no bf16 x bf16 -> f32 dot; compute in float32 (a no-op for float32 models).
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    qg = q.reshape(b, t, kh, g, dk)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, k) * scale
    mask = kv_pos[None, None, :] <= row_limits(q_pos, kv_len)[:, :, None]  # [B, T, S]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1)  # [B, K, G, T]
    o = jnp.einsum("bkgts,bksd->btkgd", p, v)
    safe = jnp.where(denom > 0, denom, 1.0)
    o = o / jnp.transpose(safe, (0, 3, 1, 2))[..., None]
    lse = jnp.where(denom > 0, m[..., 0] + jnp.log(safe), -jnp.inf)  # [B, K, G, T]
    lse = jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, h)
    return o.reshape(b, t, h, dv).astype(out_dtype), lse
