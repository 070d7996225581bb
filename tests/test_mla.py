"""DeepSeek-V2/V3 (MLA + MoE) against transformers' greedy ids and logprobs (tests/fixtures/deepseek-*,
made by scripts/make_fixtures.py), with the latent cache sharded over the whole mesh."""

import json

import jax
import numpy as np
import pytest

from dcp_jax import LLM, make_mesh
from dcp_jax.config import ModelConfig
from dcp_jax.dense import Engine
from dcp_jax.mla import route
from dcp_jax.weights import load_hf
from tests.util import FIXTURES, expected
from tests.util import run_fixture as run

# deepseek-v3: q_lora_rank, default RoPE; deepseek-v3-yarn: no q_lora_rank, YaRN; deepseek-v2: softmax
# router, group-limited greedy. All: layer 0 dense, layer 1 MoE (8 experts, top-2, a shared expert).
NAMES = ["deepseek-v3", "deepseek-v3-yarn", "deepseek-v2"]
MESHES = [(1, 1), (1, 8), (2, 4), (8, 1)]


# deepseek-v3 on every mesh; the other two (their RoPE and router) on a dcp and a tp x dcp mesh
MLA_CASES = [(n, m) for n in NAMES for m in (MESHES if n == NAMES[0] else [(1, 8), (2, 4)])]


@pytest.mark.parametrize("name,mesh", MLA_CASES, ids=[f"{n}-{m[0]}x{m[1]}" for n, m in MLA_CASES])
def test_matches_transformers(name, mesh):
    out, exp = run(name, *mesh)
    assert out.tokens == exp["greedy"]  # ragged batch of 3 prompts (5, 11, 17 tokens)
    cfg = ModelConfig.from_file(FIXTURES / name / "config.json")
    # the latent cache, stored once (B·L·S·latent·f32) and split over every device: no replication
    assert out.stats["kv_bytes_total"] == 3 * cfg.num_layers * out.stats["max_seq_len"] * cfg.head_dim * 4
    assert out.stats["kv_bytes_per_device"] * mesh[0] * mesh[1] == out.stats["kv_bytes_total"]
    for lp, first, tok in zip(out.logprobs, exp["first_logprobs"], exp["greedy"]):
        assert abs(lp[0] - first[tok[0]]) <= 2e-3
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(exp["greedy_logprobs"]), atol=2e-3)


@pytest.mark.parametrize("mesh,interleave,chunk", [((2, 4), "contiguous", 1), ((8, 1), 1, 7), ((1, 8), 2, 256)])
def test_chunked_prefill_and_placements(mesh, interleave, chunk):
    out, exp = run("deepseek-v3", *mesh, interleave=interleave, prefill_chunk=chunk, max_seq_len=48)
    assert out.tokens == exp["greedy"]


@pytest.mark.parametrize("mesh", [(4, 2)])  # (the other 8-device meshes: test_matches_transformers)
def test_latent_cache_is_split_over_every_device(mesh):
    out, _ = run("deepseek-v3", *mesh, max_seq_len=64)
    cfg = ModelConfig.from_file(FIXTURES / "deepseek-v3" / "config.json")
    total = 3 * cfg.num_layers * 64 * (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim) * 4  # B·L·S·latent·f32
    assert out.stats["kv_bytes_total"] == total
    assert out.stats["kv_bytes_per_device"] * 8 == total  # no replication on any axis, (8, 1) included
    assert out.stats["kv_replication"] == 1


def test_cache_placement_and_param_shardings():
    mesh = make_mesh(2, 4)
    model, _ = load_hf(FIXTURES / "deepseek-v3", mesh)
    assert [st.indices for st in model.stacks] == [(0,), (1,)]  # a dense layer, then an MoE one
    layer = model.stacks[1].block
    # experts: 8 stacked, one per device (behind the stack's layer axis)
    shard = layer.mlp.gate_proj[...].addressable_shards[0].data
    assert layer.mlp.gate_proj[...].shape[:2] == (1, 8) and shard.shape[:2] == (1, 1)
    eng = Engine(model, mesh)
    cache = eng.abstract_state(2, eng.layout(64))[0]
    (latent,) = cache[0]
    assert latent.shape == (1, 2, 1, 64, 40)
    assert latent.sharding.spec == jax.sharding.PartitionSpec(None, None, None, ("tp", "dcp"), None)


def test_checkpoint_round_trip_on_another_mesh(tmp_path):
    exp = expected("deepseek-v3")
    llm = LLM.load(FIXTURES / "deepseek-v3", tp=2, dcp=4)
    llm.save(tmp_path / "ds")
    back = LLM.load(tmp_path / "ds", tp=8, dcp=1)
    assert back.generate(exp["prompts"], max_new_tokens=8, ignore_eos=True).tokens == exp["greedy"]


def test_router_matches_a_direct_reading_of_the_rules():
    from dcp_jax.config import MoEConfig

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 8)).astype(np.float32)
    bias = (rng.standard_normal(8) * 0.1).astype(np.float32)
    v3 = MoEConfig(num_experts=8, top_k=2, intermediate_size=4, num_shared=1, first_dense=0, layer_freq=1,
                   scoring="sigmoid", topk_method="noaux_tc", num_groups=4, topk_groups=2, norm_topk_prob=True,
                   routed_scaling_factor=2.5)
    w = np.asarray(route(logits, bias, v3))
    for row, lg in zip(w, logits):
        s = 1 / (1 + np.exp(-lg.astype(np.float64)))
        c = s + bias
        groups = c.reshape(4, 2)
        best_groups = np.argsort(-np.sort(groups, axis=1)[:, ::-1][:, :2].sum(1))[:2]
        allowed = np.zeros(8, bool)
        for g in best_groups:
            allowed[2 * g:2 * g + 2] = True
        chosen = np.argsort(-np.where(allowed, c, -np.inf))[:2]
        want = np.zeros(8)
        want[chosen] = s[chosen] / s[chosen].sum() * 2.5
        np.testing.assert_allclose(row, want, rtol=1e-5, atol=1e-6)
        assert (row > 0).sum() == 2


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.pop("kv_lora_rank"), "config.json lacks required field 'kv_lora_rank'"),
    (lambda c: c.update(n_group=3), "8 experts do not split into n_group=3 groups"),
    (lambda c: c.update(num_experts_per_tok=9), "num_experts_per_tok=9 exceeds n_routed_experts=8"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (lambda c: c.update(architectures=["DeepseekV2ForCausalLM"]), "DeepSeek-V2 with norm_topk_prob=true"),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "needs original_max_position"),
])
def test_config_errors_are_one_line(tmp_path, capsys, edit, message):
    import shutil

    from dcp_jax.generate import run as cli

    d = tmp_path / "m"
    shutil.copytree(FIXTURES / "deepseek-v3", d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    code = cli(["--model", str(d), "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "malformed field: config.json" not in err  # said once


def test_replicated_latent_baseline():
    # The TP-alone layout the memory benchmark compares against: a whole latent cache on every device.
    from dcp_jax.model import CausalLM
    from dcp_jax.weights import SafetensorsSource

    exp = expected("deepseek-v3")
    mesh = make_mesh(2, 4)
    cfg = ModelConfig.from_file(FIXTURES / "deepseek-v3" / "config.json")
    model = CausalLM(cfg, SafetensorsSource(FIXTURES / "deepseek-v3", cfg, mesh, np.float32), mesh, latent_axes=())
    out = Engine(model, mesh).generate(exp["prompts"], max_new_tokens=8, ignore_eos=True, max_seq_len=64)
    assert out.tokens == exp["greedy"]
    assert out.stats["kv_bytes_per_device"] == out.stats["kv_bytes_total"]


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
def test_latent_attention_island_matches_float64(impl):
    # dcp_attention as MLA calls it: all heads on every device, one latent "kv head" sharded over
    # ("tp","dcp"), values = the latent's first v_dim features (v_cache=None, nothing copied).
    import jax.numpy as jnp

    from dcp_jax import KVLayout, dcp_attention
    from tests.util import assert_lse_close, dense_attention, place, rel_err

    mesh = make_mesh(2, 4)
    layout = KVLayout.create(64, 8, 2)
    rng = np.random.default_rng(0)
    lengths = np.asarray([64, 11, 3], np.int32)  # the last: most shards hold nothing
    q = rng.standard_normal((3, 2, 8, 40)).astype(np.float32)
    latent = rng.standard_normal((3, 1, 64, 40)).astype(np.float32)
    q_pos = (np.maximum(lengths, 1)[:, None] - 2 + np.arange(2)).astype(np.int32)
    ref_o, ref_lse = dense_attention(q, latent, latent[..., :32], q_pos, lengths, 0.3)
    o, lse = jax.jit(lambda q, c, p, n: dcp_attention(
        q, c, None, p, n, mesh=mesh, layout=layout, head_axes=(), context_axes=("tp", "dcp"), scale=0.3,
        v_dim=32, impl=impl, return_lse=True))(jnp.asarray(q), jnp.asarray(place(latent, layout)),
                                                 jnp.asarray(q_pos), jnp.asarray(lengths))
    assert o.shape == (3, 2, 8, 32) and o.sharding.spec[2] == ("tp", "dcp")
    assert rel_err(o, ref_o) <= 1e-5
    assert_lse_close(lse, ref_lse, 1e-5)


def test_bfloat16_keeps_the_first_greedy_ids():
    mesh = make_mesh(1, 8)
    model, _ = load_hf(FIXTURES / "deepseek-v3", mesh, "bfloat16")
    exp = expected("deepseek-v3")
    out = Engine(model, mesh).generate(exp["prompts"], max_new_tokens=4, ignore_eos=True)
    assert [t[:3] for t in out.tokens] == [t[:3] for t in exp["greedy"]]


def test_cache_free_forward_matches_transformers():
    # CausalLM.forward (training / scoring: no cache, no mesh island) runs the absorbed attention densely.
    exp = expected("deepseek-v3-yarn")
    mesh = make_mesh(1, 1)
    model, _ = load_hf(FIXTURES / "deepseek-v3-yarn", mesh)
    prompt = exp["prompts"][2]
    logits = np.asarray(model.forward(np.asarray([prompt], np.int32)))[0, -1].astype(np.float64)
    logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    np.testing.assert_allclose(logprobs, exp["first_logprobs"][2], atol=2e-4)
