"""DeepSeek Sparse Attention's per-device parts (one device's arrays; nothing of meshes).

DeepSeek-V3.2's lightning indexer scores each query against every cached token's index key,

    score(q, t) = Σ_h w_h · relu(scale · q_h · k_t)            (float32)

and the query attends only the `topk` best tokens it sees. Sharded along the sequence, each device
scores its own tokens and keeps its best `topk` (`local_topk`); the candidates of every device are
gathered and one choice is made from them all (`merge_topk`). A token in the global top-k is in its
own device's top-k, so the merge of the local choices IS the global choice, provided every step
orders tokens the same way. That order is this module's one rule:

    higher score first; among equal scores, the lower position first; unfilled candidates
    (no visible token: score -inf, position NO_POSITION) last.

`local_topk` gets it from `lax.top_k` (of equal values the lower index comes first), so its slots
must hold increasing positions (a shard's logical local slots do, whatever the interleave);
`merge_topk` sorts on (score, position) explicitly. A score of -0.0 (zero head outputs times a
negative weight) is made +0.0 first, so every comparison sees one zero. With the order total, every
device of every mesh and placement makes the same choice from the same scores.

`gathered_attention` is the attention over the chosen tokens a device owns (their latents gathered
by the caller, at most `topk` per query), returning the partial (o, LSE) the DCP combine merges.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

NO_POSITION = int(jnp.iinfo(jnp.int32).max)  # an unfilled candidate's position (sorts last)


def index_scores(q, w, keys, scale: float):
    """q [B, T, Hi, Di], w [B, T, Hi], keys [B, S, Di] -> the indexer's scores [B, T, S] float32:
    Σ_h w_h · relu(scale · q_h · k_s), with -0.0 made +0.0."""
    dots = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys.astype(jnp.float32),
                      preferred_element_type=jnp.float32) * scale
    s = jnp.einsum("bth,bths->bts", w.astype(jnp.float32), jax.nn.relu(dots),
                   preferred_element_type=jnp.float32)
    return jnp.where(s == 0, jnp.zeros((), s.dtype), s)


def local_topk(scores, positions, visible, k: int):
    """One device's best `k` of its slots [..., S] (scores, int32 positions increasing along S,
    visible mask) -> (scores [..., k], positions [..., k]) in the module's order; fewer visible
    slots than k leave unfilled candidates (-inf, NO_POSITION)."""
    s = jnp.where(visible, scores, -jnp.inf)
    n = s.shape[-1]
    if n < k:  # a shard smaller than k: pad with unfilled slots
        pad = [(0, 0)] * (s.ndim - 1) + [(0, k - n)]
        s = jnp.pad(s, pad, constant_values=-jnp.inf)
        positions = jnp.pad(jnp.broadcast_to(positions, scores.shape), pad,
                            constant_values=NO_POSITION)
    vals, idx = lax.top_k(s, k)
    pos = jnp.take_along_axis(jnp.broadcast_to(positions, s.shape), idx, axis=-1)
    return vals, jnp.where(vals > -jnp.inf, pos, NO_POSITION).astype(jnp.int32)


def merge_topk(scores, positions, k: int):
    """The best `k` of candidates [..., C] (scores, positions: several devices' `local_topk`
    concatenated) in the module's order: (scores [..., k], positions [..., k]). The one place the
    tie-break is decided."""
    neg, pos = lax.sort((-scores, positions), dimension=scores.ndim - 1, num_keys=2)
    return -neg[..., :k], pos[..., :k]


def gathered_attention(q, kv, keep, *, scale: float, v_dim: int):
    """Attention of q [M, H, D] over its own gathered keys kv [M, K, D] (values: their first v_dim
    features, MLA's latent), only where keep [M, K] -> (o [M, H, v_dim] float32, lse [M, H]); a
    query keeping none gives o = 0, lse = -inf (it adds nothing to the combine)."""
    kv32 = kv.astype(jnp.float32)
    s = jnp.einsum("mhd,mkd->mhk", q.astype(jnp.float32), kv32,
                   preferred_element_type=jnp.float32) * scale
    s = jnp.where(keep[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=-1)
    o = jnp.einsum("mhk,mkv->mhv", p, kv32[..., :v_dim]) / jnp.maximum(total, 1e-30)[..., None]
    lse = jnp.where(total > 0, m[..., 0] + jnp.log(jnp.maximum(total, 1e-30)), -jnp.inf)
    return o, lse
