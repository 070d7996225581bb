"""Flax NNX decoders of the Llama family (Llama, Mistral, Qwen2, Qwen3).

Models hold no collectives and no shard_map: their weights carry shardings (heads over "tp"; o_proj,
the MLP and the vocabulary over ("tp","dcp") where the sizes divide) and XLA inserts the reductions.
Attention goes through `dcp_jax.attention`, the one shard_map island.

Weights keep Hugging Face's [out, in] orientation, so loading never transposes. A model is built
from a `WeightSource`: a callable `(name, shape, spec, kv_rep) -> jax.Array` that returns the named
Hugging Face tensor already placed with sharding `spec` (safetensors, orbax or random init).
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dcp_jax import attention as attn_lib
from dcp_jax import mesh as mesh_lib
from dcp_jax.config import ModelConfig
from dcp_jax.errors import UserError
from dcp_jax.layout import KVLayout
from dcp_jax.mesh import AXES, DCP, TP
from pallas_kernels.attention import SlotPositions
from pallas_kernels.attention import api as kernels

WeightSource = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class AttentionContext:
    """What the attention island needs besides arrays: the mesh, the KV placement and the kernel."""

    mesh: Mesh
    layout: KVLayout
    impl: str | None = None
    combine: str = "auto"


def kv_replication(cfg: ModelConfig, tp: int) -> int:
    """How many times each KV head is stored so every tp rank holds whole heads (1 when tp <= K)."""
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


def _param(get: WeightSource, name: str, shape, spec, kv_rep: int = 1) -> nnx.Param:
    """A weight from the source, tagged with its Hugging Face name (checkpoints are keyed by it)."""
    return nnx.Param(get(name, tuple(shape), spec, kv_rep=kv_rep), hf_name=name, kv_rep=kv_rep)


class RMSNorm(nnx.Module):
    def __init__(self, weight: nnx.Param, eps: float):
        self.weight = weight
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * y.astype(x.dtype)


def _linear(x, w, b=None):
    """x [..., in] @ w[out, in].T (+ b)."""
    y = jnp.einsum("...i,oi->...o", x, w[...])
    return y if b is None else y + b[...]


def rope(x, positions, inv_freq):
    """Rotary embedding, half-split ("rotate_half") convention. x [B, T, H, D], positions [B, T]."""
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _split_tokens(x, mesh: Mesh):
    """x [B, T, E] with its tokens split over "dcp" (when T divides), for the q/k/v projections.

    Their weights are split over "tp" only, so every dcp rank would otherwise project every token of
    a prefill chunk: dcp-fold redundant work. Split over tokens, each rank projects T / dcp of them
    and XLA all-gathers q, k and v where the attention island and the cache write need them whole.
    """
    n = mesh.shape[DCP]
    if n == 1 or x.shape[1] % n:
        return x
    return jax.lax.with_sharding_constraint(x, mesh_lib.named(mesh, mesh_lib.spec((), (DCP,), ())))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, get: WeightSource, mesh: Mesh):
        tp = mesh.shape[TP]
        self.rep = kv_replication(cfg, tp)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.num_kv_heads = cfg.num_kv_heads * self.rep
        h, k, d, e = cfg.num_heads, self.num_kv_heads, cfg.head_dim, cfg.hidden_size
        heads = mesh_lib.spec((TP,), ())
        # o_proj's input rows follow the attention output: heads over ("tp","dcp") when the combine
        # scatters heads over dcp, over "tp" alone when it falls back to psum.
        out_axes = AXES if attn_lib.resolve_combine(h // tp, mesh.shape[DCP]) else (TP,)
        self.q_proj = _param(get, f"{prefix}.q_proj.weight", (h * d, e), heads)
        self.k_proj = _param(get, f"{prefix}.k_proj.weight", (k * d, e), heads, kv_rep=self.rep)
        self.v_proj = _param(get, f"{prefix}.v_proj.weight", (k * d, e), heads, kv_rep=self.rep)
        self.o_proj = _param(get, f"{prefix}.o_proj.weight", (e, h * d), mesh_lib.spec((), out_axes))
        bias = mesh_lib.spec((TP,))
        self.q_bias = _param(get, f"{prefix}.q_proj.bias", (h * d,), bias) if cfg.qkv_bias else None
        self.k_bias = (_param(get, f"{prefix}.k_proj.bias", (k * d,), bias, kv_rep=self.rep)
                       if cfg.qkv_bias else None)
        self.v_bias = (_param(get, f"{prefix}.v_proj.bias", (k * d,), bias, kv_rep=self.rep)
                       if cfg.qkv_bias else None)
        if cfg.qk_norm:
            rep = mesh_lib.spec(())
            self.q_norm = RMSNorm(_param(get, f"{prefix}.q_norm.weight", (d,), rep), cfg.rms_norm_eps)
            self.k_norm = RMSNorm(_param(get, f"{prefix}.k_norm.weight", (d,), rep), cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def __call__(self, x, positions, valid, kv_len, inv_freq, cache, ctx: AttentionContext):
        b, t, _ = x.shape
        if cache is not None and t > 1:
            x = _split_tokens(x, ctx.mesh)
        q = _linear(x, self.q_proj, self.q_bias).reshape(b, t, self.num_heads, self.head_dim)
        k = _linear(x, self.k_proj, self.k_bias).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = _linear(x, self.v_proj, self.v_bias).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, positions, inv_freq), rope(k, positions, inv_freq)
        if cache is None:  # training / scoring: causal attention within the block, no cache, no mesh
            kv_pos = SlotPositions.dense(t)
            # one dense block (block_k = T): no loop with a traced trip count, so it is reverse-differentiable
            o, _ = kernels.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), positions, kv_pos,
                                     kv_len, impl="reference", block_k=t)
            return _linear(o.reshape(b, t, -1), self.o_proj), None
        k_cache, v_cache = attn_lib.write_kv(*cache, k, v, positions, valid, mesh=ctx.mesh, layout=ctx.layout)
        o = attn_lib.dcp_attention(q, k_cache, v_cache, positions, kv_len, mesh=ctx.mesh, layout=ctx.layout,
                                   impl=ctx.impl, combine=ctx.combine)
        return _linear(o.reshape(b, t, -1), self.o_proj), (k_cache, v_cache)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, get: WeightSource, mesh: Mesh):
        i, e = cfg.intermediate_size, cfg.hidden_size
        axes = mesh_lib.fit_axes(mesh, i)
        self.gate_proj = _param(get, f"{prefix}.gate_proj.weight", (i, e), mesh_lib.spec(axes, ()))
        self.up_proj = _param(get, f"{prefix}.up_proj.weight", (i, e), mesh_lib.spec(axes, ()))
        self.down_proj = _param(get, f"{prefix}.down_proj.weight", (e, i), mesh_lib.spec((), axes))

    def __call__(self, x):
        return _linear(jax.nn.silu(_linear(x, self.gate_proj)) * _linear(x, self.up_proj), self.down_proj)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, index: int, get: WeightSource, mesh: Mesh):
        p = f"model.layers.{index}"
        rep = mesh_lib.spec(())
        self.input_layernorm = RMSNorm(_param(get, f"{p}.input_layernorm.weight", (cfg.hidden_size,), rep),
                                       cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, f"{p}.self_attn", get, mesh)
        self.post_attention_layernorm = RMSNorm(
            _param(get, f"{p}.post_attention_layernorm.weight", (cfg.hidden_size,), rep), cfg.rms_norm_eps)
        self.mlp = MLP(cfg, f"{p}.mlp", get, mesh)

    def __call__(self, x, positions, valid, kv_len, inv_freq, cache, ctx):
        a, cache = self.self_attn(self.input_layernorm(x), positions, valid, kv_len, inv_freq, cache, ctx)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class CausalLM(nnx.Module):
    """Decoder-only LM. `__call__` runs a block of T tokens per sequence against the sharded cache."""

    def __init__(self, cfg: ModelConfig, get: WeightSource, mesh: Mesh):
        self.config = cfg
        v, e = cfg.vocab_size, cfg.hidden_size
        vocab = mesh_lib.spec(mesh_lib.fit_axes(mesh, v), ())
        # The lookup table is split over the hidden dim: a gather then yields sharded activations, where a
        # vocab-split table would be all-gathered whole (1 GB for Llama-3.1-8B) at every step.
        hidden = mesh_lib.spec((), mesh_lib.fit_axes(mesh, e))
        # (a tied table stays vocab-split: it is the output head too, where the vocab split pays)
        self.embed_tokens = _param(get, "model.embed_tokens.weight", (v, e),
                                   vocab if cfg.tie_embeddings else hidden)
        self.layers = nnx.List([Block(cfg, i, get, mesh) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(_param(get, "model.norm.weight", (e,), mesh_lib.spec(())), cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else _param(get, "lm_head.weight", (v, e), vocab)
        self.kv_replication = kv_replication(cfg, mesh.shape[TP])
        self.kv_heads = cfg.num_kv_heads * self.kv_replication  # heads the cache stores

    def __call__(self, tokens, positions, valid, kv_len, cache, ctx: AttentionContext, logits_at=None):
        """tokens, positions, valid [B, T]; kv_len [B] cache length after this block is written;
        cache: tuple over layers of (k, v) [B, K, S, D]. Returns (logits, cache): logits [B, T, V], or
        [B, V] at index `logits_at` [B] of each sequence when given (prefill needs only the last one).
        """
        x, new_cache = self._trunk(tokens, positions, valid, kv_len, cache, ctx, ctx.layout.max_seq_len)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)[:, 0]
        return self._logits(x), new_cache

    def forward(self, tokens):
        """Cache-free causal forward over whole sequences [B, T] -> logits [B, T, V] (training, scoring)."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        x, _ = self._trunk(tokens, positions, None, jnp.full((b,), t, jnp.int32), None, None, t)
        return self._logits(x)

    def _trunk(self, tokens, positions, valid, kv_len, cache, ctx, max_seq_len):
        inv_freq = jnp.asarray(self.config.rope.inv_freq(self.config.head_dim, max_seq_len), jnp.float32)
        x = jnp.take(self.embed_tokens[...], tokens, axis=0)
        new_cache = []
        for i, layer in enumerate(self.layers):
            x, layer_cache = layer(x, positions, valid, kv_len, inv_freq, None if cache is None else cache[i], ctx)
            new_cache.append(layer_cache)
        return x, (None if cache is None else tuple(new_cache))

    def _logits(self, x):
        x = self.norm(x)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return jnp.einsum("...e,ve->...v", x, head[...], preferred_element_type=jnp.float32)

    def hf_weights(self) -> dict[str, jax.Array]:
        """Every weight by its Hugging Face name, with replicated KV heads folded back (mesh-independent)."""
        out = {}
        for _, var in nnx.iter_graph(self):
            if isinstance(var, nnx.Param) and getattr(var, "hf_name", None):
                value = var[...]
                rep = var.kv_rep
                if rep > 1:
                    d = self.config.head_dim
                    value = value.reshape((-1, rep, d) + value.shape[1:])[:, 0].reshape((-1,) + value.shape[1:])
                out[var.hf_name] = value
        return out


def cache_sharding(mesh: Mesh):
    return mesh_lib.named(mesh, mesh_lib.kv_cache_spec())


def init_cache(model: CausalLM, batch: int, layout: KVLayout, mesh: Mesh, dtype):
    """Zeroed cache: per layer (k, v) [B, K, S, D], sequence over "dcp", kv heads over "tp".

    Allocated sharded from the start (jit with out_shardings), never as a full array on one device.
    """
    cfg = model.config
    shape = (batch, model.kv_heads, layout.max_seq_len, cfg.head_dim)
    sharding = cache_sharding(mesh)
    make = jax.jit(lambda: tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                                 for _ in range(cfg.num_layers)),
                   out_shardings=tuple((sharding, sharding) for _ in range(cfg.num_layers)))
    return make()


def random_source(cfg: ModelConfig, mesh: Mesh, seed: int = 0, dtype=jnp.float32, scale: float = 0.5):
    """A WeightSource of random weights (norms = 1), for tests and benchmarks."""
    from dcp_jax.weights import expand_kv_rows

    def get(name, shape, spec, kv_rep=1):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name.endswith("norm.weight"):
            host = np.ones(shape, np.float32)
        else:
            base = (shape[0] // kv_rep,) + tuple(shape[1:])
            host = (rng.standard_normal(base) * scale / np.sqrt(shape[-1])).astype(np.float32)
            host = expand_kv_rows(host, kv_rep, cfg.head_dim)
        return jax.device_put(jnp.asarray(host, dtype), mesh_lib.named(mesh, spec))

    return get
