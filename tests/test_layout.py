import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.layout import KVLayout

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
    np.testing.assert_array_equal(layout.position_of(rank, slot), t)
    for r in range(layout.num_shards):
        pos = np.asarray(layout.slot_positions(r))
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
    assert c.interleave == 16 and c.is_contiguous
    np.testing.assert_array_equal(np.asarray(c.slot_positions(2)), np.arange(32, 48))
    rr = KVLayout.create(8, 4, 1)
    np.testing.assert_array_equal(np.asarray(rr.slot_positions(1)), [1, 5])


def test_traced_matches_host():
    lay = KVLayout.create(96, 3, 4)
    f = jax.jit(lambda n, r: (lay.local_length(n, r), lay.slot_positions(r)))
    for n in (0, 1, 5, 13, 96):
        for r in range(3):
            got, pos = f(jnp.int32(n), jnp.int32(r))
            assert int(got) == lay.local_length(n, r)
            np.testing.assert_array_equal(pos, lay.slot_positions(r))


@pytest.mark.parametrize("kw", [dict(num_shards=0, interleave=1, max_seq_len=8),
                                dict(num_shards=2, interleave=0, max_seq_len=8),
                                dict(num_shards=2, interleave=1, max_seq_len=0)])
def test_bad_layout(kw):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        KVLayout(**kw)
