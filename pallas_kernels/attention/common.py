"""Pieces every attention implementation shares: input checks, the mask limit, and LSE merging.

The LSE merge here is the one place that turns partial (output, LSE) pairs into weights; the kernel's
split-K combine and the cross-device DCP combine both call it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotPositions:
    """Global positions held by the slots of a KV slice, as runs: slot j holds position

        (j // run) · stride + start + j % run

    i.e. runs of `run` consecutive positions, one run every `stride` positions, the first at `start`
    (0 <= start <= stride - run). A whole sequence on one device is run = stride = S, start = 0. Positions
    increase along the slice and are computed where they are needed (never stored per slot), so
    kernels read no position array and can count the visible slots without touching the cache.
    `start` may be traced (it depends on the device's rank); `run` and `stride` are static.
    """

    start: jax.Array | int
    run: int = dataclasses.field(metadata=dict(static=True))
    stride: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def dense(cls, s: int) -> "SlotPositions":
        """Slots 0..s-1 hold positions 0..s-1."""
        return cls(start=0, run=s, stride=s)

    def at(self, slots):
        """Positions of the given slot indices."""
        return (slots // self.run) * self.stride + self.start + slots % self.run

    def count_upto(self, limit):
        """How many slots hold a position <= limit (slots beyond the slice are the caller's to cap)."""
        x = jnp.maximum(limit + 1 - self.start, 0)
        return (x // self.stride) * self.run + jnp.minimum(x % self.stride, self.run)


def check_inputs(q, k, v, q_pos, kv_pos, kv_len, v_dim: int | None = None, block_table=None) -> None:
    """Shape checks (static, so they work under jit). Raises ValueError naming the problem.

    q [B, T, H, Dk], k [B, K, S, Dk], v [B, K, S, Dv], q_pos [B, T], kv_pos SlotPositions, kv_len [B].
    v may be None when the values are the first `v_dim` features of the keys (MLA's shared latent).
    kv_pos may be None where the caller derives it (the DCP island).
    Paged: block_table [B, NB] int, k [P, K, page, Dk] and v [P, K, page, Dv] are page pools.
    """
    if v is None:
        if not (isinstance(v_dim, int) and 1 <= v_dim <= k.shape[-1]):
            raise ValueError(f"v=None takes the values from the keys: v_dim must be in 1..{k.shape[-1]}, "
                             f"got {v_dim!r}")
        v = jax.ShapeDtypeStruct(k.shape[:3] + (v_dim,), k.dtype)
    elif v_dim is not None:
        raise ValueError("v_dim is only for v=None (values shared with the keys)")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"expected q [B,T,H,Dk], k [B,K,S,Dk], v [B,K,S,Dv]; got ranks {q.ndim}, {k.ndim}, {v.ndim}"
        )
    b, t, h, dk = q.shape
    bk, kh, s, dk2 = k.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {k.shape} and v {v.shape} disagree on [B, K, S]")
    if block_table is not None:
        if block_table.ndim != 2 or block_table.shape[0] != b:
            raise ValueError(f"block_table must be [B, blocks] with B = {b}, got {block_table.shape}")
        if not jnp.issubdtype(block_table.dtype, jnp.integer):
            raise ValueError(f"block_table must be an integer array, got {block_table.dtype}")
    elif bk != b:
        raise ValueError(f"batch mismatch: q has {b}, k/v have {bk}")
    if dk2 != dk:
        raise ValueError(f"key head dim mismatch: q has {dk}, k has {dk2}")
    if kh == 0 or h % kh:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kh})")
    if q_pos.shape != (b, t):
        raise ValueError(f"q_pos must be [B, T] = {(b, t)}, got {q_pos.shape}")
    if kv_pos is not None and not isinstance(kv_pos, SlotPositions):
        raise ValueError(f"kv_pos must be a SlotPositions, got {type(kv_pos).__name__}")
    if kv_len.shape != (b,):
        raise ValueError(f"kv_len must be [B] = {(b,)}, got {kv_len.shape}")
    for name, x in (("q_pos", q_pos), ("kv_len", kv_len)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
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
