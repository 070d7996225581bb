"""The attention implementations, in one registry, and the calls that pick from it.

Two ops; each implementation offers what it can:

    attention       a query block over one KV slice, dense or paged (`reference.attention`'s
                    contract): "reference" (jnp: the oracle and the CPU path), "pallas" (Pallas
                    Triton, GPUs) and "pallas_interpret" (that kernel in Pallas' interpreter)
    self_attention  causal attention of dense tiles over their own keys and values (a prefill
                    tile's diagonal block, `ragged.self_attention`): every `attention`
                    implementation (the tile as a dense slice), and "cudnn" (cuDNN's flash
                    attention; GPUs only, so it serves no other op and no CPU run)

A caller names the implementation it runs (`impl=`, default `default_impl()`). `SELF_ROUTES` names,
per engine implementation, the implementations that take a ragged batch's diagonal blocks off its
page walk (`diagonal_impl`): "pallas" gives them to cuDNN where cuDNN takes their shapes; where none
does (and on CPU, where one walk with the diagonal masked is cheaper than two passes), the walk
keeps them.
A new kernel (a Mosaic GPU one, say) is one `register` call and a name, and no caller changes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.attention import cudnn, ragged, reference, triton
from pallas_kernels.attention import kv_quant as kvq
from pallas_kernels.attention.common import (SlotPositions, check_inputs, default_scale,
                                             merge_partials)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation.

    attention(q, k, v, q_pos, kv_pos, kv_len, *, scale, v_dim, block_table, layer, [kv_quant,]
        **options) -> (o, lse)
    self_attention(q [W,T,H,Dk], k [W,T,K,Dk], v [W,T,K,Dv] or None, lengths [W], *, scale, v_dim)
        -> (o [W,T,H,Dv], lse [W,T,H])
    takes_self(q, k, v): whether self_attention serves these shapes and dtypes (None: all).
    """

    name: str
    attention: Callable | None = None
    options: frozenset = frozenset()
    self_attention: Callable | None = None
    takes_self: Callable | None = None


REGISTRY: dict[str, Implementation] = {}


def register(impl: Implementation) -> Implementation:
    """Add (or replace) an implementation by its name. One with `attention` serves self_attention
    too (the tile as a dense slice) unless it brings its own."""
    if impl.attention is not None and impl.self_attention is None:
        tiles = functools.partial(_tiles_as_slices, impl.name)
        impl = dataclasses.replace(impl, self_attention=tiles)
    REGISTRY[impl.name] = impl
    return impl


def _tiles_as_slices(name, q, k, v, lengths, *, scale, v_dim=None):
    """Self-attention through an `attention` implementation: tile w's T tokens are a dense slice of
    T slots (positions 0..T-1, `lengths[w]` of them valid), its query j at position j."""
    w, t = q.shape[:2]
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (w, t))
    vt = None if v is None else v.transpose(0, 2, 1, 3)
    return attention(q, k.transpose(0, 2, 1, 3), vt, q_pos, SlotPositions.dense(t),
                     lengths.astype(jnp.int32), scale=scale, impl=name, v_dim=v_dim)


REF_OPTIONS = frozenset({"block_k", "block_k_masked", "pages_per_step"})
PALLAS_OPTIONS = frozenset({"block_q", "block_k", "num_splits", "num_warps", "num_stages"})
register(Implementation("reference", reference.attention, REF_OPTIONS))
register(Implementation("pallas", functools.partial(triton.attention, interpret=False),
                        PALLAS_OPTIONS))
register(Implementation("pallas_interpret", functools.partial(triton.attention, interpret=True),
                        PALLAS_OPTIONS))
register(Implementation("cudnn", self_attention=cudnn.self_attention, takes_self=cudnn.takes))

# Which implementations take an engine implementation's diagonal blocks off its page walk, in order.
SELF_ROUTES = {"pallas": ("cudnn",)}


def implementations() -> tuple[str, ...]:
    """The names `attention(impl=...)` takes."""
    return tuple(name for name, i in REGISTRY.items() if i.attention is not None)



def default_impl() -> str:
    """"pallas" when the default backend is a GPU, else "reference"."""
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def _attention_impl(impl: str | None) -> Implementation:
    impl = impl or default_impl()
    found = REGISTRY.get(impl)
    if found is None or found.attention is None:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {implementations()}")
    return found


def attention(q, k, v, q_pos, kv_pos, kv_len, *, scale: float | None = None, impl: str | None = None,
              v_dim: int | None = None, block_table=None, layer=None, kv_quant: str | None = None,
              **kernel_options):
    """Attention of a query block over one KV slice, with its log-sum-exp.

    Args:
      q: [B, T, H, Dk] queries.  k: [B, K, S, Dk] keys.  v: [B, K, S, Dv] values (Dv may differ from Dk),
        or None when the values are the keys' first `v_dim` features (MLA: the cached latent is the key
        and its first kv_lora_rank features the value; nothing is copied).
      q_pos: [B, T] global positions of the queries.
      kv_pos: `SlotPositions`, the global positions held by the slots of this slice.
      kv_len: [B] valid length of each sequence; a slot is seen by a query iff
        `kv_pos <= q_pos and kv_pos < kv_len` (causal by position).
      scale: softmax scale, default 1/sqrt(Dk).
      impl: a name of `implementations()` ("reference", "pallas", "pallas_interpret");
        default: `default_impl()`.
      block_table: [B, NB] int (paged cache): k [P, K, page, Dk] and v [P, K, page, Dv] are pools of
        pages, and sequence b's slot j (positions from kv_pos, as for a dense slice) lives in page
        block_table[b, j // page] at j % page.
      layer: a scalar (may be traced): k and v lead with a layer axis (the stacked caches of scanned
        layers) and that layer is read in place, never sliced out.
      kv_quant: "int8" / "fp8": k and v hold packed 8-bit rows (`kv_quant`), dequantized inside each
        KV block by either implementation.
    Returns:
      (o [B, T, H, Dv] in q.dtype, lse [B, T, H] float32, natural log). A row that sees no slot gets
      o = 0 and lse = -inf.
    """
    kvq.check(kv_quant)
    lead = 0 if layer is None else 1  # check one layer's shapes, as attention sees them
    k1 = kvq.logical(jax.ShapeDtypeStruct(k.shape[lead:], k.dtype), kv_quant)
    v1 = None if v is None else kvq.logical(jax.ShapeDtypeStruct(v.shape[lead:], v.dtype), kv_quant)
    check_inputs(q, k1, v1, q_pos, kv_pos, kv_len, v_dim, block_table)
    found = _attention_impl(impl)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    if set(kernel_options) - found.options:
        raise ValueError(f"{found.name} takes kernel options {sorted(found.options)}, got "
                         f"{sorted(set(kernel_options) - found.options)}")
    quant = {} if kv_quant is None else dict(kv_quant=kv_quant)
    return found.attention(q, k, v, q_pos, kv_pos, kv_len, scale=scale, v_dim=v_dim,
                           block_table=block_table, layer=layer, **quant, **kernel_options)


def diagonal_impl(impl: str | None, q, k, v) -> str | None:
    """The implementation that takes `impl`'s diagonal blocks of these tiles apart from its page
    walk (the first of `SELF_ROUTES[impl]` that takes their shapes; cuDNN only on a GPU backend), or
    None: the walk keeps them."""
    impl = _attention_impl(impl).name
    for name in SELF_ROUTES.get(impl, ()):
        found = REGISTRY[name]
        if found.takes_self is None or found.takes_self(q, k, v):
            return name
    return None


def self_attention(q, k, v, lengths, *, scale: float | None = None, impl: str | None = None,
                   v_dim: int | None = None, kv_quant: str | None = None):
    """Causal attention of W tiles of T tokens over their own keys and values through implementation
    `impl`: q [W, T, H, Dk], k [W, T, K, Dk], v [W, T, K, Dv] (or None: the keys' first v_dim
    features), lengths [W] (tile w's first lengths[w] entries are its tokens; query j sees entries
    i <= j, i < lengths[w]). `kv_quant`: the keys and values are rounded as the cache stores them
    (so a tile sees what a later read of the cache would). Returns (o [W, T, H, Dv] in q.dtype, lse [W, T, H]
    float32); a query that sees nothing gets o = 0 and lse = -inf."""
    impl = impl or default_impl()
    found = REGISTRY.get(impl)
    if found is None or found.self_attention is None:
        raise ValueError(f"unknown self-attention impl {impl!r}; choose one of "
                         f"{tuple(n for n, i in REGISTRY.items() if i.self_attention is not None)}")
    if kv_quant is not None:
        k = kvq.unpack(kvq.pack(k, kv_quant), kv_quant).astype(k.dtype)
        v = None if v is None else kvq.unpack(kvq.pack(v, kv_quant), kv_quant).astype(v.dtype)
    scale = default_scale(q.shape[-1]) if scale is None else float(scale)
    return found.self_attention(q, k, v, lengths, scale=scale, v_dim=v_dim)


def ragged_attention(q, k, v, q_pos, kv_pos, kv_len, block_table, tiles: ragged.RaggedTiles, *,
                     scale: float | None = None, impl: str | None = None, v_dim: int | None = None,
                     layer=None, kv_quant: str | None = None, fresh=None, prefix_only: bool = False,
                     **kernel_options):
    """Attention of a ragged batch (`pallas_kernels.attention.ragged`): the query tokens of many
    sequences laid end to end, each attending its own sequence's pages.

    q [N, H, Dk] flat; q_pos [N] each token's position; kv_len [R] and block_table [R, NB] per
    sequence (row); tiles: which tokens form each tile and the row it reads. k, v, kv_pos, scale,
    impl, v_dim, layer and the kernel options as `attention` (paged). Returns (o [N, H, Dv] in
    q.dtype, lse [N, H] float32). Each tile group runs as its own launches of `attention` (the
    decode rows as one call of the paged decode configuration, the prefill tiles apart), so every
    implementation serves it.

    fresh: (k_new [N, K, Dk], v_new [N, K, Dv] or None): the batch's own keys and values (as written
    to the pages; the slice must hold whole sequences). With it, a prefill tile reads the pages only
    below its first token (`prefix_only`'s part) and its diagonal block comes from `self_attention`
    over these (through `diagonal_impl(impl)`, else `impl`), merged by LSE.
    prefix_only: return that pages part alone (the DCP island merges the diagonal after its
    combine).
    """
    def attend(qg, pos, lengths, table):
        return attention(qg, k, v, pos, kv_pos, lengths, scale=scale, impl=impl, v_dim=v_dim,
                         block_table=table, layer=layer, kv_quant=kv_quant, **kernel_options)

    split = fresh is not None or prefix_only
    o, lse = ragged.attention(attend, q, q_pos, kv_len, block_table, tiles, split=split)
    if fresh is None:
        return o, lse
    k_new, v_new = fresh
    diag = diagonal_impl(impl, q[None], k_new[None], None if v_new is None else v_new[None])
    o_self, lse_self = ragged_self_attention(q, *fresh, tiles, scale=scale, impl=diag or impl,
                                             v_dim=v_dim, kv_quant=kv_quant)
    o, lse = merge_partials(jnp.stack([o, o_self]), jnp.stack([lse, lse_self]))
    return o.astype(q.dtype), lse


def ragged_self_attention(q, k_new, v_new, tiles: ragged.RaggedTiles, *, scale: float | None = None,
                          impl: str | None = None, v_dim: int | None = None,
                          kv_quant: str | None = None):
    """The diagonal blocks of a ragged batch's prefill tiles (`ragged.self_attention`) through
    `self_attention` of implementation `impl`: q [N, H, Dk], k_new [N, K, Dk], v_new [N, K, Dv] or
    None. Returns (o [N, H, Dv], lse [N, H]); decode tokens get o = 0, lse = -inf."""
    def attend_self(qg, kg, vg, lengths):
        return self_attention(qg, kg, vg, lengths, scale=scale, impl=impl, v_dim=v_dim,
                              kv_quant=kv_quant)

    return ragged.self_attention(attend_self, q, k_new, v_new, tiles)
