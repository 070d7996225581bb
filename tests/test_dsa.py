"""DeepSeek-V3.2 (DSA: MLA + the lightning indexer's top-k) against transformers' greedy ids and
logprobs (tests/fixtures/deepseek-v32, scripts/make_dsa_fixtures.py: index_topk 16, prompts of 40-97
tokens, so most queries attend a strict subset), and the one global top-k across context ranks: the
chosen positions, ties included, are the same on every mesh and placement; the candidates gathered
per step do not grow with the context; the indexer's cache is split over every device.

DCP_JAX_DSA_FULL=1 runs the whole matrix (every mesh x interleave through LLM.generate, preemption
and prefix hits on every mesh, speculation, the dense engine, each combine forced, generating from a
checkpoint saved on another mesh); CI runs one case of each kind except speculation with a draft
model (36 s for one prompt on 1x2 here); CI's round trip checks the weights come back equal, and the
dense engine's and the combines' CI coverage is in the selection tests (their comments say which).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcp_jax import LLM, UserError, make_mesh
from dcp_jax.attention import dcp_sparse_attention, write_kv
from dcp_jax.config import ModelConfig
from dcp_jax.layout import KVLayout, PagedLayout
from dcp_jax.mesh import AXES
from dcp_jax.serving.engine import run_requests
from dcp_jax.serving.request import Request
from pallas_kernels.attention.sparse import NO_POSITION
from tests.util import FIXTURES, expected, rel_err
from tests.util import run_fixture as run_dense

NAME = "deepseek-v32"
FULL = os.environ.get("DCP_JAX_DSA_FULL") == "1"


def full_only(*cases):
    return [pytest.param(*c, marks=pytest.mark.skipif(not FULL, reason="DCP_JAX_DSA_FULL=1"))
            for c in cases]


def load(tp, dcp, **kw):
    kw = {"compile": "lazy", "page_size": 4, "max_model_len": 128, "prefill_chunk": 16, **kw}
    return LLM.load(FIXTURES / NAME, tp=tp, dcp=dcp, **kw)


# --- exactness against transformers ---------------------------------------------------------


@pytest.mark.parametrize("tp,dcp,interleave", [(2, 4, 2)] + full_only(
    (1, 1, 1), (1, 4, 1), (1, 4, 4), (2, 4, 1), (1, 3, 1), (1, 3, 4), (4, 2, 2)))
def test_llm_generate_matches_transformers(tp, dcp, interleave):
    # Two slots for three prompts (the third waits for one to finish), prompts prefilled in chunks
    # of 16 (each query its own causal top-k over the chunks before it), pages of 4 slots.
    exp = expected(NAME)
    llm = load(tp, dcp, interleave=interleave, max_num_seqs=2, decode_steps=3)
    out = llm.generate(exp["prompts"], max_new_tokens=exp["max_new_tokens"], ignore_eos=True)
    assert out.tokens == exp["greedy"]
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(exp["greedy_logprobs"]),
                               atol=2e-3)
    # the indexer's keys beside the latent, both split over the whole mesh (no replication)
    cfg = ModelConfig.from_file(FIXTURES / NAME / "config.json")
    for stack in llm.engine.runner.pools:
        latent, keys = stack
        assert keys.shape[-1] == cfg.indexer.head_dim and latent.shape[:-1] == keys.shape[:-1]
        assert keys.sharding.spec == latent.sharding.spec
        shard = keys.addressable_shards[0].data
        assert shard.nbytes * tp * dcp == keys.nbytes


@pytest.mark.parametrize("tp,dcp,interleave", [(1, 3, 1)] + full_only(
    (1, 1, 1), (1, 4, 2), (2, 4, 1), (2, 4, 4)))
def test_preemption_and_prefix_hits_stay_exact(tp, dcp, interleave):
    # A pool that holds the longest request and little more, two longer requests ahead of the
    # fixture's: the newest running ones are preempted and recomputed; the prompts again afterwards
    # hit their cached blocks, on the device or copied back from the host tier (their index keys
    # with their latents: every pool array of a page travels).
    exp = expected(NAME)
    llm = load(tp, dcp, interleave=interleave, max_num_seqs=3, decode_steps=4,
               kv_host_memory="4MiB")
    tpb = llm.paged_layout().tokens_per_block
    engine = llm.engine_with(num_pages=1 + -(-(97 + 8) // tpb))
    rng = np.random.default_rng(1)

    def requests(tag):
        return [Request(f"{tag}{i}", p, max_tokens=8, ignore_eos=True)
                for i, p in enumerate(exp["prompts"])]

    fill = [Request(f"f{i}", rng.integers(0, 256, 30).tolist(), max_tokens=40, ignore_eos=True)
            for i in range(2)]
    reqs = requests("p")
    run_requests(engine, fill + reqs)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert [r.output_token_ids for r in reqs] == exp["greedy"]
    again = requests("q")
    run_requests(engine, again)
    assert [r.output_token_ids for r in again] == exp["greedy"]
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] >= stats["host_hit_tokens"] > 0  # (host hits are prefix hits)


@pytest.mark.parametrize("mesh", full_only(((1, 3),), ((1, 1),), ((2, 4),), ((8, 1),)))
def test_dense_engine_matches_transformers(mesh):
    # (the island's dense-cache path runs in CI in test_chosen_positions_..., 1x4)
    out, exp = run_dense(NAME, *mesh)
    assert out.tokens == exp["greedy"]


def test_cache_free_forward_matches_transformers():
    # CausalLM.forward (scoring: no cache, no island) makes the same choice over the block's tokens
    exp = expected(NAME)
    from dcp_jax.weights import load_hf

    model, _ = load_hf(FIXTURES / NAME, make_mesh(1, 1))
    cases = list(zip(exp["prompts"], exp["first_logprobs"]))
    for prompt, first in cases if FULL else cases[-1:]:  # (97 tokens: 81 queries choose)
        logits = np.asarray(model.forward(np.asarray([prompt], np.int32)))[0, -1].astype(np.float64)
        logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        np.testing.assert_allclose(logprobs, first, atol=2e-4)


@pytest.mark.skipif(not FULL, reason="DCP_JAX_DSA_FULL=1")
def test_speculation_with_a_draft_model_verifies_each_token_with_its_own_top_k():
    # The checkpoint drafts for itself: every draft is accepted, and each verify token's top-k is
    # its own (a wrong choice for any would reject a draft or change a token). Full matrix only:
    # mostly compiling, 36 s on this 2-core host even for one prompt on 1x2.
    exp = expected(NAME)
    llm = load(2, 2, speculative="draft", draft_model=FIXTURES / NAME, num_speculative_tokens=3,
               max_num_seqs=2)
    out = llm.generate(exp["prompts"], max_new_tokens=8, ignore_eos=True)
    assert out.tokens == exp["greedy"]
    assert out.stats["spec_acceptance_rate"] == 1.0


def test_checkpoint_round_trip_keeps_the_indexer_weights(tmp_path):
    # CI's round trip, no program compiled: saved from 1x2, loaded on 2x1, every weight (the
    # indexer's by its Hugging Face names) comes back equal; the full matrix also generates from it
    from dcp_jax.weights import load_checkpoint, load_hf, save_checkpoint

    saved, _ = load_hf(FIXTURES / NAME, make_mesh(1, 2))
    save_checkpoint(saved, tmp_path / "v32")
    back = load_checkpoint(tmp_path / "v32", make_mesh(2, 1))[0]
    want, got = saved.hf_weights(), back.hf_weights()
    assert sorted(got) == sorted(want) and any(".indexer." in name for name in want)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(value), err_msg=name)


@pytest.mark.skipif(not FULL, reason="DCP_JAX_DSA_FULL=1")
def test_checkpoint_round_trip_on_another_mesh(tmp_path):
    # the indexer's weights are saved by their Hugging Face names and load onto any mesh
    exp = expected(NAME)
    load(2, 4).save(tmp_path / "v32")
    back = LLM.load(tmp_path / "v32", tp=8, dcp=1, compile="lazy", max_model_len=128)
    assert back.generate(exp["prompts"], max_new_tokens=8, ignore_eos=True).tokens == exp["greedy"]


# --- the selection across ranks -------------------------------------------------------------

TOPK = 8
LENGTHS = (45, 6)  # the second sequence sees fewer than TOPK tokens: it attends every one
QUERIES = 3  # the last three positions of each sequence


def selection_inputs(seed=0):
    """Index queries, weights and keys with constructed ties: keys copied to other positions (equal
    scores) and zero keys (score exactly 0) around every query's k-th best."""
    rng = np.random.default_rng(seed)
    b, s, hi, di, d = len(LENGTHS), max(LENGTHS), 4, 16, 24
    keys = rng.standard_normal((b, s, di)).astype(np.float32)
    keys[0, 30:34] = keys[0, 3]  # the same key at five positions
    keys[0, [8, 17, 40]] = 0.0  # three tokens score 0 for every query
    q = rng.standard_normal((b, QUERIES, hi, di)).astype(np.float32)
    w = np.abs(rng.standard_normal((b, QUERIES, hi))).astype(np.float32)
    latent = rng.standard_normal((b, s, d)).astype(np.float32)
    qa = rng.standard_normal((b, QUERIES, 8, d)).astype(np.float32)  # 8 heads: auto scatters
    q_pos = np.stack([np.arange(n - QUERIES, n) for n in LENGTHS]).astype(np.int32)
    q_pos = np.maximum(q_pos, 0)
    return q, w, keys, latent, qa, q_pos, np.asarray(LENGTHS, np.int32)


def oracle(q, w, keys, latent, qa, q_pos, lengths, scale, index_scale, v_dim):
    """Float64: each query's top-k by (higher score, lower position) over the tokens it sees, and
    its attention over them. -> (chosen [B, T, TOPK] with NO_POSITION padding, out [B, T, H, v])."""
    b, t = q_pos.shape
    chosen = np.full((b, t, TOPK), NO_POSITION, np.int64)
    out = np.zeros((b, t, qa.shape[2], v_dim))
    for bi in range(b):
        for ti in range(t):
            seen = np.arange(min(q_pos[bi, ti] + 1, lengths[bi]))
            dots = np.einsum("hd,sd->hs", q[bi, ti].astype(np.float64), keys[bi, seen])
            dots = dots * index_scale
            score = (w[bi, ti, :, None] * np.maximum(dots, 0)).sum(0)
            order = sorted(seen, key=lambda p: (-score[p], p))[:TOPK]
            chosen[bi, ti, :len(order)] = order
            s = np.einsum("hd,kd->hk", qa[bi, ti].astype(np.float64), latent[bi, order]) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[bi, ti] = (p / p.sum(-1, keepdims=True)) @ latent[bi, order, :v_dim]
    return chosen, out


def paged_caches(mesh, layout: PagedLayout, latent, keys):
    """The sequences written into page pools through the engine's write (block table: each
    sequence its own pages, in reverse order to make the table matter)."""
    b, s = latent.shape[:2]
    nb = layout.blocks_for(s)
    table = np.asarray([[1 + bi * nb + (nb - 1 - j) for j in range(nb)] for bi in range(b)],
                       np.int32)
    pages = (1 + b * nb) * layout.num_shards

    def zeros(d):
        return jax.device_put(jnp.zeros((pages, 1, layout.page_size, d), jnp.float32),
                              jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXES)))
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    caches = write_kv((zeros(latent.shape[-1]), zeros(keys.shape[-1])),
                      (latent[:, :, None], keys[:, :, None]), pos, np.ones((b, s), bool), mesh=mesh,
                      layout=layout, head_axes=(), context_axes=AXES, block_table=table)
    return caches, table


def dense_caches(layout: KVLayout, latent, keys):
    b, s = latent.shape[:2]
    out = []
    for x in (latent, keys):
        cache = np.zeros((b, 1, layout.max_seq_len, x.shape[-1]), np.float32)
        cache[:, 0, layout.cache_index(np.arange(s))] = x
        out.append(cache)
    return out, None


def select(mesh_shape, interleave, paged=True, combine="auto"):
    q, w, keys, latent, qa, q_pos, lengths = selection_inputs()
    mesh = make_mesh(*mesh_shape)
    n = mesh_shape[0] * mesh_shape[1]
    if paged:
        layout = PagedLayout(n, interleave, 2 * interleave)
        (lat_c, key_c), table = paged_caches(mesh, layout, latent, keys)
    else:
        layout = KVLayout.create(max(LENGTHS), n, interleave)
        (lat_c, key_c), table = dense_caches(layout, latent, keys)
    out, chosen = jax.jit(lambda *a: dcp_sparse_attention(
        *a, mesh=mesh, layout=layout, topk=TOPK, index_scale=0.25, scale=0.3, v_dim=16,
        block_table=table, combine=combine, return_chosen=True))(
        qa, lat_c, key_c, q, w, q_pos, lengths)
    return np.asarray(chosen), np.asarray(out)


SELECTION_CASES = [((2, 4), 2, True), ((1, 3), 1, True), ((1, 4), 1, False)]
SELECTION_CASES += full_only(((1, 1), 1, True), ((1, 4), 4, True), ((2, 4), 1, False),
                             ((1, 3), 2, True), ((4, 2), 1, True), ((8, 1), 2, True))


@pytest.mark.parametrize("mesh,interleave,paged", SELECTION_CASES)
def test_chosen_positions_are_one_global_top_k_on_every_mesh(mesh, interleave, paged):
    q, w, keys, latent, qa, q_pos, lengths = selection_inputs()
    want, want_out = oracle(q, w, keys, latent, qa, q_pos, lengths, 0.3, 0.25, 16)
    # the inputs do what they are for: some query's k-th and (k+1)-th candidates tie exactly
    scores = [(np.maximum(np.einsum("hd,sd->hs", q[0, t], keys[0, :q_pos[0, t] + 1]) * 0.25, 0)
               * w[0, t, :, None]).sum(0) for t in range(QUERIES)]
    assert any(np.sort(s)[::-1][TOPK - 1] == np.sort(s)[::-1][TOPK] for s in scores)
    assert (want[1] == NO_POSITION).any()  # a query seeing fewer than TOPK tokens
    chosen, out = select(mesh, interleave, paged)
    np.testing.assert_array_equal(chosen, want)  # token by token, in (score, position) order
    assert rel_err(out, want_out) <= 1e-5


@pytest.mark.parametrize("combine", full_only(("psum",), ("all_to_all",), ("scatter",)))
def test_every_combine_gives_the_same_selection_and_output(combine):
    # (in CI, 1x3 above combines by psum, the others by scatter: 8 heads over 3 ranks and over 8)
    base, base_out = select((2, 4), 1, combine="auto")
    chosen, out = select((2, 4), 1, combine=combine)
    np.testing.assert_array_equal(chosen, base)
    assert rel_err(out, base_out) <= 1e-6


def all_gather_bytes(hlo: str) -> int:
    """Bytes the all-gathers of a compiled module produce (their result shapes)."""
    total = 0
    for line in hlo.splitlines():
        m = re.search(r"= \(?([a-z0-9]+)\[([\d,]*)\][^=]*\ball-gather(?:-start)?\(", line)
        if m:
            dims = [int(x) for x in m.group(2).split(",") if x]
            total += int(np.prod(dims)) * np.dtype(m.group(1).replace("s32", "int32")
                                                   .replace("f32", "float32")).itemsize
    return total


def test_top_k_gather_does_not_grow_with_context_and_the_index_cache_is_split():
    # The compiled island at a 256- and a 2048-token context: the same bytes all-gathered per step
    # (TOPK candidates per rank per query, and the combine's LSE), while the caches grow 8x; each
    # device holds 1/(tp·dcp) of the index keys.
    mesh = make_mesh(2, 4)
    layout = PagedLayout(8, 1, 4)
    q = jax.ShapeDtypeStruct((4, 1, 8, 40), jnp.float32)
    iq = jax.ShapeDtypeStruct((4, 1, 16, 32), jnp.float32)
    iw = jax.ShapeDtypeStruct((4, 1, 16), jnp.float32)
    i32 = jax.ShapeDtypeStruct((4,), jnp.int32)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXES))
    found = {}
    for context in (256, 2048):
        blocks = context // layout.tokens_per_block
        pages = (1 + 4 * blocks) * 8
        lat = jax.ShapeDtypeStruct((pages, 1, 4, 40), jnp.float32, sharding=sharded)
        keys = jax.ShapeDtypeStruct((pages, 1, 4, 32), jnp.float32, sharding=sharded)
        table = jax.ShapeDtypeStruct((4, blocks), jnp.int32)
        pos = jax.ShapeDtypeStruct((4, 1), jnp.int32)
        compiled = jax.jit(lambda *a: dcp_sparse_attention(
            *a[:7], mesh=mesh, layout=layout, topk=TOPK, index_scale=0.2, scale=0.2, v_dim=32,
            block_table=a[7])).lower(q, lat, keys, iq, iw, pos, i32, table).compile()
        found[context] = all_gather_bytes(compiled.as_text())
        assert sharded.shard_shape(keys.shape)[0] * 8 == keys.shape[0]  # 1/(tp·dcp) per device
    # candidates: 8 ranks x 4 queries x TOPK (f32 score + s32 position); the combine's partial LSEs:
    # 8 ranks x 4 queries x 8 heads (f32)
    assert found[256] == found[2048] == 8 * 4 * TOPK * 8 + 8 * 4 * 8 * 4


# --- what is refused ------------------------------------------------------------------------


def test_an_8_bit_kv_cache_is_refused_by_name():
    with pytest.raises(UserError, match="DeepSeek-V3.2's sparse attention reads no 8-bit KV cache"):
        load(1, 2, kv_cache_dtype="int8")


def test_disaggregation_is_refused_by_name():
    from dcp_jax.disagg.llm import DisaggregatedLLM

    with pytest.raises(UserError, match="does not move DeepSeek-V3.2's indexer cache"):
        DisaggregatedLLM.load(FIXTURES / NAME, prefill={"dcp": 2}, decode={"dcp": 2},
                              max_model_len=128)


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(q_lora_rank=None), "DeepSeek-V3.2's indexer reads the query's low-rank"),
    (lambda c: c.update(mlp_layer_types=["sparse", "sparse"]),
     "mlp_layer_types ['sparse', 'sparse']"),
    (lambda c: c.update(index_topk=0), "index_topk (0) and index_n_heads (16) must be >= 1"),
    (lambda c: c.update(architectures=["GlmMoeDsaForCausalLM"]), "unsupported architecture"),
])
def test_config_errors_are_one_line(tmp_path, capsys, edit, message):
    from dcp_jax.generate import run as cli

    d = tmp_path / "m"
    shutil.copytree(FIXTURES / NAME, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    code = cli(["--model", str(d), "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
