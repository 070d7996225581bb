"""logit_bias, allowed_token_ids, min_p, the presence / frequency / repetition penalties, bad words and
min_tokens (vLLM's and OpenAI's request parameters), per row on the device: greedy tokens against
transformers' own logits processors (tests/fixtures/llama-gqa/processors.json, made by
scripts/make_processor_fixture.py), on several meshes, under speculation, with prefix hits and
preemption; min_p's support checked on the tokens it samples; every rule's range checks."""

import json

import numpy as np
import pytest

from dcp_jax import LLM
from dcp_jax.errors import UserError
from dcp_jax.sampling import MAX_LISTED, SamplingParams
from tests.util import FIXTURES

CASES = json.loads((FIXTURES / "llama-gqa" / "processors.json").read_text())["cases"]


@pytest.mark.parametrize("tp,dcp,spec", [(1, 1, None), (2, 4, None), (1, 2, "ngram")])
def test_logit_bias_and_allowed_ids_match_transformers_processors(tp, dcp, spec):
    extra = dict(speculative=spec, num_speculative_tokens=3) if spec else {}
    llm = LLM.load(FIXTURES / "llama-gqa", tp=tp, dcp=dcp, page_size=4, decode_steps=3, **extra)
    for case in CASES:  # each prompt alone, as the reference ran them
        kw = dict(max_new_tokens=8, ignore_eos=True)
        biased = llm.generate([case["prompt"]], logit_bias={t: b for t, b in case["logit_bias"]}, **kw)
        assert biased.tokens[0] == case["biased"]
        allowed = llm.generate([case["prompt"]], allowed_token_ids=case["allowed_token_ids"], **kw)
        assert allowed.tokens[0] == case["allowed"]
    # the rules are per row: a batch mixing them gives each request its own tokens
    mixed = llm.generate([c["prompt"] for c in CASES], max_new_tokens=8, ignore_eos=True,
                         logit_bias={t: b for t, b in CASES[0]["logit_bias"]})
    assert mixed.tokens[0] == CASES[0]["biased"]


def test_min_p_keeps_sampled_tokens_within_its_support():
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4)
    prompts = [c["prompt"] for c in CASES]
    kw = dict(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=9, top_logprobs=20)
    out = llm.generate(prompts, min_p=0.2, **kw)
    for lps, tops in zip(out.logprobs, out.top_logprobs):  # at temperature 1: p >= 0.2 p_max
        assert all(lp >= alts[0][1] + np.log(0.2) - 1e-5 for lp, alts in zip(lps, tops))
    assert llm.generate(prompts, min_p=0.2, **kw).tokens == out.tokens  # seeded: the same draw
    free = llm.generate(prompts, **kw)  # without it the same seeds wander below 0.2 p_max somewhere
    assert any(lp < alts[0][1] + np.log(0.2) for lps, tops in zip(free.logprobs, free.top_logprobs)
               for lp, alts in zip(lps, tops))


@pytest.mark.parametrize("tp,dcp,spec", [(1, 1, None), (2, 4, None), (1, 2, "ngram")])
def test_penalties_bad_words_and_min_tokens_match_transformers(tp, dcp, spec):
    extra = dict(speculative=spec, num_speculative_tokens=3) if spec else {}
    llm = LLM.load(FIXTURES / "llama-gqa", tp=tp, dcp=dcp, page_size=4, decode_steps=3, **extra)
    kw = dict(max_new_tokens=12, ignore_eos=True)
    for case in CASES:  # each prompt alone, as the reference ran them; from the second call on, the
        # prompt's full blocks are prefix hits (the history of their tokens is filled from the host)
        assert llm.generate([case["prompt"]], **kw).tokens[0] == case["greedy12"]
        for pen in case["penalties"]:
            assert llm.generate([case["prompt"]], **pen["params"], **kw).tokens[0] == pen["tokens"], pen
        assert llm.generate([case["prompt"]], bad_words=case["bad_words"], **kw).tokens[0] == case["banned"]
        early = llm.generate([case["prompt"]], max_new_tokens=12, min_tokens=case["min_tokens"],
                             logit_bias={case["eos"]: 100.0})
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
                for r in llm.requests([c["prompt"]], max_new_tokens=12, ignore_eos=True, prefix=f"j{i}-", **params)]
    run_requests(engine, requests)
    assert engine.stats()["preemptions"] > 0
    assert [r.output_token_ids for r in requests] == [want for *_, want in jobs]
    kw = dict(max_new_tokens=10, ignore_eos=True, temperature=1.0, top_k=40, seed=5, frequency_penalty=1.5,
              repetition_penalty=1.4)
    prompts = [c["prompt"] for c in CASES]
    alone = [llm.generate([p], **kw).tokens[0] for p in prompts]
    assert llm.generate(prompts, **kw).tokens == alone
    assert llm.generate(prompts, **dict(kw, frequency_penalty=0.0, repetition_penalty=1.0)).tokens != alone


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
        llm.generate([[5, 6]], max_new_tokens=2, bad_words=["cat"])


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
        llm.generate([[5, 6, 7]], max_new_tokens=2, logit_bias={256: 1})


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 4)])
def test_n_samples_share_one_prefill(tp, dcp):
    # n = 4 seeded samples of one prompt: four distinct samples, sample j equal to seed + j sampled alone;
    # the first one's prefill fills the prompt's full blocks and the others share them, so the pages in
    # use while they run stay under 4x one request's and the prompt is prefilled about once.
    from dcp_jax.serving.engine import run_requests

    llm = LLM.load(FIXTURES / "llama-gqa", tp=tp, dcp=dcp, page_size=4, max_num_seqs=4)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 250, 61)]
    kw = dict(max_new_tokens=6, ignore_eos=True, temperature=1.0, top_k=50, seed=21)
    out = llm.generate([prompt], n=4, **kw)
    assert len(out.tokens) == 4 and len({tuple(t) for t in out.tokens}) == 4
    for j, toks in enumerate(out.tokens):
        assert toks == llm.generate([prompt], **dict(kw, seed=21 + j)).tokens[0]
    llm.reset_prefix_cache()
    alone_engine = llm.engine_with(max_model_len=128)
    run_requests(alone_engine, llm.requests([prompt], **kw))
    one = alone_engine.stats()["prefix_query_tokens"] - alone_engine.stats()["prefix_hit_tokens"]
    server, peak = llm.engine_with(max_model_len=128), []
    run_requests(server, llm.requests([prompt], n=4, **kw), on_step=lambda plan: peak.append(
        server.scheduler.stats()["pages_used"]))
    block = 4 * dcp
    single = -(-(len(prompt) + 6) // block)  # one request's pages
    assert max(peak) < 4 * single
    s = server.stats()
    assert s["prefix_hit_tokens"] == 3 * ((len(prompt) - 1) // block * block)  # the others hit its full blocks
    assert s["prefix_query_tokens"] - s["prefix_hit_tokens"] < 2 * one
    with pytest.raises(UserError, match="n must be"):
        llm.generate([prompt], n=0)
