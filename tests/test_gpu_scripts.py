"""The GPU scripts on a CPU-only machine: they refuse with one clear line (no traceback), and their pure
helpers (roofline arithmetic, the checkpoint's parameter count, the tables) are right. No torch or
transformers needed: those are imported only inside the scripts' GPU-side subprocess modes."""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


@pytest.fixture(scope="module")
def gc():
    return runpy.run_path(str(SCRIPTS / "gpu_check.py"), run_name="gpu_check")


@pytest.fixture(scope="module")
def sk():
    return runpy.run_path(str(SCRIPTS / "sweep_kernel.py"), run_name="sweep_kernel")


def run_on_cpu(script):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPTS / script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("script", ["gpu_check.py", "sweep_kernel.py"])
def test_refuses_without_a_gpu_in_one_line(script):
    p = run_on_cpu(script)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr + p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("no GPU: run on a GPU machine"), p.stderr
    assert p.stdout.strip() == ""


def test_helpers_import_neither_torch_nor_transformers():
    code = ("import runpy, sys; runpy.run_path('scripts/gpu_check.py', run_name='x'); "
            "runpy.run_path('scripts/sweep_kernel.py', run_name='y'); "
            "print(sorted(m for m in ('torch', 'transformers', 'jax') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_checkpoint_is_a_1_1b_llama(gc):
    cfg = gc["LLAMA_1B"]
    n = gc["llama_param_count"](cfg)
    # embeddings + untied head: 2 × 32000 × 2048; per layer q,o 2048² each, k,v 2048 × 512 each, MLP 3 × 2048 × 8192
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    assert n == 2 * 32000 * 2048 + 16 * per_layer + 2048 == 1_104_218_112
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (2048, 16, 32, 8, 64, 8192, 32000)
    assert cfg["max_position_embeddings"] >= 32768 + 64


def test_param_count_matches_a_real_checkpoint(gc):
    """The count from config.json alone equals the tensors transformers wrote (tests/fixtures/llama-gqa)."""
    from safetensors import safe_open

    fixture = ROOT / "tests" / "fixtures" / "llama-gqa"
    cfg = json.loads((fixture / "config.json").read_text())
    total = 0
    with safe_open(str(fixture / "model.safetensors"), framework="numpy") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            size = 1
            for d in shape:
                size *= d
            total += size
    assert gc["llama_param_count"](cfg) == total


def test_roofline_arithmetic(gc):
    cfg = gc["LLAMA_1B"]
    # batch 16 × 32K × 16 layers × 2 (K, V) × 8 kv heads × 64 × 2 B = 17.2 GB of KV read per step
    assert gc["kv_bytes_per_step"](cfg, 16, 32768) == 16 * 32768 * 16 * 2 * 8 * 64 * 2 == 17_179_869_184
    w = gc["weight_bytes_per_step"](cfg)
    assert w == 2 * (1_104_218_112 - 32000 * 2048)  # the input embedding table is gathered, not read
    roof = gc["decode_roofline"](cfg, 16, 32768, 64, copy_gbs=4000.0)
    kv = gc["kv_bytes_per_step"](cfg, 16, 32768 + 32)  # average context over the decode
    assert roof["bytes_per_step"] == pytest.approx(w + kv)
    assert roof["tokens_per_s"] == pytest.approx(16 / ((w + kv) / 4000e9))
    # more batch: more tokens per step, and more KV per step
    assert gc["decode_roofline"](cfg, 4, 32768, 64, 4000.0)["tokens_per_s"] < roof["tokens_per_s"]


def test_prefill_flops_match_the_design_anchor(gc):
    flops = gc["attention_flops"](1, 32, 8192, 8192, 128, causal=True)
    assert flops == 4 * 32 * 8192 * 8192 * 128 / 2
    assert flops / 0.96e-3 / 1e12 == pytest.approx(571, rel=0.01)  # the H200 prefill anchor: 0.96 ms = 571 TFLOP/s


def test_small_helpers(gc):
    assert gc["prefix_match"]([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert gc["prefix_match"]([1, 2], [1, 2, 3]) == 2
    m = gc["greedy_match"]([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]])
    assert (m["row0"], m["rows_equal"], m["prefix_by_row"], m["compared"]) == (3, 1, [3, 1], 3)
    assert gc["first_line"](RuntimeError("\n  boom\nmore")) == "RuntimeError: boom"
    assert gc["first_line"]("\nINTERNAL: out of shared memory\n  at ...") == "INTERNAL: out of shared memory"


def test_parse_pytest(gc):
    parse = gc["parse_pytest"]
    done = parse("..........F.F\n=== FAILURES ===\nFAILED tests/test_kernels.py::test_x - AssertionError\n"
                 "FAILED tests/test_ragged.py::test_y[a] - ValueError: no\n"
                 "2 failed, 11 passed, 2 skipped in 3.21s\n")
    assert (done["passed"], done["failed"], done["skipped"], done["complete"]) == (11, 2, 2, True)
    assert done["first_failure"].startswith("FAILED tests/test_kernels.py::test_x")
    assert [f.split(" - ")[0] for f in done["failures"]] == ["FAILED tests/test_kernels.py::test_x",
                                                            "FAILED tests/test_ragged.py::test_y[a]"]
    cut = parse("........................ [ 36%]\n....s...\n")
    assert (cut["passed"], cut["skipped"], cut["complete"]) == (31, 1, False)


def test_markdown_table_escapes_pipes(gc):
    text = gc["markdown_table"]([("a|b", "1", "2", "PASS")])
    lines = text.splitlines()
    assert lines[0] == "| metric | measured | target | verdict |"
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| a\\|b | 1 | 2 | PASS |"


SAMPLE = dict(
    meta=dict(device_kind="NVIDIA H200", jax_version="0.11.2", quick=False, elapsed_s=400, prompt_len=32768),
    stages=dict(
        copy=dict(status="ok", copy_gbs=4280.0, copy_best="device_put"),
        decode_kernel=dict(status="ok", lengths=[8192, 32768, 131072], rows=[
            dict(keys=8192, pallas_ms=0.1, cudnn_ms=0.12, pallas_gbs=2600.0, fraction_of_copy=0.61,
                 speedup_vs_cudnn=1.2, max_abs_diff_vs_reference=0.004),
            dict(keys=32768, pallas_ms=0.3, cudnn_ms=0.28, pallas_gbs=3600.0, fraction_of_copy=0.84,
                 speedup_vs_cudnn=0.93, pallas_verify5_ms=0.36, verify5_cost_vs_decode=1.2),
            dict(keys=131072, error="skipped: 3 s left in the stage budget"),
        ]),
        prefill_kernel=dict(status="ok", t=8192, pallas_ms=1.5, pallas_tflops=366.0, cudnn_ms=0.96, cudnn_tflops=572.0),
        e2e_dcp=dict(status="ok", prompt_len=32768, runs={"16": dict(
            batch=16, prompt_len=32768, prefill_chunk=2048, ttft_s=9.0, decode_tokens_per_s=900.0,
            roofline_tokens_per_s=1200.0, roofline_fraction=0.75)}),
        e2e_transformers=dict(status="failed", error="timed out", runs={"16": dict(ttft_s=12.0, decode_tokens_per_s=300.0)},
                              greedy_match=dict(batch=16, row0=7, compared=64, rows=16, rows_equal=3)),
        prefill_chunk_sweep=dict(status="skipped", error="no time left (3 s)"),
        kernel_tests=dict(status="ok", counts=dict(passed=65, failed=0, error=0, skipped=0, complete=True)),
    ),
)


def test_headline_rows_verdicts(gc):
    rows = {r[0]: r for r in gc["headline_rows"](SAMPLE)}
    assert rows["decode kernel 8K: of copy / vs cuDNN"][3] == "PASS"  # 8K: only "faster than cuDNN"
    assert rows["decode kernel 32K: of copy / vs cuDNN"][3] == "FAIL"  # 84% < 85% and slower than cuDNN
    assert rows["decode kernel 128K: of copy / vs cuDNN"][1].startswith("skipped")
    assert rows["verify step (5 queries) 32K: time vs 1 query"][1] == "0.360 ms = 1.20×"
    assert "verify step (5 queries) 8K: time vs 1 query" not in rows  # not measured there: no row
    assert rows["kernel tests on the GPU"][3] == "PASS"
    assert "1.33× faster" in rows["TTFT b=16 @32K: ours vs transformers"][1]
    assert "75% of 1200" in rows["e2e decode b=16 @32K: tok/s (roofline)"][1]
    assert rows["e2e decode b=4 @32K: tok/s (roofline)"][1].startswith("skipped")
    assert rows["best prefill chunk (TTFT b=4)"][1].startswith("skipped")
    assert "7/64" in rows["greedy tokens = transformers'"][1]


def test_fp8_page_row(gc):
    # the fp8 decode row: ratio to the bf16 pages, its bytes, PASS at <= 0.6x; an error is a FAIL naming it
    rows = dict(keys=32768, pallas_ms=1.0, fp8_vs_bf16=0.55, fp8_paged_ms=0.55, bf16_paged_ms=1.0,
                fp8_bytes_ratio=0.52)
    run = dict(meta={}, stages=dict(decode_kernel=dict(lengths=[32768, 131072], rows=[
        rows, dict(keys=131072, pallas_ms=4.0, fp8_error="RuntimeError: no fp8 on this device")])))
    got = {r[0]: r for r in gc["headline_rows"](run)}
    assert got["decode kernel 32K: fp8 pages / bf16"][1:] == (
        "0.55× (0.550 vs 1.000 ms, 0.52× the bytes)", "≤ 0.6×", "PASS")
    assert got["decode kernel 128K: fp8 pages / bf16"][1:] == ("RuntimeError: no fp8 on this device", "≤ 0.6×", "FAIL")


def test_kernel_test_row_lists_every_failure(gc):
    fails = [f"FAILED tests/test_kernels.py::test_{i} - AssertionError" for i in range(7)]
    run = dict(meta={}, stages=dict(kernel_tests=dict(status="failed", counts=dict(
        passed=90, failed=7, error=0, skipped=0, complete=True, first_failure=fails[0], failures=fails))))
    row = next(r for r in gc["headline_rows"](run) if r[0] == "kernel tests on the GPU")
    assert row[3] == "FAIL"
    assert all(f"test_kernels.py::test_{i} " in row[1] for i in range(5)) and "+2 more" in row[1]


def test_headline_rows_survive_an_empty_run(gc):
    rows = gc["headline_rows"](dict(meta={}, stages={}))
    assert all(len(r) == 4 for r in rows)
    assert any(r[0] == "kernel tests on the GPU" and r[1] == "not run" for r in rows)


def test_report_prints_the_table_last(gc, tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(SAMPLE))
    assert gc["main"](["--report", str(path), "--print-json"]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[0] == "{"
    table = out[-(len(gc["headline_rows"](SAMPLE)) + 2):]
    assert table[0] == "| metric | measured | target | verdict |"
    assert all(line.startswith("| ") and line.endswith(" |") for line in table[2:])


def test_sweep_space_and_best(sk):
    assert len(sk["space"]("decode")) == 5 * 3 * 2
    assert len(sk["space"]("prefill")) == 3 * 4 * 2 * 2
    a, b = dict(block_k=64, num_stages=2, num_warps=4), dict(block_k=128, num_stages=3, num_warps=4)
    results = [
        dict(shape="decode 32K", options="default", ms=1.0),
        dict(shape="decode 32K", options=a, ms=1.0), dict(shape="decode 32K", options=b, ms=1.1),
        dict(shape="decode 128K", options=a, ms=5.0), dict(shape="decode 128K", options=b, ms=4.0),
        dict(shape="decode 128K", options=dict(block_k=256, num_stages=5, num_warps=8), ms=1.0),  # 128K only
        dict(shape="decode 32K", options=dict(block_k=256, num_stages=5, num_warps=8), error="out of resource"),
    ]
    # a: 1.0 and 5.0 -> geomean of (1, 5) = 2.24; b: (1.1, 4.0) -> 2.10
    assert sk["best_config"](results) == b
    table = sk["format_table"](results)
    assert table.splitlines()[2].startswith("| decode 128K | block_k=256")
    assert "out of resource" in table


def test_sweep_rows_paste_into_configs(sk):
    from pallas_kernels.attention.configs import KernelConfig

    row = sk["table_row"]("decode", dict(block_k=128, num_stages=4, num_warps=8), block_q=64)
    assert row == '("decode", 128): KernelConfig(block_q=64, block_k=128, num_warps=8, num_stages=4),'
    key, cfg = eval("{" + row + "}", {"KernelConfig": KernelConfig}).popitem()  # noqa: S307 - our own text
    assert key == ("decode", 128) and cfg == KernelConfig(block_q=64, block_k=128, num_warps=8, num_stages=4)
    row = sk["table_row"]("prefill", dict(block_q=128, block_k=64, num_stages=2, num_warps=4), block_q=64)
    assert re.search(r"block_q=128, block_k=64, num_warps=4, num_stages=2", row)


def test_sweep_skips_blocks_past_the_page_or_shared_memory(sk):
    skip = sk["skip_reason"]
    assert skip(dict(block_k=128, num_stages=2, num_warps=4), "decode", "d128", 64, 4).startswith(
        "skipped: block_k 128 > page 64")
    assert skip(dict(block_k=64, num_stages=2, num_warps=4), "decode", "d128", 64, 4) is None
    # MLA prefill: 128 query rows × 576 plus 4 stages of 128 latent rows cannot fit one block
    assert "shared memory" in skip(dict(block_q=128, block_k=128, num_stages=3, num_warps=8), "prefill", "mla", 128,
                                   4096)
    assert [sk["table_bucket"](c) for c in ("d64", "d128", "d256", "mla")] == [64, 128, 256, 1024]


def test_sweep_says_when_larger_pages_win(sk):
    a, b = dict(block_k=64, num_stages=2, num_warps=4), dict(block_k=128, num_stages=2, num_warps=4)
    rows = [dict(phase="decode", case="d128", page=64, options=a, ms=1.0),
            dict(phase="decode", case="d128", page=128, options=b, ms=0.8)]
    assert "page 128 (KV blocks up to 128) is 1.25x faster than page 64" in sk["larger_pages"](rows, "decode", "d128")
    rows[1]["ms"] = 1.1
    assert sk["larger_pages"](rows, "decode", "d128") is None


def test_sweep_runs_the_paged_kernel_on_the_interpreter(sk):
    # One small MLA decode shape through the sweep's own path: the default config and two swept ones run
    # the paged kernel (values shared with the keys) and agree; one past the page is skipped.
    args, fn, nbytes, _ = sk["paged_inputs"]("mla", "decode", 16, 64, 16, batch=1)
    assert args[1].shape == (4, 1, 16, 576) and args[2] is None and nbytes == args[1].nbytes
    results = []
    opts = [dict(block_k=16, num_stages=2, num_warps=8), dict(block_k=32, num_stages=2, num_warps=4)]
    sk["sweep_shape"]("decode mla", "decode", "mla", 16, args, fn, opts, float("inf"), lambda s: "", results,
                      impl="pallas_interpret")
    assert [r.get("error", "")[:7] for r in results] == ["", "", "skipped"]
    assert results[1]["ms"] > 0 and results[1]["max_abs_diff_vs_default"] < 1e-2


def test_ragged_decode_row_runs_on_the_interpreter(gc):
    # The GPU check's ragged-vs-paged row, on Pallas' interpreter: both kernels run over the same pages
    # and give the same attention.
    q, k, v, q_pos, kv_len = gc["decode_inputs"](128, b=2, h=4, kh=2, d=16)
    row = gc["paged_vs_ragged"](q, k, v, q_pos, kv_len, page=16, impl="pallas_interpret")
    assert row["paged_ms"] > 0 and row["ragged_decode_ms"] > 0
    assert row["ragged_vs_paged"] > 0 and row["ragged_max_abs_diff"] < 2e-2  # bf16 inputs


def test_mla_decode_row_runs_on_the_interpreter(gc):
    # The GPU check's 128-head MLA decode row, on Pallas' interpreter at a small context: the kernel reads
    # the latent in two query blocks and agrees with the reference.
    row = gc["mla_decode"](64, b=1, heads=128, page=16, impl="pallas_interpret")
    assert row["mla_query_blocks"] == 2 and row["mla_ms"] > 0 and row["mla_gbs"] > 0
    assert row["mla_max_abs_diff_vs_reference"] < 2e-2  # bf16 inputs
