"""Prefill/decode disaggregation in one process (DisaggregatedLLM): each side on its own simulated CPU
devices, the KV moved by jax.experimental.transfer. Greedy tokens equal transformers' (= one instance's,
tests/test_serving.py) for every pair; the bytes pulled are the prompt's KV to within one page per rank."""

import re

import jax
import numpy as np
import pytest

from dcp_jax import DisaggregatedLLM, UserError
from dcp_jax.disagg.handoff import check_pairing
from tests.util import FIXTURES, expected

PAIRS = [  # name, prefill side, decode side
    ("llama-gqa", dict(tp=1, dcp=1, page_size=4), dict(tp=1, dcp=4, page_size=2)),
    ("llama-gqa", dict(tp=2, dcp=1, page_size=3), dict(tp=2, dcp=2, interleave=2, page_size=4)),
    ("llama-gqa", dict(tp=1, dcp=2, interleave=2, page_size=4), dict(tp=1, dcp=4, page_size=3)),
    ("llama-gqa", dict(tp=4, dcp=1, page_size=2), dict(tp=1, dcp=2, page_size=5)),  # kv heads stored twice
    ("deepseek-v3", dict(tp=1, dcp=2, page_size=2), dict(tp=2, dcp=2, interleave=2, page_size=4)),  # MLA
]


def token_bytes(cfg) -> int:
    """KV bytes of one token over all layers, each kv head once (MLA: one latent)."""
    kinds = 1 if cfg.mla else 2
    return cfg.num_layers * kinds * cfg.num_kv_heads * cfg.head_dim * 4


@pytest.mark.parametrize("name,prefill,decode", PAIRS)
def test_pair_matches_one_instance(name, prefill, decode):
    exp = expected(name)
    pair = DisaggregatedLLM.load(FIXTURES / name, prefill=prefill, decode=decode, prefill_chunk=4)
    out = pair.generate(exp["prompts"], max_new_tokens=exp["max_new_tokens"], ignore_eos=True)
    assert out.tokens == exp["greedy"]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(exp["greedy_logprobs"]), atol=2e-3)
    s = out.stats
    assert s["prefill"]["tp"] == prefill["tp"] and s["decode"]["dcp"] == decode["dcp"]
    # bytes the transfers delivered: each prompt's KV, plus less than one source page per source rank
    cfg = pair.decode_llm.model.config
    per_token = token_bytes(cfg)
    src = pair.prefill_llm.paged_layout()
    prompt = sum(len(p) for p in exp["prompts"]) * per_token
    slack = len(exp["prompts"]) * src.num_shards * src.page_size * per_token
    assert prompt <= s["transfer_bytes"] < prompt + slack, (s["transfer_bytes"], prompt, slack)
    assert s["transfers"] == len(exp["prompts"]) and s["transfer_s"] > 0
    engine = pair.decode_llm.engine
    engine.scheduler.check()
    assert engine.scheduler.stats()["pages_used"] == 0
    # a second call reuses the compiled programs and the pairing
    again = pair.generate(exp["prompts"][:1], max_new_tokens=exp["max_new_tokens"], ignore_eos=True)
    assert again.tokens == exp["greedy"][:1]


def test_small_decode_pool_admits_as_pages_free_and_sampling_matches():
    # A decode pool for one request at a time: landed requests wait for pages (FCFS); sampled tokens
    # (temperature > 0) equal a single instance's, the first token coming from the prefill side.
    from dcp_jax import LLM

    prompts = [[3, 7, 11, 2, 9], [5, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8]]
    kw = dict(max_new_tokens=6, ignore_eos=True, temperature=1.1, top_k=40, seed=5)
    pair = DisaggregatedLLM.load(FIXTURES / "llama-gqa", prefill=dict(tp=1, dcp=1, page_size=2),
                                 decode=dict(tp=1, dcp=2, page_size=2, max_num_seqs=1), prefill_chunk=4)
    out = pair.generate(prompts, **kw)
    one = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=2).generate(prompts, **kw)
    assert out.tokens == one.tokens
    assert [r["ttft_s"] for r in out.stats["requests"]] == sorted(r["ttft_s"] for r in out.stats["requests"])


def test_every_sampling_rule_reaches_the_prefill_side():
    # The first token is sampled on the prefill instance: with the request's own rules (the penalties
    # over its prompt, bad words, logit_bias, min_p, min_tokens' ban on EOS), so every token equals a
    # single instance's; prompt logprobs are refused by name.
    import json

    from dcp_jax import LLM

    case = json.loads((FIXTURES / "llama-gqa" / "processors.json").read_text())["cases"][1]
    pair = DisaggregatedLLM.load(FIXTURES / "llama-gqa", prefill=dict(tp=1, dcp=1, page_size=2),
                                 decode=dict(tp=1, dcp=2, page_size=2), prefill_chunk=4)
    one = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=2)
    prompt = case["prompt"]
    for kw in (case["penalties"][0]["params"], dict(bad_words=case["bad_words"]),
               dict(logit_bias={case["greedy12"][0]: -100.0}, min_p=0.05, temperature=0.8, seed=3),
               dict(min_tokens=case["min_tokens"], logit_bias={case["eos"]: 100.0})):
        want = one.generate([prompt], max_new_tokens=12, **dict(dict(ignore_eos="min_tokens" not in kw), **kw))
        got = pair.generate([prompt], max_new_tokens=12, **dict(dict(ignore_eos="min_tokens" not in kw), **kw))
        assert got.tokens == want.tokens, kw
    assert pair.generate([prompt], max_new_tokens=12, **case["penalties"][0]["params"]).tokens[0][:1] == \
        case["penalties"][0]["tokens"][:1]
    # top logprobs: the first token's come back from the prefill side with its offer
    got = pair.generate([prompt], max_new_tokens=4, ignore_eos=True, top_logprobs=3).top_logprobs[0]
    want = one.generate([prompt], max_new_tokens=4, ignore_eos=True, top_logprobs=3).top_logprobs[0]
    assert [[i for i, _ in t] for t in got] == [[i for i, _ in t] for t in want] and len(got[0]) == 3
    np.testing.assert_allclose([x for t in got for _, x in t], [x for t in want for _, x in t], atol=1e-5)
    with pytest.raises(UserError, match="prompt_logprobs is not supported by a disaggregated pair"):
        pair.generate([prompt], prompt_logprobs=1)


def test_pieces_travel_in_power_of_two_chunks():
    from dcp_jax.disagg.handoff import chunks

    assert chunks(13) == [(0, 8), (8, 4), (12, 1)] and chunks(64) == [(0, 64)] and chunks(0) == []
    for n in range(1, 600):
        parts = chunks(n)
        sizes = [size for _, size in parts]
        assert sum(sizes) == n and all(size & (size - 1) == 0 for size in sizes) and sizes == sorted(sizes)[::-1]
        assert [offset for offset, _ in parts] == np.cumsum([0] + sizes[:-1]).tolist()


def test_mismatched_pairs_refuse_at_start():
    a = dict(role="prefill", protocol=2, config_hash="abc", dtype="float32", kv_heads=2, head_dim=8, num_layers=2,
             max_model_len=64)
    check_pairing(a, dict(a, role="decode"))
    for key, value, words in (("config_hash", "xyz", "model (config hash) abc"), ("dtype", "bfloat16", "KV dtype"),
                              ("kv_heads", 4, "KV heads 2"), ("head_dim", 16, "KV head dim 8")):
        with pytest.raises(UserError, match=re.escape("cannot pair: the prefill instance has " + words)) as e:
            check_pairing(a, dict(a, role="decode", **{key: value}))
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="not a prefill one: start it with --role prefill"):
        check_pairing(dict(a, role="decode"), a)
    with pytest.raises(UserError, match="the same --max-model-len"):
        check_pairing(a, dict(a, role="decode", max_model_len=128))
    with pytest.raises(UserError, match="speaks handoff protocol 2 but this decode instance speaks 1; run the same"):
        check_pairing(a, dict(a, role="decode", protocol=1))


def test_load_errors():
    with pytest.raises(UserError, match="the pair needs 4 \\+ 8 devices but 8 are given"):
        DisaggregatedLLM.load(FIXTURES / "llama-gqa", prefill=dict(tp=2, dcp=2), decode=dict(tp=2, dcp=4),
                              devices=jax.devices()[:8])
    with pytest.raises(UserError, match="prefill= does not take colour"):
        DisaggregatedLLM.load(FIXTURES / "llama-gqa", prefill=dict(colour=1))


class Stalling:
    """A prefill handle whose offer for the prompt `stall` names a uuid nobody offers: the pull waits on
    a transfer that never comes (a stalled prefill instance), while the real offer is left unpulled."""

    def __init__(self, inner, stall):
        self.inner, self.stall = inner, stall

    def handshake(self):
        return self.inner.handshake()

    def prefill(self, items, timeout_s):
        out = self.inner.prefill(items, timeout_s)
        for item, offer in zip(items, out):
            if item["prompt_token_ids"] == self.stall:
                offer["parts"] = [[p, 12345, idx] for p, _, idx in offer["parts"]]
        return out

    def release(self, uuid, pulled):
        self.inner.release(uuid, pulled)


def test_stalled_transfer_fails_that_request_only_and_the_offer_is_dropped():
    import time

    exp = expected("llama-gqa")
    pair = DisaggregatedLLM.load(FIXTURES / "llama-gqa", prefill=dict(tp=1, dcp=1, page_size=2),
                                 decode=dict(tp=1, dcp=2, page_size=2), timeout_s=1.0, prefill_chunk=4)
    kw = dict(max_new_tokens=exp["max_new_tokens"], ignore_eos=True)
    assert pair.generate(exp["prompts"], **kw).tokens == exp["greedy"]
    pre, dec = pair.prefill, pair.decode_instance
    dec.prefill = Stalling(dec.prefill, exp["prompts"][1])
    out = pair.generate(exp["prompts"], **kw)  # it ends: the pull gives up at its 1 s timeout
    assert out.finish_reasons == ["length", "error", "length"]
    assert out.errors[1].startswith("pulling the KV from the prefill instance's transfer server 127.0.0.1:")
    assert "did not finish within 1 s" in out.errors[1] and "\n" not in out.errors[1]
    assert out.tokens[0] == exp["greedy"][0] and out.tokens[2] == exp["greedy"][2] and out.tokens[1] == []
    sched = dec.engine.scheduler
    sched.check()
    assert sched.stats()["pages_used"] == 0 and not sched.has_unfinished()
    # the prefill side still holds the real offer nobody pulled: after its timeout it drops it
    assert pre.port.num_pending() == 1
    time.sleep(1.2)
    assert pre.port.reap() == 1 and pre.port.num_pending() == 0
    dec.prefill = dec.prefill.inner  # the decode side goes on serving
    assert pair.generate(exp["prompts"], **kw).tokens == exp["greedy"]


@pytest.mark.parametrize("name,prefill,decode", [
    ("llama-gqa", dict(tp=1, dcp=1, page_size=4), dict(tp=1, dcp=4, page_size=2)),
    ("llama-gqa", dict(tp=2, dcp=1, page_size=3), dict(tp=2, dcp=2, interleave=2, page_size=4)),
    ("deepseek-v3", dict(tp=1, dcp=2, page_size=2), dict(tp=2, dcp=2, interleave=2, page_size=4)),  # MLA
    ("llama-gqa", dict(tp=1, dcp=2, page_size=4), dict(tp=4, dcp=1, page_size=3)),  # decode stores heads twice
])
def test_handoff_holds_each_decode_device_to_its_share(name, prefill, decode):
    # A 160-token prompt's handoff: the KV the receive path places on each decode device (the pulled
    # pieces and any copies, summed over the arrays' shards per device) is that device's tokens of its
    # heads, plus at most one source page per source rank; never the whole prompt on every device.
    # (Before pieces were cut per destination rank, every device held the whole prompt's KV.)
    from dcp_jax.serving.request import Request

    n = 160
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 250, n)]
    pair = DisaggregatedLLM.load(FIXTURES / name, prefill=prefill, decode=decode, prefill_chunk=32)
    warmed = len(pair.decode_instance.receiver.compiled)  # every write program, compiled at pairing
    out = pair.generate([prompt], max_new_tokens=3, ignore_eos=True)
    assert out.tokens == pair.decode_llm.generate([prompt], max_new_tokens=3, ignore_eos=True).tokens
    pre, dec = pair.prefill, pair.decode_instance
    cfg = pair.decode_llm.model.config
    kv = n * token_bytes(cfg)
    share = dec.engine.runner.mesh.shape["dcp"] * min(decode["tp"], cfg.num_kv_heads)  # MLA: one latent "head"
    src = pair.prefill_llm.paged_layout()
    bound = kv / share + src.num_shards * src.page_size * token_bytes(cfg) / min(decode["tp"], cfg.num_kv_heads)
    assert 0 < out.stats["max_device_bytes"] <= bound < kv
    # each piece is pulled once (a head this side stores twice is copied on arrival, not pulled twice)
    assert kv <= out.stats["transfer_bytes"] < kv + src.num_shards * src.page_size * token_bytes(cfg)
    # the prefill side refuses a request whose decode placement it cannot cut pieces for
    bad = dict(dec.placement, page_size=0)
    refused, malformed = pre.prefill([dict(request_id="y", prompt_token_ids=prompt, decode=bad),
                                      dict(request_id="z", prompt_token_ids=prompt, sampling=dict(temperature=-1.0))])
    assert refused["error"].startswith("the request names no usable decode placement: ValueError('PagedLayout")
    assert malformed["request_id"] == "z" and malformed["error"].startswith("the request is malformed: temperature")
    # the same, device by device, on a handoff driven step by step
    r = Request("x", prompt, max_tokens=2, ignore_eos=True)
    landed = dec.fetch(r)
    assert dec.admit(r, landed)
    placed = landed.device_bytes
    assert sorted(placed) == sorted(d.id for d in dec.engine.runner.mesh.devices.flat)
    assert all(0 < b <= bound for b in placed.values()), (placed, bound, kv)
    assert sum(placed.values()) >= kv  # every device's share is there: the whole prompt over the mesh
    # the compiled write programs it ran (XLA's memory analysis, per device; one per chunk): besides the
    # donated pool shard (aliased to the output) and the token indices, their arguments are one device's
    # pieces, within the bound; their temporaries hold no copy of the pieces (a few KB of indices)
    ran = {(d.id, dec.receiver.chunk_meta(s.head0, s.shape[2], s.shape[0])[0])
           for s in landed.offer.pieces for d in dec.receiver.targets(s)}
    assert ran and ran <= set(dec.receiver.compiled) and len(dec.receiver.compiled) == warmed
    for program in (dec.receiver.compiled[key] for key in ran):
        m = program.memory_analysis()
        args = jax.tree.leaves(program.args_info)
        index = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in args if a.dtype == np.int32)
        assert m.alias_size_in_bytes == sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in args if a.donated)
        pieces = m.argument_size_in_bytes - m.alias_size_in_bytes - index
        assert 0 < pieces <= bound and m.temp_size_in_bytes < bound / 4, (pieces, m.temp_size_in_bytes, bound, kv)


# --- faults on the decode side: each fails one request, and the decode instance then serves normally ----


@pytest.fixture(scope="module")
def faults():
    """A pair for the fault tests (llama-gqa, prefill 1x1 -> decode 1x2, pages of 2), shared: each test
    leaves it serving normally, which is what it checks last."""
    exp = expected("llama-gqa")
    pair = DisaggregatedLLM.load(FIXTURES / "llama-gqa", prefill=dict(tp=1, dcp=1, page_size=2),
                                 decode=dict(tp=1, dcp=2, page_size=2), timeout_s=5.0, prefill_chunk=4)
    return pair, exp, dict(max_new_tokens=exp["max_new_tokens"], ignore_eos=True)


def served_normally(pair, exp, kw):
    """The decode instance's pages and slots are all back, and the next requests' tokens equal one
    instance's (transformers' greedy tokens)."""
    sched = pair.decode_llm.engine.scheduler
    sched.check()
    assert sched.stats()["pages_used"] == 0 and not sched.has_unfinished()
    assert pair.generate(exp["prompts"], **kw).tokens == exp["greedy"]
    sched.check()
    assert sched.stats()["pages_used"] == 0


def test_a_failing_write_fails_that_request_alone(faults):
    # The write of the second prompt's KV raises before touching the pool (a TransferError, as a
    # mis-sized piece does): that request ends with a one-line retryable error, its slot and pages back;
    # the other two decode to the end.
    from dcp_jax.disagg import TransferError

    pair, exp, kw = faults
    receiver = pair.decode_instance.receiver
    real, bad = receiver.write, len(exp["prompts"][1])

    def write(pieces, specs, length, table_row):
        if length == bad:
            raise TransferError("injected: a piece does not fit")
        return real(pieces, specs, length, table_row)

    receiver.write = write
    try:
        out = pair.generate(exp["prompts"], **kw)
    finally:
        del receiver.write
    assert out.finish_reasons == ["length", "error", "length"]
    assert out.errors[1] == "injected: a piece does not fit" and out.tokens[1] == []
    assert out.tokens[0] == exp["greedy"][0] and out.tokens[2] == exp["greedy"][2]
    assert pair.decode_llm.engine.num_pool_resets == 0  # nothing was donated: the pool is intact
    served_normally(pair, exp, kw)


def test_a_failure_mid_write_rebuilds_the_pool(faults):
    # The per-device write raises on the second device after the first device's program donated its
    # pool shards: the pool is gone. That request fails alone (slot and pages back); the engine rebuilds
    # a zeroed pool and recomputes the request that was decoding (its tokens do not change); no later
    # step runs on the deleted buffers.
    pair, exp, kw = faults
    eng = pair.decode_llm.engine
    receiver = pair.decode_instance.receiver
    real, bad = receiver.write_program, len(exp["prompts"][1])
    second = list(eng.runner.mesh.devices.flat)[1]
    state = dict(length=None)

    def write(pieces, specs, length, table_row):
        state["length"] = length
        return type(receiver).write(receiver, pieces, specs, length, table_row)

    def write_program(device, meta, index_len):
        program = real(device, meta, index_len)
        if device == second and state["length"] == bad:
            def dies(*args):
                raise RuntimeError("injected: the device failed")
            return dies
        return program

    receiver.write, receiver.write_program = write, write_program
    resets, preempted = eng.num_pool_resets, eng.scheduler.num_preemptions
    try:
        out = pair.generate(exp["prompts"], **kw)
    finally:
        del receiver.write, receiver.write_program
    assert out.finish_reasons == ["length", "error", "length"]
    assert out.errors[1] == "writing its KV failed: RuntimeError: injected: the device failed"
    assert out.tokens[0] == exp["greedy"][0] and out.tokens[2] == exp["greedy"][2]
    assert eng.num_pool_resets == resets + 1 and not eng.runner.pools_lost()
    assert eng.scheduler.num_preemptions == preempted + 1  # the first prompt, decoding then: recomputed
    served_normally(pair, exp, kw)


def test_a_failed_staging_fails_that_request_alone(faults):
    # On the prefill side, cutting the second prompt's KV into pieces raises: that item of the batch is
    # answered with the error (never offered), the others are served, and the decode side gives the
    # failed request's reservation back.
    pair, exp, kw = faults
    stager = pair.prefill.stager
    real, bad = stager.stage, len(exp["prompts"][1])

    def stage(table_row, length, dest):
        if length == bad:
            raise RuntimeError("injected: the gather failed\nsecond line")
        return real(table_row, length, dest)

    stager.stage = stage
    try:
        out = pair.generate(exp["prompts"], **kw)
    finally:
        del stager.stage
    assert out.finish_reasons == ["length", "error", "length"]
    assert out.errors[1] == ("the prefill instance refused the request: staging its KV failed: RuntimeError: "
                             "injected: the gather failed")
    assert out.tokens[0] == exp["greedy"][0] and out.tokens[2] == exp["greedy"][2]
    assert pair.prefill.port.num_pending() == 0
    served_normally(pair, exp, kw)


def test_new_prompt_lengths_compile_no_write_program(faults):
    # Every write program was compiled when the pair formed (DecodeInstance.warm: per decode device,
    # head range and power-of-two chunk size): prompts of lengths never seen, up to the longest the
    # decode side admits, compile nothing on the decode side; their tokens equal one instance's. The
    # prefill side's gathers run at padded block counts: however many lengths, at most one program per
    # size in `gather_sizes` (O(log) of the longest), not one per block count.
    pair, exp, kw = faults
    dec, runner = pair.decode_instance, pair.decode_llm.engine.runner
    programs, decode_programs, dispatches = len(dec.receiver.compiled), len(runner.compiled), dec.receiver.dispatches
    assert programs > 0 and dec.warm() == 0
    rng = np.random.default_rng(3)
    lengths = (1, 6, 29, runner.config.max_model_len - 3, *range(7, 23))
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in lengths]
    out = pair.generate(prompts, max_new_tokens=2, ignore_eos=True)
    assert len(dec.receiver.compiled) == programs and len(runner.compiled) == decode_programs
    chunks = dec.receiver.dispatches - dispatches
    print(f"write programs compiled at pairing: {programs}; {len(prompts)} new lengths: 0 compiled, {chunks} run")
    assert out.tokens == pair.decode_llm.generate(prompts, max_new_tokens=2, ignore_eos=True).tokens
    stager = pair.prefill.stager
    src = pair.prefill_llm.paged_layout()
    gathered = {blocks for blocks, _ in stager.compiled}
    block_counts = {int(src.blocks_for(n)) for n in (*lengths, *map(len, exp["prompts"]))}
    assert gathered <= set(stager.gather_sizes) and len(gathered) < len(block_counts), (gathered, block_counts)
    assert len(stager.gather_sizes) <= 2 * stager.engine.max_blocks_per_seq.bit_length()


def test_the_prefill_queue_batches_what_waits_and_bounds_the_wait():
    # A stub prefill instance whose first batch takes 0.6 s: calls arriving meanwhile form the next
    # batch (one prefill call), each answered with its own items' results in order; a call whose
    # queue bound passed before its batch began is answered with the queue's error and never prefilled.
    import threading
    import time

    from dcp_jax.disagg.server import PrefillQueue

    class Stub:
        def __init__(self):
            self.batches = []

        def prefill(self, items, on_result):
            self.batches.append([it["request_id"] for it in items])
            time.sleep(0.6 if len(self.batches) == 1 else 0.0)
            for i, it in enumerate(items):
                on_result(i, dict(request_id=it["request_id"], first_token=len(it["prompt_token_ids"])))

    stub = Stub()
    q = PrefillQueue(stub, queue_timeout_s=30.0)
    q.thread.start()
    try:
        first = q.submit([dict(request_id="a", prompt_token_ids=[1])])
        while not stub.batches:
            time.sleep(0.01)
        calls = [q.submit([dict(request_id=f"b{i}", prompt_token_ids=[1] * i),
                           dict(request_id=f"c{i}", prompt_token_ids=[2])]) for i in range(1, 5)]
        late = q.submit([dict(request_id="late", prompt_token_ids=[1])], queue_timeout_s=0.2)
        assert [r["request_id"] for r in first.result(10)] == ["a"]
        for i, call in enumerate(calls, 1):
            assert call.result(10) == [dict(request_id=f"b{i}", first_token=i), dict(request_id=f"c{i}", first_token=1)]
        (refused,) = late.result(10)
        assert refused["request_id"] == "late" and refused["error"].startswith("it waited over 0.2 s in the prefill")
        assert stub.batches == [["a"], ["b1", "c1", "b2", "c2", "b3", "c3", "b4", "c4"]]
        assert q.stats == dict(batches=2, max_batch=8, queue_timeouts=1)
    finally:
        q.stop.set()
        q.thread.join(5)
    assert not any(t.name == "dcp-jax-prefill" and t.is_alive() for t in threading.enumerate())


def test_each_decode_process_gets_the_pieces_its_devices_keep():
    # A decode instance on several processes: the placement names, per (rank, kv heads) of a piece, the
    # processes keeping it; the prefill side groups the pieces so, and each process's part of the offer
    # holds exactly its pieces (a head kept on both processes: in both parts).
    from dcp_jax.disagg.handoff import Offer, PieceSpec, process_groups

    def piece(rank, head0, heads):
        return PieceSpec(0, 0, 0, rank, head0, 0, (4, 2, heads, 8), "float32")

    specs = [piece(0, 0, 1), piece(0, 1, 1), piece(1, 0, 1), piece(1, 1, 1), piece(0, 2, 2)]
    dest = dict(processes=[[0, 0, 1, [0]], [0, 1, 2, [1]], [1, 0, 1, [0]], [1, 1, 2, [1]], [0, 2, 4, [0, 1]]])
    groups = process_groups(specs, dest)
    assert groups == {0: [0, 2, 4], 1: [1, 3, 4]}
    assert process_groups(specs, {}) == {0: [0, 1, 2, 3, 4]}  # a placement without processes: one part
    with pytest.raises(ValueError, match="names no process keeping rank 1's kv heads 2..3"):
        process_groups([piece(1, 2, 2)], dest)
    offer = Offer("r", [(p, 100 + p, idx) for p, idx in groups.items()], 7, 3, -0.5, specs)
    back = Offer.from_json(offer.to_json())
    assert back.part(1) == (101, [specs[1], specs[3], specs[4]])
    assert back.part(2) == (None, [])


def test_a_spanning_decode_instance_admits_together_and_fails_together():
    # The protocol of a decode instance on several processes, in one process: a leader (Span) and a
    # follower (Follower) share a LocalStore. Both reserve the same pages; the follower pulls its part
    # (here none: every device is process 0's) and reports; the leader admits only then, and the follower
    # writes at the same point. When the follower's pull fails, the leader fails the request and both
    # give the reservation back.
    import collections
    import time

    from dcp_jax import LLM
    from dcp_jax.disagg.roles import DecodeInstance, LocalPrefill
    from dcp_jax.disagg.spanning import Span, report_key
    from dcp_jax.disagg.transfer import TransferError, TransferPort
    from dcp_jax.serving.lockstep import Lockstep
    from tests.util import LocalStore
    from dcp_jax.serving.request import Request

    kw = dict(tp=1, dcp=2, page_size=2, max_model_len=64)
    # the engines' lockstep sides, given at construction: the decode instances lead and follow
    store = LocalStore()
    lead_side, follow_side = (Lockstep(store, p, num_processes=2) for p in (0, 1))
    pair = DisaggregatedLLM.load(FIXTURES / "llama-gqa", prefill=dict(tp=1, dcp=1, page_size=2),
                                 decode=dict(kw, lockstep=lead_side), timeout_s=5.0)
    other = LLM.load(FIXTURES / "llama-gqa", devices=jax.devices()[3:5], lockstep=follow_side, **kw)
    lead = pair.decode_instance
    follow = DecodeInstance(other.engine, LocalPrefill(pair.prefill), TransferPort(other.mesh.devices.flat[0]),
                            timeout_s=5.0)
    follow.receiver.process = 1  # (in one process every device is process 0's: this side keeps no piece)
    assert isinstance(lead.span, Span) and follow.span is None

    def handoff(prompt, fail: bool):
        r = Request(f"r{len(prompt)}", prompt, max_tokens=3, ignore_eos=True)
        assert lead.reserve_ready(collections.deque([r])) == [r]
        (offer,) = lead.offers([r])
        lead.span.offered(r, offer)  # reserve + pull, published at once
        if fail:
            follow.pull = lambda offer: TransferError("the pull failed")
        msg = other.engine.lockstep.receive()
        other.engine.lockstep.apply(other.engine, msg.commands)
        key = report_key(other.engine.lockstep, r.request_id, 1)
        end = time.monotonic() + 30
        while store.try_get(key) is None:
            assert time.monotonic() < end
            time.sleep(0.01)
        backlog = collections.deque([(r, lead.pull(offer))])
        lead.admit_ready(backlog)
        lead.engine.lockstep.publish()
        msg = other.engine.lockstep.receive()
        other.engine.lockstep.apply(other.engine, msg.commands)
        return r, other.engine.scheduler.get(r.request_id) or other.engine.lockstep.known[r.request_id]

    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 250, 13)]
    r, mirror = handoff(prompt, fail=False)
    assert not r.is_finished and r.output_token_ids == mirror.output_token_ids and len(r.output_token_ids) == 1
    assert list(r.pages) == list(mirror.pages)  # the same pages on both
    assert lead.span.bytes_by_process[1] == 0 and lead.span.bytes_by_process[0] > 0  # (process 0 keeps it all)
    r2, mirror2 = handoff(prompt + [5], fail=True)
    assert r2.finish_reason == mirror2.finish_reason == "error" and r2.error_retryable
    assert r2.error == "process 1: the pull failed" and mirror2.error == r2.error
    for sched in (lead.engine.scheduler, other.engine.scheduler):
        assert not sched.reserved and len(sched.running) == 1
        sched.check()
