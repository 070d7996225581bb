"""Pallas GPU (Triton lowering) flash-decoding kernel over one KV slice.

Layout: the grid is (batch, kv head, split). One program takes the R = T·G query rows that share a KV
head (all query tokens × the G query heads of that group, padded to a power of two ≥ 16 so `dot` can use
tensor cores), walks its split of the KV slice block by block with an online softmax in float32, and
writes a partial output and LSE. The splits are then merged by LSE (`common.merge_partials`), the same
exact merge the cross-device combine uses. GQA never repeats KV: the group's rows share each K/V block.

Slot positions are computed in registers from the slice's `SlotPositions` (no position array is read),
and each program visits only the blocks up to the last slot any of its rows may see, so a decode step
over a mostly empty cache reads only the filled part. Triton needs power-of-two block shapes, so head
dims are zero-padded by the wrapper (a no-op for 64/128-wide heads); slots past the slice are masked.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.common import SlotPositions, merge_partials, row_limits

# `dot` moved from `pl` (removed in JAX 0.12) to the Triton module; JAX 0.11.2 may have only the former.
_dot = getattr(plgpu, "dot", None) or pl.dot


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _kernel(start_ref, q_ref, k_ref, *refs, scale, block_k, precision, run, stride, num_slots, shared_v):
    # start_ref []; q_ref [R, Dk]; k_ref [L, Dk]; v_ref [L, Dv] (absent when the values are k's first Dv
    # columns); lim_ref [R]; o_ref [R, Dv]; lse_ref [R]
    v_ref, lim_ref, o_ref, lse_ref = (None, *refs) if shared_v else refs
    positions = SlotPositions(start_ref[()], run, stride)
    q = q_ref[...]
    lim = lim_ref[...]
    rows, dv = o_ref.shape
    split_len = k_ref.shape[0]
    first = pl.program_id(2) * split_len
    visible = jnp.minimum(positions.count_upto(jnp.max(lim)), num_slots)
    num_blocks = jnp.clip(pl.cdiv(visible - first, block_k), 0, split_len // block_k)

    def step(i, carry):
        m, l, acc = carry
        sl = pl.ds(i * block_k, block_k)
        slots = first + i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        pos = positions.at(slots)
        k = k_ref[sl, :]
        v = k_ref[sl, :dv] if shared_v else v_ref[sl, :]
        s = _dot(q, k, trans_b=True, precision=precision).astype(jnp.float32) * scale
        mask = (pos[None, :] <= lim[:, None]) & (slots[None, :] < num_slots)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        pv = _dot(p.astype(v.dtype), v, precision=precision).astype(jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, dv), jnp.float32),
    )
    m, l, acc = lax.fori_loop(0, num_blocks, step, init)
    has = l > 0
    safe_l = jnp.where(has, l, 1.0)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(safe_l), -jnp.inf)


def attention(
    q, k, v, q_pos, kv_pos, kv_len, *, scale: float, block_k: int = 64, num_splits: int | None = None,
    num_warps: int = 4, num_stages: int = 2, interpret: bool = False, v_dim: int | None = None,
):
    """Same contract as `reference.attention`: (o [B,T,H,Dv] in q.dtype, lse [B,T,H] float32)."""
    b, t, h, dk = q.shape
    kh, s = k.shape[1], k.shape[2]
    shared_v = v is None
    dv = v_dim if shared_v else v.shape[-1]
    g = h // kh
    rows = _pow2(t * g, 16)
    dk_p, dv_p = _pow2(dk, 16), _pow2(dv, 16)
    if shared_v and dv_p != dv:  # the kernel reads the values as k's first Dv columns: no padding there
        raise ValueError(f"values shared with the keys need a power-of-two v_dim, got {dv}")
    block_k = _pow2(min(block_k, s), 16)
    num_blocks = math.ceil(s / block_k)
    if num_splits is None:
        num_splits = max(1, min(16, num_blocks // 4))
    num_splits = max(1, min(num_splits, num_blocks))
    while num_blocks % num_splits:  # splits of whole blocks: no padding when block_k divides S
        num_splits -= 1
    split_len = (num_blocks // num_splits) * block_k
    s_pad = split_len * num_splits

    # Query rows of one kv head: (token, head-in-group), padded; padded rows get limit -1 (all masked).
    qg = q.reshape(b, t, kh, g, dk).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, dk)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - t * g), (0, dk_p - dk)))
    lim = jnp.repeat(row_limits(q_pos, kv_len), g, axis=1)  # [B, T·G]
    lim = jnp.pad(lim, ((0, 0), (0, rows - t * g)), constant_values=-1)
    kp = jnp.pad(k, ((0, 0), (0, 0), (0, s_pad - s), (0, dk_p - dk)))
    vp = None if shared_v else jnp.pad(v, ((0, 0), (0, 0), (0, s_pad - s), (0, dv_p - dv)))
    start = jnp.asarray(kv_pos.start, jnp.int32)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, scale=scale, block_k=block_k, precision=precision, run=kv_pos.run,
                               stride=kv_pos.stride, num_slots=s, shared_v=shared_v)
    kv_block = lambda d: pl.BlockSpec((None, None, split_len, d), lambda i, j, c: (i, j, c, 0))  # noqa: E731
    o, lse = pl.pallas_call(
        kernel,
        grid=(b, kh, num_splits),
        in_specs=[
            pl.BlockSpec((), lambda i, j, c: ()),
            pl.BlockSpec((None, None, rows, dk_p), lambda i, j, c: (i, j, 0, 0)),
            kv_block(dk_p),
            *([] if shared_v else [kv_block(dv_p)]),
            pl.BlockSpec((None, rows), lambda i, j, c: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, dv_p), lambda i, j, c: (i, j, c, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda i, j, c: (i, j, c, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, num_splits, rows, dv_p), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, num_splits, rows), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="dcp_flash_decode",
    )(start, qg, kp, *([] if shared_v else [vp]), lim)

    o, lse = merge_partials(o, lse, axis=2)  # [B, K, R, Dv_p], [B, K, R]
    o = o[:, :, : t * g, :dv].reshape(b, kh, t, g, dv).transpose(0, 2, 1, 3, 4).reshape(b, t, h, dv)
    lse = lse[:, :, : t * g].reshape(b, kh, t, g).transpose(0, 2, 1, 3).reshape(b, t, h)
    return o.astype(q.dtype), lse
