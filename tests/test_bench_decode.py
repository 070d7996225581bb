"""Smoke test of scripts/bench_decode.py --quick (no timings asserted)."""

import json
import runpy
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
REQUIRED = ("context", "tp", "dcp", "donated_tokens_per_s", "naive_tokens_per_s", "ratio", "peer_tokens_per_s",
            "prefill_s", "peer_prefill_s", "peer_ratio", "prefill_ratio", "same_tokens",
            "serve_ttft_s", "serve_ratio", "serve_same_tokens")


def test_bench_decode_quick(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--quick", "--json"])
    mod = runpy.run_path(str(SCRIPTS / "bench_decode.py"), run_name="bench_decode")
    assert mod["main"](["--quick", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert {(r["tp"], r["dcp"]) for r in rows} == {(1, 1), (1, 8)}
    for r in rows:
        for key in REQUIRED:
            assert key in r, key
        assert r["context"] == 512
        assert r["donated_tokens_per_s"] > 0 and r["naive_tokens_per_s"] > 0
        assert r["prefill_s"] > 0 and r["ratio"] > 0
        assert r["same_tokens"] is True
        # the serving engine (LLM at its CPU defaults) decodes the same greedy tokens
        assert r["serve_ttft_s"] > 0 and r["serve_same_tokens"] is True
        assert r["serve_prefill_chunk"] > 0 and r["serve_idle_budget"] >= r["serve_token_budget"]
        # each mesh ran in its own interpreter with exactly its devices (as the CLI does)
        assert r["devices"] == r["tp"] * r["dcp"]
        assert r["gemm_gflops"] > 0 and r["prefill_floor_s"] == r["prefill_flops"] / (r["gemm_gflops"] * 1e9)
        # --quick runs no peer unless --peer-python is given
        assert r["peer_tokens_per_s"] is None and r["peer_ratio"] is None and r["prefill_ratio"] is None
        assert r["serve_ratio"] is None
        assert len(r["tokens"]) == r["new_tokens"] == 8


def test_checkpoint_uses_hf_llama_names(tmp_path):
    mod = runpy.run_path(str(SCRIPTS / "bench_decode.py"), run_name="bench_decode")
    cfg = mod["hf_config"]("llama-30m")
    names = mod["hf_tensors"](dict(cfg, num_hidden_layers=1, vocab_size=16, hidden_size=16, head_dim=2,
                                   intermediate_size=8))
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight"} <= set(names)
    assert names["model.layers.0.mlp.down_proj.weight"].shape == (16, 8)  # [out, in]
    assert mod["count_params"](mod["ensure_checkpoint"](tmp_path / "ck", "tiny")) > 0


def test_prefill_flops_matches_xla_cost_analysis():
    """The floor's FLOP count against XLA's own count of a cache-free forward on the tiny checkpoint's
    shapes, which also computes the upper attention triangle and every token's logits."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dcp_jax import make_mesh
    from dcp_jax.config import ModelConfig
    from dcp_jax.model import CausalLM, random_source

    mod = runpy.run_path(str(SCRIPTS / "bench_decode.py"), run_name="bench_decode")
    hf = mod["hf_config"]("tiny")
    cfg = ModelConfig.from_dict(hf)
    mesh = make_mesh(1, 1)
    graphdef, params = nnx.split(CausalLM(cfg, random_source(cfg, mesh), mesh))
    h, d = hf["num_attention_heads"], hf["head_dim"]
    e, v = hf["hidden_size"], hf["vocab_size"]
    one = dict(hf, num_hidden_layers=1)  # the layers are one lax.scan: XLA's cost analysis counts its body once
    for t in (16, 64):
        forward = jax.jit(lambda p, x: nnx.merge(graphdef, p).forward(x))
        xla = forward.lower(params, jnp.zeros((1, t), jnp.int32)).compile().cost_analysis()["flops"]
        extra = h * 4 * d * (t * t - t * (t + 1) // 2) + 2 * e * v * (t - 1)
        # XLA also counts the elementwise work (norms, RoPE, softmax): a few percent more
        assert 1.0 <= xla / (mod["prefill_flops"](one, t) + extra) <= 1.1
