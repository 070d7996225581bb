"""logit_bias, allowed_token_ids, min_p, the presence / frequency / repetition penalties, bad words and
min_tokens (vLLM's and OpenAI's request parameters), per row on the device: greedy tokens against
transformers' own logits processors (tests/fixtures/llama-gqa/processors.json, made by
scripts/make_processor_fixture.py), on several meshes, under speculation, with prefix hits and
preemption; min_p's support checked on the tokens it samples; every rule's range checks (each row
of `RULES` and each other parameter's error names its field); `LLM.generate` with one
SamplingParams per prompt; the device rows filled from the parameters they name."""

import dataclasses
import json
import types

import numpy as np
import pytest

from dcp_jax import LLM
from dcp_jax.errors import UserError
from dcp_jax.sampling import SamplingRows
from dcp_jax.sampling_params import MAX_LISTED, RULES, SamplingParams
from dcp_jax.serving.request import Request, make_requests
from tests.util import FIXTURES

CASES = json.loads((FIXTURES / "llama-gqa" / "processors.json").read_text())["cases"]


@pytest.mark.parametrize("tp,dcp,spec", [(1, 1, None), (2, 4, None), (1, 2, "ngram")])
def test_logit_bias_and_allowed_ids_match_transformers_processors(tp, dcp, spec):
    extra = dict(speculative=spec, num_speculative_tokens=3) if spec else {}
    llm = LLM.load(FIXTURES / "llama-gqa", tp=tp, dcp=dcp, page_size=4, decode_steps=3, **extra)
    for case in CASES:  # each prompt alone, as the reference ran them
        kw = dict(max_tokens=8, ignore_eos=True)
        biased = llm.generate([case["prompt"]], SamplingParams(logit_bias=dict(case["logit_bias"]),
                                                               **kw))
        assert biased.tokens[0] == case["biased"]
        allowed = llm.generate([case["prompt"]],
                               SamplingParams(allowed_token_ids=case["allowed_token_ids"], **kw))
        assert allowed.tokens[0] == case["allowed"]
    # the rules are per row: a batch mixing them gives each request its own tokens
    mixed = llm.generate([c["prompt"] for c in CASES],
                         SamplingParams(max_tokens=8, ignore_eos=True,
                                        logit_bias=dict(CASES[0]["logit_bias"])))
    assert mixed.tokens[0] == CASES[0]["biased"]


def test_min_p_keeps_sampled_tokens_within_its_support():
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4)
    prompts = [c["prompt"] for c in CASES]
    kw = dict(max_tokens=12, ignore_eos=True, temperature=1.0, seed=9, top_logprobs=20)
    out = llm.generate(prompts, SamplingParams(min_p=0.2, **kw))
    for lps, tops in zip(out.logprobs, out.top_logprobs):  # at temperature 1: p >= 0.2 p_max
        assert all(lp >= alts[0][1] + np.log(0.2) - 1e-5 for lp, alts in zip(lps, tops))
    assert llm.generate(prompts, SamplingParams(min_p=0.2,
                                                **kw)).tokens == out.tokens  # seeded: the same draw
    # without it the same seeds wander below 0.2 p_max somewhere
    free = llm.generate(prompts, SamplingParams(**kw))
    assert any(lp < alts[0][1] + np.log(0.2) for lps, tops in zip(free.logprobs, free.top_logprobs)
               for lp, alts in zip(lps, tops))


@pytest.mark.parametrize("tp,dcp,spec", [(1, 1, None), (2, 4, None), (1, 2, "ngram")])
def test_penalties_bad_words_and_min_tokens_match_transformers(tp, dcp, spec):
    extra = dict(speculative=spec, num_speculative_tokens=3) if spec else {}
    llm = LLM.load(FIXTURES / "llama-gqa", tp=tp, dcp=dcp, page_size=4, decode_steps=3, **extra)
    kw = dict(max_tokens=12, ignore_eos=True)
    for case in CASES:  # each prompt alone, as the reference ran them; from the second call on, the
        # prompt's full blocks are prefix hits (the history of their tokens is filled from the host)
        assert llm.generate([case["prompt"]], SamplingParams(**kw)).tokens[0] == case["greedy12"]
        for pen in case["penalties"]:
            got = llm.generate([case["prompt"]], SamplingParams(**pen["params"], **kw))
            assert got.tokens[0] == pen["tokens"], pen
        banned = llm.generate([case["prompt"]], SamplingParams(bad_words=case["bad_words"], **kw))
        assert banned.tokens[0] == case["banned"]
        early = llm.generate([case["prompt"]], SamplingParams(max_tokens=12,
                                                              min_tokens=case["min_tokens"],
                                                              logit_bias={case["eos"]: 100.0}))
        assert early.tokens[0] == case["min_tokens_tokens"] and early.finish_reasons == ["stop"]
    assert llm.engine.stats()["prefix_hit_tokens"] > 0
    # the test can fail: each penalty and the bad words change some prompt's tokens
    for i in range(len(CASES[0]["penalties"])):
        assert any(c["penalties"][i]["tokens"] != c["greedy12"] for c in CASES)
    assert all(c["banned"] != c["greedy12"][:len(c["banned"])] for c in CASES)


def test_penalties_are_per_row_through_preemption_and_sampling():
    # Every prompt with every rule in one batch, on a pool so small that requests are preempted and
    # recomputed: each request gets its reference tokens. Sampled with penalties: a seed gives the same
    # tokens alone and in a mixed batch.
    from dcp_jax.serving.engine import run_requests

    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=2, max_num_seqs=6, decode_steps=4)
    jobs = [(c, pen["params"], pen["tokens"]) for c in CASES for pen in c["penalties"]]
    jobs += [(c, dict(bad_words=c["bad_words"]), c["banned"]) for c in CASES]
    jobs += [(c, {}, c["greedy12"]) for c in CASES]
    engine = llm.engine_with(num_pages=24)
    requests = [r for i, (c, params, _) in enumerate(jobs)
                for r in llm.requests([c["prompt"]], SamplingParams(max_tokens=12, ignore_eos=True,
                                                                    **params),
                                      prefix=f"j{i}-")]
    run_requests(engine, requests)
    assert engine.stats()["preemptions"] > 0
    assert [r.output_token_ids for r in requests] == [want for *_, want in jobs]
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_k=40, seed=5,
                            frequency_penalty=1.5, repetition_penalty=1.4)
    prompts = [c["prompt"] for c in CASES]
    alone = [llm.generate([p], params).tokens[0] for p in prompts]
    assert llm.generate(prompts, params).tokens == alone
    plain = dataclasses.replace(params, frequency_penalty=0.0, repetition_penalty=1.0)
    assert llm.generate(prompts, plain).tokens != alone


def test_history_counts_read_chunk_by_chunk(monkeypatch):
    # counts over a history read in chunks of 3 (the last overlapping the one before), up to each row's
    # own length: the same as counting the whole history
    import jax.numpy as jnp

    from dcp_jax import penalties

    monkeypatch.setattr(penalties, "HISTORY_CHUNK", 3)
    rng = np.random.default_rng(0)
    history = rng.integers(0, 6, (4, 10)).astype(np.int32)
    prompt_len, upto = np.array([2, 0, 5, 9], np.int32), np.array([7, 10, 5, 1], np.int32)
    counts, in_prompt = penalties.history_counts(jnp.asarray(history), jnp.asarray(prompt_len), jnp.asarray(upto), 6)
    for i in range(4):
        out = history[i, prompt_len[i]:max(upto[i], prompt_len[i])]
        assert np.asarray(counts[i]).tolist() == np.bincount(out, minlength=6).tolist()
        assert np.asarray(in_prompt[i]).tolist() == (np.bincount(history[i, :min(prompt_len[i], upto[i])],
                                                                 minlength=6) > 0).tolist()


def test_bad_words_from_text():
    # vLLM's rule: each word as it is and after a space (a different token to byte-level BPE)
    from dcp_jax.penalties import bad_words_ids

    vocab = {"cat": [5], " cat": [9], "big dog": [3, 4], " big dog": [8, 4]}
    assert bad_words_ids(vocab.__getitem__, ["cat", " big dog"]) == ((5,), (9,), (3, 4), (8, 4))
    with pytest.raises(UserError, match="bad_words must be a list of non-empty strings"):
        bad_words_ids(vocab.__getitem__, [""])
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=1, page_size=4)
    with pytest.raises(UserError, match="bad_words as text needs a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, bad_words=["cat"]))


@pytest.mark.parametrize("kw,match", [
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-2.1), r"frequency_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=True), r"frequency_penalty must be in"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be a finite number > 0"),
    (dict(bad_words_ids=((1,) * 9,)), r"bad_words takes at most 32 token sequences .* of 1 to 8 tokens"),
    (dict(bad_words_ids=tuple((i,) for i in range(33))), r"bad_words takes at most 32"),
    (dict(bad_words_ids=(("a",),)), r"bad_words must be a list of words"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(logit_bias={5: 100.5}), r"logit_bias must map distinct token ids to numbers in \[-100, 100\]"),
    (dict(logit_bias={"x": 1}), "logit_bias must map token ids"),
    (dict(logit_bias={-1: 1}), "logit_bias must map token ids"),
    (dict(logit_bias={5: float("nan")}), r"in \[-100, 100\]"),
    (dict(allowed_token_ids=[]), "at least one token id"),
    (dict(allowed_token_ids=["a"]), "allowed_token_ids must be a list of token ids"),
    (dict(logit_bias={i: 1 for i in range(MAX_LISTED + 1)}), f"at most {MAX_LISTED} are supported"),
])
def test_rules_are_checked(kw, match):
    with pytest.raises(UserError, match=match):
        SamplingParams(**kw)
    assert SamplingParams(logit_bias={"7": 2, 3: -1}).logit_bias == ((3, -1.0), (7, 2.0))


def test_ids_outside_the_vocabulary_fail_the_request():
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=1, page_size=4)
    with pytest.raises(UserError, match=r"logit_bias / allowed_token_ids / bad_words id 256 is outside the vocabulary \[0, 256\)"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logit_bias={256: 1}))


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 4)])
def test_n_samples_share_one_prefill(tp, dcp):
    # n = 4 seeded samples of one prompt: four distinct samples, sample j equal to seed + j sampled alone;
    # the first one's prefill fills the prompt's full blocks and the others share them, so the pages in
    # use while they run stay under 4x one request's and the prompt is prefilled about once.
    from dcp_jax.serving.engine import run_requests

    llm = LLM.load(FIXTURES / "llama-gqa", tp=tp, dcp=dcp, page_size=4, max_num_seqs=4)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 250, 61)]
    kw = dict(max_tokens=6, ignore_eos=True, temperature=1.0, top_k=50, seed=21)
    out = llm.generate([prompt], SamplingParams(n=4, **kw))
    assert len(out.tokens) == 4 and len({tuple(t) for t in out.tokens}) == 4
    for j, toks in enumerate(out.tokens):
        assert toks == llm.generate([prompt], SamplingParams(**dict(kw, seed=21 + j))).tokens[0]
    llm.reset_prefix_cache()
    alone_engine = llm.engine_with(max_model_len=128)
    run_requests(alone_engine, llm.requests([prompt], SamplingParams(**kw)))
    one = alone_engine.stats()["prefix_query_tokens"] - alone_engine.stats()["prefix_hit_tokens"]
    server, peak = llm.engine_with(max_model_len=128), []
    run_requests(server, llm.requests([prompt], SamplingParams(n=4, **kw)),
                 on_step=lambda plan: peak.append(
        server.scheduler.stats()["pages_used"]))
    block = 4 * dcp
    single = -(-(len(prompt) + 6) // block)  # one request's pages
    assert max(peak) < 4 * single
    s = server.stats()
    assert s["prefix_hit_tokens"] == 3 * ((len(prompt) - 1) // block * block)  # the others hit its full blocks
    assert s["prefix_query_tokens"] - s["prefix_hit_tokens"] < 2 * one
    with pytest.raises(UserError, match="n must be"):
        llm.generate([prompt], SamplingParams(n=0))


def _bad_values(rule):
    """Values just outside `rule`'s range, of the wrong type, and None where it is not allowed."""
    step = 1 if rule.kind is int else 0.5
    bad = ["1", True, [1]] + ([] if rule.optional else [None])
    if rule.low is not None:
        bad.append(rule.low if rule.low_open else rule.low - step)
    if rule.high is not None:
        bad.append(rule.high if rule.high_open else rule.high + step)
    if rule.kind is int:
        bad.append(rule.low + 0.5 if rule.low is not None else 0.5)
    else:
        bad += [float("nan"), float("inf")]
    return bad


@pytest.mark.parametrize("name", sorted(RULES))
def test_each_rule_names_its_field(name):
    # every row of the table: a value outside it fails with a message starting with the parameter's
    # name and the error's field naming it (an HTTP 400's param); its edges pass
    rule = RULES[name]
    # (min_tokens <= max_tokens is its own rule)
    fixed = dict(max_tokens=None) if name == "min_tokens" else {}
    for value in _bad_values(rule):
        with pytest.raises(UserError) as e:
            SamplingParams(**{name: value}, **fixed)
        assert e.value.field == name, (value, e.value)
        assert str(e.value).startswith(f"{name} must be "), (value, e.value)
        assert rule.describe() in str(e.value)
    for edge in (rule.low, rule.high):
        open_edge = (rule.low_open and edge == rule.low) or (rule.high_open and edge == rule.high)
        if edge is not None and not open_edge:
            assert getattr(SamplingParams(**{name: rule.kind(edge)}, **fixed), name) == edge


@pytest.mark.parametrize("kw,field", [
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"), (dict(bad_words_ids=((1,) * 9,)), "bad_words"),
    (dict(stop=["x"] * 17), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(structured=("nope", "x")), "structured"),
    (dict(min_tokens=3, max_tokens=2), "min_tokens"),
])
def test_other_rules_name_their_field(kw, field):
    with pytest.raises(UserError) as e:
        SamplingParams(**kw)
    assert e.value.field == field


def test_the_keyword_form_is_the_same_request():
    # `SamplingParams.of`: the older keywords (max_new_tokens for max_tokens) make the same params
    assert SamplingParams.of(max_new_tokens=5, top_k=3,
                             logit_bias=None) == SamplingParams(max_tokens=5, top_k=3)
    one = SamplingParams(top_k=2)
    assert SamplingParams.of(one) is one
    with pytest.raises(UserError, match="not both"):
        SamplingParams.of(one, top_k=3)
    with pytest.raises(TypeError, match="no parameter colour"):
        SamplingParams.of(colour=1)


def test_params_from_a_source_that_names_their_fields():
    # an HTTP body or parsed flags: what they give under the fields' names (None left out), and
    # overrides
    body = types.SimpleNamespace(temperature=0.5, top_k=None, stop=["x"], n=2, model="m",
                                 top_logprobs=3)
    params = SamplingParams.from_fields(body, top_logprobs=1, max_tokens=None)
    assert (params.temperature, params.top_k, params.stop, params.n) == (0.5, 0, ("x",), 2)
    assert params.top_logprobs == 1 and params.max_tokens is None
    assert SamplingParams.from_fields({"min_p": 0.5, "colour": 1}).min_p == 0.5
    with pytest.raises(UserError) as e:
        SamplingParams.from_fields({"top_p": 2})
    assert e.value.field == "top_p"


def test_make_requests_is_the_one_builder():
    params = SamplingParams(max_tokens=7, min_tokens=2, n=3, seed=2**32 - 1, stop=["\n"],
                            stop_token_ids=[4], ignore_eos=True, include_stop_str_in_output=True,
                            skip_special_tokens=False, bad_words=["ab", [9, 8]], top_k=5)
    reqs = make_requests("q", [1, 2, 3], params, encode=lambda text: [ord(c) for c in text])
    assert [r.request_id for r in reqs] == ["q.0", "q.1",
                                            "q.2"] and [r.seed for r in reqs] == [2**32 - 1, 0, 1]
    assert reqs[1].follows is reqs[0] and all(r.sampling.top_k == 5 for r in reqs)
    for r in reqs:
        assert (r.max_tokens, r.min_tokens, r.stop, r.stop_token_ids) == (7, 2, ("\n",), (4,))
        assert r.ignore_eos and r.include_stop_str_in_output and not r.skip_special_tokens
    # vLLM's rule: " ab" is kept only when as long as "ab" (here one token longer: dropped)
    assert reqs[0].sampling.bad_words_ids == ((97, 98), (9, 8)) and reqs[0].sampling.bad_words == ()
    with pytest.raises(UserError, match="needs a tokenizer") as e:
        make_requests("q", [1], SamplingParams(bad_words=["ab"]))
    assert e.value.field == "bad_words"
    seeds = {make_requests("q", [1], SamplingParams(seed=None))[0].seed for _ in range(4)}
    assert len(seeds) > 1  # no seed: a random one per request


def test_request_problem_uses_the_same_rules():
    from dcp_jax.sampling import check_seed

    assert check_seed(2**32) == "seed must be an integer in [0, 2**32), got 4294967296"
    assert check_seed(None) is not None  # a request's seed is never None
    cfg = types.SimpleNamespace(vocab_size=None,
                                max_model_len=100)  # (the checks before the pool's)
    assert Request("a", [1], seed=-1).problem(cfg, 10, True) == check_seed(-1)
    problem = Request("a", [1], max_tokens=0).problem(cfg, 10, True)
    assert problem.startswith("max_tokens must be an integer >= 1")


def test_sampling_rows_fill_each_field_from_its_parameter():
    # the device rows read the parameters their metadata names: a parameter needs no code in `of`
    params = SamplingParams(temperature=0.5, top_k=7, top_p=0.25, top_logprobs=3, min_p=0.125,
                            presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.5)
    r = make_requests("a", [1, 2, 3], dataclasses.replace(params, seed=11))[0]
    rows = SamplingRows.of([r, None])
    empty = SamplingRows.of([None])
    for f in dataclasses.fields(SamplingRows):
        source = f.metadata["source"]
        spec = SamplingRows.spec(2)
        assert getattr(spec, f.name).shape == getattr(rows, f.name).shape
        assert getattr(spec, f.name).dtype == getattr(rows, f.name).dtype
        if source is not None:
            want = r
            for part in source.split("."):
                want = getattr(want, part)
            assert getattr(rows, f.name)[0] == np.asarray(want, f.metadata["dtype"]), f.name
            assert getattr(empty, f.name)[0] == f.metadata["neutral"], f.name
    assert rows.temperature[0] == 0.5 and rows.seed[0] == 11 and rows.prompt_len[0] == 3


def test_one_sampling_params_per_prompt():
    # a list of SamplingParams: each prompt its own (the same tokens as each alone, in one batch)
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=1, page_size=4)
    a, b = CASES[0], CASES[1]
    pa = SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=dict(a["logit_bias"]))
    pb = SamplingParams(max_tokens=5, ignore_eos=True, allowed_token_ids=b["allowed_token_ids"])
    out = llm.generate([a["prompt"], b["prompt"]], [pa, pb])
    assert out.tokens == [a["biased"], b["allowed"][:5]]
    assert out.tokens[0] != llm.generate([a["prompt"]], SamplingParams(max_tokens=8,
                                                                       ignore_eos=True)).tokens[0]
    with pytest.raises(UserError, match="1 SamplingParams for 2 prompts"):
        llm.generate([a["prompt"], b["prompt"]], [pa])
    with pytest.raises(UserError, match="not both"):
        llm.generate([a["prompt"]], pa, top_k=3)
