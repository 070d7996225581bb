"""logit_bias, allowed_token_ids and min_p (vLLM's and OpenAI's request parameters), per row on the device:
greedy tokens against transformers' own logits processors (tests/fixtures/llama-gqa/processors.json, made
by scripts/make_processor_fixture.py), on several meshes and under speculation; min_p's support checked
on the tokens it samples; every rule's range checks."""

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


@pytest.mark.parametrize("kw,match", [
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
    with pytest.raises(UserError, match=r"logit_bias / allowed_token_ids id 256 is outside the vocabulary \[0, 256\)"):
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
