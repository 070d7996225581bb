"""The continuous-batching scheduler, driven by a fake device that stores tokens in a simulated paged
pool through the plan's block table and "samples" a deterministic function of the sequence it reads
back. A page written by the wrong request, a block not reserved, or a preemption that resumes wrongly
therefore changes some request's tokens, and every request must get exactly the tokens it gets alone."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_jax.sampling import SamplingParams
from dcp_jax.errors import UserError
from dcp_jax.layout import PagedLayout
from dcp_jax.serving import NULL_PAGE, Request, RequestState, Scheduler, SchedulerConfig
from dcp_jax.serving.plan import Sampled, StepOutput

VOCAB = 50


def next_token(seq) -> int:
    """The fake model: a hash of the whole sequence (so a wrong KV anywhere changes the output)."""
    h = 17
    for t in seq:
        h = (h * 31 + int(t) + 7) % 1_000_003
    return h % VOCAB


class FakeDevice:
    """Runs plans: writes token ids into a [dcp, pages, page_size] pool through the block table (where a
    real engine writes K/V), reads the sequence back the same way and samples `sample(request, seq)`."""

    def __init__(self, sched: Scheduler, sample=lambda request, seq: next_token(seq)):
        self.sched, self.sample = sched, sample
        lay = sched.layout
        self.pool = np.full((lay.num_shards, sched.config.num_pages, lay.page_size), -1, np.int64)

    def write(self, request, row, pos, tok):
        lay = self.sched.layout
        page = row[lay.block_of(pos)]
        assert page != NULL_PAGE and page in request.pages, f"position {pos} has no reserved page"
        self.pool[lay.rank_of(pos), page, lay.page_slot_of(pos)] = tok

    def read(self, row, length):
        lay = self.sched.layout
        t = np.arange(length)
        seq = self.pool[lay.rank_of(t), row[lay.block_of(t)], lay.page_slot_of(t)]
        assert (seq >= 0).all(), "read a slot that was never written"
        return seq.tolist()

    def run(self, plan):
        """The plan's StepOutput (as ModelRunner.execute makes it), applied in one `update`."""
        n = self.sched.config.max_num_seqs
        out = StepOutput()
        if plan.prefills:  # chunk by chunk, as the ragged step runs them
            first = np.full((n, 1), -1, np.int32)
            for c in plan.prefills:
                if not c.request.is_finished:  # cancelled in flight: a real device would still write
                    for pos, tok in zip(range(c.start, c.end), c.token_ids):  # into its freed pages
                        self.write(c.request, plan.block_table[c.slot], pos, tok)
            for c in plan.prefills:
                if c.is_last and not c.request.is_finished:
                    seq = self.read(plan.block_table[c.slot], c.end)
                    first[c.slot, 0] = self.sample(c.request, seq)
            out.first = Sampled(first, np.full((n, 1), -0.5))
            if plan.joining:  # the decode loop after the ragged step: K - 1 steps from each first token
                k = plan.decode_steps - 1
                loop = np.full((n, k), -1, np.int32)
                for c in plan.joining:
                    if c.request.is_finished:
                        continue
                    row, tok = plan.block_table[c.slot], first[c.slot, 0]
                    for step in range(k):  # (every row runs all K - 1 steps, even past a stop)
                        self.write(c.request, row, c.end + step, tok)
                        seq = self.read(row, c.end + step + 1)
                        tok = loop[c.slot, step] = self.sample(c.request, seq)
                out.joined = Sampled(loop, -loop / 100.0)
        if plan.decode_slots:
            k = plan.decode_steps
            loop = np.full((n, k), -1, np.int32)
            for r, s in zip(plan.decode_requests, plan.decode_slots):
                row, tok, pos = plan.block_table[s], plan.decode_tokens[s], plan.decode_positions[s]
                if r.is_finished:  # cancelled in flight (see above)
                    continue
                for step in range(k):  # every slot runs all K steps, even past a stop
                    self.write(r, row, pos + step, tok)
                    tok = loop[s, step] = self.sample(r, self.read(row, pos + step + 1))
            out.decode = Sampled(loop, -loop / 100.0)
        self.sched.update(plan, out)


def reference(req: Request, max_model_len: int, eos=()) -> list[int]:
    """The tokens `req` gets alone, straight from the fake model."""
    seq, out = list(req.prompt_token_ids), []
    while True:
        t = next_token(seq)
        out.append(t)
        seq.append(t)
        if (t in eos and not req.ignore_eos) or t in req.stop_token_ids:
            return out
        if (req.max_tokens is not None and len(out) == req.max_tokens) or len(seq) >= max_model_len:
            return out


def make(dcp=2, interleave=1, page_size=2, num_pages=64, max_model_len=64, detokenize=None, **kw):
    cfg = SchedulerConfig(layout=PagedLayout(dcp, interleave, page_size), num_pages=num_pages,
                          max_model_len=max_model_len, **kw)
    detok = detokenize
    return Scheduler(cfg, detokenize=detok, clock=iter(range(10**6)).__next__)


def drive(sched, dev, on_step=None, max_steps=10_000):
    """Run until every request finished; returns the plans. Checks invariants after each step."""
    plans = []
    while sched.has_unfinished():
        assert len(plans) < max_steps
        plan = sched.schedule()
        assert plan.prefills or plan.decode_slots, "no progress with unfinished requests"
        plans.append(plan)
        dev.run(plan)
        sched.check()
        if on_step:
            on_step(plan)
    return plans


def req(i, n, max_tokens=8, rs=0, **kw):
    rng = np.random.default_rng(1000 + i + 100 * rs)
    return Request(f"r{i}", rng.integers(0, VOCAB, n).tolist(), max_tokens=max_tokens, **kw)


# --- admission and prefill ---------------------------------------------------------------------------
def test_fcfs_admission_and_slots():
    sched = make(max_num_seqs=2)
    reqs = [sched.add_request(req(i, 5, max_tokens=3 + i)) for i in range(4)]
    plan = sched.schedule()
    assert [c.request.request_id for c in plan.prefills] == ["r0", "r1"]
    assert [c.slot for c in plan.prefills] == [0, 1]
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    dev = FakeDevice(sched)
    dev.run(plan)
    admitted = ["r0", "r1"]
    drive(sched, dev, on_step=lambda p: admitted.extend(
        c.request.request_id for c in p.prefills if c.start == 0 and c.request.request_id not in admitted))
    assert admitted == ["r0", "r1", "r2", "r3"]  # first come, first served
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == r.max_tokens for r in reqs)
    assert sched.kv.allocator.num_used == 0 and sched.stats()["running"] == 0


def test_token_budget_and_contiguous_chunks():
    sched = make(max_num_batched_tokens=10, max_num_seqs=4)
    reqs = [sched.add_request(req(i, n, max_tokens=2)) for i, n in enumerate([25, 7, 3, 12])]
    chunks = {r.request_id: [] for r in reqs}
    plans = drive(sched, FakeDevice(sched), on_step=lambda p: [chunks[c.request.request_id].append(c)
                                                                for c in p.prefills])
    assert max(p.num_prefill_tokens for p in plans) == 10
    assert all(p.num_prefill_tokens <= 10 for p in plans)
    for r in reqs:
        cs = chunks[r.request_id]
        assert cs[0].start == 0 and all(a.end == b.start for a, b in zip(cs, cs[1:]))
        assert cs[-1].end == r.num_prompt_tokens and sum(len(c.token_ids) for c in cs) == r.num_prompt_tokens
        assert [c.is_last for c in cs] == [False] * (len(cs) - 1) + [True]
        assert sum((c.token_ids for c in cs), []) == r.prompt_token_ids
        assert r.output_token_ids == reference(r, 64)


def test_one_token_budget_for_decode_rows_and_prefill_chunks():
    # An iteration that prefills is one ragged step: each decoding request runs its first token in it,
    # charged to the budget beside the chunks (its other K - 1 follow in the decode loop, pages reserved
    # for all K); with nothing to prefill, the K-step decode loop runs alone.
    sched = make(max_num_batched_tokens=10, max_num_seqs=4, decode_steps=4)
    dev = FakeDevice(sched)
    a = sched.add_request(req(0, 3, max_tokens=30))
    dev.run(plan := sched.schedule())
    assert plan.num_prefill_tokens == 3 and not plan.decode_slots
    dev.run(plan := sched.schedule())
    assert plan.decode_steps == 4 and not plan.prefills  # nothing to prefill: the decode loop
    b, c = sched.add_request(req(1, 30, max_tokens=5)), sched.add_request(req(2, 4, max_tokens=5))
    mixed = []
    while b.state is not RequestState.DECODING or c.state is not RequestState.DECODING:
        plan = sched.schedule()
        assert plan.prefills and plan.decode_steps == 4  # decode rows ride along, one token of the budget each
        assert plan.num_prefill_tokens + len(plan.decode_slots) <= 10
        mixed.append(plan)
        dev.run(plan)
        sched.check()
    assert max(p.num_prefill_tokens + len(p.decode_slots) for p in mixed) == 10  # the budget is spent
    assert [ch.request.request_id for p in mixed for ch in p.prefills][:2] == ["r1", "r1"]  # oldest first
    # a prompt that ends in a ragged step joins the decode loop after it: c got its first token in the step
    # and K - 1 = 3 more in the loop, so it has 1 of its 5 left, which bounds the next K
    assert all(ch.joins for p in mixed for ch in p.prefills if ch.is_last) and len(c.output_token_ids) == 4
    dev.run(plan := sched.schedule())
    assert plan.decode_steps == 1 and not plan.prefills
    drive(sched, dev)
    assert [r.output_token_ids for r in (a, b, c)] == [reference(r, 64) for r in (a, b, c)]


def test_a_waiting_request_that_cannot_be_admitted_keeps_the_decode_loop():
    # No free slot (or no pages) for the waiting head: nothing can prefill, so the decode loop's K steps
    # run instead of one-token steps.
    sched = make(max_num_seqs=1, decode_steps=4)
    dev = FakeDevice(sched)
    first = sched.add_request(req(0, 5, max_tokens=9))
    dev.run(sched.schedule())
    second = sched.add_request(req(1, 5, max_tokens=3))
    dev.run(plan := sched.schedule())
    assert plan.decode_steps == 4 and not plan.prefills and second.state is RequestState.WAITING
    drive(sched, dev)
    assert [r.output_token_ids for r in (first, second)] == [reference(r, 64) for r in (first, second)]
    # pages: the decoding request holds the whole pool (2 usable pages); the waiting one gets none yet
    sched = make(dcp=1, page_size=4, num_pages=1 + 2, decode_steps=2, max_num_seqs=2)
    dev = FakeDevice(sched)
    first = sched.add_request(req(0, 6, max_tokens=3))
    dev.run(sched.schedule())
    big = sched.add_request(req(1, 7, max_tokens=1))
    dev.run(plan := sched.schedule())
    assert not plan.prefills and plan.decode_steps == 2 and big.state is RequestState.WAITING
    drive(sched, dev)
    assert [r.output_token_ids for r in (first, big)] == [reference(r, 64) for r in (first, big)]


# --- decode ------------------------------------------------------------------------------------------
def test_decode_reserves_pages_for_all_k_steps():
    sched = make(dcp=2, page_size=2, decode_steps=6, max_model_len=200)  # 4 tokens per block
    reqs = [sched.add_request(req(i, 3 + i, max_tokens=40)) for i in range(3)]
    dev = FakeDevice(sched)
    seen_k = []
    while sched.has_unfinished():
        plan = sched.schedule()
        for r, s in zip(plan.decode_requests, plan.decode_slots):
            last = plan.decode_positions[s] + plan.decode_steps - 1  # the last position written
            assert len(r.pages) == sched.layout.blocks_for(last + 1)  # whole blocks, no more
            assert (plan.block_table[s, :sched.layout.blocks_for(last + 1)] != NULL_PAGE).all()
        seen_k.append(plan.decode_steps)
        dev.run(plan)
        sched.check()
    assert 6 in seen_k
    assert all(r.output_token_ids == reference(r, 200) for r in reqs)


def test_k_reduced_by_max_tokens_and_model_length():
    sched = make(decode_steps=8, max_model_len=12)
    a = sched.add_request(req(0, 4, max_tokens=3))
    dev = FakeDevice(sched)
    dev.run(sched.schedule())  # prefill: first token
    plan = sched.schedule()
    assert plan.decode_steps == 2  # 2 more tokens reach max_tokens
    dev.run(plan)
    assert a.finish_reason == "length" and len(a.output_token_ids) == 3
    b = sched.add_request(req(1, 6, max_tokens=None))  # the model length stops it: 6 new tokens
    dev.run(sched.schedule())
    plan = sched.schedule()
    assert plan.decode_steps == 5
    dev.run(plan)
    assert b.finish_reason == "length" and b.num_tokens == 12
    assert b.output_token_ids == reference(b, 12)


# --- preemption --------------------------------------------------------------------------------------
def test_preempts_newest_and_recompute_gives_the_same_tokens():
    # 6 usable pages of 4 tokens: each request peaks at 4 pages, so two cannot both finish together
    sched = make(dcp=2, page_size=2, num_pages=7, decode_steps=3, max_num_batched_tokens=8)
    reqs = [sched.add_request(req(i, 6, max_tokens=10)) for i in range(3)]
    dev = FakeDevice(sched)
    victims = []
    while sched.has_unfinished():
        running_before = [r.request_id for r in sched.running]
        plan = sched.schedule()
        if plan.preempted:
            victims.append(plan.preempted[0])
            assert plan.preempted[0] == running_before[-1]  # the newest goes first
            # no admission after a preemption: the last one preempted heads the queue
            assert sched.waiting[0].request_id == plan.preempted[-1] and set(plan.preempted) <= set(running_before)
        dev.run(plan)
        sched.check()
    assert victims and sched.stats()["preemptions"] >= len(victims)
    assert sum(r.num_preemptions for r in reqs) == sched.num_preemptions
    for r in reqs:
        assert r.output_token_ids == reference(r, 64), r.request_id
        assert len(r.output_logprobs) == len(r.output_token_ids)
    assert sched.kv.allocator.num_used == 0


def test_preempted_request_resumes_from_prompt_plus_output():
    sched = make(dcp=1, page_size=4, num_pages=4, decode_steps=2, max_num_batched_tokens=64)  # 3 pages
    a = sched.add_request(req(0, 4, max_tokens=7))
    dev = FakeDevice(sched)
    dev.run(sched.schedule())
    dev.run(sched.schedule())
    produced = list(a.output_token_ids)
    assert len(produced) == 3
    assert sched.preempt(a) == "r0" and a.state is RequestState.WAITING and not a.pages
    assert sched.kv.allocator.num_used == 0
    plan = sched.schedule()
    (c,) = plan.prefills
    assert c.start == 0 and c.token_ids == a.prompt_token_ids + produced and c.is_last
    dev.run(plan)
    drive(sched, dev)
    assert a.output_token_ids == reference(a, 64) and a.num_preemptions == 1


# --- cancellation ------------------------------------------------------------------------------------
def test_cancel_in_every_state_frees_pages_at_once():
    sched = make(max_num_seqs=2, max_num_batched_tokens=6)
    a, b, c = (sched.add_request(req(i, 10, max_tokens=20)) for i in range(3))
    dev = FakeDevice(sched)
    dev.run(sched.schedule())  # a prefilling, b waiting for budget
    assert a.state is RequestState.PREFILLING and a.pages
    used = sched.kv.allocator.num_used
    assert sched.cancel("r0") and a.finish_reason == "abort" and not a.pages
    assert sched.kv.allocator.num_used < used and "r0" not in sched.requests
    assert sched.cancel("r2") and c.finish_reason == "abort"  # waiting
    while b.state is not RequestState.DECODING:
        dev.run(sched.schedule())
    plan = sched.schedule()  # b decoding, results in flight
    assert sched.cancel("r1") and sched.kv.allocator.num_used == 0
    dev.run(plan)  # the late results are ignored
    assert b.finish_reason == "abort" and len(b.output_token_ids) == 1
    assert not sched.cancel("r1") and not sched.cancel("nope")
    assert {r.request_id for r in sched.pop_finished()} == {"r0", "r1", "r2"}
    sched.check()


# --- stops -------------------------------------------------------------------------------------------
PIECES = {1: "he", 2: "llo", 3: " wor", 4: "ld", 5: "!", 6: "x", 7: "<eos>", 8: "y"}


def detok(ids):
    return "".join(PIECES.get(int(t), "?") for t in ids)


def scripted(scripts):
    """A fake model that emits a fixed script per request (and junk past its end)."""
    return lambda r, seq: scripts[r.request_id][len(seq) - r.num_prompt_tokens] \
        if len(seq) - r.num_prompt_tokens < len(scripts[r.request_id]) else 6


def test_stops():
    sched = make(decode_steps=4, eos_token_ids=(7,), detokenize=detok)
    scripts = {"eos": [1, 2, 7, 8, 8], "ign": [1, 7, 2, 7], "ids": [6, 6, 5, 6], "str": [1, 2, 3, 4, 5],
               "len": [8] * 10, "first": [7]}
    reqs = {
        "eos": Request("eos", [1, 2], max_tokens=10),
        "ign": Request("ign", [1, 2], max_tokens=4, ignore_eos=True),
        "ids": Request("ids", [1, 2], max_tokens=10, stop_token_ids=[5]),
        "str": Request("str", [1, 2], max_tokens=10, stop=["lo w"]),  # spans tokens 2 and 3
        "len": Request("len", [1, 2], max_tokens=5),
        "first": Request("first", [1, 2], max_tokens=5),  # EOS as the prefill's token
    }
    for r in reqs.values():
        sched.add_request(r)
    drive(sched, FakeDevice(sched, scripted(scripts)))
    out = {k: (r.output_token_ids, r.finish_reason, r.text) for k, r in reqs.items()}
    assert out["eos"] == ([1, 2, 7], "stop", "hello<eos>")  # tokens after the stop are discarded
    assert out["ign"] == ([1, 7, 2, 7], "length", "he<eos>llo<eos>")
    assert out["ids"] == ([6, 6, 5], "stop", "xx!") and reqs["ids"].stop_reason == 5
    assert out["str"][:2] == ([1, 2, 3], "stop") and out["str"][2] == "hel"  # cut before the stop string
    assert reqs["str"].stop_reason == "lo w"
    assert out["len"] == ([8] * 5, "length", "yyyyy")
    assert out["first"] == ([7], "stop", "<eos>")
    assert all(len(r.output_logprobs) == len(r.output_token_ids) for r in reqs.values())
    assert sched.kv.allocator.num_used == 0


def test_stop_string_without_tokenizer_is_refused():
    sched = make()
    r = sched.add_request(Request("s", [1, 2], stop=["x"]))
    assert r.finish_reason == "error" and "need a tokenizer" in r.error


# --- refusals ----------------------------------------------------------------------------------------
def test_impossible_requests_fail_alone():
    sched = make(dcp=2, page_size=2, num_pages=5, max_model_len=32, vocab_size=VOCAB)  # 4 pages = 16 tokens
    ok = sched.add_request(req(0, 5, max_tokens=6))
    long = sched.add_request(req(1, 32, max_tokens=1))
    big = sched.add_request(req(2, 10, max_tokens=10))  # peak 19 cache tokens > 16
    empty = sched.add_request(Request("e", [], max_tokens=3))
    oov = sched.add_request(Request("v", [VOCAB], max_tokens=3))
    bad = sched.add_request(Request("m", [1], max_tokens=0))
    fits = sched.add_request(req(3, 10, max_tokens=7))  # peak exactly 16 tokens: fits
    assert long.finish_reason == "error" and "max_model_len" in long.error and "shorten the prompt" in long.error
    assert big.finish_reason == "error" and "whole pool has 4" in big.error
    assert empty.finish_reason == "error" and "empty" in empty.error
    assert oov.finish_reason == "error" and "vocabulary" in oov.error
    assert bad.finish_reason == "error" and "max_tokens" in bad.error
    for r in (long, big, empty, oov, bad):
        assert "\n" not in r.error and r.state is RequestState.FINISHED and not r.output_token_ids
    drive(sched, FakeDevice(sched))
    assert ok.output_token_ids == reference(ok, 32) and fits.output_token_ids == reference(fits, 32)
    assert {r.request_id for r in sched.pop_finished()} == {"r0", "r1", "r2", "e", "v", "m", "r3"}
    sched.add_request(req(0, 3))  # r0 finished: its id is free again
    with pytest.raises(UserError, match="already in use"):
        sched.add_request(req(0, 3))


def test_bad_config_and_protocol():
    with pytest.raises(UserError, match="num_pages must be an integer >= 2"):
        make(num_pages=1)
    with pytest.raises(UserError, match="decode_steps"):
        make(decode_steps=0)
    sched = make()
    sched.add_request(req(0, 4))
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="apply the previous plan"):
        sched.schedule()
    assert not plan.joining and plan.decode_steps == 0  # nothing decodes: no loop runs after the step
    with pytest.raises(ValueError, match="first tokens have shape None"):
        sched.update(plan, StepOutput())  # (refused before anything changed: the right one next)
    sched.update(plan, StepOutput(first=Sampled(np.full((8, 1), 3), np.zeros((8, 1)))))
    with pytest.raises(RuntimeError, match="applied already"):
        sched.update(plan, StepOutput(first=Sampled(np.full((8, 1), 3), np.zeros((8, 1)))))
    sched.add_request(req(1, 4))
    plan = sched.schedule()  # r0 decodes, so a loop runs after the step: r1's prompt ends in it and joins
    (chunk,) = plan.joining
    k = plan.decode_steps - 1
    first = Sampled(np.full((8, 1), 3), np.zeros((8, 1)))
    bad = StepOutput(first=first, joined=Sampled(np.zeros((8, k + 1)), np.zeros((8, k + 1))),
                     decode=Sampled(np.full((8, k + 1), 4), np.zeros((8, k + 1))))
    with pytest.raises(ValueError, match="joined tokens have shape"):
        sched.update(plan, bad)
    with pytest.raises(RuntimeError, match="apply the previous plan"):
        sched.schedule()  # the step's tokens are not applied yet
    out = StepOutput(first=first, joined=Sampled(np.full((8, k), 5), np.zeros((8, k))),
                     decode=Sampled(np.full((8, k + 1), 4), np.zeros((8, k + 1))))
    sched.update(plan, out)
    assert chunk.request.output_token_ids == [3] + [5] * k
    sched.schedule()
    with pytest.raises(RuntimeError, match="not the latest"):
        sched.update(plan, out)


def test_stats():
    sched = make(dcp=4, page_size=8, num_pages=11)
    s = sched.stats()
    assert s["pages_total"] == 10 and s["kv_capacity_tokens"] == 10 * 8 * 4 and s["pages_used"] == 0
    sched.add_request(req(0, 40))  # 40 tokens = 2 blocks of 32
    sched.add_request(req(1, 4))
    sched.schedule()
    s = sched.stats()
    assert s["pages_used"] == 3 and s["running"] == 2 and s["waiting"] == 0 and s["preemptions"] == 0


# --- random workloads --------------------------------------------------------------------------------
geometry = st.sampled_from([(1, 1, 1), (1, 1, 4), (2, 1, 2), (2, 2, 2), (3, 1, 2), (3, 2, 4), (4, 1, 1)])


@settings(max_examples=150, deadline=None)
@given(geometry, st.integers(3, 12), st.integers(1, 4), st.integers(1, 5), st.integers(2, 24),
       st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 30)), min_size=1, max_size=8),
       st.sets(st.integers(0, 7), max_size=3), st.integers(0, 10))
def test_random_workload_never_leaks(geom, pages, seqs, k, budget, specs, cancel_ids, cancel_at):
    """Random prompts, lengths, pool sizes and cancellations: invariants hold after every step, pages
    all come back, and every request that was not cancelled gets exactly its solo tokens."""
    n, i, p = geom
    sched = make(dcp=n, interleave=i, page_size=p, num_pages=pages + 1, max_model_len=40, max_num_seqs=seqs,
                 decode_steps=k, max_num_batched_tokens=budget)
    reqs = [sched.add_request(req(j, ln, max_tokens=mt, rs=s)) for j, (ln, mt, s) in enumerate(specs)]
    dev = FakeDevice(sched)
    steps = [0]

    def maybe_cancel(plan):
        steps[0] += 1
        if steps[0] == cancel_at:
            for j in cancel_ids:
                sched.cancel(f"r{j}")
            sched.check()

    drive(sched, dev, on_step=maybe_cancel)
    assert sched.kv.allocator.num_used == 0 and not sched.running and not sched.waiting
    sched.kv.allocator.check(owners=[])
    assert (sched.kv.block_table == NULL_PAGE).all()
    for r in reqs:
        assert r.is_finished
        if r.finish_reason in ("stop", "length"):
            assert r.output_token_ids == reference(r, 40)
        elif r.finish_reason == "error":
            assert "pool" in r.error or "max_model_len" in r.error
        else:
            assert r.finish_reason == "abort"


def test_sampling_params_are_per_request():
    """Each request's sampling parameters and seed reach the device in its slot's row; a seed the device
    cannot hold (uint32) is refused with the request alone."""
    from dcp_jax.sampling import SamplingRows

    sched = make()
    a = sched.add_request(req(0, 3, sampling=SamplingParams(0.7, top_k=5), seed=11))
    b = sched.add_request(req(1, 3))
    bad = sched.add_request(req(2, 3, seed=2**32))
    assert bad.finish_reason == "error" and "seed must be an integer in [0, 2**32)" in bad.error
    plan = sched.schedule()
    rows = [None] * sched.config.max_num_seqs
    for c in plan.prefills:
        rows[c.slot] = c.request
    sampling = SamplingRows.of(rows)
    assert sampling.temperature[a.slot] == np.float32(0.7) and sampling.top_k[a.slot] == 5
    assert sampling.seed[a.slot] == 11 and sampling.temperature[b.slot] == 0 and sampling.seed[b.slot] == 0


def test_prefill_chunks_share_the_token_budget():
    sched = make(max_num_batched_tokens=12)
    a, b = sched.add_request(req(0, 7)), sched.add_request(req(1, 9))
    plan = sched.schedule()
    assert plan.num_prefill_tokens == 12
    assert [(c.request, c.slot, c.start, c.end, c.is_last) for c in plan.prefills] == [
        (a, a.slot, 0, 7, True), (b, b.slot, 0, 5, False)]
    assert [c.token_ids for c in plan.prefills] == [a.prompt_token_ids, b.prompt_token_ids[:5]]


# --- prompts prefilled elsewhere (prefill/decode disaggregation) --------------------------------------
def test_reserved_prompts_hold_their_pages_until_written_or_given_back():
    # A reservation takes a slot and the prompt's pages before the KV is computed elsewhere: it counts
    # in pages_used, refuses what no longer fits (None, FCFS), comes back on fail or abort, and its
    # admission writes into exactly those pages; the request then decodes as if prefilled here.
    sched = make(dcp=1, page_size=2, num_pages=8, max_num_seqs=2)  # 7 usable pages of 2 tokens
    a, b, c = req(0, 5, max_tokens=3), req(1, 6, max_tokens=3), req(2, 3, max_tokens=2)
    assert sched.reserve_prefilled(a) and sched.reserve_prefilled(b)  # 3 + 3 pages, both slots
    assert sched.stats()["pages_used"] == 6 and sched.stats()["reserved"] == 2 and not sched.has_unfinished()
    assert sched.reserve_prefilled(c) is None  # no slot, and 1 page left for its 2
    sched.check()
    with pytest.raises(UserError, match="already in use"):
        sched.reserve_prefilled(req(0, 5))
    sched.fail(b, "its KV never came", retryable=True)  # slot and pages back at once
    assert b.finish_reason == "error" and b.error_retryable and not b.pages and sched.stats()["pages_used"] == 3
    assert sched.reserve_prefilled(c)
    sched.abort(c)
    assert sched.stats()["pages_used"] == 3 and sched.pop_finished() == [b, c]
    pages, written = list(a.pages), []
    dev = FakeDevice(sched)
    for pos, tok in enumerate(a.prompt_token_ids):  # the prompt's KV, as a prefill instance sends it
        dev.pool[0, pages[pos // 2], pos % 2] = tok
    first = next_token(a.prompt_token_ids)
    assert sched.admit_prefilled(a, first, -0.5, written.append) is True
    assert written == [pages] and sched.stats()["reserved"] == 0 and a.state is RequestState.DECODING
    drive(sched, dev)
    assert a.output_token_ids == reference(a, 64) and sched.stats()["pages_used"] == 0
    assert sched.reserve_prefilled(Request("x", [])) is False  # one that can never run is refused at once
    sched.check()


def test_an_iteration_with_nothing_decoding_takes_the_idle_budget():
    # A lone prompt prefills in chunks of the idle budget; once a request decodes, every iteration
    # keeps the decode budget (the decoding request never waits on a larger step); tokens as alone.
    sched = make(max_num_seqs=2, max_num_batched_tokens=8, idle_batched_tokens=32,
                 max_model_len=128)
    dev = FakeDevice(sched)
    long = Request("long", list(range(1, 61)), max_tokens=40)
    short = Request("short", list(range(3, 53)), max_tokens=4)
    sched.add_request(long)
    plans = drive(sched, dev, on_step=lambda plan: plan.step == 1 and sched.add_request(short))
    first = plans[0]
    assert first.num_prefill_tokens == 32 and not first.decode_slots
    for plan in plans[1:]:
        decoding = len(plan.decode_slots) if not plan.verify_steps else 0
        if plan.decode_slots:  # the budget covers each decoding request's token and the chunks
            assert plan.num_prefill_tokens + decoding <= 8
        else:
            assert plan.num_prefill_tokens <= 32
    assert long.output_token_ids == reference(long, 128)
    assert short.output_token_ids == reference(short, 128)
    assert any(p.decode_slots and p.prefills for p in plans)  # both budgets were used
