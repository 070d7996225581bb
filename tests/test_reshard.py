"""The reshard plan of prefill/decode disaggregation (dcp_jax.layout.reshard_plan) against brute force:
every (rank, block, page slot) of both placements enumerated through the kernels' view of a slice
(`slice_positions`), joined on position."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.layout import PagedLayout, kv_head_sources, reshard_plan


@st.composite
def paged(draw):
    n, i = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    return PagedLayout(n, i, i * draw(st.integers(1, 4)))


def brute_force(lay: PagedLayout, length: int) -> dict[int, tuple[int, int, int]]:
    """position -> (rank, block, page slot), by walking every slot of every page the sequence uses."""
    where = {}
    for rank in range(lay.num_shards):
        for block in range(lay.blocks_for(length)):
            for s in range(lay.page_size):
                t = int(lay.slice_positions(rank).at(block * lay.page_size + s))
                if t < length:
                    assert t not in where, "two slots hold one position"
                    where[t] = (rank, block, s)
    return where


@settings(max_examples=120, deadline=None)
@given(paged(), paged(), st.integers(0, 150))
def test_plan_matches_brute_force(src, dst, length):
    # every token < length goes once, from the source rank that holds it (at the block and page slot
    # the layout says) to the destination rank that owns it, and lands on a slot of its own there
    plan = reshard_plan(src, dst, length)
    s, d = brute_force(src, length), brute_force(dst, length)
    assert sorted(s) == sorted(d) == list(range(length))  # every token once, nothing past length
    sent = {}
    for i, row in enumerate(plan.piece_positions()):
        for j, piece in enumerate(row):
            for t in piece[piece < length].tolist():
                assert t not in sent, "a token in two pieces"
                sent[t] = (i, j)
    assert sorted(sent) == list(range(length))
    table = np.arange(1, int(dst.blocks_for(length)) + 1)  # any distinct pages
    landed = set()
    for t, (i, j) in sent.items():
        assert (i, j) == (s[t][0], d[t][0])
        assert (int(src.block_of(t)), int(src.page_slot_of(t))) == s[t][1:]
        assert (int(dst.block_of(t)), int(dst.page_slot_of(t))) == d[t][1:]
        landed.add((j, int(dst.page_of(table, t)), int(dst.page_slot_of(t))))
    assert len(landed) == length  # distinct destination slots
    sizes = np.array([[int((p < length).sum()) for p in row] for row in plan.piece_positions()])
    np.testing.assert_array_equal(sizes.sum(axis=1), src.local_lengths(length))  # what each sends
    np.testing.assert_array_equal(sizes.sum(axis=0), dst.local_lengths(length))  # what each keeps


def test_partial_last_page_and_examples():
    # 1 shard, pages of 4 -> 4 shards, interleave 2, pages of 2 (a block = 8 tokens): 11 tokens
    src, dst = PagedLayout(1, 1, 4), PagedLayout(4, 2, 2)
    plan = reshard_plan(src, dst, 11)
    assert plan.src_blocks == 3 and dst.blocks_for(11) == 2 and plan.staged_tokens == 12
    t = np.arange(11)
    assert dst.rank_of(t).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1]
    assert dst.block_of(t).tolist() == [0] * 8 + [1] * 3
    # the last source page's 12th slot (position 11) is padding, sent to its owner and dropped there
    pieces = [p.tolist() for p in plan.piece_positions()[0]]
    assert pieces == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5], [6, 7]]
    assert plan.piece_sizes().tolist() == [[4, 4, 2, 2]]
    with pytest.raises(ValueError, match="length must be an integer >= 0"):
        reshard_plan(PagedLayout(1, 1, 4), PagedLayout(1, 1, 4), -1)


def test_kv_head_sources():
    assert kv_head_sources(2, 1).tolist() == [0, 1]
    assert kv_head_sources(4, 2).tolist() == [0, 0, 1, 1]  # tp=4 over 2 kv heads: each stored twice


def every_slot(lay: PagedLayout, blocks: int) -> dict[int, int]:
    """position -> rank over every slot of `blocks` blocks (past any length), walking the pages."""
    return {int(lay.slice_positions(r).at(b * lay.page_size + s)): r for r in range(lay.num_shards)
            for b in range(blocks) for s in range(lay.page_size)}


@settings(max_examples=120, deadline=None)
@given(paged(), paged(), st.integers(1, 150))
def test_piece_positions_match_brute_force(src, dst, length):
    # one piece per (source rank, destination rank): every staged slot of the source's blocks that
    # source rank holds and destination rank owns, in the destination's local-slot order
    plan = reshard_plan(src, dst, length)
    staged = every_slot(src, plan.src_blocks)
    assert sorted(staged) == list(range(plan.staged_tokens))
    owner = every_slot(dst, int(dst.blocks_for(plan.staged_tokens)))
    pieces = plan.piece_positions()
    for i in range(src.num_shards):
        for j in range(dst.num_shards):
            want = sorted(t for t in staged if staged[t] == i and owner[t] == j)
            assert pieces[i][j].tolist() == want
            slots = dst.local_slot_of(pieces[i][j])
            assert (np.diff(slots) > 0).all()  # the order the destination writes its slots in
    np.testing.assert_array_equal(plan.piece_sizes().sum(axis=1), src.local_lengths(plan.staged_tokens))
    # the sizes depend on the number of source blocks only (one program per blocks, not per length)
    first = (plan.src_blocks - 1) * src.tokens_per_block + 1
    np.testing.assert_array_equal(reshard_plan(src, dst, first).piece_sizes(), plan.piece_sizes())


def test_kv_head_ranges():
    from dcp_jax.layout import kv_head_ranges

    assert kv_head_ranges(2, 1, 1) == [(0, 2)] and kv_head_ranges(2, 1, 2) == [(0, 1), (1, 2)]
    assert kv_head_ranges(4, 2, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]  # tp=4 over 2 kv heads
    assert kv_head_ranges(8, 1, 2) == [(0, 4), (4, 8)] and kv_head_ranges(1, 1, 1) == [(0, 1)]  # MLA: one latent
    with pytest.raises(ValueError, match="do not split into 3 equal shards"):
        kv_head_ranges(4, 1, 3)
