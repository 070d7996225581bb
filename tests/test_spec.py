"""Speculative decoding over the sequence-sharded paged cache: greedy output identical to plain decoding
for both proposers on several meshes and for MLA, with continuous batching and across block boundaries;
sampled output distributed as the target's (chi-square, fixed seeds; the test catches a wrong rule);
rejected drafts' slots never read; no page leak; the CLI, the server and their errors."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from dcp_jax import LLM, SpeculativeConfig, make_mesh
from dcp_jax.sampling import SamplingParams, SamplingRows
from dcp_jax.serving.engine import run_requests
from dcp_jax.serving.request import Request
from dcp_jax.spec import layer_skip_draft, propose_ngram
from dcp_jax.spec import verify as spec_verify
from tests.util import FIXTURES, expected

NEW = 20  # tokens per request: several verify steps, many blocks of 2·dcp tokens
K = 3


def load(name, tp, dcp, **kw):
    return LLM.load(FIXTURES / name, tp=tp, dcp=dcp, page_size=2, max_num_seqs=2, **kw)


@functools.cache
def plain(name, tp, dcp):
    """Greedy tokens without speculation (the fixtures' prompts: 5, 11 and 17 tokens)."""
    llm = load(name, tp, dcp, decode_steps=3, prefill_chunk=4)
    return llm.generate(expected(name)["prompts"], max_new_tokens=NEW, ignore_eos=True).tokens


class Oracle:
    """A test proposer: a request's true greedy continuation with draft j wrong, j cycling over 0..k from
    call to call, so every acceptance length (none, some, all) occurs in every batch."""

    def __init__(self, prompts, outputs):
        self.truth = {tuple(p): list(p) + list(o) for p, o in zip(prompts, outputs)}
        self.calls = 0

    def propose(self, request, num):
        full = self.truth[tuple(request.prompt_token_ids)]
        drafts = full[request.num_tokens:request.num_tokens + num]
        j, self.calls = self.calls % (num + 1), self.calls + 1
        if j < len(drafts):
            drafts[j] = (drafts[j] + 1) % 256
        return drafts


def speculative_llm(name, tp, dcp, proposer):
    if proposer == "layer-skip":
        base = load(name, tp, dcp)
        spec = SpeculativeConfig("draft", K, draft=layer_skip_draft(base.model, base.mesh, 1),
                                 auto_off=False)
        return LLM(base.model, base.mesh, page_size=2, max_num_seqs=2, speculative=spec)
    if proposer.startswith("draft:"):  # another checkpoint (here: GQA draft for an MLA target)
        return load(name, tp, dcp, speculative="draft", num_speculative_tokens=K,
                    draft_model=FIXTURES / proposer.split(":")[1], speculative_auto_off=False)
    return load(name, tp, dcp, speculative="ngram", num_speculative_tokens=K,
                speculative_auto_off=False)


def serve(llm, prompts, proposer=None, outputs=None, arrivals=None, on_step=None, pages=None):
    pages = pages or 1 + 3 * llm.paged_layout().blocks_for(48)
    # always speculating (the rule that turns it off would make these runs' paths depend on a clock)
    spec = dataclasses.replace(llm.speculative, auto_off=False)
    if proposer == "oracle":  # a host proposer of the test's own, handed in with the configuration
        spec = dataclasses.replace(spec, proposer=Oracle(prompts, outputs))
    server = llm.engine_with(spec, max_model_len=48, prefill_chunk=4, num_pages=pages)
    reqs = [Request(f"r{i}", p, max_tokens=NEW, ignore_eos=True) for i, p in enumerate(prompts)]

    def step(plan):
        server.scheduler.check()
        if on_step is not None:
            on_step(server, plan)

    result = run_requests(server, reqs, arrivals=arrivals, on_step=step)
    return [r.output_token_ids for r in reqs], result, server


@pytest.mark.parametrize("name,tp,dcp,proposer", [
    ("llama-gqa", 1, 1, "oracle"), ("llama-gqa", 2, 4, "oracle"),
    ("llama-gqa", 2, 4, "layer-skip"), ("llama-gqa", 1, 3, "layer-skip"), ("llama-gqa", 2, 4, "ngram"),
    ("deepseek-v3", 2, 4, "oracle"), ("deepseek-v3", 1, 3, "layer-skip"), ("deepseek-v3", 2, 4, "draft:llama-gqa"),
])
def test_greedy_speculation_equals_plain_decoding(name, tp, dcp, proposer):
    # Two slots for three prompts of 5, 11 and 17 tokens, the third arriving while the others decode:
    # rows of different lengths and acceptance share each verify step; pages of 2 slots put a block
    # boundary every 2·dcp tokens, crossed inside verify steps.
    prompts, want = expected(name)["prompts"], plain(name, tp, dcp)
    llm = speculative_llm(name, tp, dcp, proposer)
    got, result, server = serve(llm, prompts, proposer, want, arrivals=[0, 0, 0.05])
    assert got == want
    assert result["spec_drafted_tokens"] > 0 and result["pages_used"] == 0
    if proposer == "oracle":  # every acceptance length occurred
        assert 0 < result["spec_accepted_tokens"] < result["spec_drafted_tokens"]
    assert sorted({k[0] for k in server.runner.compiled}) == ["ragged", "verify"]


@pytest.mark.parametrize("proposer", ["oracle", "layer-skip"])
def test_preemption_under_speculation(proposer):
    # A pool that holds the longest request but not all three: verify steps reserve k + 1 tokens, the
    # newest request is preempted and recomputed (its cached prefix blocks reused; a draft model's KV
    # comes back with them, since it lives on the same pages); every token equals plain decoding's.
    name, tp, dcp = "llama-gqa", 1, 3
    prompts, want = expected(name)["prompts"], plain(name, tp, dcp)
    llm = speculative_llm(name, tp, dcp, proposer)
    pages = 1 + llm.paged_layout().blocks_for(17 + NEW)  # the longest request alone
    got, result, _ = serve(llm, prompts, proposer, want, arrivals=[0, 0, 0.05], pages=pages)
    assert result["preemptions"] > 0 and got == want and result["pages_used"] == 0


def test_acceptance_does_not_depend_on_the_mesh():
    # DCP must not cost acceptance (vLLM users saw it collapse to ~1.1 tokens per step with DCP): the same
    # prompts draft and accept exactly as much on 2 x 4 as on one device (greedy tokens are the same, and
    # acceptance is decided by them).
    prompts = [[3, 5, 7, 3, 5, 7, 3, 5], [9, 1, 9, 1, 9, 1, 9, 1, 9, 4, 2], [6, 6, 6, 6, 6]]
    counts = []
    for tp, dcp in ((1, 1), (2, 4)):
        out = load("llama-gqa", tp, dcp, speculative="ngram", num_speculative_tokens=K,
                   speculative_auto_off=False).generate(
            prompts, max_new_tokens=NEW, ignore_eos=True)
        counts.append((out.tokens, out.stats["spec_drafted_tokens"], out.stats["spec_accepted_tokens"]))
    assert counts[0] == counts[1] and counts[0][2] > 0


def test_llm_generate_reports_acceptance():
    # the Python API end to end: LLM.load(speculative=...), generate's stats; the draft's pool shares pages
    llm = load("llama-gqa", 1, 2, speculative="draft", num_speculative_tokens=2,
               draft_model=FIXTURES / "llama-gqa", speculative_auto_off=False)
    out = llm.generate(expected("llama-gqa")["prompts"], max_new_tokens=12, ignore_eos=True)
    assert out.tokens == load("llama-gqa", 1, 2).generate(expected("llama-gqa")["prompts"], max_new_tokens=12,
                                                          ignore_eos=True).tokens
    s = out.stats
    # the target drafting for itself: every draft accepted, 3 tokens per step until the last ones
    assert s["spec_accepted_tokens"] == s["spec_drafted_tokens"] > 0 and s["spec_acceptance_rate"] == 1.0
    assert 2.5 < s["mean_acceptance_length"] <= 3
    assert s["draft_kv_bytes_per_device"] == s["kv_bytes_per_device"]  # the same model, the same pages


def plant(server, positions_of, value):
    """Write `value` into every (layer, kv head, feature) of the target pool's slots at the positions
    `positions_of(request)` of each running request (only where it holds the page)."""
    lay, sched = server.layout, server.scheduler
    pages = server.config.num_pages
    pools = jax.tree.map(np.array, server.runner.pools)
    for r in sched.running:
        for t in positions_of(r):
            block = lay.block_of(t)
            if block >= len(r.pages):
                continue
            row = int(lay.rank_of(t)) * pages + r.pages[block]  # the page's row on its rank's shard
            for leaf in jax.tree.leaves(pools):
                leaf[:, row, :, int(lay.page_slot_of(t))] = value
    runner = server.runner
    put = lambda x, old: jax.device_put(x, old.sharding)  # noqa: E731
    target = jax.tree.leaves(jax.tree.map(put, pools, runner.pools))
    # (through the runner's own writer: its pools are assigned nowhere else)
    runner.write_pool_shards(lambda dev, shards: tuple(
        next(sh.data for sh in leaf.addressable_shards if sh.device == dev) for leaf in target))


def test_rejected_drafts_never_leak_into_attention():
    # After every step, plant a huge value in each running request's slots past its length (its
    # rejected drafts, and slots it will write next): the tokens do not change. The same planting one
    # slot earlier (the last token in the cache) does change them: the planting reaches attention.
    name, tp, dcp = "llama-gqa", 1, 3
    prompts, want = expected(name)["prompts"], plain(name, tp, dcp)
    llm = speculative_llm(name, tp, dcp, "ngram")
    past = lambda r: range(r.num_computed, r.num_computed + K + 1)  # noqa: E731
    got, result, _ = serve(llm, prompts, "oracle", want, on_step=lambda srv, plan: plant(srv, past, 50.0))
    assert got == want and 0 < result["spec_accepted_tokens"] < result["spec_drafted_tokens"]
    inside = lambda r: [r.num_computed - 1]  # noqa: E731
    got, _, _ = serve(llm, prompts, "oracle", want, on_step=lambda srv, plan: plant(srv, inside, 50.0))
    assert got != want


def test_propose_ngram():
    t = np.asarray
    assert propose_ngram(t([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]), 2) == [7, 5]  # most recent match of [1,2,3]
    assert propose_ngram(t([4, 1, 2, 8, 3, 2, 9, 1, 2]), 3, max_n=2) == [8, 3, 2]  # longest n first: [1, 2]
    assert propose_ngram(t([5, 6, 7, 5, 6, 7, 5]), 5) == [6, 7, 5, 6, 7]  # continues through its own proposal
    assert propose_ngram(t([1, 2, 3, 4]), 3) == []  # nothing recurs
    assert propose_ngram(t([7, 7]), 3) == [7, 7, 7]


# --- sampling: the output is distributed as the target's ----------------------------------------------
def chi2_pvalue(samples, probs):
    """p-value of samples (ints) drawn from `probs` (cells with expected count < 5 pooled; a sample in a
    cell of probability 0 gives 0)."""
    probs = np.asarray(probs, np.float64)
    probs = probs / probs.sum()
    observed = np.bincount(np.asarray(samples), minlength=len(probs)).astype(np.float64)
    if observed[probs == 0].sum() > 0:
        return 0.0
    exp = probs * observed.sum()
    big = exp >= 5
    obs_cells = np.append(observed[big], observed[~big].sum())
    exp_cells = np.append(exp[big], exp[~big].sum())
    keep = exp_cells > 0
    obs_cells, exp_cells = obs_cells[keep], exp_cells[keep]
    return float(scipy_stats.chisquare(obs_cells, exp_cells * obs_cells.sum() / exp_cells.sum()).pvalue)


def accept_samples(p_logits, q, mode, rows=20000, top_k=0, q_claimed=None):
    """Run `verify.accept` on `rows` rows with the same target logits [k+1, V] and draft distributions
    q [k, V] (drafts drawn from q with NumPy); returns (tokens [rows, k+1], counts [rows])."""
    k, v = q.shape
    rng = np.random.default_rng(0)
    drafts = np.stack([rng.choice(v, size=rows, p=q[i]) for i in range(k)], axis=1).astype(np.int32)
    logits = jnp.broadcast_to(jnp.asarray(p_logits, jnp.float32), (rows, k + 1, v))
    params = dataclasses.replace(  # temperature 1, seed = the row, no other rule
        SamplingRows.of([None] * rows), temperature=np.ones(rows, np.float32),
        top_k=np.full(rows, top_k, np.int32), seed=np.arange(rows, dtype=np.uint32))
    claimed = q if q_claimed is None else q_claimed
    probs = None if mode == "ngram" else jnp.broadcast_to(jnp.asarray(claimed, jnp.float32), (rows, k, v))
    accept = jax.jit(lambda *a: spec_verify.accept(*a))  # traced anew: sees a monkeypatched rule
    tokens, counts, _, _ = accept(logits, jnp.asarray(drafts), jnp.ones((rows, k), bool), params,
                                  jnp.zeros(rows, jnp.int32), jnp.zeros((rows, 1), jnp.int32),
                                  jnp.full((rows, k + 1, (v + 31) // 32), -1, jnp.int32), probs)
    return np.asarray(tokens), np.asarray(counts)


P_LOGITS = np.log(np.array([[0.30, 0.25, 0.20, 0.12, 0.08, 0.05], [0.05, 0.10, 0.40, 0.25, 0.15, 0.05],
                            [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]]))
Q_DRAFT = np.array([[0.10, 0.50, 0.10, 0.10, 0.10, 0.10], [0.30, 0.10, 0.20, 0.20, 0.10, 0.10]])


@pytest.mark.parametrize("mode,top_k", [("draft", 0), ("draft", 3), ("ngram", 0)])
def test_acceptance_rule_gives_the_target_distribution(mode, top_k):
    # Token 1 of a step follows p_1 (whatever was drafted); token 2, when d_1 was accepted, follows p_2.
    # An n-gram proposal is deterministic: the drafts are one token each (q one-hot) — here a token the
    # target finds likely in one position and unlikely in the other.
    q = Q_DRAFT if mode == "draft" else np.eye(6)[[1, 0]]
    p = np.asarray(spec_verify.target_probs(jnp.asarray(P_LOGITS, jnp.float32)[None], jnp.ones(1),
                                            jnp.full(1, top_k, jnp.int32), jnp.ones(1))[0], np.float64)
    if top_k:
        assert (p == 0).any(axis=1).all()  # the filter is on: drafts outside the top-k must always be rejected
    tokens, counts = accept_samples(P_LOGITS, q, mode, top_k=top_k)
    assert chi2_pvalue(tokens[:, 0], p[0]) > 1e-3
    assert chi2_pvalue(tokens[counts >= 2, 1], p[1]) > 1e-3
    assert (counts >= 2).sum() > 2000 and (counts == 1).sum() > 2000  # both paths taken often


def test_a_wrong_acceptance_rule_is_caught(monkeypatch):
    # The same check fails for the two classic mistakes: resampling from p instead of the residual
    # max(0, p - q), and accepting against another q than the drafts were drawn from.
    p = np.exp(P_LOGITS) / np.exp(P_LOGITS).sum(-1, keepdims=True)
    tokens, _ = accept_samples(P_LOGITS, Q_DRAFT, "draft", q_claimed=np.full((2, 6), 1 / 6))
    assert chi2_pvalue(tokens[:, 0], p[0]) < 1e-6
    monkeypatch.setattr(spec_verify, "residual", lambda p, q: p)
    tokens, _ = accept_samples(P_LOGITS, Q_DRAFT, "draft")
    assert chi2_pvalue(tokens[:, 0], p[0]) < 1e-6


def small_vocab_llm(speculative=None, draft_layers=None):
    """A random 2-layer Llama with a 6-token vocabulary on a 1 x 2 mesh."""
    import json

    from dcp_jax.config import ModelConfig
    from dcp_jax.model import CausalLM, random_source

    cfg = ModelConfig.from_dict(dict(json.loads((FIXTURES / "llama-gqa" / "config.json").read_text()), vocab_size=6))
    mesh = make_mesh(1, 2)
    model = CausalLM(cfg, random_source(cfg, mesh, seed=3, scale=1.0), mesh)
    spec = None
    if speculative == "draft":
        spec = SpeculativeConfig("draft", 2, draft=layer_skip_draft(model, mesh, draft_layers),
                                 auto_off=False)
    elif speculative == "ngram":
        spec = SpeculativeConfig("ngram", 2, auto_off=False)
    return LLM(model, mesh, page_size=2, max_num_seqs=32, speculative=spec, enable_prefix_caching=False)


@pytest.mark.parametrize("speculative", ["draft", "ngram"])
def test_sampled_tokens_follow_the_target_end_to_end(speculative):
    # 1,500 requests with different seeds, temperature 1: the first three tokens (the 2nd and 3rd from
    # verify steps, k = 2) against the target's exact joint law, from scoring all 216 continuations.
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # n-gram lookup proposes [3, 1] after it
    llm = small_vocab_llm(speculative, draft_layers=1)
    n = 1500
    server = llm.engine_with(max_model_len=16, prefill_chunk=8, num_pages=1 + n)
    reqs = [Request(f"s{i}", prompt, sampling=SamplingParams(temperature=1.0), seed=i, max_tokens=3, ignore_eos=True)
            for i in range(n)]
    result = run_requests(server, reqs)
    assert result["spec_drafted_tokens"] > 0 and 0 < result["spec_accepted_tokens"] < result["spec_drafted_tokens"]
    out = np.asarray([r.output_token_ids for r in reqs])
    # the target's joint law of (t1, t2, t3), from the cache-free forward over all 216 continuations
    seqs = np.asarray([prompt + [a, b, c] for a in range(6) for b in range(6) for c in range(6)])
    lp = np.asarray(jax.nn.log_softmax(llm.model.forward(jnp.asarray(seqs)), axis=-1), np.float64)
    at = np.arange(len(seqs))
    n0 = len(prompt)
    joint = np.exp(lp[at, n0 - 1, seqs[:, n0]] + lp[at, n0, seqs[:, n0 + 1]] + lp[at, n0 + 1, seqs[:, n0 + 2]])
    assert np.isclose(joint.sum(), 1.0, atol=1e-4)
    cells = out[:, 0] * 36 + out[:, 1] * 6 + out[:, 2]
    assert chi2_pvalue(cells, joint / joint.sum()) > 1e-3


# --- command line and server ----------------------------------------------------------------------------
def test_cli_speculative_run(capsys):
    from dcp_jax.generate import run

    code = run(["--model", str(FIXTURES / "llama-gqa"), "--dcp", "2", "--prompt-ids", "1,2,3,1,2,3,1,2",
                "--max-new-tokens", "6", "--ignore-eos", "--speculative", "ngram", "--num-speculative-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "speculation ngram, k=2:" in out and "mean acceptance length" in out


@pytest.mark.parametrize("argv,needle,code", [
    (["--speculative", "draft"], "--speculative draft needs --draft-model", 2),
    (["--draft-model", "x"], "--draft-model needs --speculative draft", 2),
    (["--num-speculative-tokens", "2"], "--num-speculative-tokens needs --speculative", 2),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1", 2),
    (["--speculative", "beam"], "invalid choice", 2),
    (["--no-speculative-auto-off"], "--speculative-auto-off needs --speculative", 2),
    (["--speculative", "draft", "--draft-model", str(FIXTURES / "nowhere")], "nowhere", 1),
])
def test_cli_speculative_errors(capsys, argv, needle, code):
    from dcp_jax.generate import run

    got = run(["--model", str(FIXTURES / "llama-gqa"), "--prompt-ids", "1,2", *argv])
    out, err = capsys.readouterr()
    assert got == code and needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_draft_with_another_vocabulary_is_refused():
    import json

    from dcp_jax import UserError
    from dcp_jax.config import ModelConfig
    from dcp_jax.model import CausalLM, random_source

    target = load("llama-gqa", 1, 2)
    cfg = ModelConfig.from_dict(dict(json.loads((FIXTURES / "llama-gqa" / "config.json").read_text()), vocab_size=128))
    draft = CausalLM(cfg, random_source(cfg, target.mesh), target.mesh)
    with pytest.raises(UserError, match=r"vocabulary \(128 ids\) differs from the target's \(256\)"):
        LLM(target.model, target.mesh, speculative=SpeculativeConfig("draft", 2, draft=draft))


def test_server_with_ngram_speculation():
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from dcp_jax.launch import make_app, serve_in_thread

    app, llm = make_app(FIXTURES / "llama-tokenizer", tp=1, dcp=2, max_num_seqs=4, max_model_len=64, page_size=4,
                        prefill_chunk=16, speculative="ngram", num_speculative_tokens=3,
                        speculative_auto_off=False)
    plain_llm = LLM.load(FIXTURES / "llama-tokenizer", dcp=2, page_size=4)
    prompts = [[(5 * i + j) % 7 + 2 for j in range(12)] for i in range(3)]  # K = 3 draft positions  # repetitive: n-grams hit
    want = [plain_llm.generate([p], max_new_tokens=10, ignore_eos=True).text[0] for p in prompts]
    base, stop = serve_in_thread(app, timeout_s=30)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=60, max_retries=0)
        got = [client.completions.create(model=client.models.list().data[0].id, prompt=p, max_tokens=10,
                                         temperature=0, extra_body=dict(ignore_eos=True)).choices[0].text
               for p in prompts]
        assert got == want
        # sampled + streamed: a verify step hands several tokens to the stream at once; with the same seed
        # the streamed text equals the whole response's (draws depend on seed and position only)
        model = client.models.list().data[0].id
        kw = dict(model=model, prompt=prompts[0], max_tokens=16, temperature=0.9, seed=11,
                  extra_body=dict(ignore_eos=True))
        whole = client.completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
        assert streamed == whole
        text = httpx.get(base + "/metrics", timeout=10).text
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("dcp_jax:spec_decode")}
        assert values["dcp_jax:spec_decode_num_draft_tokens_total"] > 0
        assert values["dcp_jax:spec_decode_num_drafts_total"] > 0
        assert values["dcp_jax:spec_decode_mean_acceptance_length"] >= 1
        per_pos = [values.get(f'dcp_jax:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}', 0)
                   for i in range(3)]  # K = 3 draft positions
        assert sum(per_pos) == values["dcp_jax:spec_decode_num_accepted_tokens_total"]
        assert per_pos == sorted(per_pos, reverse=True)  # a draft token is accepted only after the ones before it
    finally:
        stop()


# --- the rule that turns speculation off --------------------------------------------------------
def test_spec_switch_turns_off_where_speculation_loses_and_probes_again():
    from dcp_jax.spec.policy import SpecSwitch

    sw = SpecSwitch(backoff=2, max_backoff=4, probe_share=1.0)  # the doubling alone (see below)
    ms = 1e-3

    def run(accept, verify_ms, plain_ms, rows=4):
        speculate = sw.choose(rows)
        if speculate:  # 8 verify steps of `rows` rows, `accept` tokens each
            sw.observe(True, rows, 8 * verify_ms * ms, 8, int(accept * 8 * rows), 8 * rows)
        else:
            sw.observe(False, rows, 8 * plain_ms * ms, 8)
        return speculate

    # the first run of each kind is cold (not counted); then each is measured once
    assert [run(3.0, 2.0, 1.0) for _ in range(4)] == [True, True, False, False]
    # gain 3 x 1 / 2 = 1.5: speculation stays on
    assert all(run(3.0, 2.0, 1.0) for _ in range(5)) and sw.stats()["spec_switches"] == 0
    # acceptance falls to 1.2 (gain 0.6 once the moving average follows it down): off
    modes = [run(1.2, 2.0, 1.0) for _ in range(3)]
    assert modes == [True, True, False] and sw.stats()["spec_switches"] == 1
    why = sw.stats()["spec_last_switch"]
    assert why.startswith("off at decode iteration") and "acceptance" in why and "< 1" in why
    # off for the backoff (2 iterations, the switch's own included), then one probe; a failed probe
    # doubles the backoff (4), which then stays at its cap
    assert [run(1.2, 2.0, 1.0) for _ in range(2)] == [False, True]
    assert [run(1.2, 2.0, 1.0) for _ in range(4)] == [False, False, False, True]
    assert not sw.on and sw.stats()["spec_switches"] == 1
    # the text turns repetitive: the next probe turns speculation back on
    assert [run(4.0, 2.0, 1.0) for _ in range(5)] == [False, False, False, True, True]
    assert sw.on and sw.stats()["spec_switches"] == 2
    assert sw.stats()["spec_last_switch"].startswith("on at decode iteration")
    # while on, a plain iteration every `refresh` speculative ones keeps the plain step time current
    sw = SpecSwitch(refresh=2)
    modes = [run(3.0, 2.0, 1.0) for _ in range(10)]
    assert modes == [True, True, False, False] + [True, True, False] * 2
    assert SpecSwitch(enabled=False).choose(8) is True


def test_spec_switch_probes_a_bad_loser_rarely_enough_that_probes_cost_their_share():
    # A draft that costs 4 plain steps per verify step and is never accepted (the 2K repeat task's
    # layer-skip draft): a probe of 2 verify steps loses 2 x (4 - 1) = 6 plain steps, a plain
    # iteration is 8 steps, so probes at most 3% of the plain time need 6 / (0.03 x 8) = 25
    # iterations between them, from the first switch on (not the doubling's 4, 8, 16).
    from dcp_jax.spec.policy import SpecSwitch

    sw = SpecSwitch()
    ms = 1e-3

    def run(accept=1.0, verify_ms=4.0, plain_ms=1.0, rows=1):
        speculate = sw.choose(rows)
        if speculate:
            steps = sw.verify_steps(8)
            sw.observe(True, rows, steps * verify_ms * ms, steps, int(accept * steps * rows),
                       steps * rows)
        else:
            sw.observe(False, rows, 8 * plain_ms * ms, 8)
        return speculate

    modes = [run() for _ in range(5)]  # cold and measured, each kind; then the switch
    assert modes == [True, True, False, False, False] and not sw.on
    assert sw.probe_budget(1) == 25 and "iteration 5 for 25 " in sw.stats()["spec_last_switch"]
    modes += [run() for _ in range(300)]
    probes = [i + 1 for i, m in enumerate(modes) if m][2:]  # decode iterations that probed
    # off for the budget (25) while it exceeds the doubling backoff (4, 8, 16), then the backoff
    assert [b - a for a, b in zip([5] + probes, probes)] == [25, 25, 25, 32, 64, 128]
    loss = len(probes) * 2 * (4.0 - 1.0)  # plain steps' worth lost to probes
    assert loss / (8 * (len(modes) - len(probes) - 5)) <= 0.03
    # a draft model's catch-up before a probe (its cache after the plain iterations) is the
    # probe's cost too, not its verify steps': 24 ms more loss, 100 more iterations between probes
    budget = sw.probe_budget(1)
    while not sw.choose(1):
        sw.observe(False, 1, 8 * ms, 8)
    sw.observe(True, 1, 2 * 4.0 * ms, 2, 2, 2, catch_up=24 * ms)
    assert sw.probe_budget(1) == budget + 100 and sw.t_verify[1].value == 4.0 * ms
    # a cheap loser (acceptance 30 / 8 = 3.75 at 4 plain steps: gain 0.94) keeps the short backoff:
    # its probe loses 2 x 0.25 steps, 3% of 3 plain iterations
    sw = SpecSwitch()
    [run(accept=3.8, verify_ms=4.0) for _ in range(5)]
    assert sw.probe_budget(1) == 3 and "for 4 " in sw.stats()["spec_last_switch"]


def test_spec_switch_fits_its_verify_steps_to_an_iteration_that_prefills():
    # An iteration that also prefills makes its chunks wait for its decode rows, which plainly take
    # K - 1 = 7 loop steps (the first token rides the ragged step). There the rule speculates with
    # the most verify steps that take no longer, if they emit at least K = 8 tokens a row, and
    # otherwise decodes that iteration plainly without switching off.
    from dcp_jax.spec.policy import SpecSwitch

    sw = SpecSwitch()
    ms = 1e-3

    def run(accept, prefilling=False, verify_ms=2.0, plain_ms=1.0, rows=4):
        if not sw.choose(rows, prefilling, 8):
            sw.observe(False, rows, 7 * plain_ms * ms, 7)
            return 0
        steps = sw.verify_steps(8)
        sw.observe(True, rows, steps * verify_ms * ms, steps, int(accept * steps * rows),
                   steps * rows)
        return steps

    # unmeasured, a prefilling iteration is measured as any other (cold and measured, each kind)
    assert [run(3.0, prefilling=True) for _ in range(4)] == [8, 8, 0, 0]
    assert run(3.0) == 8  # gain 3 x 1 / 2 = 1.5, nothing to prefill: every verify step
    # prefilling: 7 x 1 ms / 2 ms = 3.5, so 3 verify steps, 3 x 3 = 9 tokens a row >= 8
    assert run(3.0, prefilling=True) == 3 and sw.fitted == 3
    assert run(2.0) == 8  # the acceptance falls to 2.5: gain 1.25, still on
    # prefilling: 3 verify steps emit 7.5 tokens < 8: plain this iteration, the rule still on
    assert run(2.5, prefilling=True) == 0
    stats = sw.stats()
    assert stats["spec_prefill_plain_iterations"] == 1 and stats["spec_switches"] == 0 and sw.on
    assert run(2.5) == 8
    # the probe of a switched-off rule is not fitted (its own cap, probe_steps)
    sw.on, sw.off_until = False, 0
    assert run(2.5, prefilling=True) == 2


@pytest.mark.parametrize("fill_sizes,plain_first", [(None, 1), ((2,), 3)])
def test_a_draft_model_keeps_its_cache_through_plain_iterations(monkeypatch, fill_sizes,
                                                                plain_first):
    # The draft is the target itself, so over a whole draft cache every greedy draft is the token
    # the target then picks. Decode iterations are plain, then alternate speculative and plain
    # (the switch's choice, forced): the positions a plain iteration writes reach the draft's
    # cache before the next verify step (Runner.draft_fills), so the drafts after it still hit.
    # (Without the fill, the drafts after a plain iteration attended to stale slots: 6 of 58
    # accepted.) Fills of 2 tokens: a gap of 9 filled in 5 calls, a 3-token one in 2.
    from dcp_jax.serving import runner as runner_lib
    from dcp_jax.spec.policy import SpecSwitch

    if fill_sizes is not None:
        monkeypatch.setattr(runner_lib, "FILL_SIZES", fill_sizes)
    name, tp, dcp = "llama-gqa", 1, 2
    turns = []

    def choose(self, rows, *prefills):
        turns.append(len(turns) >= plain_first and (len(turns) - plain_first) % 2 == 0)
        return turns[-1]

    monkeypatch.setattr(SpecSwitch, "choose", choose)
    base = load(name, tp, dcp)
    llm = LLM(base.model, base.mesh, page_size=2, max_num_seqs=2, decode_steps=3, prefill_chunk=4,
              speculative=SpeculativeConfig("draft", K, draft=base.model))
    out = llm.generate(expected(name)["prompts"], max_new_tokens=NEW, ignore_eos=True)
    assert out.tokens == plain(name, tp, dcp)
    assert turns.count(False) >= 3 and turns.count(True) >= 3
    drafted, accepted = out.stats["spec_drafted_tokens"], out.stats["spec_accepted_tokens"]
    assert drafted > 0 and accepted >= 0.9 * drafted, (accepted, drafted)


def test_auto_off_engine_mixes_plain_and_speculative_iterations_exactly():
    # With the rule on, the first decode iterations explore both kinds (cold, then measured), so a
    # run of many decode iterations has both; every token equals plain decoding's, and the stats
    # count both kinds.
    name, tp, dcp = "llama-gqa", 1, 2
    prompts = expected(name)["prompts"]
    plain_llm = load(name, tp, dcp, decode_steps=2)
    want = plain_llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
    llm = load(name, tp, dcp, decode_steps=2, speculative="ngram", num_speculative_tokens=K)
    out = llm.generate(prompts, max_new_tokens=NEW, ignore_eos=True)
    stats = llm.engine.stats()
    assert out.tokens == want.tokens
    assert stats["spec_on_iterations"] >= 2 and stats["spec_off_iterations"] >= 2
    assert stats["spec_auto_off"] is True and out.stats["spec_verify_steps"] > 0
