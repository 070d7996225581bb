"""DCP attention (shard_map island + exact combine) against dense float64 attention."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax import KVLayout, dcp_attention, make_mesh
from dcp_jax.layout import PagedLayout
from dcp_jax.attention import resolve_combine
from tests.util import assert_lse_close, dense_attention, place, rel_err

MESHES = [(1, 1), (1, 2), (1, 8), (2, 4), (4, 2), (8, 1), (1, 3)]
INTERLEAVES = [1, 4, "contiguous"]
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def run_case(tp, dcp, gqa, interleave, t, dtype=jnp.float32, lengths=None, max_seq_len=48, combine="auto",
             impl="reference", head_axes=("tp",), context_axes=("dcp",), kv_heads=None, dk=16, dv=16,
             seed=0, page=0):
    """One DCP attention call against float64; with `page`, over a paged pool (random page order, the
    same block table on every context rank) holding what the dense layout places."""
    mesh = make_mesh(tp, dcp)
    n_ctx = int(np.prod([mesh.shape[a] for a in context_axes]))
    layout = KVLayout.create(max_seq_len, n_ctx, interleave)
    kh = kv_heads or max(2, tp if head_axes else 1)
    h = kh * gqa
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = [layout.max_seq_len, 19, 2]  # ragged; the last is shorter than most dcp sizes
    lengths = np.asarray(lengths, np.int32)
    b = len(lengths)
    q = rng.standard_normal((b, t, h, dk)).astype(np.float32)
    k = rng.standard_normal((b, kh, layout.max_seq_len, dk)).astype(np.float32)
    v = rng.standard_normal((b, kh, layout.max_seq_len, dv)).astype(np.float32)
    q_pos = (np.maximum(lengths, 1)[:, None] - t + np.arange(t)).astype(np.int32)
    scale = 1.0 / np.sqrt(dk)
    ref_o, ref_lse = dense_attention(q, k, v, q_pos, lengths, scale)

    kc, vc, extra = place(k, layout), place(v, layout), {}
    if page:
        (kc, vc), table = paginate((kc, vc), layout, page, rng)
        extra = dict(block_table=jnp.asarray(table), layout=PagedLayout(n_ctx, layout.interleave, page))
    fn = jax.jit(lambda *a: dcp_attention(
        *a, mesh=mesh, head_axes=head_axes, context_axes=context_axes, combine=combine,
        impl=impl, return_lse=True, **{"layout": layout, **extra}))
    o, lse = fn(jnp.asarray(q, dtype), jnp.asarray(kc, dtype), jnp.asarray(vc, dtype),
                jnp.asarray(q_pos), jnp.asarray(lengths))
    tol = TOL[dtype]
    assert o.dtype == dtype and o.shape == (b, t, h, dv)
    assert not np.isnan(np.asarray(o, np.float32)).any()
    err = rel_err(o, ref_o)
    assert err <= tol, f"relative error {err} > {tol}"
    assert_lse_close(lse, ref_lse, tol)
    return o


def paginate(caches, layout, page, rng, spare=2):
    """Dense placed caches [B, K, N·S_local, D] -> pools [N·P, K, page, D] and a block table [B, NB]:
    rank r's logical local slots [j·page, (j+1)·page) of sequence b go to page table[b, j] of rank r's
    P pages. Unused pages (the null page 0 among them) hold values that would show if read."""
    b, kh, s, _ = caches[0].shape
    n = layout.num_shards
    s_local = s // n
    nb = -(-s_local // page)
    pages = 1 + spare + b * nb
    table = rng.permutation(np.arange(1, pages))[: b * nb].reshape(b, nb).astype(np.int32)
    pools = []
    for c in caches:
        pool = rng.standard_normal((n * pages, kh, page, c.shape[-1])).astype(np.float32) * 100
        for r in range(n):
            local = np.zeros((b, kh, nb * page, c.shape[-1]), np.float32)
            local[:, :, :s_local] = c[:, :, r * s_local:(r + 1) * s_local]
            for bi in range(b):
                for j in range(nb):
                    pool[r * pages + table[bi, j]] = local[bi, :, j * page:(j + 1) * page]
        pools.append(pool)
    return pools, table


PAGED = [(1, 1, 1, 8), (1, 8, 1, 2), (2, 4, 2, 4), (4, 2, 1, 4), (1, 3, 4, 4), (1, 8, 2, 16)]


@pytest.mark.parametrize("tp,dcp,interleave,page", PAGED)
@pytest.mark.parametrize("t", [1, 16])
def test_paged_dcp_matches_dense(tp, dcp, interleave, page, t):
    run_case(tp, dcp, 4, interleave, t, page=page)


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
def test_paged_latent_over_both_axes(impl):
    # MLA's paged latent: one kv head, pages over ("tp", "dcp") together.
    run_case(2, 4, 8, 1, 1, head_axes=(), context_axes=("tp", "dcp"), kv_heads=1, page=2, impl=impl)


# Every mesh × T × GQA ratio, cycling interleaves so each mesh meets all three.
CASES = [
    (tp, dcp, gqa, INTERLEAVES[i % 3], t)
    for i, ((tp, dcp), t, gqa) in enumerate(itertools.product(MESHES, (1, 16), (1, 4, 8)))
]


@pytest.mark.parametrize("tp,dcp,gqa,interleave,t", CASES)
def test_dcp_matches_dense_float32(tp, dcp, gqa, interleave, t):
    run_case(tp, dcp, gqa, interleave, t)


@pytest.mark.parametrize("tp,dcp,interleave", [(2, 4, 1), (1, 8, "contiguous"), (1, 3, 4)])
def test_dcp_matches_dense_bfloat16(tp, dcp, interleave):
    run_case(tp, dcp, 4, interleave, 1, dtype=jnp.bfloat16)


@pytest.mark.parametrize("tp,dcp,combine", [(1, 8, "auto"), (2, 4, "auto"), (1, 3, "auto"),
                                             (1, 8, "all_to_all"), (2, 4, "all_to_all"), (2, 4, "psum")])
def test_empty_shards_give_no_nan(tp, dcp, combine):
    # Lengths shorter than dcp (and zero): most shards own no valid token (weight exactly 0).
    o = run_case(tp, dcp, 4, 1, 1, lengths=[1, 0, 2], combine=combine)
    np.testing.assert_array_equal(np.asarray(o[1]), 0.0)


COMBINE_NAMES = ["scatter", "psum", "all_to_all"]


@pytest.mark.parametrize("combine", COMBINE_NAMES)
@pytest.mark.parametrize("tp,dcp,t", [(1, 8, 16), (2, 4, 1), (4, 2, 16)])
def test_every_combine(combine, tp, dcp, t):
    # 8 heads per tp rank on (1, 8) and 4 per tp rank on (2, 4), (4, 2): divisible, so every combine
    # applies.
    run_case(tp, dcp, 4, 1, t, combine=combine)


@pytest.mark.parametrize("tp,dcp", [(1, 8), (2, 4)])
def test_combines_agree(tp, dcp):
    # The three combines are exact and agree with each other (lengths leave some ranks empty).
    outs = [run_case(tp, dcp, 4, 1, 1, lengths=[48, 3, 0], combine=c) for c in COMBINE_NAMES]
    for o in outs[1:]:
        np.testing.assert_allclose(np.asarray(o), np.asarray(outs[0]), rtol=1e-5, atol=1e-6)


def test_all_to_all_on_both_context_axes():
    # MLA-style: heads not split over a head axis, context over ("tp", "dcp") together.
    run_case(2, 4, 8, 1, 1, head_axes=(), context_axes=("tp", "dcp"), kv_heads=1, combine="all_to_all")


def test_psum_fallback_when_heads_do_not_divide():
    # (1, 3): 8 heads do not divide by 3 context shards -> auto falls back to psum.
    assert resolve_combine(8, 3) is False and resolve_combine(9, 3) is True
    run_case(1, 3, 4, 1, 1, combine="auto")
    for combine in ("scatter", "all_to_all"):
        with pytest.raises(ValueError, match=f"combine='{combine}' needs"):
            run_case(1, 3, 4, 1, 1, combine=combine)


def test_output_sharding_follows_combine():
    mesh = make_mesh(2, 4)
    layout = KVLayout.create(16, 4, 1)
    args = (jnp.zeros((1, 1, 16, 8)), jnp.zeros((1, 2, 16, 8)), jnp.zeros((1, 2, 16, 8)),
            jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
    out = jax.jit(lambda *a: dcp_attention(*a, mesh=mesh, layout=layout))(*args)
    assert out.sharding.spec[2] == ("tp", "dcp")
    assert out.addressable_shards[0].data.shape == (1, 1, 2, 8)
    out = jax.jit(lambda *a: dcp_attention(*a, mesh=mesh, layout=layout, combine="psum"))(*args)
    assert out.addressable_shards[0].data.shape == (1, 1, 8, 8)
    out, lse = jax.jit(lambda *a: dcp_attention(*a, mesh=mesh, layout=layout, combine="all_to_all",
                                                return_lse=True))(*args)
    assert out.sharding.spec[2] == ("tp", "dcp") and lse.sharding.spec[2] == ("tp", "dcp")
    assert out.addressable_shards[0].data.shape == (1, 1, 2, 8)


@pytest.mark.parametrize("tp,dcp", [(2, 4), (8, 1)])
def test_mla_style_context_over_whole_mesh(tp, dcp):
    # One shared latent "kv head", sequence sharded over ("tp","dcp"), all heads on every device;
    # key wider than value as in MLA's absorbed form.
    run_case(tp, dcp, 8, 1, 1, head_axes=(), context_axes=("tp", "dcp"), kv_heads=1, dk=24, dv=16)


def test_pallas_kernel_inside_shard_map():
    run_case(2, 4, 4, 1, 1, impl="pallas_interpret", max_seq_len=64, lengths=[64, 9])


def _args(b=2, t=1, h=8, kh=2, s=16, d=8):
    return [jnp.zeros((b, t, h, d)), jnp.zeros((b, kh, s, d)), jnp.zeros((b, kh, s, d)),
            jnp.zeros((b, t), jnp.int32), jnp.ones((b,), jnp.int32)]


@pytest.mark.parametrize("tp,dcp,change,match", [
    (4, 2, dict(h=6, kh=2), r"query heads \(6\) must divide"),
    (4, 2, dict(h=8, kh=2), r"kv heads \(2\) must divide"),
    (1, 2, dict(s=24), "cache holds 24 slots but the layout places 16"),
    (1, 4, {}, "layout has 2 shards"),
])
def test_bad_arguments(tp, dcp, change, match):
    mesh = make_mesh(tp, dcp)
    layout = KVLayout.create(16, 2, 1)
    with pytest.raises(ValueError, match=match):
        dcp_attention(*_args(**change), mesh=mesh, layout=layout)


def test_lengths_beyond_the_slice():
    mesh = make_mesh(1, 2)
    layout = KVLayout.create(16, 2, 1)
    args = _args()
    args[4] = jnp.asarray([3, 17], jnp.int32)
    with pytest.raises(ValueError, match=r"kv_len \[3, 17\] outside the cache's 0..16 slots"):
        dcp_attention(*args, mesh=mesh, layout=layout)


def test_paged_write_past_the_block_table_is_dropped():
    # Position 9 has no block in a 2-block table of 4-slot pages: it must be dropped, not folded
    # into the last block's page on top of position 5 (same page slot).
    from dcp_jax.attention import write_kv

    mesh = make_mesh(1, 1)
    layout = PagedLayout(1, 1, 4)
    pool = jnp.zeros((3, 1, 4, 2), jnp.float32)  # pages 0 (null), 1, 2
    new = jnp.asarray([5.0, 9.0], jnp.float32).reshape(1, 2, 1, 1) * jnp.ones((1, 1, 1, 2))
    (out,) = write_kv((pool,), (new,), jnp.asarray([[5, 9]], jnp.int32), jnp.ones((1, 2), bool), mesh=mesh,
                      layout=layout, block_table=jnp.asarray([[1, 2]], jnp.int32))
    out = np.asarray(out)
    assert out[2, 0, 1, 0] == 5.0  # position 5: block 1 -> page 2, slot 1
    assert np.count_nonzero(out) == 2  # its two features; nothing else written


@pytest.fixture
def split_diagonal(monkeypatch):
    """The island splits on CPU too: the jnp and interpreted kernels take their own diagonal blocks
    off the page walk (on a GPU "pallas" gives them to cuDNN; on CPU one walk keeps them)."""
    from pallas_kernels.attention import api

    for impl in ("reference", "pallas_interpret"):
        monkeypatch.setitem(api.SELF_ROUTES, impl, (impl,))


def run_ragged_case(tp, dcp, gqa, interleave, *, combine="auto", impl="reference",
                    head_axes=("tp",), context_axes=("dcp",), kv_heads=None, page=4,
                    dtype=jnp.float32, shared_v=False, fresh=True, seed=0):
    """A ragged step through the island against float64: decode rows deep in their context, a chunk
    after a cached prefix (in prefill tiles), a whole prompt, an empty row; flat q [1, N]; with
    `fresh`, the prefill tiles' diagonal blocks come from the step's own keys and values."""
    from pallas_kernels.attention import ragged

    mesh = make_mesh(tp, dcp)
    n_ctx = int(np.prod([mesh.shape[a] for a in context_axes]))
    layout = KVLayout.create(48, n_ctx, interleave)
    kh = kv_heads or max(2, tp if head_axes else 1)
    h, dk = kh * gqa, 16
    dv = 8 if shared_v else 16
    rng = np.random.default_rng(seed)
    lengths = np.asarray([48, 40, 13, 0, 5], np.int32)
    q_lens = np.asarray([1, 21, 13, 0, 1], np.int32)
    k = rng.standard_normal((5, kh, 48, dk)).astype(np.float32)
    v = k[..., :dv] if shared_v else rng.standard_normal((5, kh, 48, dv)).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(np.int32)
    n = 48
    q = rng.standard_normal((1, n, h, dk)).astype(np.float32)
    q_pos = np.zeros((1, n), np.int32)
    k_new, v_new = np.zeros((1, n, kh, dk)), np.zeros((1, n, kh, dv))
    for r, (s0, m) in enumerate(zip(starts, q_lens)):
        pos = lengths[r] - m + np.arange(m)
        q_pos[0, s0:s0 + m] = pos
        k_new[0, s0:s0 + m] = k[r][:, pos].swapaxes(0, 1)
        v_new[0, s0:s0 + m] = v[r][:, pos].swapaxes(0, 1)
    tiles = ragged.plan(starts, q_lens, np.arange(5), n, ragged.group_shapes(n, rows=5, tile=8),
                        positions=lengths - q_lens)
    caches = (place(k, layout),) if shared_v else (place(k, layout), place(v, layout))
    pools, table = paginate(caches, layout, page, rng)
    paged = PagedLayout(n_ctx, layout.interleave, page)
    new = (k_new,) if shared_v else (k_new, v_new)
    extra = dict(fresh=tuple(jnp.asarray(x, dtype) for x in new) if fresh else None,
                 v_dim=dv if shared_v else None)
    fn = jax.jit(lambda q, pools, qp, kl, bt, t: dcp_attention(
        q, *pools, *((None,) if shared_v else ()), qp, kl, mesh=mesh, layout=paged, block_table=bt,
        ragged=t, head_axes=head_axes, context_axes=context_axes, combine=combine, impl=impl,
        return_lse=True, **extra))
    o, lse = fn(jnp.asarray(q, dtype), tuple(jnp.asarray(p, dtype) for p in pools),
                jnp.asarray(q_pos), jnp.asarray(lengths), jnp.asarray(table), tiles)
    assert o.shape == (1, n, h, dv) and not np.isnan(np.asarray(o, np.float32)).any()
    for r, (s0, m) in enumerate(zip(starts, q_lens)):
        if m == 0:
            continue
        ref_o, ref_lse = dense_attention(q[:, s0:s0 + m], k[r:r + 1], v[r:r + 1],
                                         q_pos[:, s0:s0 + m], lengths[r:r + 1], 1.0 / np.sqrt(dk))
        err = rel_err(o[:, s0:s0 + m], ref_o)
        assert err <= TOL[dtype], (r, err)
        assert_lse_close(lse[:, s0:s0 + m], ref_lse, TOL[dtype])


@pytest.mark.parametrize("tp,dcp,gqa,interleave,combine", [
    (1, 1, 4, 1, "auto"),
    (1, 2, 4, 1, "scatter"),
    (2, 4, 2, 4, "auto"),        # 2 heads per tp rank over 4 dcp ranks: the psum fallback
    (1, 4, 2, 2, "auto"),        # 4 heads scattered over 4 ranks: each adds its own head's blocks
    (1, 3, 3, 2, "all_to_all"),
    (2, 2, 2, 1, "psum"),
])
def test_ragged_split_through_the_island_matches_float64(split_diagonal, tp, dcp, gqa, interleave,
                                                        combine):
    run_ragged_case(tp, dcp, gqa, interleave, combine=combine)


def test_ragged_split_query_heads_straddling_kv_heads(split_diagonal):
    # 6 query heads over 3 kv heads (2 per kv head) scattered over 2 ranks of 3 heads: rank 0's last
    # head shares kv head 1 with rank 1's first, so each rank picks its kv heads per query head.
    run_ragged_case(1, 2, 2, 1, combine="scatter", kv_heads=3)


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
def test_ragged_split_latent_over_both_axes(split_diagonal, impl):
    # MLA: one latent (the values its first features) over ("tp", "dcp") together, heads scattered
    # over all 8 devices; the diagonal blocks' values are the new latent's first features.
    run_ragged_case(2, 4, 8, 1, head_axes=(), context_axes=("tp", "dcp"), kv_heads=1, shared_v=True,
                    impl=impl)


def test_ragged_unsplit_reads_its_own_tokens_from_the_pages():
    # No implementation takes the diagonal blocks (CPU): the page walk keeps them, fresh or not.
    run_ragged_case(2, 4, 2, 1, fresh=False)
    run_ragged_case(1, 2, 4, 1, dtype=jnp.bfloat16)


def test_ragged_split_in_bfloat16(split_diagonal):
    run_ragged_case(1, 2, 4, 1, dtype=jnp.bfloat16)
