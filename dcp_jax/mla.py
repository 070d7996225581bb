"""DeepSeek-V2/V3: multi-head latent attention (MLA) in the absorbed form, and the mixture of experts.

MLA caches one latent per token, `[c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]` (576 values for
DeepSeek-V3), with no head axis. Tensor parallelism cannot split it, so under TP alone every device
holds all of it; here the latent cache is sharded on the sequence over the whole mesh ("tp","dcp").

Absorbed attention: the key up-projection W_UK is folded into the query and the value up-projection
W_UV is applied after attention, so every head attends straight over the latent:

    q_lat = q_nope · W_UK                    [B, T, H, kv_lora_rank]   (per head)
    score = [q_lat | q_pe] · [c_kv | k_pe]   (the latent is the key: one shared "kv head")
    o_lat = softmax(score) · c_kv            (the values are the latent's first kv_lora_rank features)
    o     = o_lat · W_UV                     [B, T, H, v_head_dim]

Each device attends all heads over its slice of the latent cache, then the same exact LSE combine
(`dcp_jax.attention`) runs over ("tp","dcp") and leaves each device its share of the heads, which
W_UV and o_proj (rows over the mesh) consume without further communication.

Prefill uses the absorbed form too: the chunk's queries attend the cached latents directly, so a later
chunk (or a cached prefix) never re-expands earlier tokens into per-head keys and values, and decode
and prefill share one path. It costs more attention FLOPs per token than the expanded form (a
576-wide score and 512-wide value per head instead of 192 and 128), which matters for long
compute-bound prefills on accelerators, not for correctness.

Mixture of experts (plain and correct first): the routed experts are stacked weights [E, ...] sharded
over the mesh (expert parallel, E / (tp·dcp) experts per device); every device runs its experts on all
tokens, weighted by the router's (mostly zero) combine weights, and XLA sums the partial outputs over
the mesh. Decode reads every expert's weights once per step, as it would at batch sizes that touch
them all; a token-dispatching (all_to_all) MoE is the follow-up for large batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dcp_jax import attention as attn_lib
from dcp_jax import mesh as mesh_lib
from dcp_jax.config import ModelConfig, MoEConfig
from dcp_jax.errors import UserError
from dcp_jax.layers import MLP, AttentionContext, WeightSource, linear, norm, param, rope
from pallas_kernels.attention import SlotPositions
from pallas_kernels.attention import api as kernels

# The latent cache has no head axis: sequence slots over the whole mesh. (context axes () keep a whole
# replicated copy on every device, as tensor parallelism alone does: the baseline of the memory benchmark.)
HEAD_AXES: tuple[str, ...] = ()
CONTEXT_AXES = mesh_lib.AXES


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, get: WeightSource, mesh: Mesh,
                 context_axes: tuple[str, ...] = CONTEXT_AXES):
        m = cfg.mla
        if cfg.hf_config.get("attention_bias"):
            raise UserError("config.json: MLA with attention_bias=true is not supported")
        h, e = cfg.num_heads, cfg.hidden_size
        self.cfg, self.context_axes = cfg, tuple(context_axes)
        rep = mesh_lib.spec(())
        # q and the kv up-projection by heads over as much of the mesh as divides them; XLA gathers
        # q (small: one row per token) before the attention island, which wants all heads everywhere.
        heads = mesh_lib.spec(mesh_lib.fit_axes(mesh, h), ())
        if m.q_lora_rank:
            self.q_a_proj = param(get, f"{prefix}.q_a_proj.weight", (m.q_lora_rank, e), rep)
            self.q_a_layernorm = norm(get, f"{prefix}.q_a_layernorm.weight", m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = param(get, f"{prefix}.q_b_proj.weight", (h * m.qk_head_dim, m.q_lora_rank), heads)
            self.q_proj = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = param(get, f"{prefix}.q_proj.weight", (h * m.qk_head_dim, e), heads)
        self.kv_a_proj_with_mqa = param(get, f"{prefix}.kv_a_proj_with_mqa.weight", (m.latent_dim, e), rep)
        self.kv_a_layernorm = norm(get, f"{prefix}.kv_a_layernorm.weight", m.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = param(get, f"{prefix}.kv_b_proj.weight",
                               (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), heads)
        # After the combine each device holds its share of heads (psum_scatter over the mesh) or all of
        # them (psum, when heads do not divide): o_proj's input rows follow.
        scattered = bool(self.context_axes) and attn_lib.resolve_combine(h, mesh_lib.axis_size(mesh, self.context_axes))
        o_spec = (mesh_lib.spec((), self.context_axes) if scattered
                  else mesh_lib.spec(mesh_lib.fit_axes(mesh, e), ()))
        self.o_proj = param(get, f"{prefix}.o_proj.weight", (e, h * m.v_head_dim), o_spec)

    def absorbed(self, x, positions, inv_freq):
        """The absorbed queries [B, T, H, lora + rope], the latent [B, T, 1, lora + rope], W_UV
        [H, v_head_dim, lora] and the query's low-rank activation [B, T, q_lora_rank] (None without
        q_lora_rank; DeepSeek-V3.2's indexer reads it)."""
        cfg, m = self.cfg, self.cfg.mla
        b, t, _ = x.shape
        h, nope, lora = cfg.num_heads, m.qk_nope_head_dim, m.kv_lora_rank
        q_resid = None
        if self.q_proj is not None:
            q = linear(x, self.q_proj)
        else:
            q_resid = self.q_a_layernorm(linear(x, self.q_a_proj))
            q = linear(q_resid, self.q_b_proj)
        q = q.reshape(b, t, h, m.qk_head_dim)
        kv = linear(x, self.kv_a_proj_with_mqa)  # [B, T, lora + rope]
        c_kv = self.kv_a_layernorm(kv[..., :lora])
        rot = dict(interleaved=m.rope_interleave, factor=cfg.rope.cos_sin_factor())
        q_pe = rope(q[..., nope:], positions, inv_freq, **rot)
        k_pe = rope(kv[:, :, None, lora:], positions, inv_freq, **rot)[:, :, 0]
        w = self.kv_b_proj[...].astype(x.dtype).reshape(h, nope + m.v_head_dim, lora)
        w_uk, w_uv = w[:, :nope], w[:, nope:]
        q_lat = jnp.einsum("bthn,hnc->bthc", q[..., :nope], w_uk)
        q_abs = jnp.concatenate([q_lat, q_pe], axis=-1)  # [B, T, H, lora + rope]
        latent = jnp.concatenate([c_kv, k_pe], axis=-1)[:, :, None, :]  # [B, T, 1, lora + rope]
        return q_abs, latent, w_uv, q_resid

    def output(self, o, w_uv):
        """Attention's output over the latent [B, T, H, lora] -> the layer's [B, T, E]."""
        b, t = o.shape[:2]
        o = jnp.einsum("bthc,hvc->bthv", o, w_uv)  # [B, T, H, v_head_dim]
        return linear(o.reshape(b, t, -1), self.o_proj)

    def __call__(self, x, positions, valid, kv_len, inv_freq, cache, ctx: AttentionContext):
        cfg = self.cfg
        t = x.shape[1]
        q_abs, latent, w_uv, _ = self.absorbed(x, positions, inv_freq)
        opts = dict(scale=cfg.softmax_scale, v_dim=cfg.mla.kv_lora_rank)
        if cache is None:  # cache-free causal attention over the block (training / scoring)
            o, _ = kernels.attention(q_abs, latent.transpose(0, 2, 1, 3), None, positions,
                                     SlotPositions.dense(t), kv_len, impl="reference", block_k=t, block_k_masked=t,
                                     **opts)
        else:
            axes = dict(head_axes=HEAD_AXES, context_axes=self.context_axes)
            cache = attn_lib.write_kv(cache, (latent,), positions, valid, **ctx.placement(), **axes)
            o = attn_lib.dcp_attention(q_abs, cache[0], None, positions, kv_len, impl=ctx.impl,
                                       combine=ctx.combine, fresh=(latent,), **ctx.placement(),
                                       **axes, **opts)
        return self.output(o, w_uv), cache


def route(logits, bias, moe: MoEConfig):
    """Router logits [..., E] (float32) -> dense combine weights [..., E], zero for unselected experts.

    V3: sigmoid scores; experts are chosen on score + bias, groups by the sum of their two best; the
    weights are the unbiased scores of the chosen, normalised if norm_topk_prob. V2: softmax scores,
    greedy or group-limited (groups by their best score) top-k, never normalised (config.py refuses
    norm_topk_prob there). Both scale by routed_scaling_factor.
    """
    n = moe.num_experts
    scores = jax.nn.sigmoid(logits) if moe.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias
    if moe.topk_method != "greedy":
        groups = choice.reshape(*choice.shape[:-1], moe.num_groups, n // moe.num_groups)
        if moe.topk_method == "noaux_tc":
            group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)
        else:
            group_scores = jnp.max(groups, axis=-1)
        top_groups = jax.lax.top_k(group_scores, moe.topk_groups)[1]
        keep = jnp.sum(jax.nn.one_hot(top_groups, moe.num_groups, dtype=jnp.int32), axis=-2) > 0
        keep = jnp.repeat(keep, n // moe.num_groups, axis=-1)
        choice = jnp.where(keep, choice, -jnp.inf if moe.topk_method == "noaux_tc" else 0.0)
    top = jax.lax.top_k(choice, moe.top_k)[1]
    weights = jnp.take_along_axis(scores, top, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * moe.routed_scaling_factor
    return jnp.sum(jax.nn.one_hot(top, n, dtype=weights.dtype) * weights[..., None], axis=-2)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, get: WeightSource, mesh: Mesh):
        moe = cfg.moe
        n, i, e = moe.num_experts, moe.intermediate_size, cfg.hidden_size
        self.moe = moe
        rep = mesh_lib.spec(())
        experts = mesh_lib.fit_axes(mesh, n)  # expert parallel: whole experts per device
        self.gate = param(get, f"{prefix}.gate.weight", (n, e), rep)
        self.bias = (param(get, f"{prefix}.gate.e_score_correction_bias", (n,), rep)
                     if moe.scoring == "sigmoid" else None)
        stacked = mesh_lib.spec(experts, (), ())
        self.gate_proj = param(get, f"{prefix}.experts.*.gate_proj.weight", (n, i, e), stacked)
        self.up_proj = param(get, f"{prefix}.experts.*.up_proj.weight", (n, i, e), stacked)
        self.down_proj = param(get, f"{prefix}.experts.*.down_proj.weight", (n, e, i), stacked)
        self.shared = (MLP(f"{prefix}.shared_experts", get, mesh, e, i * moe.num_shared)
                       if moe.num_shared else None)

    def __call__(self, x):
        logits = jnp.einsum("...e,ne->...n", x.astype(jnp.float32), self.gate[...].astype(jnp.float32))
        bias = None if self.bias is None else self.bias[...].astype(jnp.float32)
        w = route(logits, bias, self.moe).astype(x.dtype)  # [B, T, E]
        gate, up, down = (p[...].astype(x.dtype) for p in (self.gate_proj, self.up_proj, self.down_proj))
        h = jax.nn.silu(jnp.einsum("bte,nie->btni", x, gate)) * jnp.einsum("bte,nie->btni", x, up) * w[..., None]
        y = jnp.einsum("btni,nei->bte", h, down)
        return y if self.shared is None else y + self.shared(x)
