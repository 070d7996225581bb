"""Smoke test of scripts/bench_serving.py --quick --json: the report's structure, exactness and the
capacity count (a logical count, not a timing). No wall-clock ratio is asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = ("continuous, all at once", "continuous, Poisson", "static batches, all at once")


def test_bench_serving_quick_json():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_serving.py"), "--quick", "--json"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "bench_serving.py --quick --json" in report["command"]
    assert report["exact_tokens"] is True

    rows = {r["run"]: r for r in report["rows"]}
    assert tuple(rows) == RUNS
    w = report["workload"]
    assert len(w["prompt_lengths"]) == w["requests"] and max(w["prompt_lengths"]) > 4 * min(w["prompt_lengths"])
    for name, r in rows.items():
        assert r["exact_tokens"] is True and r["mismatched"] == [], name
        assert r["requests"] == w["requests"] and r["output_tokens"] == w["output_tokens"], name
        assert r["wall_s"] > 0 and r["output_tokens_per_s"] > 0, name
        for key in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
            assert r[key] is not None and r[key] >= 0, (name, key)
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["tpot_p50_s"] <= r["tpot_p99_s"], name
        assert r["prefill_tokens_computed"] >= r["prefill_tokens_useful"] == w["prompt_tokens"], name
        assert r["decode_tokens_computed"] >= r["decode_tokens_useful"], name
    for name in RUNS[:2]:  # the paged pool
        r = rows[name]
        assert 0 < r["pages_used_max"] <= r["pages_total"] and 0 <= r["pages_used_mean"] <= r["pages_used_max"]
        assert r["kv_capacity_tokens"] > 0
    assert rows["continuous, Poisson"]["rate_rps"] > 0

    ratios = report["ratios"]
    for key in ("throughput_speedup", "poisson_vs_static", "capacity_ratio", "kv_capacity_ratio"):
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
