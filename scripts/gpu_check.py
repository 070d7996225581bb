"""The GPU check: one prepared run on a machine with one NVIDIA GPU that fits one device call.

The plan (`PLAN`), most important first. Each stage has a budget the check enforces: a stage gets
its own budget plus what the stages before it left unused, never past the run's deadline, and the
budgets add up to that deadline, 360 s (scripts/gpu_check.sh stops the process at 390 s):

  stage        budget  what it measures
  copy           15 s  (a) the device copy ceiling: the fastest real copy of 1 GiB of a few ways
  gate           90 s  (b) the correctness gate (scripts/gpu_gate.py): every kernel path the
                       engine can take, compiled for the device, against float64, with bounds
  decode         40 s  (c) the paged decode kernel against cuDNN and the copy ceiling, 8K-128K keys;
                       fp8 and int8 pages against bf16 at 128K
  serving        40 s  (d) at 32K keys: the ragged step decode-only (against the paged kernel) and
                       mixed (its diagonal blocks split off to cuDNN, and not), int8 and fp8
                       pages, a verify step, MLA decode at 128 and 64 heads over 32K and 8K keys
                       (bf16 and fp8 latent: of copy and of the tensor-core peak)
  prefill        25 s  (e) the prefill kernels against cuDNN, causal chunks of 2K and 8K
  checkpoint     30 s  (f) a random-weight 1.1B Llama written by transformers (subprocess)
  e2e            60 s  (f) dcp_jax at batch 4 x 32K: TTFT, decode tokens/s against the roofline
  transformers   35 s  (f) transformers on the same prompts: TTFT, decode tokens/s, tokens compared
  chunk_sweep    10 s  extra: TTFT at prefill chunks 4096 and 1024
  scan_cost       5 s  extra: decode with the layers scanned against one stack per layer
  e2e_b16        10 s  extra: dcp_jax at batch 16 x 32K

Rows. A stage is a list of rows, each one compiled program (or one subprocess) whose compile and
run are timed apart. A row is skipped only when its own measured cost does not fit what is left of
its stage: the largest cost measured so far for rows of its kind (the same program at another
length or shape: compiling dominates, and compiling does not grow with the context), or a cost its
stage measured for it (a warm rerun: the cold run less its compile). A row of a kind not yet
measured runs when a second is left. A stage still running 10 s past its allowance is interrupted
(SIGALRM); stages past the deadline are listed as not run, in order. `--budget gate=300` gives a
stage more: a rerun of one that ran out of time, `--stages gate --budget gate=300 --deadline-s 300`.

The raw results go to a JSON file (`--out`), rewritten after every row; `--report FILE` prints it
and, last, the table of headline figures against their targets. scripts/gpu_check.sh does both.
Commit a run's JSON under docs/gpu/ beside the table it fills (docs/PERFORMANCE.md).
`--interpret`: on a CPU, the kernel stages at tiny shapes in Pallas' interpreter (to work on this
script; no figure means anything there). Internal modes (subprocesses): `--make-checkpoint`,
`--hf-peer`; torch and transformers are imported only there.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = ("no GPU: run on a GPU machine (scripts/gpu_check.sh installs the cuda extra when "
          "python3's jax sees none), or pass --interpret to run the kernel stages on this CPU")

# A Llama of 1.1B parameters (TinyLlama's shape): hidden 2048, 16 layers, 32 q / 8 kv heads of 64.
LLAMA_1B = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=65536,
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    initializer_range=0.02,
)


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    budget_s: float
    what: str


PLAN = (
    Stage("copy", 15, "(a) the device copy ceiling"),
    Stage("gate", 90, "(b) the correctness gate: every kernel path against float64"),
    Stage("decode", 40, "(c) the paged decode kernel vs cuDNN and the copy ceiling, 8K/32K/128K"),
    Stage("serving", 40, "(d) at 32K: ragged decode-only and mixed, 8-bit pages, verify, MLA"),
    Stage("prefill", 25, "(e) the prefill kernels vs cuDNN, 2K and 8K chunks"),
    Stage("checkpoint", 30, "(f) a random 1.1B Llama written by transformers"),
    Stage("e2e", 60, "(f) dcp_jax at batch 4 x 32K"),
    Stage("transformers", 35, "(f) transformers at batch 4 x 32K, tokens compared"),
    Stage("chunk_sweep", 10, "extra: TTFT at prefill chunks 4096 and 1024"),
    Stage("scan_cost", 5, "extra: layers scanned vs one stack per layer"),
    Stage("e2e_b16", 10, "extra: dcp_jax at batch 16 x 32K"),
)
PLAN_S = sum(s.budget_s for s in PLAN)  # the run's deadline
BUDGETS = {s.name: s.budget_s for s in PLAN}
MIN_STAGE_S = 3.0  # a stage allowed less is not started
MIN_ROW_S = 1.0  # a row of a kind not yet measured starts only with this much left
GRACE_S = 10  # a stage still running this long past its allowance is interrupted

TARGET_COPY_FRACTION = 0.85  # the decode kernel, at TARGET_FROM keys and more
TARGET_FROM = 32768
TARGET_RAGGED_VS_PAGED = 1.05
TARGET_8BIT_VS_BF16 = 0.6
TARGET_ROOFLINE = 0.70
TARGET_MLA_COPY, TARGET_MLA_TENSOR = 0.70, 0.50  # MLA decode, 128 heads at 32K: either bound
PLAUSIBLE_MAX_COPY_GBS = 6000.0  # faster (read + write) is no copy: an H200's HBM peaks at 4.8 TB/s


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes of the kernel stages: the device's, or TINY (--interpret, on a CPU)."""

    impl: str = "pallas"
    gpu: bool = True
    copy_bytes: int = 1 << 30
    decode_lengths: tuple[int, ...] = (8192, 32768, 131072)
    batch: int = 8
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page: int = 64
    serving_keys: int = 32768
    chunk: int = 512  # the prefill chunk of the ragged mixed step
    verify: int = 5  # query tokens of the verify step (k + 1)
    mla_heads: int = 128
    prefill_chunks: tuple[int, ...] = (2048, 8192)
    prompt_len: int = 32768
    batch_e2e: int = 4
    new_tokens: int = 64
    prefill_chunk: int = 2048


TINY = Sizes(impl="pallas_interpret", gpu=False, copy_bytes=1 << 20, decode_lengths=(64, 128),
             batch=2, heads=4, kv_heads=2, head_dim=16, page=16, serving_keys=64, chunk=16,
             prefill_chunks=(32, 64))


# =================================================================================================
# Pure helpers (no jax, no torch): tested on CPU by tests/test_gpu_scripts.py
# =================================================================================================

def llama_param_count(cfg: dict) -> int:
    """Parameters of a Llama-style decoder from its config alone (no weights built)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    embed = cfg["vocab_size"] * h
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h  # q, k, v, o (no biases)
    per_layer = attn + 3 * h * inter + 2 * h  # + gate, up, down; + the two RMSNorm weights
    head = 0 if cfg.get("tie_word_embeddings") else embed
    return embed + layers * per_layer + h + head  # + final norm


def kv_bytes_per_step(cfg: dict, batch: int, context: float, itemsize: int = 2) -> float:
    """KV bytes one decode step reads: batch x context x layers x 2 x kv heads x head dim x item."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * hd * itemsize
    return batch * context * per_token


def weight_bytes_per_step(cfg: dict, itemsize: int = 2) -> int:
    """Weight bytes one decode step reads: every parameter except the input embedding table (a step
    gathers only `batch` of its rows); a tied table is read once, as the LM head."""
    params = llama_param_count(cfg)
    if not cfg.get("tie_word_embeddings"):
        params -= cfg["vocab_size"] * cfg["hidden_size"]
    return params * itemsize


def decode_roofline(cfg: dict, batch: int, prompt_len: int, new_tokens: int, copy_gbs: float,
                    itemsize: int = 2) -> dict:
    """Tokens/s if a decode step moved its bytes at the copy ceiling. The context averages over the
    decode: prompt + new_tokens / 2. tokens/s = batch / (bytes per step / copy bandwidth)."""
    w = weight_bytes_per_step(cfg, itemsize)
    kv = kv_bytes_per_step(cfg, batch, prompt_len + new_tokens / 2, itemsize)
    step_s = (w + kv) / (copy_gbs * 1e9)
    return dict(weight_bytes=w, kv_bytes=kv, bytes_per_step=w + kv, step_s=step_s,
                tokens_per_s=batch / step_s)


def attention_flops(batch: int, heads: int, t: int, s: int, head_dim: int, causal: bool) -> float:
    """Matmul FLOPs of attention (QK^T and PV): 4·B·H·T·S·d, halved for a causal square block."""
    f = 4.0 * batch * heads * t * s * head_dim
    return f / 2 if causal else f


def prefix_match(a, b) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def greedy_match(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    pre = [prefix_match(a, b) for a, b in zip(ours, theirs)]
    return dict(row0=pre[0] if pre else 0, compared=len(theirs[0]) if theirs else 0, rows=len(pre),
                rows_equal=sum(1 for p, t in zip(pre, theirs) if p == len(t)), prefix_by_row=pre)


def first_line(e: BaseException | str) -> str:
    """The first non-empty line of an error message (XLA's errors run to pages), after its type."""
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    if isinstance(e, BaseException):
        line = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return line[:300] or "error"


def _k(n: int) -> str:
    """8192 -> "8K"; lengths under 1024 as they are."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


# =================================================================================================
# The run: stages in order under budgets, rows skipped by their measured cost (no jax)
# =================================================================================================

class StageTimeout(Exception):
    pass


class NotRun(Exception):
    """A stage that cannot run (what it needs is missing): recorded as skipped, with why."""


class Runner:
    """Runs the plan's stages in order; saves the results after every row (`out`). `clock` and
    `alarm` are for tests (a fake clock; no SIGALRM)."""

    def __init__(self, results: dict, out: Path | None = None, deadline_s: float | None = None,
                 clock=time.perf_counter, alarm: bool = True, quiet: bool = False,
                 budgets: dict | None = None):
        self.results, self.out, self.clock = results, out, clock
        self.alarm, self.quiet = alarm, quiet
        self.budgets = dict(BUDGETS, **(budgets or {}))  # `--budget` overrides the plan's
        results.setdefault("meta", {})
        results.setdefault("stages", {})
        self.t0 = clock()
        self.deadline = self.t0 + (PLAN_S if deadline_s is None else deadline_s)
        self.bank = 0.0  # seconds earlier stages left unused (negative: they ran over)
        self.costs: dict[str, float] = {}  # row kind -> the largest seconds a row of it took

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = round(self.clock() - self.t0, 1)
        if self.out is not None:
            tmp = self.out.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.results, indent=1, default=str))
            tmp.replace(self.out)

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.clock() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def stage(self, name: str, fn) -> dict:
        """Run fn(StageRun) as stage `name` within its allowance: its budget plus the bank, never
        past the deadline."""
        rec = self.results["stages"].setdefault(name, {})
        start = self.clock()
        allowance = min(self.budgets[name] + self.bank, self.deadline - start)
        rec.update(budget_s=self.budgets[name], allowance_s=round(allowance, 1),
                   started_s=round(start - self.t0, 1))
        if allowance < MIN_STAGE_S:
            rec.update(status="skipped", error=f"no time left ({max(allowance, 0):.0f} s)")
            self.log(f"{name}: skipped, {rec['error']}")
            self.save()
            return rec
        self.log(f"{name}: start ({allowance:.0f} s)")
        run = StageRun(self, name, rec, start + allowance)
        old = self._arm(name, allowance)
        try:
            fn(run)
            rec["status"] = "ok"
        except NotRun as e:
            rec.update(status="skipped", error=str(e))
        except StageTimeout as e:
            rec.update(status="timeout", error=str(e))
        except Exception as e:  # noqa: BLE001 - every failure is recorded, the run goes on
            rec.update(status="failed", error=first_line(e),
                       traceback_tail=traceback.format_exc().strip().splitlines()[-4:])
        finally:
            self._disarm(old)
        rec["seconds"] = round(self.clock() - start, 1)
        self.bank = run.t_end - self.clock()
        self.log(f"{name}: {rec['status']} in {rec['seconds']} s"
                 + (f" ({rec['error']})" if rec.get("error") else ""))
        self.save()
        return rec

    def _arm(self, name: str, allowance: float):
        if not self.alarm:
            return None

        def on_alarm(signum, frame):
            raise StageTimeout(f"stage {name} ran {GRACE_S} s past its {allowance:.0f} s")

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(max(1, int(allowance + GRACE_S)))
        return old

    def _disarm(self, old) -> None:
        if self.alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


class StageRun:
    """One stage's view of the run: its rows, what is left of it, the results so far."""

    def __init__(self, runner: Runner, name: str, rec: dict, t_end: float):
        self.runner, self.name, self.rec, self.t_end = runner, name, rec, t_end
        self.rows: dict[str, dict] = rec.setdefault("rows", {})

    def left(self) -> float:
        return min(self.t_end, self.runner.deadline) - self.runner.clock()

    def stage(self, name: str) -> dict:
        """An earlier stage's record (empty when it did not run)."""
        return self.runner.results["stages"].get(name, {})

    def skip(self, name: str, reason: str, kind: str | None = None) -> dict:
        row = self.rows[name] = dict(kind=kind or self.name, status="skipped", reason=reason)
        self.runner.log(f"  {name}: {reason}")
        self.runner.save()
        return row

    def row(self, name: str, fn, kind: str | None = None, cost: float | None = None) -> dict:
        """Run fn() -> dict as row `name` unless its cost does not fit what is left: `cost` when the
        caller measured it, else the largest measured for rows of `kind` (default: the stage's). The
        row's record: fn's dict, status (ok / failed / skipped / interrupted) and seconds."""
        kind = kind or self.name
        key = f"{self.name}/{kind}"
        known = self.runner.costs.get(key) if cost is None else cost
        left = self.left()
        if left < MIN_ROW_S:
            return self.skip(name, f"skipped: {max(left, 0):.1f} s left in the stage", kind)
        if known is not None and known > left:
            return self.skip(name, f"skipped: its measured cost {known:.1f} s > the {left:.1f} s "
                             "left", kind)
        row = self.rows[name] = dict(kind=kind)
        t = self.runner.clock()
        try:
            row.update(fn() or {})
            row["status"] = "ok"
        except StageTimeout:
            row.update(status="interrupted", seconds=round(self.runner.clock() - t, 3))
            raise
        except Exception as e:  # noqa: BLE001 - a row's failure is recorded; the stage goes on
            row.update(status="failed", error=first_line(e))
        took = self.runner.clock() - t
        row["seconds"] = round(took, 3)
        self.runner.costs[key] = max(self.runner.costs.get(key, 0.0), took)
        self.runner.log(f"  {name}: {row['status']} in {took:.1f} s"
                        + (f" ({row['error']})" if row.get("error") else ""))
        self.runner.save()
        return row


def run_plan(runner: Runner, funcs: dict, wanted=None) -> None:
    """Every stage of PLAN in order that `funcs` has and `wanted` (None: all) names."""
    for stage in PLAN:
        if stage.name in funcs and (wanted is None or stage.name in wanted):
            runner.stage(stage.name, funcs[stage.name])
    st = runner.results["stages"]
    runner.results["meta"]["not_ok"] = [n for n, r in st.items() if r.get("status") != "ok"]
    runner.save()


# =================================================================================================
# Device measurements (jax imported inside)
# =================================================================================================

def gate_module():
    """scripts/gpu_gate.py (the correctness gate; it imports jax and the kernels)."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_gate

    return gpu_gate


def bench(fn, *args, repeat: int = 7, target_s: float = 0.02, max_inner: int = 100) -> float:
    """Median seconds per call of a compiled fn. Each sample launches `inner` calls back to back and
    waits for the last (one device runs them in order), so dispatch overhead hides behind the device
    work of short kernels; no earlier output is held (a donated one may be gone)."""
    import jax

    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    single = time.perf_counter() - t
    inner = max(1, min(max_inner, int(target_s / max(single, 1e-6))))
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t) / inner)
        del out
    return statistics.median(samples)


def measure(fn, *args, repeat: int = 5, **jit_kw) -> dict:
    """fn compiled for the device, then timed: ms per call, compile_s and run_s apart. Host arrays
    (a ragged step's tiles come from NumPy) go to the device once, before: a timed call that took
    them from the host would time their transfers too (six small copies per call, which the first
    run's ragged decode-only row, 2.31x the paged kernel, probably included)."""
    import jax

    args = jax.device_put(args)
    exe, compile_s = gate_module().compile_apart(fn, *args, **jit_kw)
    t = time.perf_counter()
    sec = bench(exe, *args, repeat=repeat)
    run_s = time.perf_counter() - t
    return dict(ms=sec * 1e3, compile_s=round(compile_s, 3), run_s=round(run_s, 3))


def max_abs_diff(a, b) -> float:
    import jax.numpy as jnp

    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def _pointer(x):
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - not every array exposes one
        return None


def copy_candidates(x):
    """(name, fn, jitted) ways to copy x on the device; a jitted one is compiled apart."""
    import jax
    from jax import lax

    def device_put(a):
        try:
            return jax.device_put(a, may_alias=False)
        except TypeError:  # older signature
            return jax.device_put(a, donate=False)

    return [("jit a.copy()", lambda a: a.copy(), True), ("jit a * 1", lambda a: a * 1, True),
            ("device_put(a, may_alias=False)", device_put, False),
            ("dynamic_update_slice into a donated buffer",
             lambda dst, a: lax.dynamic_update_slice(dst, a, (0, 0)), True)]


def copy_row(name: str, fn, jitted: bool, x) -> dict:
    import jax.numpy as jnp

    row = dict(compile_s=0.0)
    if name.startswith("dynamic_update_slice"):  # an in-place write of all of x, the buffer donated
        exe, row["compile_s"] = gate_module().compile_apart(fn, x, x, donate_argnums=0)
        state = {"dst": jnp.zeros_like(x)}

        def call(a):
            state["dst"] = exe(state["dst"], a)
            return state["dst"]
    elif jitted:
        call, row["compile_s"] = gate_module().compile_apart(fn, x)
    else:
        call = fn
    out = call(x)
    elided = _pointer(out) is not None and _pointer(out) == _pointer(x)
    del out
    t = time.perf_counter()
    sec = bench(call, x, repeat=7, target_s=0.01, max_inner=6)
    row.update(run_s=round(time.perf_counter() - t, 3), ms=sec * 1e3, gbs=2 * x.nbytes / sec / 1e9,
               elided=elided)
    if elided or row["gbs"] > PLAUSIBLE_MAX_COPY_GBS:
        row["rejected"] = ("the output is the input (elided)" if elided
                           else "faster than HBM: no copy")
    return row


def stage_copy(ctx: StageRun, sz: Sizes) -> None:
    import jax
    import jax.numpy as jnp

    x = jax.random.uniform(jax.random.key(1), (sz.copy_bytes // 2048, 1024), jnp.bfloat16)
    jax.block_until_ready(x)
    ctx.rec["buffer_bytes"] = x.nbytes
    for name, fn, jitted in copy_candidates(x):
        ctx.row(name, functools.partial(copy_row, name, fn, jitted, x))
    valid = {n: r["gbs"] for n, r in ctx.rows.items() if "gbs" in r and "rejected" not in r}
    if not valid:
        raise RuntimeError("no copy candidate gave a plausible figure")
    ctx.rec["copy_best"] = max(valid, key=valid.get)
    ctx.rec["copy_gbs"] = valid[ctx.rec["copy_best"]]


def stage_gate(ctx: StageRun, kernels, tiny: bool) -> None:
    gate_module().gate(ctx.row, ctx.rec, kernels, tiny)
    if ctx.rec["not_run"]:
        ctx.rec["incomplete"] = f"{len(ctx.rec['not_run'])} of {ctx.rec['planned']} cases not run"


def _normal(key, shape, dtype="bfloat16"):
    import jax

    return jax.random.normal(jax.random.key(key), shape, dtype)


def paged_inputs(sz: Sizes, s: int, rows: int, width: int | None = None, kv_heads=None, seed=0):
    """A pool of `rows` sequences of s keys in pages of sz.page slots, in order: (k, v, table)."""
    import jax.numpy as jnp

    nb = s // sz.page
    shape = (rows * nb, kv_heads or sz.kv_heads, sz.page, width or sz.head_dim)
    k, v = _normal(seed + 1, shape), _normal(seed + 2, shape)
    return k, v, jnp.arange(rows * nb, dtype=jnp.int32).reshape(rows, nb)


def decode_queries(sz: Sizes, s: int, t: int = 1, heads=None, width=None, rows=None):
    """q [B, t, H, d] at the last t positions of s keys: (q, q_pos, kv_len)."""
    import jax.numpy as jnp

    b = rows or sz.batch
    q = _normal(7, (b, t, heads or sz.heads, width or sz.head_dim))
    q_pos = jnp.broadcast_to(jnp.arange(s - t, s, dtype=jnp.int32)[None], (b, t))
    return q, q_pos, jnp.full((b,), s, jnp.int32)


def paged_fn(impl: str, s: int, **kw):
    """(q, k, v, q_pos, kv_len, table) -> attention over a paged slice of s slots."""
    from pallas_kernels.attention import SlotPositions, attention

    pos = SlotPositions.dense(s)

    def fn(q, k, v, qp, kl, t):
        return attention(q, k, v, qp, pos, kl, impl=impl, block_table=t, **kw)

    return fn


def decode_paged_row(sz: Sizes, s: int, copy_gbs: float | None, kind: str | None = None,
                     rows: dict | None = None) -> dict:
    """The paged decode kernel over s keys (8-bit pages with `kind`; then also its time over the
    bf16 row's of the same length, from `rows`)."""
    from pallas_kernels.attention import kv_quant as kvq

    k, v, table = paged_inputs(sz, s, sz.batch)
    if kind is not None:
        k, v = kvq.pack(k, kind), kvq.pack(v, kind)
    q, q_pos, kv_len = decode_queries(sz, s)
    row = measure(paged_fn(sz.impl, s, **({"kv_quant": kind} if kind else {})), q, k, v, q_pos,
                  kv_len, table)
    row.update(keys=s, kv_bytes=k.nbytes + v.nbytes)
    if kind is not None and rows is not None:
        row["vs_bf16"] = _ratio(rows, row["ms"], f"paged {_k(s)}")
    row["gbs"] = row["kv_bytes"] / (row["ms"] / 1e3) / 1e9
    if copy_gbs:
        row["fraction_of_copy"] = row["gbs"] / copy_gbs
    return row


def cudnn_row(q, k, v, causal: bool) -> dict:
    """jax.nn.dot_product_attention through cuDNN: q [B,T,N,H], k/v [B,S,K,H]."""
    import jax

    fn = functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation="cudnn")
    return measure(fn, q, k, v)


def stage_decode(ctx: StageRun, sz: Sizes) -> None:
    copy_gbs = ctx.stage("copy").get("copy_gbs")
    ctx.rec.update(lengths=list(sz.decode_lengths), shape=(
        f"q [{sz.batch},1,{sz.heads},{sz.head_dim}] bf16; K/V {sz.kv_heads} heads in pages of "
        f"{sz.page}; cuDNN over [B,S,K,d]"))
    for s in sz.decode_lengths:
        ctx.row(f"paged {_k(s)}", functools.partial(decode_paged_row, sz, s, copy_gbs), "paged")
        if not sz.gpu:
            ctx.skip(f"cudnn {_k(s)}", "cuDNN: GPU only", "cudnn")
            continue

        def cudnn(s=s):
            shape = (sz.batch, s, sz.kv_heads, sz.head_dim)
            k, v = _normal(1, shape), _normal(2, shape)
            row = cudnn_row(decode_queries(sz, s)[0], k, v, False)
            return dict(row, keys=s, gbs=(k.nbytes + v.nbytes) / (row["ms"] / 1e3) / 1e9)

        ctx.row(f"cudnn {_k(s)}", cudnn, "cudnn")
    for kind in ("fp8", "int8"):  # 8-bit pages at the longest context, against its bf16 row
        s = sz.decode_lengths[-1]
        ctx.row(f"{kind} paged {_k(s)}", functools.partial(decode_paged_row, sz, s, copy_gbs, kind,
                                                            ctx.rows), "8-bit")


def ragged_fn(impl: str, s: int, **kw):
    """(q [N,H,d], k, v, q_pos [N], kv_len [R], table [R,NB], tiles) -> ragged_attention."""
    from pallas_kernels.attention import SlotPositions, ragged_attention

    pos = SlotPositions.dense(s)

    def fn(q, k, v, qp, kl, t, tiles):
        return ragged_attention(q, k, v, qp, pos, kl, t, tiles, impl=impl, **kw)

    return fn


def ragged_step(sz: Sizes, s: int, lens) -> tuple:
    """A step of rows with `lens` query tokens each, every row at the end of its s keys, laid end to
    end and cut into tiles as the engine cuts them: (q [N,H,d], q_pos [N], kv_len [R], tiles)."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.attention import ragged

    lens = np.asarray(lens, np.int32)
    n, rows = int(lens.sum()), len(lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    q_pos = np.concatenate([np.arange(s - m, s) for m in lens]).astype(np.int32)
    tiles = ragged.plan(starts, lens, np.arange(rows), n,
                        ragged.group_shapes(n, rows, gate_module().RAGGED_TILE), positions=s - lens)
    q = _normal(9, (n, sz.heads, sz.head_dim))
    return q, jnp.asarray(q_pos), jnp.full((rows,), s, jnp.int32), tiles


def _ratio(rows: dict, ms: float, *over: str):
    """ms over the sum of the named rows' ms (None when one of them has none)."""
    base = [rows.get(o, {}).get("ms") for o in over]
    return ms / sum(base) if base and all(base) else None


def serving_rows(sz: Sizes, data: dict, rows: dict, copy_gbs) -> dict:
    """The serving stage's rows: name -> (kind, fn)."""
    s, b, impl = sz.serving_keys, sz.batch, sz.impl
    k, v, table = data["k"], data["v"], data["table"]
    q, q_pos, kv_len = decode_queries(sz, s)

    def paged_decode():
        return measure(paged_fn(impl, s), q, k, v, q_pos, kv_len, table[:b])

    def ragged_decode_only():
        qf, qp, kl, tiles = ragged_step(sz, s, [1] * b)
        row = measure(ragged_fn(impl, s), qf, k, v, qp, kl, table[:b], tiles)
        return dict(row, vs_paged=_ratio(rows, row["ms"], "paged decode"))

    def paged_chunk():
        qc, qcp, kl = decode_queries(sz, s, t=sz.chunk, rows=1)
        return measure(paged_fn(impl, s), qc, k, v, qcp, kl, table[b:])

    def ragged_mixed():
        qf, qp, kl, tiles = ragged_step(sz, s, [1] * b + [sz.chunk])
        row = measure(ragged_fn(impl, s), qf, k, v, qp, kl, table, tiles)
        return dict(row, vs_paged_decode_plus_chunk=_ratio(rows, row["ms"], "paged decode",
                                                           "paged chunk"))

    def ragged_mixed_split():  # the serving path on a GPU: the chunk's diagonal blocks via cuDNN
        qf, qp, kl, tiles = ragged_step(sz, s, [1] * b + [sz.chunk])
        n = qf.shape[0]
        shape = (n, sz.kv_heads, sz.head_dim)
        fresh = (_normal(5, shape), _normal(6, shape))

        def fn(q, k, v, qp, kl, t, tiles, fresh):
            return ragged_fn(impl, s, fresh=fresh)(q, k, v, qp, kl, t, tiles)

        row = measure(fn, qf, k, v, qp, kl, table, tiles, fresh)
        return dict(row, vs_unsplit=_ratio(rows, row["ms"], "ragged mixed"))

    def verify():
        qv, qvp, kl = decode_queries(sz, s, t=sz.verify)
        row = measure(paged_fn(impl, s), qv, k, v, qvp, kl, table[:b])
        return dict(row, vs_decode=_ratio(rows, row["ms"], "paged decode"))

    def eight_bit(kind):
        from pallas_kernels.attention import kv_quant as kvq

        pk, pv = kvq.pack(k, kind), kvq.pack(v, kind)
        row = measure(paged_fn(impl, s, kv_quant=kind), q, pk, pv, q_pos, kv_len, table[:b])
        return dict(row, vs_bf16=_ratio(rows, row["ms"], "paged decode"),
                    bytes_vs_bf16=(pk.nbytes + pv.nbytes) / (k.nbytes + v.nbytes))

    out = {"paged decode": ("paged", paged_decode),
           "ragged decode-only": ("ragged", ragged_decode_only),
           "paged chunk": ("chunk", paged_chunk), "ragged mixed": ("ragged mixed", ragged_mixed),
           "ragged mixed split": ("ragged split", ragged_mixed_split),
           f"verify {sz.verify}": ("verify", verify)}
    for kind in ("int8", "fp8"):
        out[f"{kind} pages"] = ("8-bit", functools.partial(eight_bit, kind))
    # MLA decode (issue 47's rows): the headline first, then fp8 latent pages, 64 heads, 8K keys
    for heads, keys, kind in ((sz.mla_heads, s, None), (sz.mla_heads, s, "fp8"),
                              (sz.mla_heads // 2, s, None), (sz.mla_heads // 2, s, "fp8"),
                              (sz.mla_heads, s // 4, None), (sz.mla_heads // 2, s // 4, None)):
        name = f"mla {heads} heads {_k(keys)}" + (f" {kind}" if kind else "")
        out[name] = ("mla", functools.partial(mla_row, sz, keys, copy_gbs, heads, kind))
    return out


# an H100 SXM's dense bf16 tensor-core peak (TFLOP/s): MLA decode at 128 heads sits near the ridge
TENSOR_PEAK_TFLOPS = 989.0


def mla_row(sz: Sizes, s: int, copy_gbs, heads: int | None = None, kind: str | None = None) -> dict:
    """DeepSeek's absorbed decode: `heads` query heads over one 576-wide latent kv head (the values:
    its first 512 features) in pages, bf16 or 8-bit (`kind`): time, GB/s of the pool, TFLOP/s
    (2·heads·(576 + 512) per key per row), the fraction of copy and of the tensor-core peak."""
    from pallas_kernels.attention import SlotPositions, attention, configs
    from pallas_kernels.attention import kv_quant as kvq

    heads = heads or sz.mla_heads
    pool, _, table = paged_inputs(sz, s, sz.batch, width=576, kv_heads=1, seed=4)
    if kind is not None:
        pool = kvq.pack(pool, kind)
    q, q_pos, kv_len = decode_queries(sz, s, heads=heads, width=576)
    pos = SlotPositions.dense(s)

    def fn(q, k, qp, kl, t):
        return attention(q, k, None, qp, pos, kl, impl=sz.impl, v_dim=512, block_table=t,
                         kv_quant=kind)

    row = measure(fn, q, pool, q_pos, kv_len, table)
    _, cfg = configs.pick(heads, 576, 512, 2, shared_v=True)
    sec = row["ms"] / 1e3
    keys = sz.batch * s
    row.update(heads=heads, keys=s, kv_quant=kind, gbs=keys * pool.shape[-1] * pool.dtype.itemsize
               / sec / 1e9, tflops=2 * heads * (576 + 512) * keys / sec / 1e12,
               query_blocks=-(-heads // cfg.block_q))
    row["fraction_of_tensor_peak"] = row["tflops"] / TENSOR_PEAK_TFLOPS
    if copy_gbs:
        row["fraction_of_copy"] = row["gbs"] / copy_gbs
    return row


def stage_serving(ctx: StageRun, sz: Sizes) -> None:
    s = sz.serving_keys
    k, v, table = paged_inputs(sz, s, sz.batch + 1)  # the decode rows, and the chunk's row last
    ctx.rec.update(keys=s, batch=sz.batch, chunk=sz.chunk, shape=(
        f"{sz.batch} decode rows of q [{sz.heads},{sz.head_dim}] bf16 over {_k(s)} keys in pages "
        f"of {sz.page} ({sz.kv_heads} kv heads); mixed: + one {sz.chunk}-token chunk at the end "
        f"of {_k(s)}"))
    copy_gbs = ctx.stage("copy").get("copy_gbs")
    rows = serving_rows(sz, dict(k=k, v=v, table=table), ctx.rows, copy_gbs)
    for name, (kind, fn) in rows.items():
        ctx.row(name, fn, kind)


def stage_prefill(ctx: StageRun, sz: Sizes, kernels) -> None:
    from pallas_kernels.attention import SlotPositions, attention

    h, kh, d = sz.heads, sz.kv_heads, sz.head_dim
    registered = gate_module().registered
    impls = [kn.impl for kn in kernels if "chunk" in kn.paths and registered(kn.impl)]
    ctx.rec["shape"] = f"one causal chunk T = S, q [1,T,{h},{d}], {kh} kv heads, bf16"
    for t in sz.prefill_chunks:
        flops = attention_flops(1, h, t, t, d, causal=True)

        def kernel(impl, t=t, flops=flops):
            q, q_pos, kv_len = decode_queries(sz, t, t=t, rows=1)
            k, v = _normal(1, (1, kh, t, d)), _normal(2, (1, kh, t, d))
            pos = SlotPositions.dense(t)
            row = measure(lambda q, k, v, qp, kl: attention(q, k, v, qp, pos, kl, impl=impl),
                          q, k, v, q_pos, kv_len)
            return dict(row, t=t, tflops=flops / (row["ms"] / 1e3) / 1e12)

        for impl in impls:
            ctx.row(f"{impl} {_k(t)}", functools.partial(kernel, impl), impl)
        if not sz.gpu:
            ctx.skip(f"jax.nn cudnn {_k(t)}", "cuDNN: GPU only", "jax.nn cudnn")
            continue

        def cudnn(t=t, flops=flops):
            q = decode_queries(sz, t, t=t, rows=1)[0]
            row = cudnn_row(q, _normal(1, (1, t, kh, d)), _normal(2, (1, t, kh, d)), True)
            return dict(row, t=t, tflops=flops / (row["ms"] / 1e3) / 1e12)

        ctx.row(f"jax.nn cudnn {_k(t)}", cudnn, "jax.nn cudnn")


# --- end to end -----------------------------------------------------------------------------------

def make_checkpoint(out_dir: str, seed: int = 0) -> int:
    """Subprocess mode: write the random bf16 LLAMA_1B checkpoint with transformers (weights drawn
    on the GPU when torch sees one). Prints one JSON line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t = time.perf_counter()
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):  # drawn on the GPU: seconds, where 1.1B normals on a CPU take a minute
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B))
    model = model.to(torch.bfloat16)
    made = time.perf_counter() - t
    model.save_pretrained(out_dir, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps(dict(params=n, device=dev, make_s=made, total_s=time.perf_counter() - t)))
    return 0


def hf_peer(spec_path: str) -> int:
    """Subprocess mode: transformers' greedy generate (SDPA, bf16, GPU) on the saved prompts: TTFT
    (one new token), then the whole generation. Prints one JSON line."""
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    kw = dict(attn_implementation="sdpa")
    try:
        model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.bfloat16, **kw)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], torch_dtype=torch.bfloat16,
                                                     **kw)
    model = model.to("cuda").eval()
    load_s = time.perf_counter() - t0
    x = torch.from_numpy(np.load(spec["ids"])).long().to("cuda")
    n = spec["new_tokens"]

    def run(x, new):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0, use_cache=True)
        torch.cuda.synchronize()
        return y, time.perf_counter() - t

    with torch.inference_mode():
        run(x[:1, :256], 2)  # CUDA and cuBLAS start-up, outside the timings
        _, ttft = run(x, 1)
        y, total = run(x, n)
    print(json.dumps(dict(batch=int(x.shape[0]), prompt_len=int(x.shape[1]), new_tokens=n,
                          load_s=load_s, ttft_s=ttft, total_s=total,
                          decode_tokens_per_s=x.shape[0] * (n - 1) / max(total - ttft, 1e-9),
                          tokens=y[:, x.shape[1]:].cpu().tolist(),
                          transformers_version=transformers.__version__,
                          torch_version=torch.__version__)))
    return 0


def _child(args, timeout_s: float) -> dict:
    """Run a subprocess mode of this script; its last stdout line is JSON. Raises with its error."""
    try:
        p = subprocess.run([sys.executable, __file__, *args], cwd=ROOT, capture_output=True,
                           text=True, timeout=max(1.0, timeout_s), check=False)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"timed out after {timeout_s:.0f} s") from e
    if p.returncode != 0:
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()][-1:] or ["?"]
        raise RuntimeError(f"rc {p.returncode}: {tail[0][:300]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def batch_pages(batch: int, tokens: int) -> int:
    """Pages (the null page included) for `batch` sequences of `tokens` each on one device with the
    default page size: a pool sized for the batch, not for the GPU's free memory."""
    from dcp_jax.serving.config import DEFAULT_PAGE_SIZE

    return 1 + batch * -(-tokens // DEFAULT_PAGE_SIZE)


class E2E:
    """dcp_jax's side of the end-to-end stages: the loaded weights, the prompts (shared with
    transformers) and an LLM per (batch, prefill chunk), without prefix caching, so a second run of
    the same prompts prefills them again."""

    def __init__(self, ckpt: Path, work: Path, sz: Sizes):
        import numpy as np

        from dcp_jax import LLM

        n = sz.prompt_len + sz.new_tokens
        t = time.perf_counter()
        self.base = LLM.load(str(ckpt), dtype="bfloat16", compile="lazy", max_num_seqs=1,
                             max_model_len=n, num_pages=batch_pages(1, n))
        self.load_s = time.perf_counter() - t
        self.sz, self.ckpt, self.tokens, self.sized = sz, ckpt, {}, (None, None)
        vocab = self.base.model.config.vocab_size
        rng = np.random.default_rng(0)
        self.ids = rng.integers(3, vocab, size=(16, sz.prompt_len), dtype=np.int32)
        self.ids_path = work / "prompt_ids.npy"
        np.save(self.ids_path, self.ids[:sz.batch_e2e])

    def llm_for(self, b: int, chunk: int):
        """An LLM of `b` slots and prefill chunk `chunk` over the loaded weights, its pool holding
        the requests' whole contexts; the last one is kept, an earlier one dropped first."""
        import gc

        from dcp_jax import LLM

        if self.sized[0] != (b, chunk):
            self.sized = (None, None)
            gc.collect()  # the previous pool goes before the next is allocated
            n = self.sz.prompt_len + self.sz.new_tokens
            self.sized = ((b, chunk), LLM(
                self.base.model, self.base.mesh, self.base.tokenizer, max_num_seqs=b,
                decode_steps=16, max_num_batched_tokens=b * self.sz.prompt_len, max_model_len=n,
                prefill_chunk=chunk, num_pages=batch_pages(b, n), enable_prefix_caching=False))
        return self.sized[1]

    def run(self, b: int, chunk: int, copy_gbs: float | None) -> dict:
        from dcp_jax import SamplingParams

        t = time.perf_counter()
        out = self.llm_for(b, chunk).generate([r.tolist() for r in self.ids[:b]], SamplingParams(
            max_tokens=self.sz.new_tokens, ignore_eos=True))
        st = out.stats
        row = dict(batch=b, prompt_len=self.sz.prompt_len, new_tokens=self.sz.new_tokens,
                   prefill_chunk=chunk, wall_s=time.perf_counter() - t,
                   **{k: st.get(k) for k in ("ttft_s", "decode_tokens_per_s", "compile_s")})
        if copy_gbs and st.get("decode_tokens_per_s"):
            roof = decode_roofline(LLAMA_1B, b, self.sz.prompt_len, self.sz.new_tokens, copy_gbs)
            row.update(roofline_tokens_per_s=roof["tokens_per_s"],
                       roofline_fraction=st["decode_tokens_per_s"] / roof["tokens_per_s"])
        self.tokens[b] = out.tokens
        return row


def stage_checkpoint(ctx: StageRun, state: dict) -> None:
    ckpt = state["work"] / "llama-1b"
    ctx.rec.update(config=LLAMA_1B, params_from_config=llama_param_count(LLAMA_1B))
    row = ctx.row("write", lambda: _child(["--make-checkpoint", str(ckpt)], ctx.left()))
    if row.get("status") != "ok":
        raise RuntimeError(f"no checkpoint ({row.get('error') or row.get('reason')})")
    state["ckpt"] = ckpt


def stage_e2e(ctx: StageRun, state: dict, sz: Sizes) -> None:
    """Load (timed), a first run (it compiles; `compile_s` from the engine's stats) and, when its
    measured cost fits, a warm second run: batch 4 x 32K, the headline figures."""
    if "ckpt" not in state:
        raise NotRun("no checkpoint (its stage did not finish)")

    def load():
        state["e2e"] = E2E(state["ckpt"], state["work"], sz)
        return dict(load_s=state["e2e"].load_s)

    if ctx.row("load", load).get("status") != "ok":
        raise RuntimeError("dcp_jax could not load the checkpoint")
    e2e, copy_gbs, b = state["e2e"], ctx.stage("copy").get("copy_gbs"), sz.batch_e2e
    first = ctx.row("first run", lambda: e2e.run(b, sz.prefill_chunk, copy_gbs), "run")
    if first.get("status") != "ok":
        raise RuntimeError(f"the first run failed ({first.get('error') or first.get('reason')})")
    state["run_s"] = first["seconds"]
    warm = ctx.row("warm run", lambda: e2e.run(b, sz.prefill_chunk, copy_gbs), "warm",
                   cost=first["seconds"] - (first.get("compile_s") or 0.0))
    ctx.rec["headline"] = "warm run" if warm.get("status") == "ok" else "first run"


def stage_transformers(ctx: StageRun, state: dict, sz: Sizes) -> None:
    if "e2e" not in state:
        raise NotRun("no dcp_jax run to compare with (the e2e stage did not load the model)")
    e2e = state["e2e"]
    spec = state["work"] / "hf_peer.json"
    spec.write_text(json.dumps(dict(checkpoint=str(state["ckpt"]), ids=str(e2e.ids_path),
                                    new_tokens=sz.new_tokens)))
    row = ctx.row(f"batch {sz.batch_e2e}", lambda: _child(["--hf-peer", str(spec)], ctx.left()))
    theirs = row.pop("tokens", None)
    ours = e2e.tokens.get(sz.batch_e2e)
    if theirs and ours:
        ctx.rec["greedy_match"] = greedy_match(ours, theirs)
    if row.get("status") != "ok":
        raise RuntimeError(row.get("error") or row.get("reason"))


def stage_chunk_sweep(ctx: StageRun, state: dict, sz: Sizes) -> None:
    """TTFT at other prefill chunks (each a new LLM: it compiles, as the first e2e run did)."""
    if "run_s" not in state:
        raise NotRun("no first e2e run to measure against")
    copy_gbs = ctx.stage("copy").get("copy_gbs")
    for chunk in (4096, 1024):
        ctx.row(f"chunk {chunk}", lambda c=chunk: state["e2e"].run(sz.batch_e2e, c, copy_gbs),
                "run", cost=state["run_s"])
    ttft = {n: r["ttft_s"] for n, r in ctx.rows.items() if r.get("ttft_s") is not None}
    ttft[f"chunk {sz.prefill_chunk}"] = ctx.stage("e2e")["rows"]["first run"]["ttft_s"]
    ctx.rec["ttft_by_chunk"] = ttft
    ctx.rec["best"] = min(ttft, key=ttft.get)


def stage_scan_cost(ctx: StageRun, state: dict, sz: Sizes, batch: int = 16, prompt_len: int = 2048,
                    new_tokens: int = 32) -> None:
    """Decode with the layers scanned (the default) against one stack per layer, at a short context
    (weights dominate a step): does XLA:GPU copy each scanned layer's weights out of the stack?"""
    import numpy as np

    from dcp_jax import LLM, SamplingParams

    if "e2e" not in state:
        raise NotRun("no loaded model to measure against")
    ids = np.random.default_rng(1).integers(3, 32000, size=(batch, prompt_len)).tolist()
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)

    def run(scan: bool):
        llm = LLM.load(str(state["ckpt"]), dtype="bfloat16", compile="lazy", max_num_seqs=batch,
                       decode_steps=16, max_num_batched_tokens=batch * prompt_len,
                       scan_layers=scan, max_model_len=prompt_len + new_tokens,
                       num_pages=batch_pages(batch, prompt_len + new_tokens),
                       enable_prefix_caching=False)
        llm.generate(ids, params)  # compiles
        return dict(decode_tokens_per_s=llm.generate(ids, params).stats["decode_tokens_per_s"])

    cost = state["e2e"].load_s + state["run_s"]
    for name, scan in (("scanned", True), ("per layer", False)):
        ctx.row(name, functools.partial(run, scan), "load and run", cost=cost)
    a, b = (ctx.rows[n].get("decode_tokens_per_s") for n in ("scanned", "per layer"))
    if a and b:
        ctx.rec["scanned_over_per_layer"] = a / b


def stage_e2e_b16(ctx: StageRun, state: dict, sz: Sizes) -> None:
    if "run_s" not in state:
        raise NotRun("no first e2e run to measure against")
    copy_gbs = ctx.stage("copy").get("copy_gbs")
    ctx.row("batch 16", lambda: state["e2e"].run(16, sz.prefill_chunk, copy_gbs), "run",
            cost=state["run_s"])


# =================================================================================================
# The report: the headline figures against their targets (no jax)
# =================================================================================================

def _fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _verdict(ok) -> str:
    return "—" if ok is None else ("PASS" if ok else "FAIL")


def _why(rec: dict | None) -> str:
    """What became of a stage or row that has no figure."""
    if not rec:
        return "not run"
    why = rec.get("error") or rec.get("reason")
    return f"{rec.get('status', 'not run')}: {why[:90]}" if why else rec.get("status", "not run")


def gate_row(gate: dict) -> tuple[str, str, str, str]:
    label, target = "correctness gate: every kernel path vs float64", "all pass"
    if not gate.get("planned") and not gate.get("failures"):
        return label, _why(gate), target, "FAIL" if gate.get("status") == "failed" else "—"
    fails = gate.get("failures", [])
    parts = [f"{gate.get('passed', 0)}/{gate.get('planned', 0)} cases pass"]
    if gate.get("not_run"):
        parts.append(f"{len(gate['not_run'])} not run")
    parts += [f.replace("|", "/")[:110] for f in fails[:5]]
    if len(fails) > 5:
        parts.append(f"+{len(fails) - 5} more failures (see the JSON)")
    return label, "; ".join(parts), target, _verdict(bool(gate.get("verdict")))


def decode_rows(st: dict) -> list:
    rows, dk = [], st.get("decode", {}).get("rows", {})
    for s in st.get("decode", {}).get("lengths", [8192, 32768, 131072]):
        r, c = dk.get(f"paged {_k(s)}"), dk.get(f"cudnn {_k(s)}") or {}
        target = f"≥ {_pct(TARGET_COPY_FRACTION)} of copy" if s >= TARGET_FROM else "report"
        label = f"decode kernel {_k(s)} keys: of copy; cuDNN"
        if not r or r.get("ms") is None:
            rows.append((label, _why(r or st.get("decode")), target, "—"))
            continue
        frac = r.get("fraction_of_copy")
        cudnn = (f"cuDNN {c['ms']:.3f} ms ({c['ms'] / r['ms']:.2f}x the kernel's speed)"
                 if c.get("ms") else f"cuDNN {_why(c)}")
        ok = None if s < TARGET_FROM else (frac is not None and frac >= TARGET_COPY_FRACTION)
        rows.append((label, f"{_pct(frac)} ({r['gbs']:.0f} GB/s, {r['ms']:.3f} ms); {cudnn}",
                     target, _verdict(ok)))
    for name in [n for n in dk if n.split()[0] in ("fp8", "int8")]:
        x = dk[name]
        ok = x.get("vs_bf16") is not None and x["vs_bf16"] <= TARGET_8BIT_VS_BF16
        rows.append((f"{name.split()[0]} pages / bf16, decode {name.split()[-1]} keys",
                     f"{_fmt(x.get('vs_bf16'))}x ({x['ms']:.3f} ms)" if x.get("ms") else _why(x),
                     f"≤ {TARGET_8BIT_VS_BF16}x", _verdict(ok if x.get("ms") else None)))
    return rows


def serving_rows_report(st: dict) -> list:
    sv = st.get("serving", {})
    rows, r = [], sv.get("rows", {})
    at = _k(sv.get("keys", 32768))

    def row(label, name, text, target="report", ok=None):
        x = r.get(name)
        rows.append((label, text(x) if x and x.get("ms") is not None else _why(x or sv), target,
                     _verdict(ok(x) if ok and x and x.get("ms") is not None else None)))

    def at_most(field, bound):
        return lambda x: x.get(field) is not None and x[field] <= bound

    row(f"ragged decode-only / paged decode, {at}", "ragged decode-only",
        lambda x: f"{_fmt(x.get('vs_paged'))}x ({x['ms']:.3f} ms)",
        f"≤ {TARGET_RAGGED_VS_PAGED}x", at_most("vs_paged", TARGET_RAGGED_VS_PAGED))
    row(f"ragged mixed (decode + {sv.get('chunk')}-token chunk) / paged decode + chunk, {at}",
        "ragged mixed",
        lambda x: f"{_fmt(x.get('vs_paged_decode_plus_chunk'))}x ({x['ms']:.3f} ms)")
    for kind in ("int8", "fp8"):
        row(f"{kind} pages / bf16 pages, paged decode {at}", f"{kind} pages",
            lambda x: (f"{_fmt(x.get('vs_bf16'))}x ({x['ms']:.3f} ms, "
                       f"{_fmt(x['bytes_vs_bf16'])}x the bytes)"),
            f"≤ {TARGET_8BIT_VS_BF16}x", at_most("vs_bf16", TARGET_8BIT_VS_BF16))
    name = next((n for n in r if n.startswith("verify")), "verify 5")
    row(f"verify step ({name.removeprefix('verify ')} queries) / 1 query, {at}", name,
        lambda x: f"{_fmt(x.get('vs_decode'))}x ({x['ms']:.3f} ms)")
    row(f"ragged mixed, diagonal blocks split off (cuDNN) / unsplit, {at}", "ragged mixed split",
        lambda x: f"{_fmt(x.get('vs_unsplit'))}x ({x['ms']:.3f} ms)")

    def mla_ok(x):
        return ((x.get("fraction_of_copy") or 0) >= TARGET_MLA_COPY
                or (x.get("fraction_of_tensor_peak") or 0) >= TARGET_MLA_TENSOR)

    for name in [n for n in r if n.startswith("mla")]:
        headline = name == f"mla 128 heads {at}"
        row(f"MLA decode, {name.removeprefix('mla ')}: of copy / of tensor peak", name,
            lambda x: (f"{_pct(x.get('fraction_of_copy'))} / "
                       f"{_pct(x.get('fraction_of_tensor_peak'))} ({x['gbs']:.0f} GB/s, "
                       f"{x['tflops']:.0f} TFLOP/s, {x['ms']:.3f} ms)"),
            (f"≥ {_pct(TARGET_MLA_COPY)} of copy or ≥ {_pct(TARGET_MLA_TENSOR)} of peak"
             if headline else "report"), mla_ok if headline else None)
    return rows


def prefill_rows(st: dict) -> list:
    pf = st.get("prefill", {}).get("rows", {})
    rows = []
    for name, r in pf.items():
        if name.startswith("jax.nn cudnn"):
            continue
        c = pf.get(f"jax.nn cudnn {name.rsplit(' ', 1)[-1]}") or {}
        text = (f"{r['ms']:.2f} ms ({r['tflops']:.0f} TFLOP/s); cuDNN "
                + (f"{c['ms']:.2f} ms ({c['tflops']:.0f} TFLOP/s)" if c.get("ms") else _why(c))
                if r.get("ms") is not None else _why(r))
        rows.append((f"prefill {name}, causal chunk", text, "report", "—"))
    return rows or [("prefill kernels vs cuDNN", _why(st.get("prefill")), "report", "—")]


def e2e_rows(st: dict) -> list:
    e2e, hf = st.get("e2e", {}), st.get("transformers", {})
    ours = (e2e.get("rows") or {}).get(e2e.get("headline", "first run"))
    theirs = next(iter((hf.get("rows") or {}).values()), None)
    where = f"batch {(ours or {}).get('batch', 4)} x {_k((ours or {}).get('prompt_len', 32768))}"
    rows = []
    if ours and ours.get("decode_tokens_per_s"):
        frac = ours.get("roofline_fraction")
        hf_tps = (f"; transformers {theirs['decode_tokens_per_s']:.0f} tok/s"
                  if theirs and theirs.get("decode_tokens_per_s") else "")
        rows.append((f"e2e decode {where}: of the roofline",
                     (f"{ours['decode_tokens_per_s']:.0f} tok/s = {_pct(frac)} of "
                      f"{_fmt(ours.get('roofline_tokens_per_s'), '.0f')}{hf_tps}"),
                     f"≥ {_pct(TARGET_ROOFLINE)}",
                     _verdict(None if frac is None else frac >= TARGET_ROOFLINE)))
    else:
        rows.append((f"e2e decode {where}: of the roofline", _why(ours or e2e), "≥ 70%", "—"))
    t_ours, t_hf = (ours or {}).get("ttft_s"), (theirs or {}).get("ttft_s")
    rows.append((f"TTFT {where}: ours vs transformers",
                 (f"{t_ours:.2f} s" if t_ours else _why(ours or e2e)) + " vs "
                 + (f"{t_hf:.2f} s" if t_hf else _why(theirs or hf)),
                 "≤ transformers'", _verdict(t_ours <= t_hf if t_ours and t_hf else None)))
    m = hf.get("greedy_match")
    rows.append(("greedy tokens = transformers'", (
        f"row 0: {m['row0']}/{m['compared']} equal; rows fully equal {m['rows_equal']}/{m['rows']}"
        if m else _why(hf)), "report (bf16 ties)", "—"))
    return rows


def extra_rows(st: dict) -> list:
    sweep, scan, b16 = st.get("chunk_sweep", {}), st.get("scan_cost", {}), st.get("e2e_b16", {})
    best = sweep.get("best")
    ttft = ", ".join(f"{c}: {t:.2f} s" for c, t in (sweep.get("ttft_by_chunk") or {}).items())
    r16 = (b16.get("rows") or {}).get("batch 16") or {}
    return [
        ("extra: best prefill chunk (TTFT)", f"{best} ({ttft})" if best else _why(sweep),
         "report", "—"),
        ("extra: decode, layers scanned / one stack per layer",
         _fmt(scan.get("scanned_over_per_layer")) + "x" if scan.get("scanned_over_per_layer")
         else _why(scan), "report", "—"),
        ("extra: e2e decode batch 16 x 32K: of the roofline",
         f"{r16['decode_tokens_per_s']:.0f} tok/s = {_pct(r16.get('roofline_fraction'))}; TTFT "
         f"{_fmt(r16.get('ttft_s'))} s" if r16.get("decode_tokens_per_s") else _why(r16 or b16),
         "report", "—"),
    ]


def headline_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(metric, measured, target, verdict) rows of the table; any stage may be missing, partial."""
    st = results.get("stages", {})
    copy = st.get("copy", {})
    rows = [gate_row(st.get("gate", {})),
            ("device copy ceiling (read + write)",
             f"{copy['copy_gbs']:.0f} GB/s ({copy.get('copy_best')})" if copy.get("copy_gbs")
             else _why(copy), "—", "—")]
    return rows + decode_rows(st) + serving_rows_report(st) + prefill_rows(st) + e2e_rows(st) \
        + extra_rows(st)


def markdown_table(rows, header=("metric", "measured", "target", "verdict")) -> str:
    """A markdown table; cells have their pipes escaped."""
    def cell(x):
        return str(x).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def report(path: Path, print_json: bool) -> int:
    """Print the results JSON (or its path) and, last, the table."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        print(f"no results to report ({first_line(e)})", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=1) if print_json else f"results JSON: {path}")
    meta = results.get("meta", {})
    st = results.get("stages", {})
    not_ok = ", ".join(f"{n} ({st.get(n, {}).get('status')})" for n in meta.get("not_ok", []))
    how = "interpreted (--interpret: no figure means anything), " if meta.get("interpret") else ""
    not_ok = f"; not ok: {not_ok}" if not_ok else ""
    print(f"\n## GPU check: {meta.get('device_kind', '?')}, jax {meta.get('jax_version', '?')}, "
          f"{how}{_fmt(meta.get('elapsed_s'), '.0f')} s{not_ok}")
    print()
    print(markdown_table(headline_rows(results)))
    return 0


# =================================================================================================
# main
# =================================================================================================

def stage_funcs(sz: Sizes, kernels, state: dict) -> dict:
    """Stage name -> fn(StageRun). With TINY sizes (--interpret) the end-to-end stages do not
    run."""
    funcs = dict(copy=lambda c: stage_copy(c, sz),
                 gate=lambda c: stage_gate(c, kernels, not sz.gpu),
                 decode=lambda c: stage_decode(c, sz), serving=lambda c: stage_serving(c, sz),
                 prefill=lambda c: stage_prefill(c, sz, kernels))
    e2e = dict(checkpoint=lambda c: stage_checkpoint(c, state),
               e2e=lambda c: stage_e2e(c, state, sz),
               transformers=lambda c: stage_transformers(c, state, sz),
               chunk_sweep=lambda c: stage_chunk_sweep(c, state, sz),
               scan_cost=lambda c: stage_scan_cost(c, state, sz),
               e2e_b16=lambda c: stage_e2e_b16(c, state, sz))
    for name, fn in e2e.items():
        funcs[name] = fn if sz.gpu else _not_on_cpu
    return funcs


def _not_on_cpu(ctx: StageRun) -> None:
    raise NotRun("needs a GPU and torch (not run with --interpret)")


def stages_asked(text: str) -> list[str]:
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    if unknown := [s for s in wanted if s not in BUDGETS]:
        raise ValueError(f"unknown stage {unknown[0]!r}: choose from {','.join(BUDGETS)}")
    return wanted


def parse_budgets(items) -> dict[str, float]:
    """`--budget STAGE=SECONDS` items as {stage: seconds}; a bad one raises ValueError naming it."""
    out = {}
    for item in items:
        name, _, sec = item.partition("=")
        if name not in BUDGETS:
            raise ValueError(f"--budget {item!r}: unknown stage {name!r}; choose from "
                             f"{','.join(BUDGETS)}")
        try:
            out[name] = float(sec)
        except ValueError:
            out[name] = -1.0
        if not out[name] > 0:
            raise ValueError(f"--budget {item!r}: give a positive number of seconds, as gate=200")
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="results JSON (default: in a temporary directory)")
    p.add_argument("--report", type=Path, metavar="JSON", help="print a results file and its table")
    p.add_argument("--print-json", action="store_true",
                   help="with --report: the JSON before the table")
    p.add_argument("--deadline-s", type=float,
                   default=float(os.environ.get("GPU_CHECK_DEADLINE_S") or PLAN_S))
    p.add_argument("--stages", default=",".join(s.name for s in PLAN),
                   help="comma-separated stages to run, of " + ",".join(s.name for s in PLAN))
    p.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS",
                   help="a stage's budget instead of the plan's (a rerun of one stage that ran "
                        "out of time); the deadline still holds")
    p.add_argument("--interpret", action="store_true",
                   help="on a CPU: the kernel stages at tiny shapes in Pallas' interpreter")
    p.add_argument("--make-checkpoint", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--hf-peer", metavar="SPEC", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.report:
        return report(args.report, args.print_json)
    if args.make_checkpoint:
        return make_checkpoint(args.make_checkpoint)
    if args.hf_peer:
        return hf_peer(args.hf_peer)
    try:
        wanted, budgets = stages_asked(args.stages), parse_budgets(args.budget)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    import warnings

    warnings.filterwarnings("ignore", message=".*[Tt]riton.*deprecated.*")
    try:
        import jax

        backend = jax.default_backend()
    except Exception as e:  # noqa: BLE001 - no jax, or no backend at all
        print(f"{NO_GPU} ({first_line(e)})", file=sys.stderr)
        return 2
    if backend != "gpu" and not args.interpret:
        print(NO_GPU, file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    gg = gate_module()
    sz, kernels = (TINY, gg.INTERPRET_KERNELS) if args.interpret else (Sizes(), gg.KERNELS)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out = args.out or work / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    results = dict(meta=dict(
        jax_version=jax.__version__, backend=backend, device_kind=dev.device_kind,
        num_sms=getattr(dev, "core_count", None), python=sys.version.split()[0],
        interpret=args.interpret, deadline_s=args.deadline_s, stages_asked=wanted,
        started=time.strftime("%Y-%m-%d %H:%M:%S")),
        plan=[dict(dataclasses.asdict(s), budget_s=budgets.get(s.name, s.budget_s)) for s in PLAN])
    runner = Runner(results, out, args.deadline_s, budgets=budgets)
    runner.log(f"{dev.device_kind}, jax {jax.__version__}; results -> {out}")
    run_plan(runner, stage_funcs(sz, kernels, dict(work=work)), wanted)
    gate = results["stages"].get("gate")
    failed = [n for n, r in results["stages"].items() if r.get("status") in ("failed", "timeout")]
    verdict = "" if gate is None else f"; gate {'passed' if gate.get('verdict') else 'NOT passed'}"
    runner.log(f"done; failed stages: {failed or 'none'}{verdict}")
    return 1 if failed or (gate is not None and not gate.get("verdict")) else 0


if __name__ == "__main__":
    sys.exit(main())
