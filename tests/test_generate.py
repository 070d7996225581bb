"""End-to-end generation against transformers' greedy ids and logprobs (tests/fixtures, made by
scripts/make_fixtures.py), across meshes, interleaves and prefill chunk sizes."""

import dataclasses

import numpy as np
import pytest

from dcp_jax import LLM, make_mesh
from dcp_jax.config import ModelConfig
from dcp_jax.dense import Engine
from dcp_jax.sampling import SamplingParams, sample
from dcp_jax.weights import load_hf
from tests.util import FIXTURES, expected
from tests.util import run_fixture as run

FAMILIES = ["llama-gqa", "llama-mha-tied", "mistral", "qwen2", "qwen3", "llama-tokenizer",
            "llama-dynamic"]
MESHES = [(1, 1), (1, 8), (2, 4), (4, 2), (1, 3)]


def valid_mesh(name, tp):
    cfg = ModelConfig.from_file(FIXTURES / name / "config.json")
    return cfg.num_heads % tp == 0 and (tp <= cfg.num_kv_heads or tp % cfg.num_kv_heads == 0)


# every mesh for llama-gqa; each other family on two meshes that shard it differently (tp x dcp, odd dcp):
# the family's own parts (tied embeddings, biases, q/k norms, windows, dynamic RoPE) against the
# placement math once each
CASES = [(n, m) for n in FAMILIES for m in (MESHES if n == FAMILIES[0] else [(2, 4), (1, 3)])
         if valid_mesh(n, m[0])]


@pytest.mark.parametrize("name,mesh", CASES, ids=[f"{n}-{m[0]}x{m[1]}" for n, m in CASES])
def test_matches_transformers(name, mesh):
    out, exp = run(name, *mesh)
    assert out.tokens == exp["greedy"]
    for lp, first, tok in zip(out.logprobs, exp["first_logprobs"], exp["greedy"]):
        assert abs(lp[0] - first[tok[0]]) <= 2e-3
    # every step's logprob of the chosen token, not just the first
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(exp["greedy_logprobs"]), atol=2e-3)


# Every (tp, dcp) of 8 devices meets every chunk size and both placements.
SAME = [((1, 8), 1, 1), ((1, 8), "contiguous", 7), ((1, 8), 1, 256),
        ((2, 4), "contiguous", 1), ((2, 4), 1, 7), ((2, 4), "contiguous", 256),
        ((4, 2), 1, 1), ((4, 2), "contiguous", 7), ((4, 2), 1, 256),
        ((8, 1), "contiguous", 1), ((8, 1), 1, 7), ((8, 1), "contiguous", 256)]


@pytest.mark.parametrize("mesh,interleave,chunk", SAME)
def test_same_tokens_on_every_mesh(mesh, interleave, chunk):
    out, exp = run("llama-gqa", *mesh, interleave=interleave, prefill_chunk=chunk, max_seq_len=40)
    assert out.tokens == exp["greedy"]


# qwen2 has q/k/v biases: the q bias follows q_proj's rows.
@pytest.mark.parametrize("name,mesh,q_gather,combine", [("llama-gqa", (2, 4), True, "auto"),
                                                        ("qwen2", (2, 2), True, "auto"),
                                                        ("llama-gqa", (2, 4), False, "all_to_all")])
def test_comm_variants_generate_the_same(name, mesh, q_gather, combine):
    base, exp = run(name, *mesh)
    out, _ = run(name, *mesh, q_gather=q_gather, combine=combine)
    assert out.tokens == base.tokens == exp["greedy"]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(base.logprobs), rtol=0, atol=1e-5)


def test_q_gather_splits_q_proj_over_the_whole_mesh():
    mesh = make_mesh(2, 4)
    model, _ = load_hf(FIXTURES / "llama-gqa", mesh, q_gather=True)
    q = model.stacks[0].block.self_attn.q_proj[...]  # [layers, rows, hidden]: the layers are stacked
    assert q.addressable_shards[0].data.shape == (q.shape[0], q.shape[1] // 8, q.shape[2])
    with pytest.raises(Exception, match="q_gather needs the 8 attention heads to divide by tp x dcp = 3"):
        load_hf(FIXTURES / "llama-gqa", make_mesh(1, 3), q_gather=True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_keeps_greedy_ids(dtype):
    mesh = make_mesh(2, 4)
    model, _ = load_hf(FIXTURES / "llama-gqa", mesh, dtype)
    exp = expected("llama-gqa")
    out = Engine(model, mesh).generate(exp["prompts"], max_new_tokens=8, ignore_eos=True)
    assert out.stats["kv_bytes_total"] * 2 == run("llama-gqa", 2, 4)[0].stats["kv_bytes_total"]
    # half precision may flip a late near-tie; the first tokens must agree
    assert [t[:4] for t in out.tokens] == [t[:4] for t in exp["greedy"]]


def test_kv_bytes_are_the_real_shards_and_fall_as_one_over_dcp():
    per_device = {}
    for dcp in (1, 2, 4, 8):
        out, _ = run("llama-gqa", 1, dcp, max_seq_len=64)
        cfg = ModelConfig.from_file(FIXTURES / "llama-gqa" / "config.json")
        total = 3 * cfg.num_layers * 2 * cfg.num_kv_heads * 64 * cfg.head_dim * 4  # B·L·(k,v)·K·S·D·f32
        assert out.stats["kv_bytes_total"] == total
        per_device[dcp] = out.stats["kv_bytes_per_device"]
        assert per_device[dcp] * dcp == total
    # tp shards kv heads too: (2, 4) holds 1/8 of the cache per device
    out, _ = run("llama-gqa", 2, 4, max_seq_len=64)
    assert out.stats["kv_bytes_per_device"] == per_device[1] // 8


def test_stop_on_eos_per_sequence():
    exp = expected("llama-gqa")
    mesh = make_mesh(1, 2)
    model, _ = load_hf(FIXTURES / "llama-gqa", mesh)
    eng = Engine(model, mesh)
    eng.eos = (exp["greedy"][0][2],)  # sequence 0 stops at its 3rd token
    out = eng.generate(exp["prompts"], max_new_tokens=8)
    assert out.tokens[0] == exp["greedy"][0][:3]
    for got, want in zip(out.tokens[1:], exp["greedy"][1:]):
        stop = [i for i, t in enumerate(want) if t == eng.eos[0]]
        assert got == want[: stop[0] + 1] if stop else got == want
    assert out.stats["generated_tokens"] == sum(map(len, out.tokens))


@pytest.mark.parametrize("interval", [1, 3, 64])
def test_streaming_in_segments_gives_every_token_once(interval):
    # Streaming runs the donated decode program in segments (no host callback inside the loop, so no
    # CPU device is needed next to a GPU): every step's tokens reach on_token once, in order, and equal
    # the result; a sequence stopping early at EOS ends the last segment early.
    exp = expected("llama-gqa")
    mesh = make_mesh(1, 2)
    model, _ = load_hf(FIXTURES / "llama-gqa", mesh)
    eng = Engine(model, mesh)
    eng.eos = (exp["greedy"][0][2],)  # sequence 0 stops at its 3rd token
    seen = []
    out = eng.generate(exp["prompts"], max_new_tokens=8, on_token=lambda step, toks: seen.append((step, list(toks))),
                       stream_interval=interval)
    assert [step for step, _ in seen] == list(range(len(seen)))
    for i, toks in enumerate(out.tokens):
        assert [t[i] for _, t in seen[: len(toks)]] == toks
        assert all(t[i] == -1 for _, t in seen[len(toks):])
    plain = eng.generate(exp["prompts"], max_new_tokens=8)
    assert plain.tokens == out.tokens
    hlo = eng.decode_program(len(exp["prompts"]), eng.layout(64), 8).as_text()
    assert "callback" not in hlo.lower()


def test_python_api_text_and_sampling():
    exp = expected("llama-tokenizer")
    llm = LLM.load(FIXTURES / "llama-tokenizer", tp=2, dcp=4)
    out = llm.generate(exp["prompt_texts"], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [llm.encode(t) for t in exp["prompt_texts"]] == exp["prompts"]
    assert out.tokens == exp["greedy"]
    assert out.text == [llm.decode(t) for t in exp["greedy"]]
    sampled = SamplingParams(max_tokens=8, temperature=1.5, ignore_eos=True)
    a = llm.generate(exp["prompt_texts"][0], dataclasses.replace(sampled, seed=1))
    b = llm.generate(exp["prompt_texts"][0], dataclasses.replace(sampled, seed=1))
    c = llm.generate(exp["prompt_texts"][0], dataclasses.replace(sampled, seed=2))
    assert a.tokens == b.tokens and a.tokens != c.tokens
    # a stop string (a SamplingParams field like any other): the text ends before its first occurrence
    text = out.text[0]
    stop = text[-3:]
    stopped = llm.generate(exp["prompt_texts"][0], SamplingParams(max_tokens=8, ignore_eos=True, stop=[stop]))
    assert stopped.text[0] == text[:text.find(stop)] and stopped.finish_reasons == ["stop"]


def test_sampling_filters():
    import jax
    import jax.numpy as jnp

    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)) * 3, jnp.float32)
    greedy = np.argmax(np.asarray(logits), -1)
    keys = jax.random.split(jax.random.key(0), 20)
    for p in (SamplingParams(1.0, top_k=1), SamplingParams(1.0, top_p=1e-6)):
        for k in keys:
            np.testing.assert_array_equal(sample(logits, k, p)[0], greedy)
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    for k in keys:
        tok = np.asarray(sample(logits, k, SamplingParams(5.0, top_k=3))[0])
        assert all(t in row for t, row in zip(tok, top3))
    tok, lp = sample(logits, keys[0], SamplingParams())
    np.testing.assert_allclose(lp, np.asarray(jax.nn.log_softmax(logits))[np.arange(4), greedy], rtol=1e-6)
