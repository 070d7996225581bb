"""The GPU scripts on a CPU-only machine: they refuse with one clear line (no traceback); the
check's plan fits its deadline, runs its stages in order, skips a row only by its own measured cost
and stops in order when the time runs out (a fake clock); the correctness gate runs in Pallas'
interpreter, passes, and fails when a kernel is wrong; the pure helpers (roofline arithmetic, the
checkpoint's parameter count, the table) are right. No torch or transformers needed: those are
imported only inside the check's GPU-side subprocess modes."""

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


def run_on_cpu(script, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", ["gpu_check.py", "sweep_kernel.py"])
def test_refuses_without_a_gpu_in_one_line(script):
    p = run_on_cpu(script)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr + p.stdout
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("no GPU: run on a GPU machine"), p.stderr
    assert p.stdout.strip() == ""


STAGES = ("copy,gate,decode,serving,prefill,checkpoint,e2e,transformers,chunk_sweep,scan_cost,"
          "e2e_b16")
SECONDS = "give a positive number of seconds, as gate=200"


@pytest.mark.parametrize("args,line", [
    (["--stages", "copy,kernel_tests"], f"unknown stage 'kernel_tests': choose from {STAGES}"),
    (["--budget", "gates=100"],
     f"--budget 'gates=100': unknown stage 'gates'; choose from {STAGES}"),
    (["--budget", "gate=lots"], f"--budget 'gate=lots': {SECONDS}"),
    (["--budget", "gate=-5"], f"--budget 'gate=-5': {SECONDS}"),
])
def test_a_bad_argument_is_named_in_one_line(args, line):
    p = run_on_cpu("gpu_check.py", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip() == line


def test_helpers_import_neither_torch_nor_transformers():
    code = ("import runpy, sys; runpy.run_path('scripts/gpu_check.py', run_name='x'); "
            "runpy.run_path('scripts/sweep_kernel.py', run_name='y'); "
            "print(sorted(m for m in ('torch', 'transformers', 'jax') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_checkpoint_is_a_1_1b_llama(gc):
    cfg = gc["LLAMA_1B"]
    n = gc["llama_param_count"](cfg)
    # embeddings + untied head: 2 × 32000 × 2048; per layer q,o 2048² each, k,v 2048 × 512 each,
    # MLP 3 × 2048 × 8192
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048
    assert n == 2 * 32000 * 2048 + 16 * per_layer + 2048 == 1_104_218_112
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
            cfg["vocab_size"]) == (2048, 16, 32, 8, 64, 8192, 32000)
    assert cfg["max_position_embeddings"] >= 32768 + 64


def test_param_count_matches_a_real_checkpoint(gc):
    """The count from config.json alone equals the tensors transformers wrote
    (tests/fixtures/llama-gqa)."""
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
    kv = gc["kv_bytes_per_step"](cfg, 16, 32768)
    assert kv == 16 * 32768 * 16 * 2 * 8 * 64 * 2 == 17_179_869_184
    w = gc["weight_bytes_per_step"](cfg)
    assert w == 2 * (1_104_218_112 - 32000 * 2048)  # the input embedding table is gathered
    roof = gc["decode_roofline"](cfg, 16, 32768, 64, copy_gbs=4000.0)
    kv = gc["kv_bytes_per_step"](cfg, 16, 32768 + 32)  # average context over the decode
    assert roof["bytes_per_step"] == pytest.approx(w + kv)
    assert roof["tokens_per_s"] == pytest.approx(16 / ((w + kv) / 4000e9))
    # more batch: more tokens per step, and more KV per step
    assert gc["decode_roofline"](cfg, 4, 32768, 64, 4000.0)["tokens_per_s"] < roof["tokens_per_s"]


def test_prefill_flops_count_both_products_and_the_causal_half(gc):
    flops = gc["attention_flops"](1, 32, 8192, 8192, 128, causal=True)
    assert flops == 4 * 32 * 8192 * 8192 * 128 / 2
    assert gc["attention_flops"](2, 32, 8192, 8192, 128, causal=False) == 4 * flops


def test_small_helpers(gc):
    assert gc["prefix_match"]([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert gc["prefix_match"]([1, 2], [1, 2, 3]) == 2
    m = gc["greedy_match"]([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 0, 6]])
    assert (m["row0"], m["rows_equal"], m["prefix_by_row"], m["compared"]) == (3, 1, [3, 1], 3)
    assert gc["first_line"](RuntimeError("\n  boom\nmore")) == "RuntimeError: boom"
    line = gc["first_line"]("\nINTERNAL: out of shared memory\n  at ...")
    assert line == "INTERNAL: out of shared memory"


def test_markdown_table_escapes_pipes(gc):
    text = gc["markdown_table"]([("a|b", "1", "2", "PASS")])
    lines = text.splitlines()
    assert lines[0] == "| metric | measured | target | verdict |"
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| a\\|b | 1 | 2 | PASS |"


# --- the plan and its skip rule, on a fake clock -------------------------------------------------

class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def advance(self, seconds, **row):
        self.t += seconds
        return dict(row, ran=True)


def runner(gc, deadline_s=None):
    clock = FakeClock()
    run = gc["Runner"](dict(meta={}), None, deadline_s, clock=clock, alarm=False, quiet=True)
    return run, clock


def rows_of(clock, costs):
    """A stage function whose rows (name, kind, seconds) each advance the fake clock so much."""
    def stage(ctx):
        for name, kind, sec in costs:
            ctx.row(name, lambda sec=sec: clock.advance(sec), kind)
    return stage


def test_the_plan_fits_360_s_in_order_and_the_docs_say_so(gc):
    plan = gc["PLAN"]
    assert [s.name for s in plan] == ["copy", "gate", "decode", "serving", "prefill", "checkpoint",
                                      "e2e", "transformers", "chunk_sweep", "scan_cost", "e2e_b16"]
    assert gc["PLAN_S"] == sum(s.budget_s for s in plan) <= 360
    # the module docstring's table is the plan's (one source of truth, checked)
    table = re.findall(r"^  (\w+) +(\d+) s  ", gc["__doc__"], re.MULTILINE)
    doc = {name: float(sec) for name, sec in table}
    assert doc == {s.name: s.budget_s for s in plan}
    # the wrapper's deadline is the plan's, and its hard stop comes after it
    sh = (SCRIPTS / "gpu_check.sh").read_text()
    assert "GPU_CHECK_DEADLINE_S=${GPU_CHECK_DEADLINE_S:-360}" in sh
    assert "TOTAL_S=${GPU_CHECK_TIMEOUT_S:-$((GPU_CHECK_DEADLINE_S + 30))}" in sh


def test_the_plan_runs_in_order_and_stops_in_order_on_a_tiny_budget(gc):
    # A 60 s deadline instead of 360: copy takes 2 s; the gate's rows take 4 s each, so it runs 14
    # of them in its 58 s and skips the rest by their measured cost; every later stage is skipped
    # in plan order ("no time left"), none started.
    run, clock = runner(gc, deadline_s=60)
    funcs = {s.name: rows_of(clock, [(f"{s.name} row", s.name, 1.0)]) for s in gc["PLAN"]}
    funcs["copy"] = rows_of(clock, [("copy", "copy", 2.0)])
    funcs["gate"] = rows_of(clock, [(f"case {i}", "paged", 4.0) for i in range(20)])
    gc["run_plan"](run, funcs)
    st = run.results["stages"]
    assert list(st) == [s.name for s in gc["PLAN"]]
    assert st["copy"]["status"] == "ok" and st["gate"]["status"] == "ok"
    gate = st["gate"]["rows"]
    assert [r["status"] for r in gate.values()] == ["ok"] * 14 + ["skipped"] * 6
    assert gate["case 14"]["reason"] == "skipped: its measured cost 4.0 s > the 2.0 s left"
    assert st["gate"]["allowance_s"] == 58.0  # its 90 s cut to what the deadline leaves
    later = [st[s.name] for s in gc["PLAN"][2:]]
    assert all(r["status"] == "skipped" and r["error"].startswith("no time left") for r in later)
    assert all("rows" not in r or not r["rows"] for r in later)
    assert run.results["meta"]["not_ok"] == [s.name for s in gc["PLAN"][2:]]


def test_a_row_is_skipped_only_by_its_own_measured_cost(gc):
    # The decode stage's 40 s: each length's program costs what compiling it costs (10 s, whatever
    # the context), so the 128K row runs where a rule scaling the 8K row's time by the context would
    # have skipped it; the cuDNN row after it (4.5 s measured) does not fit the 1 s left.
    run, clock = runner(gc)
    costs = []
    for s in ("8K", "32K", "128K"):
        costs += [(f"paged {s}", "paged", 10.0), (f"cudnn {s}", "cudnn", 4.5)]
    run.stage("decode", rows_of(clock, costs))
    rows = run.results["stages"]["decode"]["rows"]
    assert [rows[n]["status"] for n, _, _ in costs] == ["ok"] * 5 + ["skipped"]
    assert rows["cudnn 128K"]["reason"] == "skipped: its measured cost 4.5 s > the 1.0 s left"
    assert rows["paged 128K"]["seconds"] == 10.0


def test_a_budget_given_replaces_the_plans_and_the_deadline_still_holds(gc):
    clock = FakeClock()
    run = gc["Runner"](dict(meta={}), None, 200, clock=clock, alarm=False, quiet=True,
                       budgets=gc["parse_budgets"](["gate=300"]))
    rec = run.stage("gate", rows_of(clock, [(f"case {i}", "paged", 50.0) for i in range(6)]))
    assert (rec["budget_s"], rec["allowance_s"]) == (300.0, 200.0)
    assert [r["status"] for r in rec["rows"].values()] == ["ok"] * 4 + ["skipped"] * 2


def test_unused_time_carries_to_the_next_stage_and_a_measured_cost_skips_a_rerun(gc):
    run, clock = runner(gc)
    run.stage("copy", rows_of(clock, [("copy", "copy", 5.0)]))  # 10 s of its 15 unused

    def e2e(ctx):
        first = ctx.row("first run", lambda: clock.advance(50, compile_s=5))
        ctx.row("warm run", lambda: dict(ran=True), "warm", cost=first["seconds"] - 5)

    rec = run.stage("e2e", e2e)
    assert rec["allowance_s"] == 70.0  # 60 s + the copy stage's 10
    assert rec["rows"]["warm run"]["reason"] == (
        "skipped: its measured cost 45.0 s > the 20.0 s left")


def test_failures_are_recorded_and_the_run_goes_on(gc):
    run, _ = runner(gc)

    def bad_row(ctx):
        ctx.row("compiles", lambda: 1 / 0)
        ctx.row("after it", lambda: dict(ran=True))

    def no_model(ctx):
        raise gc["NotRun"]("no checkpoint (its stage did not finish)")

    def broken(ctx):
        raise RuntimeError("\n  out of memory\nmore")

    gc["run_plan"](run, dict(copy=bad_row, e2e=no_model, gate=broken))
    st = run.results["stages"]
    assert st["copy"]["rows"]["compiles"] == dict(kind="copy", status="failed", seconds=0.0,
                                                  error="ZeroDivisionError: division by zero")
    assert st["copy"]["rows"]["after it"]["status"] == "ok" and st["copy"]["status"] == "ok"
    assert (st["gate"]["status"], st["gate"]["error"]) == ("failed", "RuntimeError: out of memory")
    assert (st["e2e"]["status"], st["e2e"]["error"]) == (
        "skipped", "no checkpoint (its stage did not finish)")
    assert list(st) == ["copy", "gate", "e2e"]  # in plan order, whatever the order funcs were given


# --- the correctness gate, in Pallas' interpreter ------------------------------------------------

@pytest.fixture(scope="module")
def gate_mod():
    sys.path.insert(0, str(SCRIPTS))
    import gpu_gate

    return gpu_gate


GATE_CASES = ["ragged mixed page 64", "int8 paged decode page 64", "mla 128 heads decode page 64",
              "paged decode 8 splits"]


def run_gate(gc, gate_mod, kernels, names):
    """The named cases of the tiny gate, through the check's own row runner (real clock)."""
    run = gc["Runner"](dict(meta={}), None, 3600, alarm=False, quiet=True)
    return run.stage("gate", lambda ctx: gate_mod.gate(ctx.row, ctx.rec, kernels, tiny=True,
                                                       names=names))


def test_the_gate_runs_in_the_interpreter_and_passes(gc, gate_mod):
    # The serving paths (ragged mixed step, 8-bit pages, MLA at 128 heads, several KV splits) in the
    # interpreter at tiny shapes: each compiled and run with its time apart, within its bound.
    rec = run_gate(gc, gate_mod, gate_mod.INTERPRET_KERNELS, GATE_CASES)
    assert (rec["planned"], rec["passed"], rec["failures"], rec["verdict"]) == (4, 4, [], True)
    for name in GATE_CASES:
        r = rec["rows"][f"pallas_interpret: {name}"]
        assert r["passed"] and r["problem"] is None and r["compile_s"] > 0 and r["run_s"] > 0
        assert 0 < max(r["o_err"], r["lse_err"]) <= r["bound"] == gate_mod.BOUNDS[r["dtype"]]
    assert gate_mod.BOUNDS == {"float32": 1e-5, "bfloat16": 2e-2}


def test_the_gate_fails_when_a_kernel_is_wrong(gc, gate_mod, monkeypatch):
    # The Pallas kernel with its softmax in the wrong base (e instead of 2: LOG2E = 1): every case
    # fails, each failure named with its error and bound; the verdict is a fail.
    from pallas_kernels.attention import triton

    monkeypatch.setattr(triton, "LOG2E", 1.0)
    names = ["paged decode page 64", "dense decode 1 split"]
    rec = run_gate(gc, gate_mod, gate_mod.INTERPRET_KERNELS, names)
    assert (rec["planned"], rec["passed"], rec["verdict"]) == (2, 0, False)
    failed = [f.split(": o error")[0] for f in rec["failures"]]
    assert failed == [f"pallas_interpret: {n}" for n in names]
    assert rec["failures"][1].endswith("> 1e-05") and rec["failures"][0].endswith("> 0.02")
    row = gc["gate_row"](rec)
    assert row[1].startswith("0/2 cases pass; pallas_interpret: paged decode page 64: o error")
    assert row[3] == "FAIL"


def test_the_gate_table_takes_a_backend_in_one_line(gc, gate_mod):
    # A required backend the registry lacks fails the gate; an optional one is listed as absent.
    # The entry's paths choose its cases, and cases with the Pallas kernel's options go to kernels
    # taking them only.
    kernels = (gate_mod.Kernel("pallas_interpret", ("dense",), options=False),
               gate_mod.Kernel("not_a_backend", ("chunk",), required=False),
               gate_mod.Kernel("mosaic_gpu_someday", gate_mod.PATHS))
    names = ["dense decode", "dense decode 8 splits", "chunk causal 16"]
    rec = run_gate(gc, gate_mod, kernels, names)
    assert rec["kernels"] == {"pallas_interpret": 1,
                              "not_a_backend": "absent from pallas_kernels' registry",
                              "mosaic_gpu_someday": "absent from pallas_kernels' registry"}
    assert list(rec["rows"]) == ["pallas_interpret: dense decode"] and rec["passed"] == 1
    assert rec["failures"] == ["mosaic_gpu_someday: absent from pallas_kernels' registry"]
    assert not rec["verdict"]


@pytest.mark.parametrize("name", ["ragged mixed page 64", "mla 128 heads decode page 64",
                                  "dense interleaved head dim 80"])
def test_the_gates_device_cases_lower_for_cuda(gate_mod, name):
    # The gate's device-sized cases as the GPU run builds them (impl "pallas"), exported for CUDA on
    # this CPU: the Pallas kernel lowers to Triton for each (head dims, page blocks, shared memory).
    import jax
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    case = next(c for c in gate_mod.cases() if c.name == name)
    build = gate_mod.ragged_call if case.q_lens else gate_mod.batched_call
    fn, args, _, _ = build(case, "pallas")
    spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    gpu = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"))
    triton = "__gpu$xla.gpu.triton"
    with jax.sharding.use_abstract_mesh(gpu):
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call(triton)])(*spec)
    assert triton in exported.mlir_module()


def test_the_gate_covers_every_path_and_the_issue_shapes(gate_mod):
    device = gate_mod.cases()
    assert {c.path for c in device} == set(gate_mod.PATHS)
    assert len({c.name for c in device}) == len(device)
    assert {c.heads for c in device if c.dk == 576} == {16, 64, 128}
    assert all(c.dv == 512 and c.shared_v for c in device if c.dk == 576)
    assert {c.page for c in device} == {0, 16, 64, 128}
    assert {c.quant for c in device} == {None, "int8", "fp8"}
    assert {c.dtype for c in device} == {"float32", "bfloat16"}
    assert {dict(c.options).get("num_splits") for c in device} == {None, 1, 8}
    assert any(c.q_lens and set(c.q_lens) == {0, 1} for c in device)  # ragged decode-only
    assert any(c.q_lens and max(c.q_lens) >= 256 for c in device)  # a chunk in the long-tile group
    assert any(c.t == 5 and c.path == "verify" for c in device)
    assert all(0 in c.lengths or 0 in c.q_lens or c.path == "chunk" for c in device)  # empty rows
    assert all(c.dk % 16 == 0 and c.dv % 16 == 0 for c in device)  # the compiled kernel's dims
    for c in device + gate_mod.cases(tiny=True):
        assert c.slots % max(c.page, 1) == 0
        assert all(q <= n for q, n in zip(c.q_lens, c.lengths))


# --- the report ----------------------------------------------------------------------------------

SAMPLE = dict(
    meta=dict(device_kind="NVIDIA H200", jax_version="0.11.2", elapsed_s=340, not_ok=["e2e_b16"]),
    stages=dict(
        copy=dict(status="ok", copy_gbs=4280.0, copy_best="jit a.copy()"),
        gate=dict(status="ok", planned=33, passed=33, failures=[], not_run=[], verdict=True),
        decode=dict(status="ok", lengths=[8192, 32768, 131072], rows={
            "paged 8K": dict(ms=0.1, gbs=2600.0, fraction_of_copy=0.61),
            "cudnn 8K": dict(ms=0.12),
            "paged 32K": dict(ms=0.3, gbs=3600.0, fraction_of_copy=0.84),
            "cudnn 32K": dict(ms=0.28),
            "paged 128K": dict(status="skipped",
                               reason="skipped: its measured cost 9.0 s > the 2.0 s left"),
            "fp8 paged 128K": dict(ms=0.5, vs_bf16=0.55),
        }),
        serving=dict(status="ok", keys=32768, chunk=512, rows={
            "paged decode": dict(ms=0.3), "ragged decode-only": dict(ms=0.306, vs_paged=1.02),
            "ragged mixed": dict(ms=0.5, vs_paged_decode_plus_chunk=1.1),
            "int8 pages": dict(ms=0.17, vs_bf16=0.57, bytes_vs_bf16=0.52),
            "fp8 pages": dict(ms=0.4, vs_bf16=1.34, bytes_vs_bf16=0.52),
            "verify 5": dict(ms=0.36, vs_decode=1.2),
            "ragged mixed split": dict(ms=0.45, vs_unsplit=0.9),
            "mla 128 heads 32K": dict(ms=1.2, gbs=400.0, tflops=100.0, fraction_of_copy=0.09,
                                      fraction_of_tensor_peak=0.1, query_blocks=2),
            "mla 64 heads 32K fp8": dict(ms=0.5, gbs=500.0, tflops=80.0, fraction_of_copy=0.1,
                                         fraction_of_tensor_peak=0.08, query_blocks=1)}),
        prefill=dict(status="ok", rows={
            "pallas 2K": dict(ms=0.2, tflops=300.0),
            "jax.nn cudnn 2K": dict(ms=0.1, tflops=600.0)}),
        e2e=dict(status="ok", headline="warm run", rows={"warm run": dict(
            batch=4, prompt_len=32768, ttft_s=1.2, decode_tokens_per_s=1300.0,
            roofline_tokens_per_s=1800.0, roofline_fraction=0.72)}),
        transformers=dict(status="ok", rows={"batch 4": dict(ttft_s=1.3, decode_tokens_per_s=77.0)},
                          greedy_match=dict(row0=64, compared=64, rows=4, rows_equal=4)),
        e2e_b16=dict(status="skipped", error="no time left (2 s)"),
    ),
)


def test_headline_rows_verdicts(gc):
    rows = {r[0]: r[1:] for r in gc["headline_rows"](SAMPLE)}
    assert rows["correctness gate: every kernel path vs float64"] == (
        "33/33 cases pass", "all pass", "PASS")
    assert rows["decode kernel 8K keys: of copy; cuDNN"][2] == "—"  # 8K: reported, no target
    assert rows["decode kernel 32K keys: of copy; cuDNN"] == (
        "84% (3600 GB/s, 0.300 ms); cuDNN 0.280 ms (0.93x the kernel's speed)", "≥ 85% of copy",
        "FAIL")
    assert rows["decode kernel 128K keys: of copy; cuDNN"][0] == (
        "skipped: skipped: its measured cost 9.0 s > the 2.0 s left")
    assert rows["ragged decode-only / paged decode, 32K"] == ("1.02x (0.306 ms)", "≤ 1.05x", "PASS")
    assert rows["int8 pages / bf16 pages, paged decode 32K"][2] == "PASS"
    assert rows["fp8 pages / bf16 pages, paged decode 32K"] == (
        "1.34x (0.400 ms, 0.52x the bytes)", "≤ 0.6x", "FAIL")
    assert rows["verify step (5 queries) / 1 query, 32K"][0] == "1.20x (0.360 ms)"
    assert rows["fp8 pages / bf16, decode 128K keys"] == ("0.55x (0.500 ms)", "≤ 0.6x", "PASS")
    assert rows["ragged mixed, diagonal blocks split off (cuDNN) / unsplit, 32K"][0] == (
        "0.90x (0.450 ms)")
    assert rows["MLA decode, 128 heads 32K: of copy / of tensor peak"] == (
        "9% / 10% (400 GB/s, 100 TFLOP/s, 1.200 ms)", "≥ 70% of copy or ≥ 50% of peak", "FAIL")
    assert rows["MLA decode, 64 heads 32K fp8: of copy / of tensor peak"][1:] == ("report", "—")
    assert rows["prefill pallas 2K, causal chunk"][0] == (
        "0.20 ms (300 TFLOP/s); cuDNN 0.10 ms (600 TFLOP/s)")
    assert rows["e2e decode batch 4 x 32K: of the roofline"] == (
        "1300 tok/s = 72% of 1800; transformers 77 tok/s", "≥ 70%", "PASS")
    assert rows["TTFT batch 4 x 32K: ours vs transformers"] == (
        "1.20 s vs 1.30 s", "≤ transformers'", "PASS")
    assert rows["extra: e2e decode batch 16 x 32K: of the roofline"][0] == (
        "skipped: no time left (2 s)")


def test_the_gate_row_lists_every_failure(gc):
    fails = [f"pallas: case {i}: o error 3.00e-01, lse error 1.00e-02 > 0.02" for i in range(7)]
    row = gc["gate_row"](dict(planned=33, passed=25, failures=fails, not_run=["x"], verdict=False))
    assert row[1].startswith("25/33 cases pass; 1 not run; pallas: case 0: o error")
    assert all(f"case {i}:" in row[1] for i in range(5)) and "+2 more failures" in row[1]
    assert row[3] == "FAIL"


def test_headline_rows_survive_an_empty_run(gc):
    rows = gc["headline_rows"](dict(meta={}, stages={}))
    assert all(len(r) == 4 for r in rows)
    assert rows[0][1:] == ("not run", "all pass", "—")


def test_report_prints_the_table_last(gc, tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(SAMPLE))
    assert gc["main"](["--report", str(path), "--print-json"]) == 0
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[0] == "{"
    assert any(line == "## GPU check: NVIDIA H200, jax 0.11.2, 340 s; not ok: e2e_b16 (skipped)"
               for line in out)
    table = out[-(len(gc["headline_rows"](SAMPLE)) + 2):]
    assert table[0] == "| metric | measured | target | verdict |"
    assert all(line.startswith("| ") and line.endswith(" |") for line in table[2:])


def test_sweep_space_and_best(sk):
    assert len(sk["space"]("decode")) == 5 * 3 * 2
    assert len(sk["space"]("prefill")) == 3 * 4 * 2 * 2
    a, b = dict(block_k=64, num_stages=2, num_warps=4), dict(block_k=128, num_stages=3, num_warps=4)
    c = dict(block_k=256, num_stages=5, num_warps=8)
    results = [
        dict(shape="decode 32K", options="default", ms=1.0),
        dict(shape="decode 32K", options=a, ms=1.0), dict(shape="decode 32K", options=b, ms=1.1),
        dict(shape="decode 128K", options=a, ms=5.0), dict(shape="decode 128K", options=b, ms=4.0),
        dict(shape="decode 128K", options=c, ms=1.0),  # 128K only
        dict(shape="decode 32K", options=c, error="out of resource"),
    ]
    # a: 1.0 and 5.0 -> geomean of (1, 5) = 2.24; b: (1.1, 4.0) -> 2.10
    assert sk["best_config"](results) == b
    table = sk["format_table"](results)
    assert table.splitlines()[2].startswith("| decode 128K | block_k=256")
    assert "out of resource" in table


def test_sweep_rows_paste_into_configs(sk):
    from pallas_kernels.attention.configs import KernelConfig

    row = sk["table_row"]("decode", dict(block_k=128, num_stages=4, num_warps=8), block_q=64)
    assert row == ('("decode", 128): KernelConfig(block_q=64, block_k=128, num_warps=8, '
                   'num_stages=4),')
    # the row is our own text: eval is safe
    key, cfg = eval("{" + row + "}", {"KernelConfig": KernelConfig}).popitem()  # noqa: S307
    assert key == ("decode", 128)
    assert cfg == KernelConfig(block_q=64, block_k=128, num_warps=8, num_stages=4)
    row = sk["table_row"]("prefill", dict(block_q=128, block_k=64, num_stages=2, num_warps=4),
                          block_q=64)
    assert re.search(r"block_q=128, block_k=64, num_warps=4, num_stages=2", row)


def test_sweep_skips_blocks_past_the_page_or_shared_memory(sk):
    skip = sk["skip_reason"]
    assert skip(dict(block_k=128, num_stages=2, num_warps=4), "decode", "d128", 64, 4).startswith(
        "skipped: block_k 128 > page 64")
    assert skip(dict(block_k=64, num_stages=2, num_warps=4), "decode", "d128", 64, 4) is None
    # MLA prefill: 128 query rows × 576 plus 4 stages of 128 latent rows cannot fit one block
    assert "shared memory" in skip(dict(block_q=128, block_k=128, num_stages=3, num_warps=8),
                                   "prefill", "mla", 128, 4096)
    assert [sk["table_bucket"](c) for c in ("d64", "d128", "d256", "mla")] == [64, 128, 256, 1024]


def test_sweep_says_when_larger_pages_win(sk):
    a, b = dict(block_k=64, num_stages=2, num_warps=4), dict(block_k=128, num_stages=2, num_warps=4)
    rows = [dict(phase="decode", case="d128", page=64, options=a, ms=1.0),
            dict(phase="decode", case="d128", page=128, options=b, ms=0.8)]
    assert "page 128 (KV blocks up to 128) is 1.25x faster than page 64" in sk["larger_pages"](
        rows, "decode", "d128")
    rows[1]["ms"] = 1.1
    assert sk["larger_pages"](rows, "decode", "d128") is None


def test_sweep_runs_the_paged_kernel_on_the_interpreter(sk):
    # One small MLA decode shape through the sweep's own path: the default config and two swept
    # ones run the paged kernel (values shared with the keys) and agree; one past the page is
    # skipped.
    args, fn, nbytes, _ = sk["paged_inputs"]("mla", "decode", 16, 64, 16, batch=1)
    assert args[1].shape == (4, 1, 16, 576) and args[2] is None and nbytes == args[1].nbytes
    results = []
    opts = [dict(block_k=16, num_stages=2, num_warps=8),
            dict(block_k=32, num_stages=2, num_warps=4)]
    sk["sweep_shape"]("decode mla", "decode", "mla", 16, args, fn, opts, float("inf"), lambda s: "",
                      results, impl="pallas_interpret")
    assert [r.get("error", "")[:7] for r in results] == ["", "", "skipped"]
    assert results[1]["ms"] > 0 and results[1]["max_abs_diff_vs_default"] < 1e-2
