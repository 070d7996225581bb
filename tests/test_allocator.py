"""PageAllocator: all-or-nothing allocation, reference counts, and no page ever lost or double-owned."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.kv.allocator import PageAllocator


def test_all_or_nothing_and_counts():
    a = PageAllocator(8, reserved=1)
    assert a.num_usable == 7 and a.num_free == 7 and a.num_used == 0
    x = a.allocate(5)
    assert len(x) == 5 and 0 not in x and len(set(x)) == 5
    assert a.allocate(3) is None and a.num_free == 2  # nothing taken on failure
    assert a.allocate(0) == []
    a.share(x[:2])
    a.free(x)
    assert a.num_used == 2 and a.refcount[x[0]] == 1 and a.refcount[x[4]] == 0
    a.free(x[:2])
    assert a.num_free == 7
    a.check(owners=[])


def test_free_errors_change_nothing():
    a = PageAllocator(4)
    x = a.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        a.free([x[0], x[0]])  # two references dropped from a page that has one
    assert a.refcount[x[0]] == 1  # checked before anything changed
    a.free(x)
    with pytest.raises(ValueError, match="double free"):
        a.free([x[1]])
    with pytest.raises(ValueError, match="not a page of this pool"):
        a.free([4])
    with pytest.raises(ValueError, match="double free|never allocated"):
        a.share([x[0]])
    r = PageAllocator(4, reserved=1)
    with pytest.raises(ValueError, match="not a page of this pool"):
        r.free([0])  # the null page belongs to no one
    a.check(owners=[])


@pytest.mark.parametrize("kw", [dict(num_pages=0), dict(num_pages=2, reserved=2), dict(num_pages=2, reserved=-1)])
def test_bad_pool(kw):
    with pytest.raises(ValueError):
        PageAllocator(**kw)


ops = st.lists(st.tuples(st.sampled_from(["admit", "grow", "share", "preempt", "cancel", "finish"]),
                         st.integers(0, 10_000), st.integers(0, 6)), max_size=80)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 24), st.integers(0, 2), ops)
def test_random_lifecycles_never_leak_or_double_own(num_pages, reserved, script):
    """Owners (requests, or prefix-cache entries made by `share`) come and go in random order; after
    every step each page's refcount equals the number of owners holding it, and at the end every page
    is free again."""
    reserved = min(reserved, num_pages - 1)
    a = PageAllocator(num_pages, reserved=reserved)
    owners: list[list[int]] = []
    for op, pick, n in script:
        if op == "admit":
            got = a.allocate(n)
            if got is None:
                assert n > a.num_free
            else:
                owners.append(got)
        elif owners:
            i = pick % len(owners)
            if op == "grow":
                got = a.allocate(n)
                if got is not None:
                    owners[i] += got
            elif op == "share":  # a new owner of a prefix of owner i's pages
                prefix = owners[i][: n]
                a.share(prefix)
                owners.append(list(prefix))
            else:  # preempt / cancel / finish all release every page the owner holds
                a.free(owners.pop(i))
        a.check(owners)
        assert a.num_used == len({p for o in owners for p in o})
        assert all(p >= reserved for o in owners for p in o)
    for o in owners:
        a.free(o)
    a.check(owners=[])
    assert a.num_free == a.num_usable
