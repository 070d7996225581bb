"""Pieces every attention implementation shares: input checks, the mask limit, and LSE merging.

The LSE merge here is the one place that turns partial (output, LSE) pairs into weights; the kernel's
split-K combine and the cross-device DCP combine both call it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def check_inputs(q, k, v, q_pos, kv_pos, kv_len) -> None:
    """Shape checks (static, so they work under jit). Raises ValueError naming the problem.

    q [B, T, H, Dk], k [B, K, S, Dk], v [B, K, S, Dv], q_pos [B, T], kv_pos [S], kv_len [B].
    kv_pos may be None where the caller derives it (the DCP island).
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"expected q [B,T,H,Dk], k [B,K,S,Dk], v [B,K,S,Dv]; got ranks {q.ndim}, {k.ndim}, {v.ndim}"
        )
    b, t, h, dk = q.shape
    bk, kh, s, dk2 = k.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {k.shape} and v {v.shape} disagree on [B, K, S]")
    if bk != b:
        raise ValueError(f"batch mismatch: q has {b}, k/v have {bk}")
    if dk2 != dk:
        raise ValueError(f"key head dim mismatch: q has {dk}, k has {dk2}")
    if kh == 0 or h % kh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kh})")
    if q_pos.shape != (b, t):
        raise ValueError(f"q_pos must be [B, T] = {(b, t)}, got {q_pos.shape}")
    if kv_pos is not None and kv_pos.shape != (s,):
        raise ValueError(f"kv_pos must be [S] = {(s,)}, got {kv_pos.shape}")
    if kv_len.shape != (b,):
        raise ValueError(f"kv_len must be [B] = {(b,)}, got {kv_len.shape}")
    for name, x in (("q_pos", q_pos), ("kv_pos", kv_pos), ("kv_len", kv_len)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {x.dtype}")


def row_limits(q_pos, kv_len):
    """The largest slot position each query may see: min(q_pos, kv_len - 1), int32 [B, T].

    The mask `slot_pos <= q_pos and slot_pos < kv_len` is `slot_pos <= limit`; a limit of -1 masks all.
    """
    return jnp.minimum(q_pos, kv_len[:, None] - 1).astype(jnp.int32)


def merge_weights(lse_parts, axis: int = 0):
    """Exact LSE merge: (lse, w) with lse = logsumexp(lse_parts) and w = exp(lse_parts - lse).

    Parts whose LSE is -inf (no valid token) get weight exactly 0; when every part is -inf the merged
    LSE is -inf and all weights are 0, so no NaN can escape.
    """
    lse_parts = lse_parts.astype(jnp.float32)
    m = jnp.max(lse_parts, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(lse_parts - m), axis=axis, keepdims=True)
    lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    w = jnp.exp(lse_parts - jnp.where(jnp.isfinite(lse), lse, 0.0))
    w = jnp.where(jnp.isfinite(lse), w, 0.0)
    return jnp.squeeze(lse, axis), w


def merge_partials(o_parts, lse_parts, axis: int = 0):
    """Merge partial outputs o_parts [..., Dv] (LSE lse_parts [...]) along `axis`, in float32."""
    lse, w = merge_weights(lse_parts, axis)
    o = jnp.sum(o_parts.astype(jnp.float32) * w[..., None], axis=axis)
    return o, lse


def default_scale(dk: int) -> float:
    return float(1.0 / np.sqrt(dk))
