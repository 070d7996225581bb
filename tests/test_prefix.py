"""Prefix caching: the block table's bookkeeping (no block freed while referenced, none leaked, LRU
eviction, chained keys), the scheduler serving cached prefills exactly through a fake paged device, and
the real engine's greedy tokens with caching on equal to those with it off on several meshes and MLA."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.kv.allocator import PageAllocator
from dcp_jax.kv.prefix import PrefixCache, chain_keys
from dcp_jax.layout import PagedLayout
from dcp_jax.serving import Request, Scheduler, SchedulerConfig
from tests.test_scheduler import FakeDevice, drive, reference


# --- keys ----------------------------------------------------------------------------------------------
def test_keys_chain_the_prefix():
    a = chain_keys([1, 2, 3, 4, 5, 6], 2)
    b = chain_keys([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and a[0] != b[0]
    assert a[1] != b[1] and a[2] != b[2]  # same tokens after a different prefix: different key
    assert chain_keys([1, 2, 3, 4, 5, 6, 7], 2) == a  # a partial last block has no key
    assert chain_keys([1, 2, 3, 4, 5, 6], 2, chain_keys([1, 2], 2)) == a  # extending = recomputing


# --- the table over the allocator --------------------------------------------------------------------
def test_free_pages_first_then_lru_eviction():
    pool = PrefixCache(PageAllocator(6, reserved=1))  # pages 1..5
    keys = chain_keys(list(range(8)), 2)  # 4 blocks
    pages = pool.allocate(4)
    for k, p in zip(keys, pages):
        assert pool.register(k, p)
    pool.release(pages)  # released tail first: the head stays longest
    assert pool.num_available == 5 and pool.num_cached == 4 and pool.num_in_use == 0
    assert pool.allocate(1) == [5] and pool.num_evictions == 0  # a truly free page first
    got = pool.allocate(2)  # then the least recently released: the tail blocks
    assert got == [pages[3], pages[2]] and pool.num_evictions == 2
    assert pool.lookup(keys) == pages[:2]  # head still cached
    pool.acquire(pool.lookup(keys[:1]))  # in use again: not evictable
    assert pool.allocate(2) is None  # only pages[1] is evictable
    assert pool.allocate(1) == [pages[1]] and pool.lookup(keys) == pages[:1]
    pool.check(owners=[[5], got, [pages[1]], [pages[0]]])


def test_duplicate_block_stays_private():
    pool = PrefixCache(PageAllocator(4, reserved=1))
    key = chain_keys([1, 2], 2)[0]
    p, q = pool.allocate(2)
    assert pool.register(key, p) and not pool.register(key, q)
    assert pool.is_shared_or_cached(p) and not pool.is_shared_or_cached(q)
    pool.release([q])
    pool.release([p])
    pool.check(owners=[])
    assert pool.num_available == 3 and pool.num_cached == 1


ops = st.lists(st.tuples(st.sampled_from(["admit", "finish", "evict"]),
                         st.lists(st.integers(0, 2), min_size=0, max_size=9), st.integers(0, 7)),
               min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 12), st.integers(1, 3), ops)
def test_random_admit_share_finish_evict_never_frees_in_use_nor_leaks(num_pages, block, script):
    # Requests over a tiny alphabet share prefixes often. After every operation, each page is free,
    # cached-evictable (table reference only) or owned with refcount = holders + the table's reference.
    pool = PrefixCache(PageAllocator(num_pages + 1, reserved=1))
    held: list[list[int]] = []
    for op, tokens, pick in script:
        if op == "admit":
            keys = chain_keys(tokens, block)
            hit = pool.lookup(keys[:max(len(tokens) - 1, 0) // block])
            blocks = -(-len(tokens) // block)
            taken = sum(p in pool.evictable for p in hit)
            if blocks - len(hit) > pool.num_available - taken:
                continue
            pool.acquire(hit)
            pages = hit + pool.allocate(blocks - len(hit))
            for k, p in zip(keys, pages):  # its full blocks are written now
                if p not in hit:
                    pool.register(k, p)
            held.append(pages)
        elif op == "finish" and held:
            pool.release(held.pop(pick % len(held)))
        elif op == "evict" and pool.evictable:
            in_use = {p for pages in held for p in pages}
            assert pool.evict_one() not in in_use
        pool.check(owners=held)
        assert pool.num_in_use == len({p for pages in held for p in pages})
    for pages in held:
        pool.release(pages)
    pool.check(owners=[])
    assert pool.num_available == num_pages  # nothing leaked


# --- the scheduler, through the fake paged device ----------------------------------------------------
class GuardedDevice(FakeDevice):
    """The fake device, refusing any write into a page that is cached or shared."""

    def write(self, request, row, pos, tok):
        page = row[self.sched.layout.block_of(pos)]
        assert not self.sched.kv.pool.is_shared_or_cached(page), f"write into shared/cached page {page}"
        super().write(request, row, pos, tok)


def make(dcp=2, page_size=2, num_pages=64, max_model_len=64, caching=True, **kw):
    """A scheduler and its guarded fake device."""
    sched = Scheduler(SchedulerConfig(layout=PagedLayout(dcp, 1, page_size), num_pages=num_pages,
                                      max_model_len=max_model_len, enable_prefix_caching=caching, **kw),
                      clock=iter(range(10**6)).__next__)
    return sched, GuardedDevice(sched)


def serve(sched, dev, prompts, max_tokens=5):
    """Run `prompts` to completion; returns the requests (the first plan is `serve.plans[0]`)."""
    reqs = [Request(f"x{sched.step}-{i}", p, max_tokens=max_tokens, ignore_eos=True) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    serve.plans = drive(sched, dev)
    for r in reqs:
        assert r.output_token_ids == reference(r, sched.config.max_model_len)
    return reqs


def test_cached_prefill_starts_after_the_hit_and_recomputes_the_partial_block():
    sched, dev = make()  # blocks of 4 tokens
    doc = list(range(1, 11))  # 2 full blocks + 2 tokens
    first, = serve(sched, dev, [doc + [20, 21]])
    again, = serve(sched, dev, [doc + [30]])
    assert serve.plans[0].prefills[0].start == 8  # 2 cached blocks; the partial third block is recomputed
    s = sched.stats()
    assert s["prefix_hit_tokens"] == 8 and s["prefix_query_tokens"] == 12 + 11 and s["pages_used"] == 0
    # each request's share of the hits: its prompt tokens the cache served (usage's cached_tokens)
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 8)
    assert 0 < s["prefix_hit_rate"] < 1 and s["cached_blocks"] >= 4


def test_fully_cached_prompt_still_computes_its_last_token():
    sched, dev = make()
    doc = list(range(1, 13))  # exactly 3 blocks
    serve(sched, dev, [doc])
    serve(sched, dev, [doc])
    c = serve.plans[0].prefills[0]
    assert c.start == 8 and c.end == 12 and c.is_last  # the last cached block dropped from the hit


def test_decode_blocks_are_cached_for_the_next_turn():
    sched, dev = make()
    turn1, = serve(sched, dev, [[5, 6, 7]], max_tokens=9)  # 11 tokens in cache: blocks 0-1 full
    serve(sched, dev, [turn1.prompt_token_ids + turn1.output_token_ids + [8]], max_tokens=3)
    assert serve.plans[0].prefills[0].start == 8  # the blocks decode filled were cached


def test_preempted_request_resumes_after_its_cached_blocks():
    # 8 usable pages of 2 tokens, two requests growing to 14 tokens each: r1 is preempted; r0's growth
    # evicts most of r1's released blocks, and r1 resumes after the ones still cached.
    sched, dev = make(dcp=1, page_size=2, num_pages=9, max_model_len=32, max_num_seqs=2, decode_steps=2)
    reqs = [Request(f"r{i}", list(range(10 * i + 1, 10 * i + 8)), max_tokens=8, ignore_eos=True) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    resumed = []
    drive(sched, dev, on_step=lambda p: resumed.extend(c.start for c in p.prefills if c.request.num_preemptions))
    assert resumed and resumed[0] > 0
    assert [r.output_token_ids for r in reqs] == [reference(r, 32) for r in reqs]
    # a resumed request's hit is its own output's blocks: its prompt's cached tokens stay those of
    # its first admission
    assert [r.num_cached_tokens for r in reqs] == [0, 0]
    assert sched.stats()["prefix_hit_tokens"] >= resumed[0] > 0
    assert sched.stats()["evictions"] > 0 and sched.stats()["pages_used"] == 0


def test_caching_off_never_hits():
    sched, dev = make(caching=False)
    serve(sched, dev, [list(range(1, 13))])
    again, = serve(sched, dev, [list(range(1, 13))])
    assert again.num_cached_tokens == 0
    s = sched.stats()
    assert s["prefix_hit_tokens"] == 0 and s["prefix_hit_rate"] == 0 and s["cached_blocks"] == 0
    assert sched.kv.allocator.num_used == 0


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([(1, 2), (2, 1), (3, 2)]), st.integers(7, 24), st.integers(1, 4), st.integers(1, 3),
       st.lists(st.tuples(st.integers(0, 3), st.integers(0, 14), st.lists(st.integers(0, 3), max_size=6),
                          st.integers(1, 6)), min_size=1, max_size=8))
def test_random_shared_prefix_workload_is_exact_and_leaks_nothing(geom, pages, seqs, k, specs):
    # Prompts = a cut of one of 4 documents + a random tail, in waves; small pools preempt and evict.
    # Every request gets exactly the tokens it gets alone; check() runs after every step.
    dcp, page_size = geom
    docs = [list(np.random.default_rng(d).integers(0, 50, 14)) for d in range(4)]
    sched, dev = make(dcp=dcp, page_size=page_size, num_pages=pages, max_model_len=32, max_num_seqs=seqs,
                      decode_steps=k, max_num_batched_tokens=5)
    waves = [specs[i:i + 3] for i in range(0, len(specs), 3)]
    reqs = []
    for w, wave in enumerate(waves):
        for i, (d, cut, tail, n) in enumerate(wave):
            r = Request(f"w{w}-{i}", docs[d][:cut] + tail or [1], max_tokens=n, ignore_eos=True)
            sched.add_request(r)
            reqs.append(r)
        drive(sched, dev)
    for r in reqs:
        if r.finish_reason == "error":  # refused for what it needs, never for the cache's state
            assert "pool" in r.error or "max_model_len" in r.error, r.error
        else:
            assert r.output_token_ids == reference(r, 32)
    assert sched.stats()["pages_used"] == 0
    sched.kv.pool.check(owners=[])


# --- the real engine: caching on gives the tokens caching off gives ----------------------------------
@pytest.mark.parametrize("name,tp,dcp", [("llama-gqa", 1, 1), ("llama-gqa", 2, 4), ("llama-gqa", 1, 3),
                                         ("deepseek-v3", 1, 2)])
def test_greedy_tokens_equal_with_caching_on_and_off(name, tp, dcp):
    # Pages of 2 slots: a block is 2·dcp tokens. Waves on one server (its cache persists): a document;
    # cuts of it ending inside a block, on a block boundary (fully cached: the last block is recomputed)
    # and past several blocks; several requests sharing it at once; a multi-turn follow-up; then new
    # documents that evict it from a pool holding about two requests, and the first questions again.
    from dcp_jax import LLM
    from dcp_jax.serving.engine import run_requests
    from tests.util import FIXTURES

    block = 2 * dcp
    rng = np.random.default_rng(dcp)
    doc = [int(t) for t in rng.integers(1, 200, 5 * block + 3)]
    other = [[int(t) for t in rng.integers(1, 200, 4 * block)] for _ in range(2)]
    waves = [[doc], [doc[:block + 1]], [doc[:2 * block]], [doc + [7, 8], doc + [9], doc[:3 * block] + [5]],
             [doc + [11]], *[[o] for o in other], [doc + [9], doc[:2 * block]]]
    pages = 1 + 2 * -(-(len(doc) + 2 + 6) // block)
    outs = {}
    for caching in (False, True):
        llm = LLM.load(FIXTURES / name, tp=tp, dcp=dcp, page_size=2, max_num_seqs=3, decode_steps=3,
                       enable_prefix_caching=caching)
        server = llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=pages)
        got = []
        for w, prompts in enumerate(waves):
            if w == 4:  # multi-turn: the transcript of wave 0 plus a new message
                prompts = [waves[0][0] + got[0][0] + prompts[0][-1:]]
            reqs = [Request(f"{w}-{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]
            run_requests(server, reqs)
            server.scheduler.check()
            got.append([r.output_token_ids for r in reqs])
        outs[caching] = got
        stats = server.scheduler.stats()
    assert outs[True] == outs[False]
    assert stats["prefix_hit_tokens"] > 0 and stats["evictions"] > 0 and stats["pages_used"] == 0


def test_bench_prefix_quick_json():
    # Structure and hit rates only: no wall-clock ratio is asserted.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "scripts" / "bench_prefix.py"), "--quick", "--json"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "bench_prefix.py --quick --json" in report["command"] and report["mismatches"] == []
    n = report["size"]["questions"]
    for side in ("off", "on"):
        r = report[side]
        assert len(r["questions"]["ttft_s"]) == n and all(t > 0 for t in r["questions"]["ttft_s"])
        assert len(r["conversation"]["ttft_s"]) == report["size"]["turns"]
        assert r["batch"]["requests_per_s"] > 0 and r["batch"]["output_tokens_per_s"] > 0
    for phase in ("questions", "batch", "conversation"):
        assert report["off"][phase]["hit_rate"] == 0 and report["on"][phase]["hit_rate"] > 0, phase
    assert report["on"]["stats"]["prefix_hit_tokens"] > 0 and report["off"]["stats"]["cached_blocks"] == 0
    # two LLM.generate calls sharing a 3,000-token document: the second hits its full blocks and compiles
    # nothing (the LLM's one engine); with caching off nothing is hit
    on, off = report["on"]["two_calls"], report["off"]["two_calls"]
    block = report["size"]["page_size"]  # tp=1, dcp=1: a block is one page
    assert on["hit_tokens"] == [0, (report["size"]["call_doc"] // block) * block] and off["hit_tokens"] == [0, 0]
    assert on["new_compilations"] == off["new_compilations"] == [0, 0]
    assert report["second_call_speedup"] > 0


def test_bench_prefix_working_set_json():
    # The host tier's workload, small: exact on every side, no leaks, the questions hit the host tier;
    # no wall-clock ratio is asserted.
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, str(root / "scripts" / "bench_prefix.py"), "--quick", "--working-set",
                           "--doc", "256", "--json"], capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    sides = report["sides"]
    assert report["mismatches"] == [] and all(s["no_leaks"] for s in sides.values())
    assert all(len(s["ttft_s"]) == 12 and s["ttft_p50_s"] > 0 for s in sides.values())
    assert sides["host"]["host_hit_rate"] > 0.5 and sides["host"]["bytes_copied_back"] > 0
    assert sides["device"]["host_hit_rate"] == 0 and sides["off"]["device_hit_rate"] == 0
    assert sides["host"]["host_bytes"] > 0 and report["host_vs_device"] > 0


def test_flag_on_by_default_everywhere():
    import inspect

    from dcp_jax import LLM
    from dcp_jax.errors import UserError
    from dcp_jax.generate import build_parser as generate_parser
    from dcp_jax.serve import build_parser as serve_parser

    for parser in (generate_parser(), serve_parser()):
        assert parser.parse_args([]).enable_prefix_caching is True
        assert parser.parse_args(["--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert inspect.signature(LLM).parameters["enable_prefix_caching"].default is True  # LLM.load passes it on
    from tests.util import FIXTURES

    with pytest.raises(UserError, match="enable_prefix_caching"):
        LLM.load(FIXTURES / "llama-gqa", enable_prefix_caching="yes")
