"""Top logprobs (`top_logprobs=N`, up to 20): each generated token's N most likely tokens and their
log-probabilities, computed on the device from the logits the token was sampled from, against
transformers' log-softmax (tests/fixtures' first_logprobs) on several meshes, the decode loop, the
ragged step and speculative verify steps alike."""

import numpy as np
import pytest

from dcp_jax import LLM
from dcp_jax.errors import UserError
from dcp_jax.sampling import MAX_TOP_LOGPROBS, SamplingParams
from tests.util import FIXTURES, expected


@pytest.mark.parametrize("name,tp,dcp", [("llama-gqa", 1, 1), ("llama-gqa", 2, 4), ("llama-gqa", 1, 3),
                                         ("deepseek-v3", 1, 2)])
def test_top_logprobs_match_transformers(name, tp, dcp):
    exp = expected(name)
    llm = LLM.load(FIXTURES / name, tp=tp, dcp=dcp, page_size=4, decode_steps=3)
    out = llm.generate(exp["prompts"], max_new_tokens=8, ignore_eos=True, top_logprobs=5)
    assert out.tokens == exp["greedy"]
    for first, tops, toks, lps in zip(exp["first_logprobs"], out.top_logprobs, out.tokens, out.logprobs):
        ref = np.asarray(first)
        want = np.argsort(-ref, kind="stable")[:5]
        assert [i for i, _ in tops[0]] == want.tolist()  # the same order
        np.testing.assert_allclose([x for _, x in tops[0]], ref[want], atol=1e-5)
        assert len(tops) == len(toks) == 8
        # greedy: each token's first alternative is the token itself, with its logprob
        assert [t[0][0] for t in tops] == toks and np.allclose([t[0][1] for t in tops], lps, atol=1e-6)
        assert all(len(t) == 5 and [x for _, x in t] == sorted((x for _, x in t), reverse=True) for t in tops)


def test_asking_changes_no_token_and_is_checked():
    exp = expected("llama-gqa")
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4)
    kw = dict(max_new_tokens=8, ignore_eos=True, temperature=0.9, top_k=20, seed=7)
    plain = llm.generate(exp["prompts"], **kw)
    asked = llm.generate(exp["prompts"], top_logprobs=MAX_TOP_LOGPROBS, **kw)
    assert plain.top_logprobs is None and asked.tokens == plain.tokens and asked.logprobs == plain.logprobs
    assert all(len(t) == MAX_TOP_LOGPROBS for req in asked.top_logprobs for t in req)
    # sampled: the token is among the alternatives (top_k 20 over the same logits), with its logprob
    for tops, toks, lps in zip(asked.top_logprobs, asked.tokens, asked.logprobs):
        for alts, tok, lp in zip(tops, toks, lps):
            assert dict(alts)[tok] == pytest.approx(lp, abs=1e-6)
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(UserError, match=r"top_logprobs must be an integer in \[0, 20\]"):
            SamplingParams(top_logprobs=bad)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_top_logprobs_under_speculation(method):
    # verify steps report the same alternatives as plain decoding, for every token they accept
    exp = expected("llama-gqa")
    base = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4)
    want = base.generate(exp["prompts"], max_new_tokens=8, ignore_eos=True, top_logprobs=4)
    extra = dict(draft_model=FIXTURES / "llama-gqa") if method == "draft" else {}
    spec = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4, speculative=method, num_speculative_tokens=3,
                    **extra)
    got = spec.generate(exp["prompts"], max_new_tokens=8, ignore_eos=True, top_logprobs=4)
    assert got.tokens == want.tokens
    for a, b in zip(got.top_logprobs, want.top_logprobs):
        assert [[i for i, _ in t] for t in a] == [[i for i, _ in t] for t in b]
        np.testing.assert_allclose([[x for _, x in t] for t in a], [[x for _, x in t] for t in b], atol=1e-5)
