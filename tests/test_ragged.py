"""Attention over a ragged batch (pallas_kernels/attention/ragged.py): the tiling on the host, and the
reference and the Pallas kernel (interpret mode) against float64 NumPy over mixes of decode rows, chunk
rows after a cached prefix, whole prompts and empty rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import SlotPositions, attention, ragged, ragged_attention
from tests.test_kernels import PALLAS, TOL, dim, to_pages
from tests.util import assert_lse_close, dense_attention, rel_err


def layout_rows(lens):
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    return starts, np.asarray(lens, np.int32)


def test_plan_tiles_never_straddle_rows_and_every_token_maps_back():
    lens = [1, 0, 37, 1, 5, 16, 1]  # decode rows, an empty row, chunks that do and do not fill a tile
    starts, lens = layout_rows(lens)
    rows = np.asarray([4, 0, 2, 6, 1, 3, 5])
    n = 64
    shapes = ragged.group_shapes(n, rows=8, tile=8)
    first_pos = np.asarray([50, 0, 3, 20, 0, 7, 9])  # each row's first position
    tiles = ragged.plan(starts, lens, rows, n, shapes, positions=first_pos)
    assert [g.index.shape + (g.bands,) for g in tiles.groups] == [tuple(s) for s in shapes]
    row_of = np.full(n, -1)
    for s, m, r in zip(starts, lens, rows):
        row_of[s:s + m] = r
    np.testing.assert_array_equal(tiles.token_row[row_of >= 0], row_of[row_of >= 0])
    flat_index = np.concatenate([g.index.reshape(-1) for g in tiles.groups])
    flat_row = np.concatenate([np.repeat(g.row, g.index.shape[1]) for g in tiles.groups])
    for g in tiles.groups:
        for idx, r in zip(g.index, g.row):
            assert (idx >= 0).all() and set(row_of[idx]) == {r} or (idx == -1).all()  # one row's tokens, or none
    real = np.flatnonzero(row_of >= 0)
    np.testing.assert_array_equal(flat_index[tiles.where[real]], real)  # each token's output is its own
    np.testing.assert_array_equal(flat_row[tiles.where[real]], row_of[real])
    # decode rows (one token) are decode tiles; the 37-token chunk is 5 prefill tiles of 8
    dec, pre = tiles.groups[:2]
    assert sorted(dec.row[dec.index[:, 0] >= 0].tolist()) == [4, 5, 6]
    assert (pre.row[pre.index[:, 0] >= 0] == 2).sum() == 5
    # within a group, tiles are sorted by how far they see (unused ones first)
    pos_of = np.zeros(n, np.int64)
    for s, m, p in zip(starts, lens, first_pos):
        pos_of[s:s + m] = p + np.arange(m)
    for g in tiles.groups:
        extent = np.where(g.index >= 0, pos_of[g.index], -1).max(axis=1)
        assert (np.diff(extent) >= 0).all() and (extent[:(g.index[:, 0] < 0).sum()] == -1).all()


def test_plan_refuses_an_overfull_group():
    starts, lens = layout_rows([30, 30])
    with pytest.raises(ValueError, match="tiles of 8 tokens do not fit"):
        ragged.plan(starts, lens, [0, 1], 60, ((1, 1, 1), (2, 8, 1)))


def ragged_case(dtype, h, kh, dk, dv, page, runs, seed=0):
    """Five sequences over one paged slice: a decode row deep in its context, a chunk after a cached
    prefix, a whole short prompt, an empty row (nothing to run) and a second decode row; flat q."""
    rng = np.random.default_rng(seed)
    kv_pos = SlotPositions(*runs)
    nb = 6
    s = nb * page  # slots per sequence in this slice
    end = int(kv_pos.at(s - 1)) + 1
    lengths = np.asarray([end, min(end, 70), 9, 0, 3], np.int32)
    q_lens = [1, 23, 9, 0, 1]
    kv = rng.standard_normal((5, kh, s, dk)), rng.standard_normal((5, kh, s, dv))
    k_pool, table = to_pages(jnp.asarray(kv[0], dtype), page, seed=seed)
    v_pool, _ = to_pages(jnp.asarray(kv[1], dtype), page, seed=seed)
    starts, lens = layout_rows(q_lens)
    n = 40  # 34 tokens, padded
    q = rng.standard_normal((n, h, dk))
    q_pos = np.zeros(n, np.int32)
    for s0, m, length in zip(starts, lens, lengths):
        q_pos[s0:s0 + m] = length - m + np.arange(m)
    return dict(q=jnp.asarray(q, dtype), k=k_pool, v=v_pool, q_pos=jnp.asarray(q_pos), kv_pos=kv_pos,
                kv_len=jnp.asarray(lengths), block_table=table), (kv, starts, lens, lengths)


def check_ragged(o, lse, x, dense, tol):
    (k, v), starts, lens, lengths = dense
    assert not np.isnan(np.asarray(o, np.float32)).any()
    scale = 1.0 / np.sqrt(x["q"].shape[-1])
    slots = x["kv_pos"].at(np.arange(k.shape[2]))
    for r, (s0, m) in enumerate(zip(starts, lens)):
        if m == 0:
            continue
        q = np.asarray(x["q"][s0:s0 + m], np.float32)[None]
        ref_o, ref_lse = dense_attention(q, k[r:r + 1], v[r:r + 1], np.asarray(x["q_pos"][s0:s0 + m])[None],
                                         lengths[r:r + 1], scale, kv_pos=slots)
        assert rel_err(o[s0:s0 + m], ref_o[0]) <= tol, (r, rel_err(o[s0:s0 + m], ref_o[0]))
        assert_lse_close(lse[s0:s0 + m], ref_lse[0], tol)


@pytest.mark.parametrize("impl,opts", [("reference", dict(block_k=16, block_k_masked=8)), ("reference", {}),
                                       (PALLAS, dict(block_k=16))])
@pytest.mark.parametrize("h,kh,dk,dv,page,runs,dtype,tile,bands,long_tile", [
    (8, 2, 16, 16, 16, (0, 1, 2), jnp.float32, 8, 1, 256),   # a dcp shard (every 2nd position), GQA 4
    (4, 4, 32, 16, 16, (2, 2, 8), jnp.float32, 16, 2, 256),  # interleaved shard, MHA, Dk != Dv
    (8, 2, 16, 16, 16, (0, 1, 1), jnp.bfloat16, 4, 3, 256),  # one device, bf16, tiles in 3 bands
    (8, 2, 16, 16, 16, (0, 1, 2), jnp.float32, 4, 2, 16),    # the 23-token chunk in the long-chunk group
])
def test_ragged_matches_float64(impl, opts, h, kh, dk, dv, page, runs, dtype, tile, bands, long_tile):
    x, dense = ragged_case(dtype, h, kh, dk, dv, page, runs)
    starts, lens = dense[1], dense[2]
    tiles = ragged.plan(starts, lens, np.arange(5), x["q"].shape[0],
                        ragged.group_shapes(x["q"].shape[0], rows=5, tile=tile, bands=bands, long_tile=long_tile),
                        positions=dense[3] - np.asarray(lens))
    o, lse = jax.jit(lambda x, t: ragged_attention(**x, tiles=t, impl=impl, **opts))(x, tiles)
    assert o.shape == x["q"].shape[:2] + (dv,) and lse.dtype == jnp.float32
    check_ragged(o, lse, x, dense, TOL[dtype])


@pytest.mark.parametrize("impl", ["reference", PALLAS])
def test_ragged_values_shared_with_keys(impl):
    # MLA's latent: one kv head, values = the keys' first v_dim features.
    x, ((k, v), starts, lens, lengths) = ragged_case(jnp.float32, 8, 1, dim(24), dim(24), 16, (1, 1, 4))
    v = k[..., :16]
    x = dict(x, v=None)
    tiles = ragged.plan(starts, lens, np.arange(5), 40, ragged.group_shapes(40, rows=5, tile=8))
    o, lse = jax.jit(lambda x, t: ragged_attention(**x, tiles=t, impl=impl, v_dim=16))(x, tiles)
    check_ragged(o, lse, x, ((k, v), starts, lens, lengths), 1e-5)


def fresh_of(x, dense, shared_v=False):
    """Each flat token's own key and value (what the step writes to the pages), from the rows'
    dense KV (a slice holding whole sequences: slot = position); zero for padding."""
    (k, v), starts, lens, _ = dense
    n = x["q"].shape[0]
    kn = np.zeros((n,) + k.shape[1:2] + k.shape[3:])
    vn = np.zeros((n,) + v.shape[1:2] + v.shape[3:])
    for r, (s0, m) in enumerate(zip(starts, lens)):
        pos = np.asarray(x["q_pos"][s0:s0 + m])
        kn[s0:s0 + m] = k[r][:, pos].transpose(1, 0, 2)
        vn[s0:s0 + m] = v[r][:, pos].transpose(1, 0, 2)
    dtype = x["q"].dtype
    return jnp.asarray(kn, dtype), None if shared_v else jnp.asarray(vn, dtype)


@pytest.mark.parametrize("impl,opts", [("reference", dict(block_k=16, block_k_masked=8)),
                                       (PALLAS, dict(block_k=16))])
@pytest.mark.parametrize("h,kh,dtype,tile,long_tile", [
    (8, 2, jnp.float32, 8, 256),   # GQA 4: the 23-token chunk in tiles of 8, the 9-token prompt in 2
    (4, 4, jnp.float32, 4, 16),    # MHA; the 23-token chunk in the long-chunk group (tiles of 16)
    (8, 2, jnp.bfloat16, 16, 256),  # bf16
])
def test_split_prefill_tiles_match_float64(impl, opts, h, kh, dtype, tile, long_tile):
    # Decode rows through the decode launch; each prefill tile's cached prefix through the pages and
    # its diagonal block through self_attention (the tile's own keys and values), merged by LSE: the
    # same attention as float64 over decode rows, a chunk after a cached prefix, a whole prompt (no
    # prefix: its first tile reads no page) and an empty row.
    x, dense = ragged_case(dtype, h, kh, 16, 16, 16, (0, 1, 1))
    starts, lens, lengths = dense[1], dense[2], dense[3]
    n = x["q"].shape[0]
    tiles = ragged.plan(starts, lens, np.arange(5), n,
                        ragged.group_shapes(n, rows=5, tile=tile, long_tile=long_tile),
                        positions=lengths - np.asarray(lens))
    fresh = fresh_of(x, dense)
    o, lse = jax.jit(lambda x, t, f: ragged_attention(**x, tiles=t, impl=impl, fresh=f, **opts))(
        x, tiles, fresh)
    check_ragged(o, lse, x, dense, TOL[dtype])


@pytest.mark.parametrize("impl", ["reference", PALLAS])
def test_split_prefill_tiles_with_values_shared_with_keys(impl):
    # MLA's latent: the diagonal blocks take their values from the new keys' first v_dim features.
    x, ((k, v), starts, lens, lengths) = ragged_case(jnp.float32, 8, 1, dim(24), dim(24), 16,
                                                     (0, 1, 1))
    dense = ((k, k[..., :16]), starts, lens, lengths)
    x = dict(x, v=None)
    tiles = ragged.plan(starts, lens, np.arange(5), 40, ragged.group_shapes(40, rows=5, tile=8),
                        positions=lengths - np.asarray(lens))
    fresh = fresh_of(x, ((k, k), starts, lens, lengths), shared_v=True)
    o, lse = jax.jit(lambda x, t, f: ragged_attention(**x, tiles=t, impl=impl, v_dim=16, fresh=f))(
        x, tiles, fresh)
    check_ragged(o, lse, x, dense, 1e-5)


def test_split_prefill_tiles_read_only_their_prefix():
    # The pages part of a split prefill tile sees only the slots below the tile's first token: the
    # 9-token prompt's first tile (positions 0-7) sees none, its second (position 8) sees those 8;
    # the 23-token chunk after 47 cached tokens sees less than its full attention does.
    x, dense = ragged_case(jnp.float32, 8, 2, 16, 16, 16, (0, 1, 1))
    starts, lens, lengths = dense[1], dense[2], dense[3]
    tiles = ragged.plan(starts, lens, np.arange(5), 40, ragged.group_shapes(40, rows=5, tile=8),
                        positions=lengths - np.asarray(lens))
    prefix = jax.jit(lambda x, t: ragged_attention(**x, tiles=t, impl="reference",
                                                   prefix_only=True))(x, tiles)
    full = jax.jit(lambda x, t: ragged_attention(**x, tiles=t, impl="reference"))(x, tiles)
    s2 = starts[2]
    assert np.isneginf(np.asarray(prefix[1][s2:s2 + 8])).all()
    assert not np.asarray(prefix[0][s2:s2 + 8]).any()
    one = dict(x, q=x["q"][s2 + 8:s2 + 9][None], q_pos=jnp.full((1, 1), 7, jnp.int32),
               kv_len=x["kv_len"][2:3], block_table=x["block_table"][2:3])
    expected = jax.jit(lambda c: attention(**c, impl="reference"))(one)  # position 8 over 0..7
    np.testing.assert_allclose(np.asarray(prefix[0][s2 + 8]), np.asarray(expected[0][0, 0]),
                               rtol=1e-5, atol=1e-6)
    s1, m1 = starts[1], lens[1]
    assert np.isfinite(np.asarray(prefix[1][s1:s1 + m1])).all()
    assert (np.asarray(prefix[1][s1:s1 + m1]) < np.asarray(full[1][s1:s1 + m1])).all()


def test_ragged_kernel_lowers_for_cuda_without_copying_the_cache():
    # A ragged step of 8 decode rows and two prefill chunks (300 and 45 tokens) over a paged,
    # layer-stacked pool, lowered for CUDA, split: each band of each tile group is one Triton call
    # reading the pool as it is, each prefill group's diagonal blocks one more over the step's own
    # keys and values; only q and those (a few rows) are gathered into tiles, nothing pool- or
    # cache-sized is padded, sliced or copied.
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    from tests.test_kernels import large_copies

    n, rows, h, kh, d, page, pages, layers = 384, 10, 32, 8, 128, 64, 4096, 4
    shapes = ragged.group_shapes(n, rows, 16)
    starts, lens = layout_rows([1] * 8 + [300, 45])
    tiles = ragged.plan(starts, lens, np.arange(rows), n, shapes)
    pool = jax.ShapeDtypeStruct((layers, pages, kh, page, d), jnp.bfloat16)
    fresh = (jax.ShapeDtypeStruct((n, kh, d), jnp.bfloat16),) * 2
    args = (jax.ShapeDtypeStruct((n, h, d), jnp.bfloat16), pool, pool, jax.ShapeDtypeStruct((n,), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32),
            jax.ShapeDtypeStruct((rows, 256), jnp.int32), jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tiles),
            jax.ShapeDtypeStruct((), jnp.int32), fresh)

    def f(q, k, v, q_pos, start, kv_len, table, t, layer, fresh):
        return ragged_attention(q, k, v, q_pos, SlotPositions(start, 1, 2), kv_len, table, t, impl="pallas",
                                layer=layer, fresh=fresh)

    gpu = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="gpu"))
    with jax.sharding.use_abstract_mesh(gpu):
        text = jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    # the pages: one call per band of each group, reading the pools themselves; the prefill groups'
    # diagonal blocks: one call each over the step's own keys and values (cuDNN's on a GPU backend)
    reads_pool = [c for c in calls if "%arg1" in c and "%arg2" in c]
    assert len(shapes) == 3 and len(reads_pool) == sum(b for _, _, b in shapes)
    assert len(calls) == len(reads_pool) + len(shapes) - 1
    assert large_copies(text, pages * kh * page * d // 2) == []


def test_the_dcp_island_refuses_a_malformed_ragged_batch():
    from dcp_jax.attention import check_ragged

    starts, lens = layout_rows([3, 1])
    tiles = ragged.plan(starts, lens, [0, 1], 8, ragged.group_shapes(8, 2, 8))
    q, q_pos = jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8), jnp.int32)
    table, kv_len = jnp.zeros((2, 4), jnp.int32), jnp.zeros(2, jnp.int32)
    check_ragged(q, q_pos, kv_len, table, tiles)  # well formed
    with pytest.raises(ValueError, match="reads a paged pool"):
        check_ragged(q, q_pos, kv_len, None, tiles)
    with pytest.raises(ValueError, match="one flat row"):
        check_ragged(q[:, :6], q_pos[:, :6], kv_len, table, tiles)
    with pytest.raises(ValueError, match="disagree on the rows"):
        check_ragged(q, q_pos, kv_len[:1], table, tiles)


def test_diagonal_blocks_route_to_cudnn_only_where_it_serves(monkeypatch):
    # "pallas" gives its diagonal blocks to cuDNN: only on a GPU backend, in bf16/fp16, with
    # separate values of one head dim (a multiple of 8 up to 128); otherwise (and for every other
    # implementation) the page walk keeps them.
    from pallas_kernels.attention import api

    def tiles(dtype=jnp.bfloat16, d=128, shared=False):
        q = jax.ShapeDtypeStruct((4, 16, 8, d), dtype)
        k = jax.ShapeDtypeStruct((4, 16, 2, d), dtype)
        return q, k, None if shared else k

    assert api.diagonal_impl("pallas", *tiles()) is None  # a CPU backend: cuDNN cannot trace here
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert api.diagonal_impl("pallas", *tiles()) == "cudnn"
    assert api.diagonal_impl("pallas", *tiles(jnp.float16, 64)) == "cudnn"
    assert api.diagonal_impl("pallas", *tiles(jnp.float32)) is None
    assert api.diagonal_impl("pallas", *tiles(d=256)) is None
    assert api.diagonal_impl("pallas", *tiles(shared=True)) is None  # MLA's latent
    assert api.diagonal_impl("reference", *tiles()) is None
    assert api.diagonal_impl("pallas_interpret", *tiles()) is None


def test_a_registered_implementation_serves_every_caller():
    # A new implementation is one register() call: attention(impl=) and the ragged batch (its pages
    # and its diagonal blocks) run it with no caller changed, and it gives what the reference gives.
    from pallas_kernels.attention import api, reference

    calls = []

    def counted(*a, **kw):
        calls.append(kw.get("block_table") is not None)
        return reference.attention(*a, **kw)

    api.register(api.Implementation("counted", counted, api.REF_OPTIONS))
    try:
        assert "counted" in api.implementations()
        x, dense = ragged_case(jnp.float32, 8, 2, 16, 16, 16, (0, 1, 1))
        starts, lens, lengths = dense[1], dense[2], dense[3]
        tiles = ragged.plan(starts, lens, np.arange(5), 40, ragged.group_shapes(40, rows=5, tile=8),
                            positions=lengths - np.asarray(lens))
        o, lse = jax.jit(lambda x, t, f: ragged_attention(**x, tiles=t, impl="counted", fresh=f))(
            x, tiles, fresh_of(x, dense))
        check_ragged(o, lse, x, dense, 1e-5)
        assert True in calls and False in calls  # the pages (paged) and the diagonal blocks (dense)
    finally:
        del api.REGISTRY["counted"]
    with pytest.raises(ValueError, match="unknown attention impl 'counted'"):
        ragged_attention(**x, tiles=tiles, impl="counted")
    with pytest.raises(ValueError, match="unknown attention impl 'cudnn'"):
        ragged_attention(**x, tiles=tiles, impl="cudnn")  # cuDNN serves diagonal blocks only


def triton_calls(fn, *args):
    """The Triton custom calls of fn lowered for CUDA (on this CPU-only machine), each as its
    backend config (grid, warps, stages; the kernel's IR left out) and its operand types."""
    import re

    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    gpu = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="gpu"))
    with jax.sharding.use_abstract_mesh(gpu):
        triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton])
        text = exported(*args).mlir_module()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    config = re.compile(r"grid_x = \d+ : i32, grid_y = \d+ : i32, grid_z = \d+ : i32|num_\w+ = \d+")
    operands = re.compile(r"\(tensor<i32>, tensor<[^>]*>")
    return [(tuple(config.findall(c)), operands.search(c).group(0)) for c in calls]


def test_decode_rows_run_as_the_paged_decode_launch():
    # The ragged step's decode rows are one launch with the paged decode kernel's grid, warps,
    # stages and operands (8 rows of one token over the same pool); the prefill tiles are launches
    # of their own.
    n, rows, h, kh, d, page, pages = 64, 8, 32, 8, 128, 64, 512
    shapes = ragged.group_shapes(n, rows, 16)
    starts, lens = layout_rows([1] * 8)
    tiles = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                         ragged.plan(starts, lens, np.arange(rows), n, shapes))
    pool = jax.ShapeDtypeStruct((pages, kh, page, d), jnp.bfloat16)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    pos = SlotPositions.dense(64 * page)
    flat = triton_calls(
        lambda q, k, v, qp, kl, bt, t: ragged_attention(q, k, v, qp, pos, kl, bt, t, impl="pallas"),
        jax.ShapeDtypeStruct((n, h, d), jnp.bfloat16), pool, pool, i32(n), i32(rows),
        i32(rows, 64), tiles)
    paged = triton_calls(
        lambda q, k, v, qp, kl, bt: attention(q, k, v, qp, pos, kl, impl="pallas", block_table=bt),
        jax.ShapeDtypeStruct((rows, 1, h, d), jnp.bfloat16), pool, pool, i32(rows, 1), i32(rows),
        i32(rows, 64))
    assert len(paged) == 1 and len(flat) == len(shapes)
    assert flat[0] == paged[0]
    assert all(c[1] != paged[0][1] for c in flat[1:])
