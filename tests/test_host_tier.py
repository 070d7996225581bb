"""The host-memory tier under the prefix cache (dcp_jax/kv/host.py, dcp_jax/serving/host_copy.py): evicted
blocks are copied to host memory rank by rank and copied back on a hit; the tokens never change."""

import re

import numpy as np
import pytest

from dcp_jax.errors import UserError
from dcp_jax.kv.host import HostTier
from dcp_jax.serving import Request
from tests.util import FIXTURES


def test_tier_is_an_lru_by_key():
    tier = HostTier(2)
    a, b = tier.store(b"a"), tier.store(b"b")
    assert tier.store(b"a") is None  # held already: nothing to copy
    c = tier.store(b"c")  # full: the least recently stored ("b": "a" was stored again) goes
    assert a and b and c and list(tier.blocks) == [b"a", b"c"] and tier.num_dropped == 1
    assert tier.lookup([b"a", b"c", b"b"]) == 2 and tier.lookup([b"b", b"a"]) == 0
    assert tier.take([b"a"]) == [a] and len(tier) == 1
    c.payload = None
    assert tier.drop_unfilled() == 1 and len(tier) == 0
    with pytest.raises(ValueError, match="at least one block"):
        HostTier(0)


def serve_waves(server, waves, max_tokens, record=None):
    """Each wave's prompts run to completion on `server` (its caches persist); their greedy tokens."""
    from dcp_jax.serving.engine import run_requests

    got = []
    for w, prompts in enumerate(waves):
        reqs = [Request(f"{w}-{i}", p, max_tokens=max_tokens, ignore_eos=True) for i, p in enumerate(prompts)]
        run_requests(server, reqs)
        server.scheduler.check()
        got.append([r.output_token_ids for r in reqs])
        if record is not None:
            record.extend(reqs)
    return got


def working_set(dcp: int, seed: int = 0):
    """Four documents of 4 blocks + 1 token (blocks of 2·dcp tokens), questions about them in waves, each
    answered with two blocks' worth of tokens: the pool holds about two requests, so every later wave
    finds its document evicted (to the host, with the tier). Returns (waves, pages, max_tokens)."""
    block = 2 * dcp
    rng = np.random.default_rng(seed)
    docs = [[int(t) for t in rng.integers(1, 200, 4 * block + 1)] for _ in range(4)]
    waves = [[d + [5]] for d in docs] + [[docs[0] + [6], docs[1] + [7]], [docs[2] + [8]], [docs[3] + [9], docs[0] + [3]]]
    max_tokens = 2 * block + 2
    pages = 1 + 2 * -(-(len(docs[0]) + 1 + max_tokens) // block)
    return waves, pages, max_tokens


@pytest.mark.parametrize("name,tp,dcp", [("llama-gqa", 1, 1), ("llama-gqa", 2, 4), ("deepseek-v3", 1, 2)])
def test_greedy_tokens_equal_with_the_host_tier_on_and_off(name, tp, dcp):
    from dcp_jax import LLM

    waves, pages, max_tokens = working_set(dcp)
    llm = LLM.load(FIXTURES / name, tp=tp, dcp=dcp, page_size=2, max_num_seqs=2, decode_steps=3)
    outs, stats, hosted = {}, {}, {}
    # off; a tier holding the working set; one too small for it; a tier under a pool two pages
    # smaller, where requests admitted with host hits are preempted and resumed
    for case, (host_blocks, less) in dict(off=(0, 0), on=(64, 0), small=(3, 0), tight=(64, 2)).items():
        server = llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=pages - less, host_blocks=host_blocks)
        kv, hosted[case] = server.scheduler.kv, []
        admit = kv.admit

        def admit_and_note(r, hit=(), host_hits=0, admit=admit, note=hosted[case]):
            if host_hits:
                note.append(r)
            admit(r, hit, host_hits)

        kv.admit = admit_and_note
        outs[case] = serve_waves(server, waves, max_tokens)
        stats[case] = server.stats()
        assert stats[case]["pages_used"] == 0
    assert outs["on"] == outs["off"] and outs["small"] == outs["off"] and outs["tight"] == outs["off"]
    on, small = stats["on"], stats["small"]
    assert stats["off"]["evictions"] > 0 and "host_blocks" not in stats["off"] and not hosted["off"]
    assert on["host_stored_blocks"] > 0 and on["host_hit_tokens"] > 0 and on["host_bytes_to_device"] > 0
    assert on["host_hit_tokens"] >= 4 * 2 * dcp  # a whole document came back at least once
    assert small["host_dropped_blocks"] > 0 and small["host_blocks"] <= 3
    assert sum(r.num_preemptions for r in hosted["tight"]) > 0


def test_host_bytes_are_each_ranks_share_and_copies_hold_no_collective():
    # 2 x 4: every device keeps 1/8 of a block (its kv head's share of its context rank's slots); the host
    # keeps exactly the shards of this process's devices, and the copy programs move nothing between them.
    from dcp_jax import LLM

    waves, pages, max_tokens = working_set(4)
    llm = LLM.load(FIXTURES / "llama-gqa", tp=2, dcp=4, page_size=2, max_num_seqs=2, decode_steps=3)
    server = llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=pages, host_blocks=64)
    serve_waves(server, waves, max_tokens)
    stats, runner = server.stats(), server.runner
    import jax

    shards = [sh for leaf in jax.tree.leaves(runner.caches) for sh in leaf.addressable_shards]
    assert len({sh.device for sh in shards}) == 8
    block_bytes = sum(sh.data.nbytes for sh in shards) // pages  # one page of every pool array, all 8 devices
    per_device = {d: sum(sh.data.nbytes for sh in shards if sh.device == d) // pages for d in {sh.device for sh in shards}}
    assert set(per_device.values()) == {block_bytes // 8}  # each device holds 1/8 of the block
    assert stats["host_blocks"] > 0 and stats["host_bytes"] == stats["host_blocks"] * block_bytes
    assert block_bytes == llm.page_bytes() * 8  # what kv_host_memory is divided by
    copies = [k for k in runner.compiled if k[0] in ("host_offload", "host_restore")]
    assert {k[0] for k in copies} == {"host_offload", "host_restore"}
    for key in copies:
        hlo = runner.compiled[key].as_text()
        assert not re.search(r"all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter", hlo), key
        if key[0] == "host_offload":  # the gathered pages land in pinned host memory (the CPU client has it)
            kinds = {s.memory_kind for s in jax.tree.leaves(runner.compiled[key].output_shardings)}
            assert kinds == {"pinned_host"}, kinds


def test_kv_host_memory_sizes_the_tier_and_refuses_what_cannot_work():
    from dcp_jax import LLM

    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4, kv_host_memory="1MiB")
    block = llm.page_bytes() * 2
    assert llm.config.host_blocks == 2**20 // block and llm.engine.scheduler.kv.host.capacity == 2**20 // block
    assert "host_blocks" in llm.engine.stats()
    with pytest.raises(UserError, match="needs prefix caching on"):
        LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, kv_host_memory="1MiB", enable_prefix_caching=False)
    with pytest.raises(UserError, match=f"holds no block: one block takes {block:,} bytes"):
        LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4, kv_host_memory=block - 1)
    with pytest.raises(UserError, match="not a positive size"):
        LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, kv_host_memory="lots")


def test_host_tier_metrics():
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from dcp_jax.server.metrics import Metrics

    m = Metrics(tp=1, dcp=2)
    m.update(dict(host_blocks=5, host_bytes=5120, host_hit_tokens=40, host_bytes_to_host=6144,
                  host_bytes_to_device=4096, host_copy_s=0.5))
    text = generate_latest(m.registry).decode()
    for line in ("dcp_jax:kv_host_blocks 5.0", "dcp_jax:kv_host_bytes 5120.0", "dcp_jax:kv_host_hit_tokens_total 40.0",
                 "dcp_jax:kv_host_bytes_to_device_total 4096.0", "dcp_jax:kv_host_copy_seconds_total 0.5"):
        assert line in text


def test_flag_on_every_entry_point():
    from dcp_jax.cli import engine_kwargs
    from dcp_jax.generate import build_parser as generate_parser
    from dcp_jax.serve import build_parser as serve_parser

    for parser in (generate_parser(), serve_parser()):
        args = parser.parse_args(["--kv-host-memory", "1GiB"])
        assert args.kv_host_memory == 2**30 and engine_kwargs(args)["kv_host_memory"] == 2**30
        assert parser.parse_args([]).kv_host_memory is None


@pytest.mark.parametrize("after_write", [False, True])
def test_a_failed_copy_back_fails_its_request_and_nothing_stale_is_served(after_write):
    # The copy back of a host hit raises (before or after writing the pages): the request that needed it
    # fails (retryable), the device's cached blocks are forgotten (a registered block whose copy may not
    # have run is never served), and the same prompt then gets exactly its tokens; nothing leaks.
    from dcp_jax import LLM
    from dcp_jax.serving.engine import run_requests

    waves, pages, max_tokens = working_set(1)
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=1, page_size=2, max_num_seqs=2, decode_steps=3)
    want = serve_waves(llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=pages), waves, max_tokens)
    server = llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=pages, host_blocks=64)
    serve_waves(server, waves[:4], max_tokens)  # every document read: three of them now on the host
    copier = server.runner.copier
    real = copier.restore

    def failing(caches, blocks, pages_):
        copier.restore = real  # fails once
        if after_write:
            real(caches, blocks, pages_)  # (the pools donated to it: lost, as after a failed write)
        raise RuntimeError("injected copy failure")

    copier.restore = failing
    reqs = [Request(f"a{i}", p, max_tokens=max_tokens, ignore_eos=True) for i, p in enumerate(waves[4])]
    run_requests(server, reqs)
    assert reqs[0].finish_reason == "error" and reqs[0].error_retryable and "injected copy failure" in reqs[0].error
    server.scheduler.check()
    stats = server.stats()
    assert stats["failed_steps"] == 1 and stats["pages_used"] == 0 and stats["cached_blocks"] == 0
    assert serve_waves(server, waves[4:], max_tokens) == want[4:]  # again, and the later waves: exact
    assert server.stats()["host_hit_tokens"] > stats["host_hit_tokens"]


def test_generate_stats_count_host_hits_as_prefix_hits():
    # a device pool holding one document, four documents asked twice in one generate each: the
    # second round's prompts all come back from the host tier, which its stats report as prefix hits
    # (of the documents' full blocks) and as host hits, with the bytes copied back; the tokens are
    # the first round's
    from dcp_jax import LLM

    block = 2 * 2  # page_size 2 x dcp 2
    rng = np.random.default_rng(3)
    docs = [[int(t) for t in rng.integers(1, 200, 4 * block)] + [5] for _ in range(4)]
    pages = 1 + -(-(len(docs[0]) + 4) // block)  # one request's prompt and output
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=2, max_num_seqs=1,
                   num_pages=pages, max_model_len=24, kv_host_memory="1MiB")
    first = llm.generate(docs, max_new_tokens=4, ignore_eos=True)
    second = llm.generate(docs, max_new_tokens=4, ignore_eos=True)
    assert second.tokens == first.tokens
    assert first.stats["host_hit_tokens"] == first.stats["prefix_hit_tokens"] == 0
    assert first.stats["host_bytes_to_host"] > 0 and first.stats["host_bytes_to_device"] == 0
    s = second.stats
    assert s["host_hit_tokens"] == s["prefix_hit_tokens"] == 4 * 4 * block  # 4 blocks a document
    assert s["prefix_hit_rate"] == s["prefix_hit_tokens"] / s["prefix_query_tokens"] > 0
    assert s["host_bytes_to_device"] > 0 and s["host_copy_s"] > 0 and s["host_bytes"] > 0
    assert llm.engine.stats()["host_hit_tokens"] == s["host_hit_tokens"]  # the manager's total


def test_each_requests_cached_tokens_are_its_device_and_host_hits():
    # the setup above (a device pool holding one document): a request's num_cached_tokens (usage's
    # cached_tokens over HTTP) is the prefix hits its admission counted: none the first time, a
    # whole document's from the host tier the second, from the device when it comes right back
    from dcp_jax import LLM
    from dcp_jax.serving.engine import run_requests

    block = 2 * 2  # page_size 2 x dcp 2
    rng = np.random.default_rng(3)
    docs = [[int(t) for t in rng.integers(1, 200, 4 * block)] + [5] for _ in range(3)]
    pages = 1 + -(-(len(docs[0]) + 4) // block)
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=2, max_num_seqs=1,
                   num_pages=pages, max_model_len=24, kv_host_memory="1MiB")
    seen = []
    for i, doc in enumerate(docs + docs + docs[-1:]):
        before = llm.engine.stats()
        r = Request(f"d{i}", doc, max_tokens=2, ignore_eos=True)
        run_requests(llm.engine, [r])
        after = llm.engine.stats()
        hits = after["prefix_hit_tokens"] - before["prefix_hit_tokens"]
        host = after["host_hit_tokens"] - before["host_hit_tokens"]
        assert r.num_cached_tokens == hits, (i, r.num_cached_tokens, hits)
        seen.append((hits, host))
    whole = 4 * block  # a document's full blocks (its last token's block is never a hit)
    assert seen == [(0, 0)] * 3 + [(whole, whole)] * 3 + [(whole, 0)]
