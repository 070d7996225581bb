"""Continuous batching over the paged, sequence-sharded pool: exact against transformers and against each
request alone (arrivals mid-flight, preemption and recompute, small pools), on every mesh and for MLA;
XLA's own figures for the pool (per-device bytes, aliasing, one compilation per program)."""

import jax
import numpy as np
import pytest

from dcp_jax import LLM, UserError
from dcp_jax.serving.engine import run_requests
from dcp_jax.serving.request import Request
from dcp_jax.sampling import SamplingParams
from tests.util import FIXTURES, copies_in_loops, expected

MESHES = [(1, 1), (2, 4), (1, 3), (4, 2)]


def load(name, tp, dcp, **kw):
    # lazy: these tests count what the first calls compile (LLM.load compiles all by default)
    return LLM.load(FIXTURES / name, tp=tp, dcp=dcp, **{"compile": "lazy", **kw})


@pytest.mark.parametrize("name,tp,dcp", [("llama-gqa", *m) for m in MESHES]
                         + [("deepseek-v3", 1, 3), ("deepseek-v3", 2, 4)]  # (MLA on two meshes)
                         + [("llama-dynamic", 2, 4)])
def test_matches_transformers_with_fewer_slots_than_requests(name, tp, dcp):
    # Two slots for three prompts: the third waits and is admitted when one finishes; pages of 2 slots
    # make every sequence span several blocks. (Dynamic RoPE: the context its reference's base is
    # for.)
    exp = expected(name)
    llm = load(name, tp, dcp, page_size=2, max_num_seqs=2, decode_steps=3, prefill_chunk=4,
               max_model_len=exp.get("max_seq_len"))
    out = llm.generate(exp["prompts"], max_new_tokens=exp["max_new_tokens"], ignore_eos=True)
    assert out.tokens == exp["greedy"]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(exp["greedy_logprobs"]), atol=2e-3)
    assert out.finish_reasons == ["length"] * 3
    assert out.stats["compilations"] == 2  # one prefill-chunk program, one decode program


def alone(llm, prompt, max_tokens, **kw):
    return llm.generate([prompt], max_new_tokens=max_tokens, ignore_eos=True, **kw).tokens[0]


@pytest.mark.parametrize("tp,dcp,interleave", [(1, 1, 1), (2, 4, 2), (1, 3, 1)])
def test_preemption_and_arrivals_keep_every_request_exact(tp, dcp, interleave):
    # A pool too small for every request at once: the newest is preempted and recomputed later; requests
    # also arrive while others decode. Each request's greedy tokens equal what it gets alone.
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 256, size=n)) for n in (23, 5, 17, 30, 9, 12)]
    lengths = [12, 20, 7, 16, 11, 9]
    llm = load("llama-gqa", tp, dcp, page_size=2, max_num_seqs=4, decode_steps=4, interleave=interleave,
               max_model_len=64)
    solo = [alone(llm, p, n) for p, n in zip(prompts, lengths)]
    pages = 1 + (30 + 16) // llm.paged_layout().tokens_per_block + 4  # the longest fits, not four slots' worth
    server = llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=pages)
    reqs = [Request(f"q{i}", p, max_tokens=n, ignore_eos=True) for i, (p, n) in enumerate(zip(prompts, lengths))]
    result = run_requests(server, reqs, arrivals=[0, 0, 0, 0.05, 0.1, 0.1])
    assert result["preemptions"] > 0
    assert [r.output_token_ids for r in reqs] == solo
    assert all(r.finish_reason == "length" for r in reqs)
    server.scheduler.check()
    assert server.scheduler.stats()["pages_used"] == 0  # every page back (cached ones are evictable)


@pytest.mark.parametrize("name,tp,dcp", [("llama-gqa", 1, 1), ("llama-gqa", 2, 4), ("llama-gqa", 1, 3),
                                          ("deepseek-v3", 2, 4)])
def test_ragged_steps_mix_decode_rows_and_chunks_exactly(name, tp, dcp):
    # Requests arrive while others decode, some sharing a cached prefix: iterations run decode rows and
    # prefill chunks of several requests (whole prompts, cached-prefix tails, chunks of a long prompt) in
    # one ragged step. Every request's greedy tokens equal what it gets alone.
    rng = np.random.default_rng(5)
    doc = [int(t) for t in rng.integers(0, 256, size=24)]
    prompts = [doc + [1, 2], list(rng.integers(0, 256, size=40)), [7, 7, 7], doc + [3], list(rng.integers(0, 256, 9)),
               doc + [4, 5, 6]]
    lengths = [10, 6, 12, 7, 9, 5]
    llm = load(name, tp, dcp, page_size=2, max_num_seqs=4, decode_steps=4, max_model_len=64)
    solo = [alone(llm, p, n) for p, n in zip(prompts, lengths)]
    server = llm.engine_with(max_model_len=64, prefill_chunk=16, num_pages=64)
    reqs = [Request(f"m{i}", p, max_tokens=n, ignore_eos=True) for i, (p, n) in enumerate(zip(prompts, lengths))]
    kinds = []
    run_requests(server, reqs, arrivals=[0, 0.02, 0.04, 0.06, 0.06, 0.08],
                 on_step=lambda p: kinds.append((len(p.prefills), len(p.decode_slots), p.decode_steps)))
    assert [r.output_token_ids for r in reqs] == solo
    assert any(pre >= 1 and dec >= 1 for pre, dec, k in kinds)  # decode rows beside chunks
    assert any(pre == 0 and k == 4 for pre, dec, k in kinds)  # the decode loop when nothing prefills
    assert server.scheduler.stats()["prefix_hit_tokens"] > 0
    t = server.timing  # each ragged step ran one of the step sizes, padding included
    assert 0 < t["rows_useful"] <= t["rows_computed"] <= t["ragged_steps"] * max(server.config.step_sizes)


def test_a_prompt_that_ends_in_a_step_decodes_in_the_loop_after_it():
    # While a request decodes, the K - 1 loop steps behind a ragged step run for it; requests whose prompt
    # ends in that step decode in them too: the first token from the step, K - 1 more from the loop, under
    # every sampling rule that reads state (a seeded draw, penalties over the token history, min_tokens'
    # ban on stop ids, top logprobs), with the same tokens and logprobs as with K = 1, where no loop
    # follows. A request alone on an idle engine does not join: no loop delays its first token.
    llm = load("llama-gqa", 1, 2, page_size=2, max_num_seqs=3, decode_steps=4)
    sampling = SamplingParams(temperature=0.9, top_k=40, repetition_penalty=1.3, presence_penalty=0.5,
                              top_logprobs=3)
    prompts = [[3, 7, 11, 2, 9], [5, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8]]

    def make():
        return [Request(f"j{i}", p, sampling=sampling, seed=10 + i, max_tokens=9, min_tokens=6)
                for i, p in enumerate(prompts)]

    engine, joined = llm.engine_with(max_model_len=32, prefill_chunk=16, num_pages=64), make()
    engine.add_request(joined[0])
    plan = engine.step()
    assert not plan.joining and plan.decode_steps == 0 and len(joined[0].output_token_ids) == 1
    for r in joined[1:]:
        engine.add_request(r)
    plan = engine.step()
    assert {c.request.request_id for c in plan.joining} == {"j1", "j2"} and plan.decode_steps == 4
    assert [len(r.output_token_ids) for r in joined] == [5, 4, 4]  # j0 decoded K; j1, j2: the step's and 3
    while engine.scheduler.has_unfinished():
        engine.step()
    alone_k1 = make()
    run_requests(llm.engine_with(max_model_len=32, prefill_chunk=16, num_pages=64, decode_steps=1), alone_k1)
    for a, b in zip(joined, alone_k1):
        assert a.output_token_ids == b.output_token_ids and len(a.output_token_ids) >= 6
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-4)
        assert [[t for t, _ in top] for top in a.output_top_logprobs] == [[t for t, _ in top] for top in
                                                                         b.output_top_logprobs]
    # no free page for its loop positions: a request does not join (nothing is preempted for it). Blocks
    # of 4 tokens, 5 in the pool: d decodes in 2, a's and b's prompts take one each, and the last one holds
    # a's loop positions: none is left for b's.
    tight = llm.engine_with(max_model_len=32, prefill_chunk=16, num_pages=1 + 5, max_num_seqs=3)
    d, a, b = (Request(f"t{i}", p, max_tokens=m, ignore_eos=True)
               for i, (p, m) in enumerate([([8, 6, 7], 6), ([3, 7], 4), ([5, 1, 4, 1], 5)]))
    tight.add_request(d)
    tight.step()
    tight.add_request(a), tight.add_request(b)
    plan = tight.step()
    assert [c.joins for c in plan.prefills] == [True, False] and not plan.preempted and plan.decode_slots
    while tight.scheduler.has_unfinished():
        tight.step()
    assert [r.output_token_ids for r in (d, a, b)] == [alone(llm, [8, 6, 7], 6), alone(llm, [3, 7], 4),
                                                        alone(llm, [5, 1, 4, 1], 5)]


def test_sampling_is_per_request_and_survives_preemption():
    # Temperature > 0: a request's tokens depend on its seed and positions only, not on what shares the
    # batch or on being preempted and recomputed.
    llm = load("llama-gqa", 1, 2, page_size=2, max_num_seqs=3, decode_steps=2)
    prompts = [[3, 7, 11, 2, 9], [5, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8]]
    sampling = SamplingParams(temperature=1.3, top_k=50, top_p=0.9)

    def make():
        return [Request(f"s{i}", p, sampling=sampling, seed=100 + i, max_tokens=10, ignore_eos=True)
                for i, p in enumerate(prompts)]

    big = llm.engine_with(max_model_len=32, prefill_chunk=4, num_pages=64)
    roomy = make()
    run_requests(big, roomy)
    tight = make()
    result = run_requests(llm.engine_with(max_model_len=32, prefill_chunk=4, num_pages=1 + 8), tight)
    assert result["preemptions"] > 0
    assert [r.output_token_ids for r in tight] == [r.output_token_ids for r in roomy]
    solo = make()[1:2]
    run_requests(big, solo)
    assert solo[0].output_token_ids == roomy[1].output_token_ids
    other_seed = [Request("x", prompts[1], sampling=sampling, seed=7, max_tokens=10, ignore_eos=True)]
    run_requests(big, other_seed)
    assert other_seed[0].output_token_ids != roomy[1].output_token_ids


def test_fifty_requests_compile_each_program_once():
    llm = load("llama-gqa", 1, 2, page_size=4, max_num_seqs=4, decode_steps=4)
    server = llm.engine_with(max_model_len=48, prefill_chunk=8, num_pages=20)
    rng = np.random.default_rng(1)
    reqs = [Request(f"n{i}", list(rng.integers(0, 256, size=int(rng.integers(1, 30)))),
                    max_tokens=int(rng.integers(1, 12)), ignore_eos=True) for i in range(50)]
    result = run_requests(server, reqs, arrivals=list(np.linspace(0, 0.5, 50)))
    assert all(r.finish_reason == "length" for r in reqs)
    # a long mixed run compiles the decode loop and at most one ragged step per step size, each once
    sizes = server.config.step_sizes
    assert sizes == (12,)  # a budget of one chunk (8) + 4 slots: one size
    assert sorted(k[0] for k in server.runner.compiled) == ["decode", "ragged"]
    assert server.timing["ragged_steps"] > 10 and result["pages_used"] == 0


@pytest.mark.parametrize("name,tp,dcp", [("llama-gqa", 2, 4), ("llama-gqa", 4, 2), ("deepseek-v3", 2, 4),
                                          ("qwen2", 2, 2)])
def test_pool_bytes_per_device_and_aliasing(name, tp, dcp):
    # Per-device KV bytes = pool bytes / (min(tp, kv heads) · dcp) (MLA: / (tp · dcp)); the decode
    # program aliases the whole pool shard and its loop copies no pool-shaped buffer.
    llm = load(name, tp, dcp, page_size=4)
    server = llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=9)
    pool = server.runner.pools
    cfg = llm.model.config
    logical = sum(a.nbytes for a in jax.tree.leaves(pool)) // llm.model.kv_replication
    split = tp * dcp if cfg.mla else min(tp, cfg.num_kv_heads) * dcp
    kv = server.kv_bytes()
    assert kv["kv_bytes_total"] == logical and kv["kv_bytes_per_device"] * split == logical
    prog = server.runner.programs.decode_program()
    shard_bytes = sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(pool))
    assert prog.memory_analysis().alias_size_in_bytes >= shard_bytes
    leaf = jax.tree.leaves(pool)[0]
    shape = leaf.sharding.shard_shape(leaf.shape)  # [layers, pages, K, page, D] of one stack
    shard, one_layer = ("f32[" + ",".join(map(str, dims)) + "]" for dims in (shape, shape[1:]))
    assert copies_in_loops(prog.as_text(), [shard, one_layer]) == []
    # the token history (penalties, bad words) is donated too, and its loop copies it never
    history = server.runner.history_spec()
    assert prog.memory_analysis().alias_size_in_bytes >= shard_bytes + history.size * 4
    assert copies_in_loops(prog.as_text(), ["s32[" + ",".join(map(str, history.shape)) + "]"]) == []


def test_program_size_does_not_grow_with_depth():
    # The layers are one lax.scan: a 32-layer model compiles the same program as a 4-layer one (XLA's
    # instruction count, exact; scripts/bench_compile.py times the compiles side by side).
    import json

    from dcp_jax import make_mesh
    from dcp_jax.config import ModelConfig
    from dcp_jax.model import CausalLM, random_source

    base = json.loads((FIXTURES / "llama-gqa" / "config.json").read_text())
    mesh = make_mesh(1, 2)
    sizes = {}
    for layers in (4, 32):
        cfg = ModelConfig.from_dict(dict(base, num_hidden_layers=layers))
        llm = LLM(CausalLM(cfg, random_source(cfg, mesh), mesh), mesh, page_size=4)
        runner = llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=9).runner
        sizes[layers] = [sum(1 for line in prog.as_text().splitlines() if " = " in line)
                         for prog in (runner.programs.decode_program(),
                                      runner.programs.ragged_program(16))]
    assert sizes[4] == sizes[32], sizes


def test_bad_requests_fail_alone():
    llm = load("llama-gqa", 1, 2, page_size=2, max_num_seqs=2, max_model_len=16)
    out = llm.generate([[1, 2, 3], list(range(40)), [4, 5]], max_new_tokens=3, ignore_eos=True)
    assert out.errors[0] is None and out.errors[2] is None
    assert out.errors[1].startswith("the prompt has 40 tokens but the model context (max_model_len) is 16")
    assert [len(t) for t in out.tokens] == [3, 0, 3] and out.finish_reasons == ["length", "error", "length"]
    # 3 usable pages of 2 x 2 tokens: a request needing more never fits
    server = llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=4)
    big = Request("big", list(range(20)), max_tokens=8)
    ok = Request("ok", [1, 2], max_tokens=2, ignore_eos=True)
    run_requests(server, [big, ok])
    assert big.finish_reason == "error" and "the whole pool has 3" in big.error
    assert ok.finish_reason == "length" and len(ok.output_token_ids) == 2


@pytest.mark.parametrize("name", ["llama-gqa", "deepseek-v3"])
def test_pallas_kernel_over_pages_end_to_end(name):
    # The GPU kernel (in Pallas' interpreter) reads the paged pool through the block table inside the
    # DCP island, prefill chunks and decode alike: the same tokens as transformers.
    exp = expected(name)
    llm = load(name, 1, 2, page_size=4, impl="pallas_interpret", prefill_chunk=8)
    out = llm.generate(exp["prompts"], max_new_tokens=exp["max_new_tokens"], ignore_eos=True)
    assert out.tokens == exp["greedy"]


def test_token_budget_and_decode_timing():
    # A budget of several chunks prefills more requests per iteration: same tokens. The decode speed
    # counts only the decode program's tokens and time.
    exp = expected("llama-gqa")
    llm = load("llama-gqa", 2, 4, page_size=2, max_num_seqs=3, max_num_batched_tokens=64, prefill_chunk=4)
    out = llm.generate(exp["prompts"], max_new_tokens=exp["max_new_tokens"], ignore_eos=True)
    assert out.tokens == exp["greedy"]
    s = out.stats
    # decode speed: the decode loop's own tokens over its time (tokens decoded beside a prefill chunk in a
    # ragged step are prefill's time), so at most every token after each request's first
    # (rounded: tokens/s × s is the integer count up to float rounding)
    assert s["decode_s"] > 0 and 0 < round(s["decode_tokens_per_s"] * s["decode_s"]) <= s["generated_tokens"] - 3
    with pytest.raises(UserError, match="max_num_batched_tokens must be an integer >= 1"):
        load("llama-gqa", 1, 1, max_num_batched_tokens=-3)


def test_one_stack_per_layer_gives_the_same_tokens_without_weight_slices():
    # scan_layers=False: a stack (a trip-count-1 scan) per layer: the same tokens, and the decode program
    # never slices a layer's weights out of a stack (what XLA:CPU does, copying, for scanned layers).
    import re

    exp = expected("llama-gqa")
    llm = load("llama-gqa", 2, 4, page_size=2, scan_layers=False)
    assert [st.indices for st in llm.model.stacks] == [(0,), (1,)]
    out = llm.generate(exp["prompts"], max_new_tokens=exp["max_new_tokens"], ignore_eos=True)
    assert out.tokens == exp["greedy"]
    q = llm.model.stacks[0].block.self_attn.q_proj[...]
    shard = "f32[" + ",".join(map(str, q.sharding.shard_shape(q.shape)[1:])) + "]"
    engine = llm.engine_with(max_model_len=64, prefill_chunk=8, num_pages=9)
    hlo = engine.runner.programs.decode_program().as_text()
    assert not [line for line in hlo.splitlines() if re.search(r"slice\S* = " + re.escape(shard), line)]


def test_one_engine_for_the_life_of_an_llm():
    # Calls with prompts of other lengths go to the same engine: its pool (and prefix cache) and its
    # programs stay; a second call about the same document hits its cached blocks and compiles at most
    # the one step size it needs that the first did not; after LLM.compile() nothing compiles again
    # (counted by XLA's own compile events, not only the runner's table).
    import jax.monitoring

    llm = load("llama-gqa", 1, 2, page_size=2, max_model_len=128)
    engine = llm.engine
    rng = np.random.default_rng(3)
    doc = [int(t) for t in rng.integers(0, 256, size=60)]
    first = llm.generate([doc + [1, 2, 3]], max_new_tokens=4, ignore_eos=True)
    # the first call compiles the decode loop and the ragged step of its first step's size
    assert first.stats["prefix_hit_tokens"] == 0 and first.stats["new_compilations"] == 2
    second = llm.generate([doc + [9, 8, 7, 6, 5, 4, 3, 2, 1]], max_new_tokens=6, ignore_eos=True)
    assert llm.engine is engine and second.stats["new_compilations"] <= 1  # a 9-token step: size 16
    tpb = llm.paged_layout().tokens_per_block
    assert second.stats["prefix_hit_tokens"] == (len(doc) // tpb) * tpb  # the document's full blocks
    # the same tokens as with caching off
    cold = load("llama-gqa", 1, 2, page_size=2, max_model_len=128, enable_prefix_caching=False)
    assert cold.generate([doc + [9, 8, 7, 6, 5, 4, 3, 2, 1]], max_new_tokens=6, ignore_eos=True).tokens == second.tokens
    assert llm.compile() > 0  # (and the history fills, `dcp_jax.compilation.compile_history_fills`)
    steps = [k for k in engine.runner.compiled if k[0] != "history"]  # (and the history fills)
    assert len(steps) == 1 + len(llm.config.step_sizes)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    assert llm.reset_prefix_cache() > 0
    third = llm.generate([doc + [5], list(range(30))], max_new_tokens=2, ignore_eos=True)
    assert third.stats["prefix_hit_tokens"] == 0 and engine.scheduler.stats()["pages_used"] == 0
    assert compiles == [] and third.stats["new_compilations"] == 0


def test_pool_and_context_are_sized_once():
    # max_model_len defaults to the checkpoint's (256 for the fixture), lowered with one note when the
    # pool cannot hold it; an explicit one that does not fit is refused with the fix.
    import contextlib
    import io

    llm = load("llama-gqa", 1, 2, page_size=2)
    assert llm.config.max_model_len == 256 and llm.engine.config is llm.config
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        small = load("llama-gqa", 1, 2, page_size=2, kv_cache_memory=llm.page_bytes() * 9)
    assert small.config.max_model_len == 8 * 4 + 1
    assert err.getvalue().count("\n") == 1 and err.getvalue().startswith("note: max_model_len lowered")
    with pytest.raises(UserError, match="does not fit the KV pool"):
        load("llama-gqa", 1, 2, page_size=2, kv_cache_memory=llm.page_bytes() * 9, max_model_len=200)


def test_parse_bytes():
    from dcp_jax.serving.config import parse_bytes

    assert parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("2GB") == 2 * 10**9 and parse_bytes(4096) == 4096
    assert parse_bytes("1.5 KiB") == 1536
    for bad in ("inf", "1e400", "infb", "0.5", "0", "-3MiB", "12XB", "lots", 0, -5):
        with pytest.raises(UserError, match="is not a positive size"):
            parse_bytes(bad)


@pytest.mark.parametrize("after_donation", [True, False])
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(after_donation):
    # A step that raises fails the requests in it (retryable) and the engine goes on. Raised after the
    # program took (donated) the pools: the pool is rebuilt, the prefix cache dropped, and a request
    # that was waiting runs exactly as it would have. Raised before: nothing else is lost.
    llm = load("llama-gqa", 1, 2, page_size=2, max_num_seqs=1, max_model_len=64)
    engine, runner = llm.engine, llm.engine.runner
    prompts = [[3, 7, 11, 2, 9, 4, 4, 1, 8], [5, 1, 4, 1, 5, 9, 2, 6]]
    want = [alone(llm, p, 6) for p in prompts]
    real = runner.step_program

    def failing():
        program = real()

        def run(*args):
            runner.step_program = real  # fails once
            if after_donation:
                program(*args)
            raise RuntimeError("injected device failure")
        return run

    runner.step_program = failing
    reqs = [Request(f"f{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]
    run_requests(engine, reqs)
    first, second = reqs
    assert first.finish_reason == "error" and first.error_retryable and "injected device failure" in first.error
    assert second.finish_reason == "length" and second.output_token_ids == want[1]
    stats = engine.stats()
    assert stats["failed_steps"] == 1 and stats["pool_resets"] == int(after_donation) and stats["pages_used"] == 0
    engine.scheduler.check()
    assert alone(llm, prompts[0], 6) == want[0]  # and it serves the failed one normally afterwards


def test_min_tokens_holds_stop_ids_back_on_the_device():
    # Before min_tokens outputs no stop id is sampled (greedy takes the next best token); after it the
    # stop ids stop the request again. Without min_tokens the same request stops at once.
    llm = load("llama-gqa", 1, 2, page_size=2, max_model_len=64)
    prompt = [3, 7, 11, 2, 9]
    free = alone(llm, prompt, 10)
    stop = free[1]
    plain = Request("p", prompt, max_tokens=10, stop_token_ids=[stop], ignore_eos=True)
    held = Request("m", prompt, max_tokens=10, stop_token_ids=[stop], min_tokens=6, ignore_eos=True)
    run_requests(llm.engine, [plain, held])
    assert plain.output_token_ids == free[:2] and plain.finish_reason == "stop"
    assert stop not in held.output_token_ids[:6] and len(held.output_token_ids) >= 6
    assert held.output_token_ids[0] == free[0]  # the first token is not a stop id: nothing changes
    bad = Request("b", prompt, max_tokens=3, min_tokens=5)
    run_requests(llm.engine, [bad])
    assert bad.finish_reason == "error" and "min_tokens (5) must be at most max_tokens (3)" in bad.error


def test_cpu_defaults_give_a_lone_prompt_the_idle_budget():
    # On CPU an iteration in which nothing decodes may take 1,024 tokens (capped at the context),
    # its step sizes compiled beside the decode budget's; a chunk or budget given by hand holds for
    # every iteration (LLM and engine_with alike).
    llm = load("llama-gqa", 1, 1)
    cfg = llm.config
    whole = max(16, 1 << (cfg.max_model_len - 1).bit_length())
    assert cfg.idle_batched_tokens == min(1024, whole) and cfg.idle_budget == max(
        cfg.token_budget, min(1024, whole))
    assert set(cfg.step_sizes) >= {cfg.token_budget, cfg.idle_budget}
    assert load("llama-gqa", 1, 1, prefill_chunk=64).config.idle_batched_tokens is None
    assert llm.engine_with(prefill_chunk=8).config.idle_batched_tokens is None
