"""DCP attention: the one `shard_map` island. Local kernel on each device's KV slice, then the exact combine.

Per device: attend the (replicated over context) queries to this device's slice of the cache, giving a
partial output and its LSE. Combine over the context axes:

    lse   = logsumexp_r(all_gather(lse_r))          (every rank sees every rank's LSE)
    w_r   = exp(lse_r − lse)                         (0 where a shard holds no valid token)
    out   = psum_scatter(o_r · w_r, scatter_dimension=heads)   → each rank keeps its share of heads

When a device's head count does not divide by the number of context shards, `psum` is used instead and
every context rank keeps all of its heads.

`combine="all_to_all"` reaches the same head-scattered result another way: each context rank sends every
other rank the slice of heads that rank will own (`all_to_all` of o_r, and of its LSE), then merges the
N partials of its own heads locally (`merge_partials`). Its output sharding is that of "scatter"; it sends
each rank 1/N of the LSEs that "scatter" all-gathers.

Standard attention: heads over ("tp",), context over ("dcp",). MLA (one latent per token, no head axis):
heads over (), context over ("tp", "dcp"): the island takes its axes as parameters.

DeepSeek Sparse Attention (`dcp_sparse_attention`, DeepSeek-V3.2): the same island and combine, with
a selection before the attention: each rank scores its own tokens with the indexer and keeps its
top-k candidates, the candidates (k per rank per query) are all-gathered over the context axes,
every rank makes the same global choice (`pallas_kernels.attention.sparse`: the one tie-break rule)
and attends only the chosen tokens it owns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from dcp_jax import mesh as mesh_lib
from dcp_jax.layout import KVLayout, PagedLayout
from pallas_kernels.attention import api as kernels
from pallas_kernels.attention import kv_quant as kvq
from pallas_kernels.attention import sparse
from pallas_kernels.attention.common import check_inputs, merge_partials, merge_weights
from pallas_kernels.attention.ragged import RaggedTiles

COMBINES = ("auto", "scatter", "psum", "all_to_all")


def _concrete(x):
    """x as a NumPy array when it is a concrete value, else None (under jit)."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return jax.device_get(x)
    except Exception:  # noqa: BLE001 - abstract values cannot be fetched; skip the value checks
        return None


def resolve_combine(local_heads: int, num_shards: int, combine: str = "auto") -> bool:
    """True when the combine leaves heads scattered over the context axes ("scatter", "all_to_all"),
    False when every context rank keeps all of its heads ("psum")."""
    if combine not in COMBINES:
        raise ValueError(f"combine must be one of {COMBINES}, got {combine!r}")
    divisible = local_heads % num_shards == 0
    if combine in ("scatter", "all_to_all") and not divisible:
        raise ValueError(
            f"combine={combine!r} needs the {local_heads} heads per device to divide by the "
            f"{num_shards} context shards; use combine='psum' or 'auto'"
        )
    return divisible if combine == "auto" else combine != "psum"


def check_ragged(q, q_pos, kv_len, block_table, ragged: RaggedTiles) -> None:
    """Shape checks of a ragged batch (static): one flat row of N tokens, R sequences."""
    if block_table is None:
        raise ValueError("a ragged batch reads a paged pool: pass its block_table [R, blocks]")
    n = q.shape[1]
    if q.shape[0] != 1 or q_pos.shape != (1, n) or ragged.where.shape != (n,) or ragged.token_row.shape != (n,):
        raise ValueError(f"a ragged batch is one flat row: q [1, N, H, D] and q_pos, where, token_row of N "
                         f"tokens; got q {q.shape}, q_pos {q_pos.shape}, where {ragged.where.shape}, "
                         f"token_row {ragged.token_row.shape}")
    if kv_len.shape != block_table.shape[:1]:
        raise ValueError(f"kv_len {kv_len.shape} and block_table {block_table.shape} disagree on the rows")


def dcp_attention(
    q, k_cache, v_cache, q_pos, kv_len, *, mesh: Mesh, layout: KVLayout | PagedLayout,
    head_axes: tuple[str, ...] = (mesh_lib.TP,), context_axes: tuple[str, ...] = (mesh_lib.DCP,),
    scale: float | None = None, impl: str | None = None, combine: str = "auto",
    return_lse: bool = False, v_dim: int | None = None, block_table=None, layer=None,
    ragged: RaggedTiles | None = None, kv_quant: str | None = None, fresh: tuple | None = None,
    **kernel_options,
):
    """Exact attention of queries over a KV cache sharded along the sequence.

    Args:
      q: [B, T, H, Dk] queries (global view; heads split over `head_axes`).
      k_cache: [B, K, S, Dk], v_cache: [B, K, S, Dv], S = layout.max_seq_len, placed by `layout`
        (slots over `context_axes`, kv heads over `head_axes`). v_cache None: the values are the keys'
        first `v_dim` features (MLA's latent cache).
      q_pos: [B, T] global positions of the queries. kv_len: [B] valid cache length per sequence.
      layout: the KV placement; its num_shards must equal the size of `context_axes`.
      block_table: [B, blocks] int (paged, with a `PagedLayout`): k_cache/v_cache are page pools
        [N·pages, K, page, D] (`mesh.kv_pool_spec`): every context rank reads its own pages through the
        same replicated table.
      layer: a scalar (may be traced): the caches are the stacked caches of scanned layers [L, ...]
        and layer `layer` is attended, read in place by the kernel.
      ragged: a ragged batch (`pallas_kernels.attention.ragged`, paged only): q [1, N, H, Dk] and q_pos
        [1, N] are the tokens of R sequences laid end to end, kv_len [R] and block_table [R, NB] per
        sequence, and the tiles say which tokens belong to which sequence. The combine is per (token,
        head), so it runs on the flat batch unchanged.
      combine: "auto" (psum_scatter when heads divide, else psum), "scatter", "psum" or "all_to_all".
      return_lse: also return the merged LSE [B, T, H] (float32).
      kv_quant: "int8" / "fp8": the caches hold packed 8-bit rows (`pallas_kernels.attention.kv_quant`),
        dequantized inside each KV block by the kernel.
      fresh: (k_new, v_new) [B, T, K, D] (MLA: (latent,)), the entries this call's tokens just
        wrote (as `write_kv` took them: replicated over the context axes). With a ragged batch whose
        diagonal blocks an implementation takes off the page walk (`kernels.diagonal_impl`: cuDNN
        under "pallas"), each prefill tile reads the pages only below its first token, and after
        the combine each context rank adds the tiles' diagonal blocks for the heads it keeps
        (`_diagonal`): computed once, by the rank that owns the heads. Ignored otherwise.
    Returns:
      out [B, T, H, Dv] in q.dtype, sharded per `mesh.attn_out_spec` (and the LSE if asked).
    """
    paged, stacked = block_table is not None, layer is not None
    n_heads_shards = mesh_lib.axis_size(mesh, head_axes)
    n_ctx = mesh_lib.axis_size(mesh, context_axes)
    _check_call(q, k_cache, v_cache, q_pos, kv_len, layout=layout, head_axes=head_axes,
                n_heads_shards=n_heads_shards, context_axes=context_axes, n_ctx=n_ctx, v_dim=v_dim,
                block_table=block_table, stacked=stacked, ragged=ragged, kv_quant=kv_quant)
    impl = impl or kernels.default_impl()
    scattered = resolve_combine(q.shape[2] // n_heads_shards, n_ctx, combine)
    exchanged = combine == "all_to_all"
    shared_v = v_cache is None
    diag, fresh = _split_diagonal(impl, q, fresh if ragged is not None else None)
    body = functools.partial(
        _island, layout=layout, context_axes=context_axes, n_ctx=n_ctx, scattered=scattered,
        exchanged=exchanged, shared_v=shared_v, paged=paged, stacked=stacked, ragged=ragged is not None,
        n_fresh=len(fresh), return_lse=return_lse, diag=diag,
        opts=dict(scale=scale, impl=impl, v_dim=v_dim, kv_quant=kv_quant, **kernel_options))

    make_spec = mesh_lib.kv_pool_spec if paged else mesh_lib.kv_cache_spec
    cache_spec = make_spec(head_axes, context_axes, stacked)
    caches = (k_cache,) if shared_v else (k_cache, v_cache)
    extras = _extras(block_table, layer, ragged)
    replicated = mesh_lib.lengths_spec()  # lengths, block table, layer, tiles
    out, lse = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(mesh_lib.q_spec(head_axes), *(cache_spec for _ in caches), replicated, replicated,
                  *(replicated for _ in extras), *(mesh_lib.q_spec(head_axes) for _ in fresh)),
        out_specs=(
            mesh_lib.attn_out_spec(head_axes, context_axes, scattered),
            (mesh_lib.attn_lse_spec(head_axes, context_axes) if exchanged
             else mesh_lib.stacked_lse_spec(head_axes, context_axes)),
        ),
        # A pallas_call (in interpret mode on CPU for certain) does not carry shard_map's
        # varying-manual-axes annotations, so those checks are off for the kernel; the reference
        # keeps them.
        check_vma=not impl.startswith("pallas"),
    )(q, *caches, q_pos, kv_len, *extras, *fresh)
    if exchanged:
        return (out, lse) if return_lse else out
    return (out, lse[0]) if return_lse else out


def _split_diagonal(impl, q, fresh):
    """(the implementation that takes a ragged step's diagonal blocks, the fresh entries it reads),
    or (None, ()) where none does (the page walk keeps them) or the call has no fresh entries."""
    if not fresh:
        return None, ()
    diag = kernels.diagonal_impl(impl, q, fresh[0], fresh[1] if len(fresh) > 1 else None)
    return (diag, tuple(fresh)) if diag else (None, ())


def _island(q, k, *rest, layout, context_axes, n_ctx, scattered, exchanged, shared_v, paged,
            stacked, ragged, n_fresh, return_lse, diag, opts):
    """One device's part of `dcp_attention` (the shard_map body): the kernel over this device's
    slice, then the combine over the context axes. rest: v (unless shared), q_pos, kv_len, then the
    block table, the layer and the ragged tiles where the call has them, and the fresh entries."""
    rest = list(rest)
    v = None if shared_v else rest.pop(0)
    fresh = tuple(rest[len(rest) - n_fresh:])
    q_pos, kv_len, *extra = rest[:len(rest) - n_fresh]
    rank = lax.axis_index(context_axes) if context_axes else 0
    table, layer, tiles = _unpack_extras(extra, paged, stacked, ragged)
    opts = dict(opts, layer=layer)
    positions = layout.slice_positions(rank)
    if ragged:  # one flat row of tokens: [N, ...] in, [1, N, ...] out
        o, lse = kernels.ragged_attention(q[0], k, v, q_pos[0], positions, kv_len, table, tiles,
                                          prefix_only=bool(fresh), **opts)
        o, lse = o[None], lse[None]
    else:
        o, lse = kernels.attention(q, k, v, q_pos, positions, kv_len, block_table=table, **opts)
    split = bool(context_axes) and (scattered or exchanged)
    if fresh and not split:  # every rank keeps every head: the diagonal joins rank 0's partial
        o, lse = _diagonal(o, lse, q, fresh, tiles, 0, opts=dict(opts, impl=diag), owner=rank == 0)
    if not context_axes:  # one whole copy of the cache: nothing to combine
        return o.astype(q.dtype), (lse if exchanged else lse[None])
    out, lse = _combine(o, lse, rank, context_axes=context_axes, n_ctx=n_ctx, scattered=scattered,
                        exchanged=exchanged)
    if fresh and split:  # each rank adds its own heads' diagonal blocks
        lse_mine = lse if exchanged else lax.dynamic_slice_in_dim(lse[0], rank * out.shape[2],
                                                                  out.shape[2], axis=-1)
        out, merged = _diagonal(out, lse_mine, q, fresh, tiles, rank * out.shape[2],
                                opts=dict(opts, impl=diag))
        if exchanged:
            lse = merged
        elif return_lse:  # the other heads' LSEs from their ranks ([N, H/N] floats each)
            lse = lax.all_gather(merged, context_axes, axis=-1, tiled=True)[None]
        # (else the LSE is dropped by the caller: the combine's is returned, not gathered)
    return out.astype(q.dtype), lse


def _diagonal(o, lse, q, fresh, tiles, first, *, opts, owner=True):
    """A split ragged batch's (o [1, N, Hs, Dv], lse [1, N, Hs]) for query heads [first, first + Hs)
    merged by LSE with the prefill tiles' diagonal blocks of those heads: their queries over the
    batch's fresh keys and values (`kernels.ragged_self_attention` through opts["impl"]). owner
    False (may be traced): the blocks count for nothing (a rank that must not add them again).
    Returns (o float32, lse)."""
    k_new = fresh[0][0]
    v_new = None if len(fresh) == 1 else fresh[1][0]
    hl, kl, hs = q.shape[2], k_new.shape[1], o.shape[2]
    q_mine = lax.dynamic_slice_in_dim(q[0], first, hs, axis=1)
    g = hl // kl
    if hs % g == 0 or g % hs == 0:  # whole kv heads, or a share of one: a contiguous slice
        kv_first, kv_n = first // g, max(hs // g, 1)

        def pick(x):
            return None if x is None else lax.dynamic_slice_in_dim(x, kv_first, kv_n, axis=1)
    else:  # heads that straddle kv heads unevenly: each query head its own kv head
        heads = (first + jnp.arange(hs)) // g

        def pick(x):
            return None if x is None else jnp.take(x, heads, axis=1)
    o_self, lse_self = kernels.ragged_self_attention(
        q_mine, pick(k_new), pick(v_new), tiles, scale=opts["scale"], impl=opts["impl"],
        v_dim=opts["v_dim"], kv_quant=opts["kv_quant"])
    lse_self = jnp.where(owner, lse_self, -jnp.inf)
    return merge_partials(jnp.stack([o, o_self[None]]), jnp.stack([lse, lse_self[None]]))


def _check_call(q, k_cache, v_cache, q_pos, kv_len, *, layout, head_axes, n_heads_shards,
                context_axes, n_ctx, v_dim, block_table, stacked, ragged, kv_quant) -> None:
    """The shape and placement rules of a `dcp_attention` call; a ValueError names the first broken
    one. Values are checked only where kv_len is concrete (not under jit)."""
    paged = block_table is not None

    def one(c):  # one layer's view of a stacked cache
        return c if not stacked or c is None else jax.ShapeDtypeStruct(c.shape[1:], c.dtype)

    k1 = kvq.logical(one(k_cache), kv_quant)
    if ragged is not None:  # (each tile group's call checks q, k and v against each other)
        check_ragged(q, q_pos, kv_len, block_table, ragged)
    else:
        v1 = kvq.logical(one(v_cache), kv_quant)
        check_inputs(q, k1, v1, q_pos, None, kv_len, v_dim, block_table)
    h, kh = q.shape[2], k1.shape[1]
    s = layout.capacity_tokens(block_table.shape[1]) if paged else k1.shape[2]
    if h % n_heads_shards:
        raise ValueError(f"query heads ({h}) must divide by the {n_heads_shards} shards of {head_axes}")
    if kh % n_heads_shards:
        raise ValueError(
            f"kv heads ({kh}) must divide by the {n_heads_shards} shards of {head_axes}; "
            "replicate kv heads so every tp rank holds whole heads"
        )
    _check_layout(layout, context_axes, n_ctx, paged)
    if paged and (k1.shape[2] != layout.page_size or k1.shape[0] % n_ctx):
        raise ValueError(f"pool {k1.shape} does not hold pages of {layout.page_size} slots on "
                         f"{n_ctx} context shards")
    if not paged and s != layout.max_seq_len:
        raise ValueError(f"cache holds {s} slots but the layout places {layout.max_seq_len}")
    lengths = _concrete(kv_len)
    if lengths is not None and (lengths.min() < 0 or lengths.max() > s):
        raise ValueError(f"kv_len {lengths.tolist()} outside the cache's 0..{s} slots")


def _check_layout(layout, context_axes, n_ctx: int, paged: bool) -> None:
    """The layout of a call's cache: one shard per context rank, paged with a block table."""
    if layout.num_shards != n_ctx:
        raise ValueError(f"layout has {layout.num_shards} shards but context axes {context_axes} "
                         f"have {n_ctx}")
    if paged != isinstance(layout, PagedLayout):
        raise ValueError("a paged pool takes a PagedLayout and its block_table; a dense cache a "
                         "KVLayout")


def _extras(block_table, layer, ragged) -> tuple:
    """The replicated arguments an island takes after the lengths: the block table, the layer and
    the ragged tiles, each where the call has it (`_unpack_extras` reads them back)."""
    return (((block_table,) if block_table is not None else ())
            + ((jnp.asarray(layer, jnp.int32),) if layer is not None else ())
            + ((ragged,) if ragged is not None else ()))


def _unpack_extras(extra, paged: bool, stacked: bool, ragged: bool):
    """(block table, layer, tiles) from an island's `_extras` arguments; None where absent."""
    extra = list(extra)
    table = extra.pop(0) if paged else None
    layer = extra.pop(0) if stacked else None
    return table, layer, extra.pop(0) if ragged else None


def _combine(o, lse, rank, *, context_axes, n_ctx: int, scattered: bool, exchanged: bool):
    """Inside the island: this rank's partial (o [B, T, H_local, Dv], lse [B, T, H_local]) merged with
    the other context ranks' into (out float32, its LSE): the LSE stacked over ranks
    [1, B, T, H_local] (every rank holds the same one: no replication claim to prove to shard_map,
    the caller keeps rank 0's copy), or with "all_to_all" this rank's heads' LSE [B, T, H_local/N]."""
    if exchanged:
        # Heads [H_local] -> [N, H_local/N]: slice j goes to context rank j, which receives the N
        # ranks' partials of its heads stacked on the same axis (source rank order) and merges them.
        b_, t_, hl, dv = o.shape
        o_parts = lax.all_to_all(o.reshape(b_, t_, n_ctx, hl // n_ctx, dv), context_axes, 2, 2)
        lse_parts = lax.all_to_all(lse.reshape(b_, t_, n_ctx, hl // n_ctx), context_axes, 2, 2)
        return merge_partials(o_parts, lse_parts, axis=2)  # [B, T, H_local/N, Dv]
    lse_all = lax.all_gather(lse, context_axes, axis=0)  # [N, B, T, H_local]
    lse_total, w = merge_weights(lse_all, axis=0)
    ow = o.astype(jnp.float32) * w[rank][..., None]
    if scattered:
        out = lax.psum_scatter(ow, context_axes, scatter_dimension=2, tiled=True)
    else:
        out = lax.psum(ow, context_axes)
    return out, lse_total[None]

def write_kv(
    caches: tuple,
    new: tuple,
    positions,
    valid,
    *,
    mesh: Mesh,
    layout: KVLayout | PagedLayout,
    head_axes: tuple[str, ...] = (mesh_lib.TP,),
    context_axes: tuple[str, ...] = (mesh_lib.DCP,),
    block_table=None,
    layer=None,
    ragged: RaggedTiles | None = None,
    kv_quant: str | None = None,
):
    """Write new tokens' entries into the cache shards that own their positions, in place.

    caches: a tuple of caches [B, K, S, D_i] ((k, v), or MLA's single latent cache); new: the matching
    tuple of new entries [B, T, K, D_i] (replicated over the context axes); positions [B, T]; valid [B, T]
    (padding tokens of a ragged chunk are not written). Each context rank scatters only the tokens it
    owns; every other index is dropped, so no cache-sized temporary is made. Returns the new caches.
    Paged (`block_table` [B, blocks] with a `PagedLayout`): caches are pools [N·pages, K, page, D_i]
    and position t of sequence b goes to page block_table[b, block_of(t)], slot page_slot_of(t).
    `layer` (scalar, may be traced): the caches are stacked over layers [L, ...]; only that layer is
    written, in place. `ragged` (paged only): positions [1, N] are the tokens of R sequences laid end to
    end, block_table [R, blocks], and token i goes through row `ragged.token_row[i]` of it.
    `kv_quant` ("int8" / "fp8"): each entry is quantized as it is written (`kv_quant.pack`: its values and
    its scale in one stored row).
    """
    b, t = positions.shape
    n = len(caches)
    paged, stacked = block_table is not None, layer is not None
    if paged != isinstance(layout, PagedLayout):
        raise ValueError("a paged pool takes a PagedLayout and its block_table; a dense cache a KVLayout")

    def body(*args):
        cs, ns, (pos, ok, *extra) = args[:n], args[n:2 * n], args[2 * n:]
        if kv_quant is not None:
            ns = tuple(kvq.pack(x, kv_quant) for x in ns)
        table, layer, tiles = _unpack_extras(extra, paged, stacked, ragged is not None)
        lead = (jnp.broadcast_to(layer, (b, t)),) if stacked else ()  # the layer, for every token
        rank = lax.axis_index(context_axes) if context_axes else 0
        mine = ok & (layout.rank_of(pos) == rank)
        if paged:
            num_pages = cs[0].shape[len(lead)]
            rows = tiles.token_row[None] if tiles is not None else None
            # not mine, or past the table: dropped
            page = layout.page_of(table, pos, mine, missing=num_pages, rows=rows)
            return tuple(c.at[(*lead, page, slice(None), layout.page_slot_of(pos))].set(x.astype(c.dtype), mode="drop")
                         for c, x in zip(cs, ns))
        slot = jnp.where(mine, layout.slot_of(pos), layout.slots_per_shard)  # out of range: dropped
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        return tuple(c.at[(*lead, rows, slice(None), slot)].set(x.astype(c.dtype), mode="drop")
                     for c, x in zip(cs, ns))

    cache_spec = (mesh_lib.kv_pool_spec if paged else mesh_lib.kv_cache_spec)(head_axes, context_axes, stacked)
    if ragged is not None and not paged:
        raise ValueError("a ragged batch writes a paged pool: pass its block_table [R, blocks]")
    extras = _extras(block_table, layer, ragged)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(*(cache_spec,) * n, *(mesh_lib.q_spec(head_axes),) * n, mesh_lib.lengths_spec(),
                  mesh_lib.lengths_spec(), *(mesh_lib.lengths_spec() for _ in extras)),  # block table, layer: replicated
        out_specs=(cache_spec,) * n,
    )(*caches, *new, positions, valid, *extras)


def dcp_sparse_attention(
    q, latent, index_keys, index_q, index_w, q_pos, kv_len, *, mesh: Mesh,
    layout: KVLayout | PagedLayout, topk: int, index_scale: float, scale: float, v_dim: int,
    context_axes: tuple[str, ...] = mesh_lib.AXES, combine: str = "auto", block_table=None,
    layer=None, ragged: RaggedTiles | None = None, return_chosen: bool = False,
):
    """DeepSeek Sparse Attention (DeepSeek-V3.2) over MLA's latent cache sharded along the sequence,
    with ONE exact top-k per query across the context ranks.

    Per context rank (the island): score every cached token it holds with the indexer
    (`sparse.index_scores` of the query's index heads against the rank's index keys, causal and
    within the sequence's length), keep its best `topk` (score, position) (`sparse.local_topk`);
    all-gather those candidates over `context_axes` (topk per rank per query: the bytes do not grow
    with the context); every rank makes the same choice from them (`sparse.merge_topk`: higher
    score, then lower position); then attend only the chosen tokens it owns (their latents gathered
    from its own pages: at most topk per query) and the LSE combine (`_combine`) finishes the sum. A
    query that sees fewer than topk tokens attends all of them.

    Args (MLA's layout: heads replicated, the caches' one "kv head" and slots over `context_axes`):
      q: [B, T, H, D] absorbed queries; latent, index_keys: the caches ([B, 1, S, D] and
        [B, 1, S, Di], or page pools with `block_table`, stacked over layers with `layer`),
        written already;
      index_q [B, T, Hi, Di], index_w [B, T, Hi] (float32): the indexer's queries and head weights;
      q_pos, kv_len, block_table, layer, ragged, combine: as `dcp_attention`.
      return_chosen: also return the chosen positions [B, T, topk] (replicated; NO_POSITION where a
        query sees fewer than topk tokens), the same on every mesh and placement.
    Returns out [B, T, H, v_dim] in q.dtype (sharded as `dcp_attention`'s), and the chosen
    positions if asked.
    """
    paged, stacked = block_table is not None, layer is not None
    n_ctx = mesh_lib.axis_size(mesh, context_axes)
    _check_layout(layout, context_axes, n_ctx, paged)
    if ragged is not None:
        check_ragged(q, q_pos, kv_len, block_table, ragged)
    scattered = resolve_combine(q.shape[2], n_ctx, combine)
    exchanged = combine == "all_to_all"
    body = functools.partial(
        _sparse_island, layout=layout, context_axes=context_axes, n_ctx=n_ctx, scattered=scattered,
        exchanged=exchanged, paged=paged, stacked=stacked, ragged=ragged is not None,
        topk=topk, index_scale=index_scale, scale=scale, v_dim=v_dim)
    make_spec = mesh_lib.kv_pool_spec if paged else mesh_lib.kv_cache_spec
    cache_spec = make_spec((), context_axes, stacked)
    extras = _extras(block_table, layer, ragged)
    rep = mesh_lib.lengths_spec()
    out, chosen = jax.shard_map(
        body, mesh=mesh,
        in_specs=(mesh_lib.q_spec(()), cache_spec, cache_spec, mesh_lib.q_spec(()), rep, rep, rep,
                  *(rep for _ in extras)),
        # the chosen positions stacked over the ranks (each holds the same): no replication claim
        out_specs=(mesh_lib.attn_out_spec((), context_axes, scattered),
                   mesh_lib.stacked_lse_spec((), context_axes)),
    )(q, latent, index_keys, index_q, index_w.astype(jnp.float32), q_pos, kv_len, *extras)
    return (out, chosen[0]) if return_chosen else out


def _sparse_island(q, latent, index_keys, index_q, index_w, q_pos, kv_len, *extra, layout,
                   context_axes, n_ctx, scattered, exchanged, paged, stacked, ragged, topk,
                   index_scale, scale, v_dim):
    """One device's part of `dcp_sparse_attention`: its candidates, the gathered choice, the
    attention over the chosen tokens it owns, then the combine. Tokens are handled flat [M] (B·T,
    or a ragged batch's N), each with its row (its sequence's length, block-table row, cache
    row)."""
    table, layer, tiles = _unpack_extras(extra, paged, stacked, ragged)
    rank = lax.axis_index(context_axes) if context_axes else 0
    b, t, h, d = q.shape
    m = b * t
    rows = tiles.token_row if ragged else jnp.repeat(jnp.arange(b, dtype=jnp.int32), t)
    pos_q = q_pos.reshape(m)

    def one_layer(c):
        return c[layer] if stacked else c

    keys = _rows_of(one_layer(index_keys), table, paged)  # [R, S_loc, Di], logical local slots
    slots = layout.slice_positions(rank).at(jnp.arange(keys.shape[1], dtype=jnp.int32))
    if ragged:  # tile by tile: each tile's queries against its row's keys
        vals, pos = _ragged_candidates(index_q[0], index_w[0], keys, slots, pos_q, kv_len, tiles,
                                       topk=topk, index_scale=index_scale)
    else:
        scores = sparse.index_scores(index_q, index_w, keys, index_scale).reshape(m, -1)
        visible = (slots[None] <= pos_q[:, None]) & (slots[None] < kv_len[rows][:, None])
        vals, pos = sparse.local_topk(scores, slots, visible, topk)
    if context_axes:  # the candidates, topk per rank per query
        vals = lax.all_gather(vals, context_axes, axis=1, tiled=True)
        pos = lax.all_gather(pos, context_axes, axis=1, tiled=True)
    vals, chosen = sparse.merge_topk(vals, pos, topk)
    mine = (vals > -jnp.inf) & (layout.rank_of(chosen) == rank)
    at = jnp.where(mine, chosen, 0)
    lat = one_layer(latent)
    if paged:
        page = layout.page_of(table, at, mine, rows=jnp.broadcast_to(rows[:, None], at.shape))
        kv = lat[page, 0, layout.page_slot_of(at)]  # [M, topk, D]
    else:
        kv = lat[rows[:, None], 0, layout.slot_of(at)]
    o, lse = sparse.gathered_attention(q.reshape(m, h, d), kv, mine, scale=scale, v_dim=v_dim)
    o, lse = o.reshape(b, t, h, v_dim), lse.reshape(b, t, h)
    chosen = chosen.reshape(b, t, topk)[None]
    if not context_axes:
        return o.astype(q.dtype), chosen
    out, _ = _combine(o, lse, rank, context_axes=context_axes, n_ctx=n_ctx, scattered=scattered,
                      exchanged=exchanged)
    return out.astype(q.dtype), chosen


def _ragged_candidates(iq, iw, keys, slots, q_pos, kv_len, tiles: RaggedTiles, *, topk: int,
                       index_scale: float):
    """A ragged batch's local candidates ([N, topk] scores and positions), scored per tile group as
    the attention kernels run it: each tile's queries (iq [N, Hi, Di], iw [N, Hi]) against its row's
    keys (keys [R, S_loc, Di] gathered once per tile, not once per token), then each token's entry
    picked back out (`tiles.where`)."""
    vals, pos = [], []
    for g in tiles.groups:
        safe = jnp.maximum(g.index, 0)  # [W, T]
        scores = sparse.index_scores(iq[safe], iw[safe], keys[g.row], index_scale)  # [W, T, S]
        visible = ((slots[None, None] <= q_pos[safe][..., None])
                   & (slots[None, None] < kv_len[g.row][:, None, None]))
        v, p = sparse.local_topk(scores, slots, visible, topk)
        vals.append(v.reshape(-1, topk))
        pos.append(p.reshape(-1, topk))
    return jnp.concatenate(vals)[tiles.where], jnp.concatenate(pos)[tiles.where]


def _rows_of(cache, table, paged: bool):
    """Every row's entries in this device's logical local slot order [R, S_loc, D]: a page pool
    [P, 1, page, D] through the block table [R, NB] (slot j at page table[r, j // page], j % page),
    or a dense cache [B, 1, S_loc, D]."""
    if not paged:
        return cache[:, 0]
    pages = cache[table, 0]  # [R, NB, page, D]
    return pages.reshape(table.shape[0], -1, cache.shape[-1])
