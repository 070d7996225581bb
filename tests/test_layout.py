import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.layout import KVLayout


def slot_positions(layout, rank, xp=np):
    """The global positions of every slot of shard `rank`, through the kernels' SlotPositions."""
    return layout.slice_positions(rank).at(xp.arange(layout.slots_per_shard, dtype=xp.int32))

layouts = st.builds(
    lambda n, i, s, contiguous: KVLayout.create(s, n, "contiguous" if contiguous else i),
    st.integers(1, 8), st.integers(1, 9), st.integers(1, 200), st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(layouts)
def test_every_position_has_exactly_one_owner(layout):
    t = np.arange(layout.max_seq_len)
    rank, slot = layout.rank_of(t), layout.slot_of(t)
    assert rank.min() >= 0 and rank.max() < layout.num_shards
    assert slot.min() >= 0 and slot.max() < layout.slots_per_shard
    # (rank, slot) pairs are distinct and cover every slot: a bijection
    idx = layout.cache_index(t)
    assert sorted(idx.tolist()) == list(range(layout.max_seq_len))
    # the kernels' view of a slice (SlotPositions) gives back each slot's position
    np.testing.assert_array_equal(layout.slice_positions(rank).at(slot), t)
    for r in range(layout.num_shards):
        pos = np.asarray(slot_positions(layout, r))
        np.testing.assert_array_equal(layout.rank_of(pos), r)
        np.testing.assert_array_equal(layout.slot_of(pos), np.arange(layout.slots_per_shard))
        assert (np.diff(pos) > 0).all()  # slot positions increase along a shard (kernels rely on it)


@settings(max_examples=150, deadline=None)
@given(layouts, st.data())
def test_local_lengths_sum_and_balance(layout, data):
    length = data.draw(st.integers(0, layout.max_seq_len))
    counts = layout.local_lengths(length)
    assert counts.sum() == length
    owners = layout.rank_of(np.arange(length))
    np.testing.assert_array_equal(counts, np.bincount(owners, minlength=layout.num_shards))
    assert counts.max() - counts.min() <= layout.interleave


def test_round_up_and_contiguous():
    lay = KVLayout.create(10, 4, 1)
    assert lay.max_seq_len == 12 and lay.slots_per_shard == 3
    lay = KVLayout.create(10, 4, 2)
    assert lay.max_seq_len == 16
    c = KVLayout.create(64, 4, "contiguous")
    assert c.interleave == c.slots_per_shard == 16
    np.testing.assert_array_equal(np.asarray(slot_positions(c, 2)), np.arange(32, 48))
    rr = KVLayout.create(8, 4, 1)
    np.testing.assert_array_equal(np.asarray(slot_positions(rr, 1)), [1, 5])


def test_traced_matches_host():
    lay = KVLayout.create(96, 3, 4)
    f = jax.jit(lambda n, r: (lay.local_length(n, r), slot_positions(lay, r, jnp)))
    for n in (0, 1, 5, 13, 96):
        for r in range(3):
            got, pos = f(jnp.int32(n), jnp.int32(r))
            assert int(got) == lay.local_length(n, r)
            np.testing.assert_array_equal(pos, slot_positions(lay, r))


@pytest.mark.parametrize("kw", [dict(num_shards=0, interleave=1, max_seq_len=8),
                                dict(num_shards=2, interleave=0, max_seq_len=8),
                                dict(num_shards=2, interleave=1, max_seq_len=0)])
def test_bad_layout(kw):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        KVLayout(**kw)


# --- paged placement ---------------------------------------------------------------------------------
from dcp_jax.layout import PagedLayout  # noqa: E402

PAGED_CASES = [(1, 1, 1), (1, 1, 4), (1, 2, 4), (2, 1, 2), (3, 1, 4), (3, 2, 4), (3, 3, 3), (4, 2, 8),
               (4, 4, 4), (5, 2, 6), (8, 1, 16)]


@pytest.mark.parametrize("n,i,p", PAGED_CASES)
def test_paged_matches_dense_brute_force(n, i, p):
    """Every position's (rank, local slot) is the dense layout's; block/page slot cut those slots."""
    paged = PagedLayout(n, i, p)
    length = 7 * paged.tokens_per_block + 3  # several blocks and a ragged tail
    dense = KVLayout.create(length, n, i)
    t = np.arange(length)
    rank, block, pslot = paged.rank_of(t), paged.block_of(t), paged.page_slot_of(t)
    np.testing.assert_array_equal(rank, dense.rank_of(t))
    np.testing.assert_array_equal(block * p + pslot, dense.slot_of(t))
    np.testing.assert_array_equal(block, t // (p * n))  # the shortcut the docstring claims
    assert pslot.min() >= 0 and pslot.max() < p
    # exactly one (block, rank, page slot) per position, and every triple of a full block is used
    triples = set(zip(block.tolist(), rank.tolist(), pslot.tolist()))
    assert len(triples) == length
    full = block < length // paged.tokens_per_block
    assert full.sum() == (length // paged.tokens_per_block) * n * p
    np.testing.assert_array_equal(paged.slice_positions(rank).at(block * p + pslot), t)
    # a block's page holds the same tokens on every rank's side: block b covers [b·p·n, (b+1)·p·n)
    for b in range(paged.blocks_for(length)):
        sel = t[block == b]
        assert sel.min() == b * paged.tokens_per_block
        assert sel.max() == min(length, (b + 1) * paged.tokens_per_block) - 1
    # the kernel's view: logical local slot j of rank r holds slice_positions(r).at(j)
    for r in range(n):
        sp = paged.slice_positions(r)
        assert sp == dense.slice_positions(r)
        own = t[rank == r]
        np.testing.assert_array_equal(sp.at(np.arange(len(own))), own)


@pytest.mark.parametrize("n,i,p", PAGED_CASES)
def test_paged_lengths(n, i, p):
    paged = PagedLayout(n, i, p)
    for length in range(0, 4 * paged.tokens_per_block + 2):
        counts = paged.local_lengths(length)
        assert counts.sum() == length
        owners = paged.rank_of(np.arange(length))
        np.testing.assert_array_equal(counts, np.bincount(owners, minlength=n))
        blocks = paged.blocks_for(length)  # the fewest blocks that hold `length` tokens
        assert paged.capacity_tokens(blocks) >= length and (blocks == 0 or paged.capacity_tokens(blocks - 1) < length)


def test_local_length_is_not_shiftable():
    """local(L - k) != local(L) - k: rank-local lengths must be recomputed from the global length."""
    paged = PagedLayout(4, 1, 4)
    L, k = 10, 3
    assert paged.local_length(L - k, 0) != paged.local_length(L, 0) - k
    assert [paged.local_length(L - k, r) for r in range(4)] == [2, 2, 2, 1]


def test_paged_capacity_counts_every_shard():
    paged = PagedLayout(4, 2, 8)
    assert paged.tokens_per_block == 32
    assert paged.capacity_tokens(10) == 10 * 8 * 4
    assert paged.blocks_for(0) == 0 and paged.blocks_for(1) == 1 and paged.blocks_for(32) == 1
    assert paged.blocks_for(33) == 2


def test_paged_page_through_table():
    paged = PagedLayout(2, 2, 4)  # 8 tokens per block
    row = np.array([5, 2, 9, 0], np.int32)
    t = np.arange(24)
    np.testing.assert_array_equal(paged.page_of(row, t), row[t // 8])
    np.testing.assert_array_equal(paged.page_slot_of(t), paged.local_slot_of(t) % 4)
    # past the table's blocks, or not valid: the missing page (such a write is dropped)
    past = np.array([31, 32, 40])
    np.testing.assert_array_equal(paged.page_of(row, past, missing=-1), [0, -1, -1])
    np.testing.assert_array_equal(paged.page_of(row, t, valid=t < 3, missing=-1)[:4], [5, 5, 5, -1])


def test_paged_traced_matches_host():
    paged = PagedLayout(3, 2, 4)
    row = jnp.array([7, 1, 4, 2], jnp.int32)
    f = jax.jit(lambda t, n, r: (paged.block_of(t), paged.rank_of(t), paged.page_slot_of(t),
                                 paged.blocks_for(n), paged.local_length(n, r), paged.page_of(row, t)))
    t = np.arange(40)
    for n in (0, 1, 11, 12, 13, 40):
        for r in range(3):
            b, rk, ps, nb, ll, ix = f(jnp.asarray(t, jnp.int32), jnp.int32(n), jnp.int32(r))
            np.testing.assert_array_equal(b, paged.block_of(t))
            np.testing.assert_array_equal(rk, paged.rank_of(t))
            np.testing.assert_array_equal(ps, paged.page_slot_of(t))
            np.testing.assert_array_equal(ix, paged.page_of(np.asarray(row), t))
            assert int(nb) == paged.blocks_for(n) and int(ll) == paged.local_length(n, r)


def test_bad_paged_layout():
    with pytest.raises(ValueError, match="multiple of the interleave"):
        PagedLayout(2, 4, 6)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        PagedLayout(2, 1, 0)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        PagedLayout(0, 1, 4)
