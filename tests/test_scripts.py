"""Smoke tests of the benchmark scripts' --quick modes (no timings asserted)."""

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def test_bench_comm_quick_is_flat_in_context(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_comm.py", "--quick", "--json"])
    mod = runpy.run_path(str(SCRIPTS / "bench_comm.py"), run_name="bench_comm")
    assert mod["main"](["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = out["rows"]
    for key in ("tp", "dcp", "context", "variant", "collective_bytes_per_step"):
        assert all(key in r for r in rows)
    assert {r["variant"] for r in rows} == {"scatter", "psum", "all_to_all", "scatter+q_gather"}
    assert all(r["collective_bytes_per_step"] > 0 for r in rows)
    assert out["max_relative_change_over_context"] < 0.01
    by = {(r["tp"], r["dcp"], r["variant"], r["context"]): r for r in rows}
    total = {v: by[(2, 4, v, 4096)]["collective_bytes_per_step"] for v in ("scatter", "psum", "all_to_all",
                                                                            "scatter+q_gather")}
    # scatter moves fewer bytes than psum; all_to_all sends 1/dcp of the LSEs the scatter all-gathers;
    # q_gather adds an all-gather of q
    assert total["all_to_all"] < total["scatter"] < total["psum"]
    assert total["scatter"] < total["scatter+q_gather"]
    # the number of collectives a step launches is flat in context too; q_gather adds one all-gather per layer
    counts = {}
    for r in rows:
        counts.setdefault((r["tp"], r["dcp"], r["variant"]), set()).add(r["collectives_per_step"])
    assert all(len(c) == 1 for c in counts.values())
    q = by[(2, 4, "scatter+q_gather", 4096)]["count_all_gather"] - by[(2, 4, "scatter", 4096)]["count_all_gather"]
    assert q == by[(2, 4, "scatter", 4096)]["layers"]
    assert by[(2, 4, "all_to_all", 4096)]["bytes_all_to_all"] > 0
    assert "bytes_reduce_scatter" not in by[(2, 4, "all_to_all", 4096)]


def test_bench_comm_counts_every_element_of_a_long_tuple():
    mod = runpy.run_path(str(SCRIPTS / "bench_comm.py"), run_name="bench_comm")
    parts = [f"%p.{i} = f32[1,4]{{1,0}} parameter({i})" for i in range(8)]
    elems = ", ".join(("/*index=5*/" if i == 5 else "") + "f32[1,4]{1,0}" for i in range(8))
    ops = ", ".join(("/*index=5*/" if i == 5 else "") + f"%p.{i}" for i in range(8))
    hlo = "\n".join(parts + [f"%all-to-all = ({elems}) all-to-all({ops}), channel_id=1"])
    assert mod["collective_bytes"](hlo) == {"all-to-all": 8 * 16}
    assert mod["collective_counts"](hlo) == {"all-to-all": 1}


def test_each_layer_adds_only_the_combine_and_two_all_reduces():
    """The decode step's collectives per layer (tiny model, tp=2 x dcp=4): the combine's LSE all-gather
    and reduce-scatter, then the all-reduces after o_proj and down_proj. The residual stream stays
    replicated, so no norm, projection or MLP input needs a collective of its own."""
    import collections

    mod = runpy.run_path(str(SCRIPTS / "bench_comm.py"), run_name="bench_comm")

    def count(layers):
        return collections.Counter(mod["collective_counts"](mod["step_hlo"]("tiny", layers, 2, 4, 4096, "scatter", 1)))

    one, two = count(1), count(2)
    assert two - one == {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2}
    assert one - two == collections.Counter()


def test_bench_memory_quick(capsys):
    mod = runpy.run_path(str(SCRIPTS / "bench_memory.py"), run_name="bench_memory")
    assert mod["main"](["--quick", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    for key in ("model", "tp", "dcp", "context", "kv_heads", "kv_bytes_per_device", "weight_bytes_per_device",
                "temp_bytes_per_device", "fits"):
        assert all(key in r for r in rows)
    for r in rows:  # XLA's figure equals the exact share
        assert r["kv_bytes_per_device"] * min(r["tp"], r["kv_heads"]) * r["dcp"] == r["kv_bytes_total"]
        assert r["weight_bytes_per_device"] > 0 and r["temp_bytes_per_device"] > 0
    tp_only = next(r for r in rows if r["dcp"] == 1)
    dcp8 = next(r for r in rows if r["dcp"] == 8)
    assert dcp8["weight_bytes_per_device"] > tp_only["weight_bytes_per_device"]  # dcp=8 does not split heads


def test_bench_compile_quick(capsys):
    mod = runpy.run_path(str(SCRIPTS / "bench_compile.py"), run_name="bench_compile")
    assert mod["main"](["--quick", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shallow, deep = out["rows"]
    assert (shallow["layers"], deep["layers"]) == (4, 32)
    # the same program whatever the depth (exact); the compile-time ratio is reported, not asserted
    assert shallow["decode_instructions"] == deep["decode_instructions"]
    assert shallow["prefill_instructions"] == deep["prefill_instructions"]
    assert out["ratio_deepest_to_shallowest"]["decode"] > 0
    assert {(r["engine"], r["scan_layers"]) for r in out["decode_speed"]} == {
        ("paged", True), ("paged", False), ("dense", True), ("dense", False)}  # (same tokens: asserted inside)


def test_bench_spec_quick(capsys):
    # both tasks on a 1 x 2 mesh, small: every speculative run gives plain decoding's tokens; the figures
    # (speed-ups) are reported, not asserted
    mod = runpy.run_path(str(SCRIPTS / "bench_spec.py"), run_name="bench_spec")
    argv = ["--quick", "--json", "--mesh", "1x2", "--context", "512", "--new-tokens", "24", "--repeats", "1"]
    assert mod["main"](argv) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = {"plain", "ngram", "ngram-always", "draft", "draft-always"}
    assert out["mismatches"] == [] and set(out["docs"]["runs"]) == kinds
    for task in ("docs", "repeat"):
        for name, r in out[task]["runs"].items():
            assert r["exact"] and r["decode_tokens_per_s"] > 0
            # the speed-up pairs each round with plain decoding's round beside it
            assert len(r["rounds_speedup"]) == 1 and r["speedup"] == pytest.approx(
                r["decode_tokens_per_s"] / out[task]["runs"]["plain"]["decode_tokens_per_s"])
            if name.endswith("-always"):  # every decode iteration speculates
                assert r["spec_drafted_tokens"] > 0 and r["mean_acceptance_length"] >= 1
                assert r["spec_off_iterations"] == 0
            elif name != "plain":  # the rule decided each iteration: counted either way
                assert r["spec_on_iterations"] + r["spec_off_iterations"] > 0
