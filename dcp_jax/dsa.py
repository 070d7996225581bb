"""DeepSeek-V3.2: MLA (`dcp_jax.mla`) with DeepSeek Sparse Attention's lightning indexer.

Per layer the indexer adds one cached key of `index_head_dim` per token beside the latent, and per
query a choice: each query attends only the `index_topk` tokens the indexer scores highest among the
tokens it sees (all of them when it sees fewer), as transformers' `DeepseekV32Indexer`:

    q_i  = wq_b(q_resid)             [B, T, Hi, Di]   q_resid = q_a_layernorm(q_a_proj(x)), MLA's
    k_i  = LayerNorm(wk(x))          [B, T, Di]       (weight and bias, eps 1e-6)
           RoPE on the first qk_rope_head_dim dims of both, half-split (MLA's own is interleaved)
    w    = weights_proj(x) · Hi^-0.5 [B, T, Hi]       float32
    score(t) = Σ_h w_h · relu(q_i,h · k_i(t) · Di^-0.5)   float32

The index keys live in a cache of their own shaped like the latent's (`CausalLM.cache_widths`):
paged and sharded along the sequence over the whole mesh ("tp","dcp"), written beside the latent at
prefill and decode (`attention.write_kv` takes both). The selection and the attention over the
chosen tokens are one island (`attention.dcp_sparse_attention`): every rank scores its own tokens,
the candidates (index_topk per rank per query) are all-gathered, every rank makes the same choice
(higher score, then lower position) and attends the chosen tokens it owns; the MLA combine finishes.

The indexer's weights are replicated: every device computes the same index queries, keys and
weights, bit for bit on every mesh, so the choice does not depend on the mesh. They are 14M values a
layer in DeepSeek-V3.2 (wq_b 8192 x 1536, wk 128 x 7168, weights_proj 64 x 7168), 0.85G over its 61
layers (1.7 GB a device in bf16, against 84 GB of fp8 weights at tp = 8); splitting wq_b's heads
over the mesh, with the index queries all-gathered before the island, would cut that to 1/(tp·dcp).

Memory of the selection (jnp; a fused indexer kernel is the follow-up): per query it scores every
token its rank holds, [tokens, index heads, S_local] float32 before the head sum, and gathers at
most index_topk latents [tokens, index_topk, latent] for the attention. Decode rows are small; a
long prefill chunk pays tokens x S_local, so prefill_chunk bounds it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dcp_jax import attention as attn_lib
from dcp_jax import mesh as mesh_lib
from dcp_jax.config import ModelConfig
from dcp_jax.layers import AttentionContext, WeightSource, linear, param, rope
from dcp_jax.mla import HEAD_AXES, MLAttention
from pallas_kernels.attention import sparse

LAYER_NORM_EPS = 1e-6  # transformers' DeepseekV32Indexer.k_norm


class Indexer(nnx.Module):
    """The lightning indexer's weights (`{prefix}.wq_b`, `wk`, `k_norm`, `weights_proj`) and its
    projections."""

    def __init__(self, cfg: ModelConfig, prefix: str, get: WeightSource):
        ix, e = cfg.indexer, cfg.hidden_size
        rep = mesh_lib.spec(())
        self.cfg = cfg
        self.wq_b = param(get, f"{prefix}.wq_b.weight",
                          (ix.num_heads * ix.head_dim, cfg.mla.q_lora_rank), rep)
        self.wk = param(get, f"{prefix}.wk.weight", (ix.head_dim, e), rep)
        self.k_norm_weight = param(get, f"{prefix}.k_norm.weight", (ix.head_dim,), rep)
        self.k_norm_bias = param(get, f"{prefix}.k_norm.bias", (ix.head_dim,), rep)
        self.weights_proj = param(get, f"{prefix}.weights_proj.weight", (ix.num_heads, e), rep)

    def __call__(self, x, q_resid, positions, inv_freq):
        """-> the index queries [B, T, Hi, Di], keys [B, T, Di] (x's dtype) and head weights
        [B, T, Hi] (float32)."""
        cfg, ix = self.cfg, self.cfg.indexer
        b, t, _ = x.shape
        r = cfg.mla.qk_rope_head_dim
        q = linear(q_resid, self.wq_b).reshape(b, t, ix.num_heads, ix.head_dim)
        k32 = linear(x, self.wk).astype(jnp.float32)
        mean = jnp.mean(k32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(k32 - mean), axis=-1, keepdims=True)
        k32 = (k32 - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS)
        k = (k32 * self.k_norm_weight[...].astype(jnp.float32)
             + self.k_norm_bias[...].astype(jnp.float32)).astype(x.dtype)[:, :, None]
        rot = {"interleaved": False, "factor": cfg.rope.cos_sin_factor()}
        q = jnp.concatenate([rope(q[..., :r], positions, inv_freq, **rot), q[..., r:]], axis=-1)
        k = jnp.concatenate([rope(k[..., :r], positions, inv_freq, **rot), k[..., r:]], axis=-1)
        w = linear(x.astype(jnp.float32), self.weights_proj) * ix.num_heads ** -0.5
        return q, k[:, :, 0], w


class DSAttention(MLAttention):
    """MLA whose queries attend only the indexer's top-k tokens (DeepSeek-V3.2); its layer cache is
    (latent, index keys)."""

    def __init__(self, cfg: ModelConfig, prefix: str, get: WeightSource, mesh: Mesh,
                 context_axes: tuple[str, ...] = mesh_lib.AXES):
        super().__init__(cfg, prefix, get, mesh, context_axes)
        self.indexer = Indexer(cfg, f"{prefix}.indexer", get)

    def __call__(self, x, positions, valid, kv_len, inv_freq, cache, ctx: AttentionContext):
        cfg, ix = self.cfg, self.cfg.indexer
        q_abs, latent, w_uv, q_resid = self.absorbed(x, positions, inv_freq)
        iq, ik, iw = self.indexer(x, q_resid, positions, inv_freq)
        opts = {"scale": cfg.softmax_scale, "v_dim": cfg.mla.kv_lora_rank}
        if cache is None:  # cache-free (training / scoring): the block's own tokens
            o = _cache_free(q_abs, latent[:, :, 0], iq, iw, ik, positions, kv_len, ix, **opts)
            return self.output(o.astype(x.dtype), w_uv), None
        if ctx.kv_quant is not None:
            raise ValueError("DeepSeek-V3.2's sparse attention reads no 8-bit KV cache")
        axes = {"head_axes": HEAD_AXES, "context_axes": self.context_axes}
        cache = attn_lib.write_kv(cache, (latent, ik[:, :, None]), positions, valid,
                                  **ctx.placement(), **axes)
        o = attn_lib.dcp_sparse_attention(
            q_abs, cache[0], cache[1], iq, iw, positions, kv_len, mesh=ctx.mesh, layout=ctx.layout,
            topk=ix.topk, index_scale=ix.scale, context_axes=self.context_axes, combine=ctx.combine,
            block_table=ctx.block_table, layer=ctx.layer, ragged=ctx.ragged, **opts)
        return self.output(o, w_uv), cache


def _cache_free(q, latent, iq, iw, ik, positions, kv_len, ix, *, scale: float, v_dim: int):
    """Sparse attention of a block's queries over the block's own tokens (no cache, no mesh):
    latent [B, T, D], ik [B, T, Di]; the same selection as the island's with one rank."""
    b, t = positions.shape
    scores = sparse.index_scores(iq, iw, ik, ix.scale)  # [B, T, T]
    keys_pos = positions[:, None, :]
    visible = (keys_pos <= positions[:, :, None]) & (keys_pos < kv_len[:, None, None])
    vals, chosen = sparse.local_topk(scores, positions[:, None, :], visible, ix.topk)
    keep = vals > -jnp.inf
    # positions of a cache-free block are 0..T-1: a position is its index in the block
    kv = jnp.take_along_axis(latent[:, None], jnp.where(keep, chosen, 0)[..., None], axis=2)
    o, _ = sparse.gathered_attention(q.reshape(b * t, *q.shape[2:]), kv.reshape(b * t, ix.topk, -1),
                                     keep.reshape(b * t, -1), scale=scale, v_dim=v_dim)
    return o.reshape(b, t, *o.shape[1:])
