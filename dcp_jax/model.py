"""Flax NNX decoders: the Llama family (Llama, Mistral, Qwen2, Qwen3), DeepSeek-V2/V3
(`dcp_jax.mla`) and DeepSeek-V3.2 (`dcp_jax.dsa`: MLA with the lightning indexer's sparse attention).

Models hold no collectives and no shard_map: their weights carry shardings (heads over "tp"; o_proj,
the MLP and the vocabulary over ("tp","dcp") where the sizes divide) and XLA inserts the reductions.
Two activation placements are pinned, both specs from `dcp_jax.mesh`: the residual stream replicated
(`residual_spec`) and, in prefill, the q/k/v projections' tokens over "dcp" (`token_split_spec`).
Attention goes through `dcp_jax.attention`, the one shard_map island. Shared layers and the weight
source protocol are in `dcp_jax.layers`.

The KV cache, per layer: (k, v) [B, K, S, D] with kv heads over "tp" and slots over "dcp" (GQA), or
one latent [B, 1, S, kv_lora_rank + rope] with slots over ("tp","dcp") (MLA), and beside it for
DeepSeek-V3.2 the indexer's keys [B, 1, S, index_head_dim], placed the same way.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dcp_jax import attention as attn_lib
from dcp_jax import dsa, mla
from dcp_jax import mesh as mesh_lib
from dcp_jax.config import ModelConfig
from dcp_jax.errors import UserError
from dcp_jax.layers import (LAYER, MLP, AttentionContext, WeightSource, expand_kv_rows, linear, norm, param, rope,
                            stack_names, stacked_source)
from dcp_jax.layout import KVLayout
from dcp_jax.mesh import AXES, DCP, TP
from pallas_kernels.attention import SlotPositions
from pallas_kernels.attention import api as kernels


def kv_replication(cfg: ModelConfig, tp: int) -> int:
    """How many times each KV head is stored so every tp rank holds whole heads (1 when tp <= K).

    MLA's latent is sharded on the sequence over the whole mesh: never replicated (1); any tp works.
    """
    if cfg.mla:
        return 1
    if cfg.num_heads % tp:
        raise UserError(
            f"tp={tp} does not divide the model's {cfg.num_heads} attention heads; pick tp from "
            f"{[d for d in range(1, cfg.num_heads + 1) if cfg.num_heads % d == 0]}")
    if tp <= cfg.num_kv_heads:
        if cfg.num_kv_heads % tp:
            raise UserError(f"tp={tp} does not divide the model's {cfg.num_kv_heads} kv heads")
        return 1
    if tp % cfg.num_kv_heads:
        raise UserError(
            f"tp={tp} exceeds the {cfg.num_kv_heads} kv heads and is not a multiple of them; "
            "KV heads can only be replicated a whole number of times")
    return tp // cfg.num_kv_heads


def _split_tokens(x, mesh: Mesh):
    """x [B, T, E] with its tokens split over "dcp" (when T divides), for the q/k/v projections.

    Their weights are split over "tp" only, so every dcp rank would otherwise project every token of
    a prefill chunk: dcp-fold redundant work. Split over tokens, each rank projects T / dcp of them
    and XLA all-gathers q, k and v where the attention island and the cache write need them whole.
    """
    n = mesh.shape[DCP]
    if n == 1 or x.shape[1] % n:
        return x
    return jax.lax.with_sharding_constraint(x, mesh_lib.named(mesh, mesh_lib.token_split_spec()))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, get: WeightSource, mesh: Mesh, q_gather: bool = False):
        tp = mesh.shape[TP]
        self.rep = kv_replication(cfg, tp)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.rope_factor = cfg.rope.cos_sin_factor()
        self.num_kv_heads = cfg.num_kv_heads * self.rep
        h, k, d, e = cfg.num_heads, self.num_kv_heads, cfg.head_dim, cfg.hidden_size
        heads = mesh_lib.spec((TP,), ())
        # o_proj's input rows follow the attention output: heads over ("tp","dcp") when the combine
        # scatters heads over dcp, over "tp" alone when it falls back to psum.
        out_axes = AXES if attn_lib.resolve_combine(h // tp, mesh.shape[DCP]) else (TP,)
        q_axes = mesh_lib.q_proj_axes(q_gather)
        if h % mesh_lib.axis_size(mesh, q_axes):
            raise UserError(f"q_gather needs the {h} attention heads to divide by tp x dcp = "
                            f"{mesh_lib.axis_size(mesh, q_axes)}")
        self.q_proj = param(get, f"{prefix}.q_proj.weight", (h * d, e), mesh_lib.spec(q_axes, ()))
        self.k_proj = param(get, f"{prefix}.k_proj.weight", (k * d, e), heads, kv_rep=self.rep)
        self.v_proj = param(get, f"{prefix}.v_proj.weight", (k * d, e), heads, kv_rep=self.rep)
        self.o_proj = param(get, f"{prefix}.o_proj.weight", (e, h * d), mesh_lib.spec((), out_axes))
        bias = mesh_lib.spec((TP,))
        self.q_bias = (param(get, f"{prefix}.q_proj.bias", (h * d,), mesh_lib.spec(q_axes))
                       if cfg.qkv_bias else None)
        self.k_bias = (param(get, f"{prefix}.k_proj.bias", (k * d,), bias, kv_rep=self.rep)
                       if cfg.qkv_bias else None)
        self.v_bias = (param(get, f"{prefix}.v_proj.bias", (k * d,), bias, kv_rep=self.rep)
                       if cfg.qkv_bias else None)
        if cfg.qk_norm:
            self.q_norm = norm(get, f"{prefix}.q_norm.weight", d, cfg.rms_norm_eps)
            self.k_norm = norm(get, f"{prefix}.k_norm.weight", d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, positions, valid, kv_len, inv_freq, cache, ctx: AttentionContext):
        b, t, _ = x.shape
        if cache is not None and t > 1:
            x = _split_tokens(x, ctx.mesh)
        q = linear(x, self.q_proj, self.q_bias).reshape(b, t, self.num_heads, self.head_dim)
        k = linear(x, self.k_proj, self.k_bias).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = linear(x, self.v_proj, self.v_bias).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        factor = self.rope_factor
        q, k = rope(q, positions, inv_freq, factor=factor), rope(k, positions, inv_freq, factor=factor)
        if cache is None:  # training / scoring: causal attention within the block, no cache, no mesh
            kv_pos = SlotPositions.dense(t)
            # one dense block (both block sizes T): no loop with a traced trip count, so it is reverse-differentiable
            o, _ = kernels.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions, kv_pos,
                                     kv_len, impl="reference", block_k=t, block_k_masked=t)
            return linear(o.reshape(b, t, -1), self.o_proj), None
        cache = attn_lib.write_kv(cache, (k, v), positions, valid, **ctx.placement())
        o = attn_lib.dcp_attention(q, *cache, positions, kv_len, impl=ctx.impl, combine=ctx.combine,
                                   fresh=(k, v), **ctx.placement())
        return linear(o.reshape(b, t, -1), self.o_proj), cache


class Block(nnx.Module):
    """One decoder layer. `index` picks its kind (dense or MoE); `prefix` names its weights (default
    `model.layers.{index}`; a scanned stack passes the `{layer}` placeholder)."""

    def __init__(self, cfg: ModelConfig, index: int, get: WeightSource, mesh: Mesh, *,
                 latent_axes=mla.CONTEXT_AXES, q_gather: bool = False, prefix: str | None = None):
        p = prefix or f"model.layers.{index}"
        e = cfg.hidden_size
        self.input_layernorm = norm(get, f"{p}.input_layernorm.weight", e, cfg.rms_norm_eps)
        if cfg.indexer:  # DeepSeek-V3.2: MLA with the lightning indexer's top-k
            self.self_attn = dsa.DSAttention(cfg, f"{p}.self_attn", get, mesh, latent_axes)
        elif cfg.mla:
            self.self_attn = mla.MLAttention(cfg, f"{p}.self_attn", get, mesh, latent_axes)
        else:
            self.self_attn = Attention(cfg, f"{p}.self_attn", get, mesh, q_gather)
        self.post_attention_layernorm = norm(get, f"{p}.post_attention_layernorm.weight", e, cfg.rms_norm_eps)
        if cfg.moe and cfg.moe.is_moe_layer(index):
            self.mlp = mla.MoE(cfg, f"{p}.mlp", get, mesh)
        else:
            self.mlp = MLP(f"{p}.mlp", get, mesh, e, cfg.intermediate_size)

    def __call__(self, x, positions, valid, kv_len, inv_freq, cache, ctx):
        a, cache = self.self_attn(self.input_layernorm(x), positions, valid, kv_len, inv_freq, cache, ctx)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class LayerStack(nnx.Module):
    """Consecutive layers of one kind, their weights stacked [n, ...] and run by one `lax.scan`, so
    compile time does not grow with depth. The stack's caches are stacked too, [n, ...]: they ride in
    the scan's carry and each layer writes and reads its own in place (write_kv and the kernels take
    the layer index), so no layer's cache is ever sliced out or copied."""

    def __init__(self, cfg: ModelConfig, indices, get: WeightSource, mesh: Mesh, **kw):
        self.indices = tuple(int(i) for i in indices)
        self.block = Block(cfg, self.indices[0], stacked_source(get, self.indices, mesh), mesh,
                           prefix=f"model.layers.{LAYER}", **kw)
        for _, var in nnx.iter_graph(self.block):
            if isinstance(var, nnx.Param):
                var.set_metadata(layers=self.indices)  # hf_weights unstacks by these

    def __call__(self, x, positions, valid, kv_len, inv_freq, cache, ctx):
        graphdef, state = nnx.split(self.block)

        def body(carry, xs):
            x, cache = carry
            weights, layer = xs
            layer_ctx = None if ctx is None else dataclasses.replace(ctx, layer=layer)
            x, cache = nnx.merge(graphdef, weights)(x, positions, valid, kv_len, inv_freq, cache, layer_ctx)
            return (x, cache), None

        layers = jnp.arange(len(self.indices), dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (state, layers))
        return x, cache


def layer_runs(cfg: ModelConfig, scan: bool = True) -> list[list[int]]:
    """The layers cut into runs of one kind (dense / MoE): each run is one scanned `LayerStack`.
    `scan=False`: a stack per layer (a trip-count-1 scan is no loop: the program grows with depth)."""
    runs: list[list[int]] = []
    kind = None
    for i in range(cfg.num_layers):
        k = bool(cfg.moe and cfg.moe.is_moe_layer(i))
        if k != kind or not scan:
            runs.append([])
            kind = k
        runs[-1].append(i)
    return runs


class CausalLM(nnx.Module):
    """Decoder-only LM. `__call__` runs a block of T tokens per sequence against the sharded cache.

    `latent_axes` (MLA only): the mesh axes the latent cache's slots are sharded over; the default is the
    whole mesh, () keeps a replicated copy per device (tensor parallelism alone: a baseline).
    `q_gather` (GQA only): compute each dcp rank's 1/dcp share of the query heads and all-gather q over
    "dcp" before attention, instead of computing all of the tp group's heads on every dcp rank
    (`mesh.q_proj_axes`). Same numbers either way; it trades q_proj compute and weight memory for one
    all-gather of q per layer.
    `scan_layers`: consecutive layers of one kind run as one `lax.scan` (the default: program size and
    compile time flat in depth). False gives each layer its own stack: the program grows with depth,
    but no layer's weights are sliced out of a stack at run time (XLA:CPU copies each scanned layer's
    weights out of the stack every step: 5-17% of a decode step in docs/PERFORMANCE.md's CPU runs,
    16% for one 4K-token request).
    """

    def __init__(self, cfg: ModelConfig, get: WeightSource, mesh: Mesh, *, latent_axes=mla.CONTEXT_AXES,
                 q_gather: bool = False, scan_layers: bool = True):
        self.config = cfg
        v, e = cfg.vocab_size, cfg.hidden_size
        vocab = mesh_lib.spec(mesh_lib.fit_axes(mesh, v), ())
        # The lookup table is split over the hidden dim: a gather then yields sharded activations, where a
        # vocab-split table would be all-gathered whole (1 GB for Llama-3.1-8B) at every step.
        hidden = mesh_lib.spec((), mesh_lib.fit_axes(mesh, e))
        # (a tied table stays vocab-split: it is the output head too, where the vocab split pays)
        self.embed_tokens = param(get, "model.embed_tokens.weight", (v, e),
                                   vocab if cfg.tie_embeddings else hidden)
        self.stacks = nnx.List([LayerStack(cfg, run, get, mesh, latent_axes=latent_axes, q_gather=q_gather)
                                for run in layer_runs(cfg, scan_layers)])
        self.norm = norm(get, "model.norm.weight", e, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else param(get, "lm_head.weight", (v, e), vocab)
        self.kv_replication = kv_replication(cfg, mesh.shape[TP])
        self.kv_heads = cfg.num_kv_heads * self.kv_replication  # heads the cache stores
        # where the cache lives: kv heads over head_axes, sequence slots over context_axes
        if cfg.mla:
            self.head_axes, self.context_axes = mla.HEAD_AXES, tuple(latent_axes)
        else:
            self.head_axes, self.context_axes = (TP,), (DCP,)

    def cache_shapes(self, batch: int, max_seq_len: int) -> tuple:
        """Per layer stack, the shapes of its stacked cache arrays: ((n,B,K,S,D), (n,B,K,S,D)), or
        ((n,B,1,S,latent),) for MLA."""
        return self.stacked_shapes((batch, self.kv_heads, max_seq_len, self.config.head_dim))

    def cache_widths(self, width: int) -> tuple[int, ...]:
        """The last dim of each of a layer's cache arrays, `width` being the KV's (its head dim, or
        an 8-bit row's): (k, v); MLA's (latent,); DeepSeek-V3.2's (latent, index keys)."""
        if self.config.indexer:
            return (width, self.config.indexer.head_dim)
        return (width,) if self.config.mla else (width, width)

    def stacked_shapes(self, one: tuple) -> tuple:
        """Per layer stack, (k, v) (MLA: (latent,); DeepSeek-V3.2: (latent, index keys)) shapes of
        `one` layer's array stacked over its layers (`one`'s last dim is the KV's width)."""
        return tuple(tuple((len(st.indices), *one[:-1], w) for w in self.cache_widths(one[-1]))
                     for st in self.stacks)

    def __call__(self, tokens, positions, valid, kv_len, cache, ctx: AttentionContext, logits_at=None,
                 hidden: bool = False):
        """tokens, positions, valid [B, T]; kv_len [B] cache length after this block is written;
        cache: tuple over layer stacks of (k, v) [n, B, K, S, D] (MLA: (latent,)), or of paged pools
        [n, N·pages, K, page, D] with `ctx.block_table`. Returns (logits, cache): logits
        [B, T, V], or [B, V] at index `logits_at` [B] of each sequence when given (prefill needs only the last).
        A ragged batch (`ctx.ragged`): tokens, positions, valid [1, N] are many sequences' tokens end to end,
        kv_len [R] per sequence, and `logits_at` [R] indexes the flat tokens: logits [R, V].
        With `hidden`, also the last layer's output at every token [B, T, E] (its logits: `head_logits`).
        """
        out, new_cache = self._trunk(tokens, positions, valid, kv_len, cache, ctx, ctx.seq_len)
        x = out
        if logits_at is not None and ctx.ragged is not None:
            x = x[0, logits_at]
        elif logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)[:, 0]
        if hidden:
            return self.head_logits(x), new_cache, out
        return self.head_logits(x), new_cache

    def forward(self, tokens):
        """Cache-free causal forward over whole sequences [B, T] -> logits [B, T, V] (training, scoring)."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x, _ = self._trunk(tokens, positions, None, jnp.full((b,), t, jnp.int32), None, None, t)
        return self.head_logits(x)

    def _trunk(self, tokens, positions, valid, kv_len, cache, ctx, max_seq_len):
        inv_freq = jnp.asarray(self.config.rope.inv_freq(self.config.rope_dim, max_seq_len), jnp.float32)
        x = jnp.take(self.embed_tokens[...], tokens, axis=0)
        if ctx is not None:  # the lookup table is split over the hidden dim; the residual stream is not
            x = jax.lax.with_sharding_constraint(x, mesh_lib.named(ctx.mesh, mesh_lib.residual_spec()))
        new_cache = []
        for i, stack in enumerate(self.stacks):
            x, stack_cache = stack(x, positions, valid, kv_len, inv_freq, None if cache is None else cache[i], ctx)
            new_cache.append(stack_cache)
        return x, (None if cache is None else tuple(new_cache))

    def head_logits(self, x):
        """The last layer's output [..., E] -> logits [..., V] float32 (final norm, then the LM head)."""
        x = self.norm(x)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return jnp.einsum("...e,ve->...v", x, head[...], preferred_element_type=jnp.float32)

    def hf_weights(self) -> dict[str, jax.Array]:
        """Every weight by its Hugging Face name, with replicated KV heads folded back (mesh-independent)."""
        out = {}
        for _, var in nnx.iter_graph(self):
            if isinstance(var, nnx.Param) and getattr(var, "hf_name", None):
                value = var[...]
                layers = var.get_metadata().get("layers")
                named = ([(var.hf_name.format(layer=i), value[j]) for j, i in enumerate(layers)] if layers
                         else [(var.hf_name, value)])
                for name, value in named:
                    rep = var.kv_rep
                    if rep > 1:
                        d = self.config.head_dim
                        value = value.reshape((-1, rep, d) + value.shape[1:])[:, 0].reshape((-1,) + value.shape[1:])
                    out[name] = value
        return out


def cache_sharding(model: CausalLM, mesh: Mesh):
    """Every (stacked) cache array: layers unsharded, kv heads and slots as `mesh.kv_cache_spec`."""
    return mesh_lib.named(mesh, mesh_lib.kv_cache_spec(model.head_axes, model.context_axes, stacked=True))


def init_cache(model: CausalLM, batch: int, layout: KVLayout, mesh: Mesh, dtype):
    """Zeroed cache (see `CausalLM.cache_shapes`), sharded per `cache_sharding`.

    Allocated sharded from the start (jit with out_shardings), never as a full array on one device.
    """
    sharding = cache_sharding(model, mesh)
    return mesh_lib.zeros(tuple(tuple(jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in layer)
                                for layer in model.cache_shapes(batch, layout.max_seq_len)))


def random_source(cfg: ModelConfig, mesh: Mesh, seed: int = 0, dtype=jnp.float32, scale: float = 0.5):
    """A WeightSource of random weights (norms = 1), for tests and benchmarks."""
    def one(name, shape, kv_rep):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name.endswith("norm.weight"):
            return np.ones(shape, np.float32)
        base = (shape[0] // kv_rep,) + tuple(shape[1:])
        host = (rng.standard_normal(base) * scale / np.sqrt(shape[-1])).astype(np.float32)
        return expand_kv_rows(host, kv_rep, cfg.head_dim)

    def get(name, shape, spec, kv_rep=1):
        if "*" in name:  # a stack of per-name tensors
            host = np.stack([one(n, shape[1:], 1) for n in stack_names(name, shape[0])])
        else:
            host = one(name, shape, kv_rep)
        return jax.device_put(jnp.asarray(host, dtype), mesh_lib.named(mesh, spec))

    return get
