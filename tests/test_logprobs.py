"""Top logprobs (`top_logprobs=N`, up to 20): each generated token's N most likely tokens and their
log-probabilities, computed on the device from the logits the token was sampled from, against
transformers' log-softmax (tests/fixtures' first_logprobs) on several meshes, the decode loop, the
ragged step and speculative verify steps alike; prompt logprobs (`prompt_logprobs=N`, what `echo` reports)
against transformers' scores of a prompt (tests/fixtures/llama-gqa/processors.json)."""

import json

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
    out = llm.generate(exp["prompts"], SamplingParams(max_tokens=8, ignore_eos=True,
                                                      top_logprobs=5))
    assert out.tokens == exp["greedy"]
    for first, tops, toks, lps in zip(exp["first_logprobs"], out.top_logprobs, out.tokens, out.logprobs):
        ref = np.asarray(first)
        want = np.argsort(-ref, kind="stable")[:5]
        assert [i for i, _ in tops[0]] == want.tolist()  # the same order
        # 1e-5, plus float32's relative rounding of a sum over the hidden size (XLA's accumulation order
        # depends on the CPU's vector width: 1.17e-5 at -2.95 measured on an AMD EPYC with AVX-512)
        np.testing.assert_allclose([x for _, x in tops[0]], ref[want], atol=1e-5, rtol=5e-6)
        assert len(tops) == len(toks) == 8
        # greedy: each token's first alternative is the token itself, with its logprob
        assert [t[0][0] for t in tops] == toks and np.allclose([t[0][1] for t in tops], lps, atol=1e-6)
        assert all(len(t) == 5 and [x for _, x in t] == sorted((x for _, x in t), reverse=True) for t in tops)


def test_asking_changes_no_token_and_is_checked():
    exp = expected("llama-gqa")
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4)
    kw = dict(max_tokens=8, ignore_eos=True, temperature=0.9, top_k=20, seed=7)
    plain = llm.generate(exp["prompts"], SamplingParams(**kw))
    asked = llm.generate(exp["prompts"], SamplingParams(top_logprobs=MAX_TOP_LOGPROBS, **kw))
    assert plain.top_logprobs is None and asked.tokens == plain.tokens
    # (a program that also ranks the top logprobs is fused differently: float32 rounding may differ, by
    # ~1e-6 on an AMD EPYC with AVX-512, bit-equal on the Intel CI machine)
    np.testing.assert_allclose(np.asarray(asked.logprobs), np.asarray(plain.logprobs), atol=5e-6, rtol=0)
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
    want = base.generate(exp["prompts"], SamplingParams(max_tokens=8, ignore_eos=True,
                                                        top_logprobs=4))
    extra = dict(draft_model=FIXTURES / "llama-gqa") if method == "draft" else {}
    spec = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4, speculative=method, num_speculative_tokens=3,
                    **extra)
    got = spec.generate(exp["prompts"], SamplingParams(max_tokens=8, ignore_eos=True,
                                                       top_logprobs=4))
    assert got.tokens == want.tokens
    for a, b in zip(got.top_logprobs, want.top_logprobs):
        assert [[i for i, _ in t] for t in a] == [[i for i, _ in t] for t in b]
        np.testing.assert_allclose([[x for _, x in t] for t in a], [[x for _, x in t] for t in b], atol=1e-5)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 4), (1, 3)])
def test_prompt_logprobs_match_transformers(tp, dcp):
    # a 45-token prompt prefilled in chunks of 16 (several steps, pages of 4): each prompt token's
    # log-probability given the ones before it, its rank and its 5 most likely alternatives, as
    # transformers scores the prompt; the prompt is computed whole even when its blocks are cached
    ref = json.loads((FIXTURES / "llama-gqa" / "processors.json").read_text())["prompt_scores"]
    prompt = ref["prompt"]
    llm = LLM.load(FIXTURES / "llama-gqa", tp=tp, dcp=dcp, page_size=4, prefill_chunk=16, max_model_len=128)
    plain = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True))
    assert plain.prompt_logprobs is None
    hits = llm.engine.stats()["prefix_hit_tokens"]
    out = llm.generate([prompt, [5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True,
                                                           prompt_logprobs=5))
    assert llm.engine.stats()["prefix_hit_tokens"] == hits  # (the cached blocks were not taken)
    assert out.tokens[0] == plain.tokens[0]
    lps, tops = out.prompt_logprobs[0], out.prompt_top_logprobs[0]
    assert lps[0] is None and tops[0] is None and len(lps) == len(tops) == len(prompt)
    # float32 over 45 positions: the model's own cache-free forward differs from transformers' by up to
    # 1.05e-5 here (XLA's sums against torch's), the paged prefill by up to 1.8e-5
    np.testing.assert_allclose(lps[1:], ref["logprobs"][1:], atol=3e-5)
    for got, want in zip(tops[1:], ref["top"][1:]):
        assert [i for i, _ in got] == [i for i, _ in want]  # the same order
        np.testing.assert_allclose([x for _, x in got], [x for _, x in want], atol=3e-5)
    assert len(out.prompt_logprobs[1]) == 3 and out.prompt_logprobs[1][0] is None


def test_prompt_logprobs_ranks_and_n_samples():
    ref = json.loads((FIXTURES / "llama-gqa" / "processors.json").read_text())["prompt_scores"]
    prompt = ref["prompt"]
    llm = LLM.load(FIXTURES / "llama-gqa", tp=1, dcp=2, page_size=4, prefill_chunk=16, max_model_len=128)
    requests = llm.requests([prompt], SamplingParams(max_tokens=2, ignore_eos=True,
                                                     prompt_logprobs=20, n=3,
                                                   temperature=1.0))
    from dcp_jax.serving.engine import run_requests

    run_requests(llm.engine, requests)
    lps, ranks, tops = requests[0].prompt_scores()
    for lp, rank, alts in zip(lps[1:], ranks[1:], tops[1:]):
        assert rank == 1 + sum(x > lp for _, x in alts) or (rank > 20 and all(x > lp for _, x in alts))
    assert any(r > 1 for r in ranks[1:])  # (a random prompt: not every token is the model's first choice)
    # the other samples follow the first: they share its prompt blocks and report its scores
    assert all(r.prompt_scores() == (lps, ranks, tops) for r in requests[1:])
    with pytest.raises(UserError, match=r"prompt_logprobs must be an integer in \[0, 20\] or None"):
        SamplingParams(prompt_logprobs=21)
