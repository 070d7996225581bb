"""Smoke test of scripts/bench_decode.py --quick (no timings asserted)."""

import json
import runpy
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
REQUIRED = ("context", "tp", "dcp", "donated_tokens_per_s", "naive_tokens_per_s", "ratio", "peer_tokens_per_s",
            "prefill_s", "peer_prefill_s", "peer_ratio", "prefill_ratio", "same_tokens")


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
        # --quick runs no peer unless --peer-python is given
        assert r["peer_tokens_per_s"] is None and r["peer_ratio"] is None and r["prefill_ratio"] is None
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
