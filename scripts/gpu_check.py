"""The GPU check: one prepared, time-bounded run on a machine with one NVIDIA GPU.

Stages, in the order they run (most important first; each has its own time budget, and what it
measured is kept even when it fails or runs out of time):

  copy            the device copy ceiling: several copy candidates on a 1 GiB buffer, the best is `copy_gbs`
  decode_kernel   the Pallas decode kernel vs the jnp reference vs cuDNN at 8K/32K/128K keys; the paged
                  kernel vs the ragged step's decode-only tiles over the same pages (ragged_vs_paged);
                  DeepSeek's absorbed MLA decode at 128 heads over a paged 576-wide latent (mla_*);
                  the paged kernel over fp8 pages against the same pages in bf16 (fp8_vs_bf16)
  checkpoint      a random-weight bf16 Llama of 1.1B parameters, written with transformers (subprocess)
  e2e_dcp         dcp_jax LLM.generate at batch 16 × 32K prompt: TTFT, decode tokens/s, roofline
  e2e_transformers  transformers' model.generate (SDPA, bf16) on the same prompts (subprocess)
  prefill_chunk_sweep  TTFT at batch 4 × 32K for prefill_chunk 2048/4096/1024/512 (batch 4's e2e figures)
  scan_cost       decode at batch 16 × 2K with the layers scanned vs one stack per layer (scan_layers=False)
  prefill_kernel  the Pallas prefill kernel vs cuDNN causal at T = S = 8192
  kernel_tests    pytest tests/test_kernels.py and tests/test_ragged.py with the kernel compiled for the
                  GPU (subprocess; every test runs, every failure is listed)

Results go to a JSON file (`--out`, rewritten after every measurement); `--report FILE` prints that
JSON and, last, a markdown table of the headline figures against their targets. Run through
scripts/gpu_check.sh, which does both. Internal modes (subprocesses of the run): `--make-checkpoint`
and `--hf-peer`. torch and transformers are imported only inside those.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = "no GPU: run on a GPU machine (scripts/gpu_check.sh installs the cuda extra when python3's jax sees none)"

# --- the model of the end-to-end stage -------------------------------------------------------------
# A Llama of 1.1B parameters (TinyLlama's shape): hidden 2048, 16 layers, 32 q / 8 kv heads of 64.
LLAMA_1B = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=65536,
    rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
)

# --- targets (printed next to the figures) -----------------------------------------------------------
TARGET_COPY_FRACTION = 0.85  # of the device copy ceiling, at 32K and 128K keys
TARGET_COPY_FRACTION_FROM = 32768
PREFILL_ANCHOR_CUDNN_MS = 0.96  # the H200 prefill anchor (docs/ARCHITECTURE.md, Kernels): cuDNN causal T=S=8192, 32/8 heads, d=128, bf16 on an H200
# A copy faster than this (bytes read + written per second) was elided or is mis-measured: an H200's HBM
# peaks at 4.8 TB/s.
PLAUSIBLE_MAX_COPY_GBS = 6000.0

# Stage caps in seconds (a stage also never runs past the overall deadline). Typical use is well under.
BUDGETS = dict(copy=25, decode_kernel=70, checkpoint=70, e2e_dcp=100, e2e_transformers=80,
               prefill_chunk_sweep=80, scan_cost=60, prefill_kernel=30, kernel_tests=150)
QUICK_BUDGETS = dict(copy=20, decode_kernel=30, checkpoint=70, e2e_dcp=60, e2e_transformers=50,
                     prefill_chunk_sweep=40, scan_cost=40, prefill_kernel=30, kernel_tests=150)
STAGES = tuple(BUDGETS)
MIN_STAGE_S = 8  # a stage that would get less than this is skipped


# =====================================================================================================
# Pure helpers (no jax, no torch): unit-tested on CPU by tests/test_gpu_scripts.py
# =====================================================================================================

def llama_param_count(cfg: dict) -> int:
    """Parameters of a Llama-style decoder from its config alone (no weights built)."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    embed = cfg["vocab_size"] * h
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h  # q, k, v, o (no biases)
    mlp = 3 * h * inter  # gate, up, down
    per_layer = attn + mlp + 2 * h  # + input / post-attention RMSNorm weights
    head = 0 if cfg.get("tie_word_embeddings") else embed
    return embed + layers * per_layer + h + head  # + final norm


def kv_bytes_per_step(cfg: dict, batch: int, context: float, itemsize: int = 2) -> float:
    """KV bytes one decode step reads: batch × context × layers × 2 (K and V) × kv heads × head dim × itemsize."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return batch * context * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * hd * itemsize


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
    context = prompt_len + new_tokens / 2
    w = weight_bytes_per_step(cfg, itemsize)
    kv = kv_bytes_per_step(cfg, batch, context, itemsize)
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


def first_line(e: BaseException | str) -> str:
    """The first non-empty line of an error message (XLA's errors run to pages), after its type."""
    line = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
    if isinstance(e, BaseException):
        line = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return line[:300] or "error"


def parse_pytest(text: str) -> dict:
    """Counts from pytest's output: the summary line when there is one, else the progress dots of a
    run that was cut short. Also every failure's short-summary line (run pytest with -rfE)."""
    counts = {}
    summary = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error|errors|skipped)", ln)]
    if summary:
        for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", summary[-1]):
            counts["error" if what.startswith("error") else what] = int(n)
        counts["complete"] = True
    else:
        prog = "".join(m.group(1) for m in re.finditer(r"^([.FEsxX]+)\s*(?:\[\s*\d+%\])?\s*$", text, re.M))
        counts = dict(passed=prog.count("."), failed=prog.count("F"), error=prog.count("E"),
                      skipped=prog.count("s"), complete=False)
    fails = [ln.strip()[:300] for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR "))]
    if fails:
        counts["first_failure"] = fails[0]
        counts["failures"] = fails
    return counts


def _k(n: int) -> str:
    """8192 -> "8K"; lengths under 1024 as they are."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt(x, spec: str = ".2f", none: str = "n/a") -> str:
    if x is None:
        return none
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def _verdict(ok) -> str:
    return "—" if ok is None else ("PASS" if ok else "FAIL")


def _why(stage: dict | None) -> str:
    if not stage:
        return "not run"
    if stage.get("error"):
        return f"{stage.get('status', 'failed')}: {stage['error'][:80]}"
    return stage.get("status", "not run")


def headline_rows(results: dict) -> list[tuple[str, str, str, str]]:
    """(metric, measured, target, verdict) rows of the final table from a results dict (any stage may
    be missing, failed or partial)."""
    st = results.get("stages", {})
    rows = []
    copy = st.get("copy", {})
    copy_gbs = copy.get("copy_gbs")
    rows.append(("device copy ceiling (read+write)",
                 f"{_fmt(copy_gbs, '.0f')} GB/s ({copy.get('copy_best', _why(copy))})" if copy_gbs else _why(copy),
                 "—", "—"))
    dk = st.get("decode_kernel", {})
    by_len = {r["keys"]: r for r in dk.get("rows", [])}
    for s in dk.get("lengths", [8192, 32768, 131072]):
        r = by_len.get(s)
        label = f"decode kernel {_k(s)}: of copy / vs cuDNN"
        target = ("≥ 85% of copy, faster than cuDNN" if s >= TARGET_COPY_FRACTION_FROM else "faster than cuDNN")
        if not r or r.get("pallas_ms") is None:
            rows.append((label, (r or {}).get("error") or _why(dk), target, "FAIL" if r else "—"))
            continue
        frac, sp = r.get("fraction_of_copy"), r.get("speedup_vs_cudnn")
        measured = (f"{_pct(frac)} ({_fmt(r.get('pallas_gbs'), '.0f')} GB/s, {_fmt(r['pallas_ms'], '.3f')} ms)"
                    f" / {_fmt(sp)}× (cuDNN {_fmt(r.get('cudnn_ms'), '.3f')} ms); max|Δref| "
                    f"{_fmt(r.get('max_abs_diff_vs_reference'), '.1e')}")
        oks = [sp > 1.0 if sp is not None else False]
        if s >= TARGET_COPY_FRACTION_FROM:
            oks.append(frac is not None and frac >= TARGET_COPY_FRACTION)
        rows.append((label, measured, target, _verdict(all(oks))))
        if s >= 32768 and (r.get("fp8_vs_bf16") is not None or r.get("fp8_error")):
            if r.get("fp8_vs_bf16") is None:
                rows.append((f"decode kernel {_k(s)}: fp8 pages / bf16", r["fp8_error"], "≤ 0.6×", "FAIL"))
            else:
                rows.append((f"decode kernel {_k(s)}: fp8 pages / bf16",
                             f"{_fmt(r['fp8_vs_bf16'])}× ({_fmt(r['fp8_paged_ms'], '.3f')} vs "
                             f"{_fmt(r['bf16_paged_ms'], '.3f')} ms, {_fmt(r['fp8_bytes_ratio'])}× the bytes)",
                             "≤ 0.6×", _verdict(r["fp8_vs_bf16"] <= 0.6)))
        if r.get("mla_ms") is not None:
            rows.append((f"MLA decode {r['mla_heads']} heads {_k(s)}: of copy",
                         f"{_pct(r.get('mla_fraction_of_copy'))} ({_fmt(r['mla_gbs'], '.0f')} GB/s, "
                         f"{_fmt(r['mla_ms'], '.3f')} ms, {r['mla_query_blocks']} query blocks); max|Δref| "
                         f"{_fmt(r.get('mla_max_abs_diff_vs_reference'), '.1e')}", "report", "—"))
        if r.get("pallas_verify5_ms") is not None:
            rows.append((f"verify step (5 queries) {_k(s)}: time vs 1 query",
                         f"{_fmt(r['pallas_verify5_ms'], '.3f')} ms = {_fmt(r.get('verify5_cost_vs_decode'))}×",
                         "report (speculation gains ≈ acceptance length / this)", "—"))
    pk = st.get("prefill_kernel", {})
    if pk.get("pallas_ms") is not None:
        rows.append((f"prefill kernel causal T=S={pk.get('t', 8192)}",
                     f"Pallas {_fmt(pk['pallas_ms'], '.2f')} ms ({_fmt(pk.get('pallas_tflops'), '.0f')} TFLOP/s) vs "
                     f"cuDNN {_fmt(pk.get('cudnn_ms'), '.2f')} ms ({_fmt(pk.get('cudnn_tflops'), '.0f')} TFLOP/s)",
                     f"report (cuDNN anchor {PREFILL_ANCHOR_CUDNN_MS} ms)", "—"))
    else:
        rows.append(("prefill kernel causal T=S=8192", _why(pk), "report", "—"))
    e2e = st.get("e2e_dcp", {})
    sweep = st.get("prefill_chunk_sweep", {})
    hf = st.get("e2e_transformers", {})
    runs = dict(e2e.get("runs") or {})
    runs.update(sweep.get("e2e") or {})
    batches = sorted({int(k) for k in runs} | ({4} if results.get("meta", {}).get("quick") else {4, 16}),
                     reverse=True)
    for b in batches:
        r = runs.get(str(b))
        h = (hf.get("runs") or {}).get(str(b))
        ctx = (r or {}).get("prompt_len") or (results.get("meta", {}).get("prompt_len")) or 32768
        where = f"b={b} @{_k(ctx)}"
        if not r:
            rows.append((f"e2e decode {where}: tok/s (roofline)", _why(e2e if b == 16 else sweep), "report", "—"))
            continue
        theirs = f"{_fmt(h.get('decode_tokens_per_s'), '.0f')} tok/s" if h else _why(hf)
        rows.append((f"e2e decode {where}: tok/s (roofline)",
                     f"{_fmt(r.get('decode_tokens_per_s'), '.0f')} tok/s = {_pct(r.get('roofline_fraction'))} of "
                     f"{_fmt(r.get('roofline_tokens_per_s'), '.0f')}; transformers {theirs}", "report", "—"))
        ttft_hf = (h or {}).get("ttft_s")
        faster = ttft_hf / r["ttft_s"] if ttft_hf and r.get("ttft_s") else None
        rows.append((f"TTFT {where}: ours vs transformers",
                     f"{_fmt(r.get('ttft_s'), '.2f')} s vs " + (f"{ttft_hf:.2f} s" if ttft_hf else _why(hf))
                     + (f" ({faster:.2f}× faster)" if faster else "") + f"; chunk {r.get('prefill_chunk')}",
                     "report", "—"))
    match = hf.get("greedy_match")
    rows.append(("greedy tokens = transformers'",
                 (f"b={match['batch']} row 0: {match['row0']}/{match['compared']} tokens equal; rows fully equal: "
                  f"{match['rows_equal']}/{match['rows']}") if match else _why(hf), "report (bf16 ties)", "—"))
    best = sweep.get("best_prefill_chunk")
    ttfts = ", ".join(f"{c}: {_fmt(t, '.2f')} s" for c, t in (sweep.get("ttft_by_chunk") or {}).items())
    rows.append(("best prefill chunk (TTFT b=4)", f"{best} ({ttfts})" if best else _why(sweep), "report", "—"))
    sc = st.get("scan_cost", {})
    if sc.get("scanned_over_per_layer"):
        r = sc["runs"]
        rows.append((f"decode b={sc['batch']} @{sc['prompt_len']}: layers scanned vs one stack per layer",
                     f"{_fmt(r['scanned']['decode_tokens_per_s'], '.0f')} vs "
                     f"{_fmt(r['per_layer']['decode_tokens_per_s'], '.0f')} tok/s "
                     f"({_fmt(sc['scanned_over_per_layer'], '.2f')}x)", "report (CPU: ~0.8x)", "—"))
    else:
        rows.append(("decode: layers scanned vs one stack per layer", _why(sc), "report", "—"))
    kt = st.get("kernel_tests", {})
    if kt.get("counts"):
        c = kt["counts"]
        ok = c.get("failed", 0) == 0 and c.get("error", 0) == 0 and c.get("passed", 0) > 0 and c.get("complete")
        measured = (f"{c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('error', 0)} errors, "
                    f"{c.get('skipped', 0)} skipped" + ("" if c.get("complete") else " (cut short)")
                    + "".join(f"; {f.removeprefix('FAILED ')[:90]}" for f in c.get("failures", [])[:5])
                    + (f"; +{len(c['failures']) - 5} more (see the JSON)" if len(c.get("failures", [])) > 5 else ""))
        rows.append(("kernel tests on the GPU", measured, "all pass", _verdict(bool(ok))))
    else:
        rows.append(("kernel tests on the GPU", _why(kt), "all pass", "FAIL" if kt.get("status") == "failed" else "—"))
    return rows


def markdown_table(rows, header=("metric", "measured", "target", "verdict")) -> str:
    """A markdown table; cells have their pipes escaped."""
    def cell(x):
        return str(x).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def report(path: Path, print_json: bool) -> int:
    """Print the results JSON (unless it lives in a file the caller keeps) and, last, the table."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        print(f"no results to report ({first_line(e)})", file=sys.stderr)
        return 1
    if print_json:
        print(json.dumps(results, indent=1))
    else:
        print(f"results JSON: {path}")
    meta = results.get("meta", {})
    print(f"\n## GPU check: {meta.get('device_kind', '?')}, jax {meta.get('jax_version', '?')}, "
          f"{'quick, ' if meta.get('quick') else ''}{_fmt(meta.get('elapsed_s'), '.0f')} s"
          + (f"; skipped: {', '.join(meta['skipped_stages'])}" if meta.get("skipped_stages") else ""))
    print()
    print(markdown_table(headline_rows(results)))
    return 0


# =====================================================================================================
# Device measurements (jax imported inside)
# =====================================================================================================

def bench(fn, *args, repeat: int = 7, target_s: float = 0.02, max_inner: int = 100) -> float:
    """Median seconds per call. The first call compiles; each sample launches `inner` calls back to back
    and waits for all of them, so dispatch overhead hides behind the device work of short kernels."""
    import jax

    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    single = time.perf_counter() - t
    inner = max(1, min(max_inner, int(target_s / max(single, 1e-6))))
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        outs = [fn(*args) for _ in range(inner)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t) / inner)
        del outs
    return statistics.median(samples)


def _pointer(x):
    try:
        return x.unsafe_buffer_pointer()
    except Exception:  # noqa: BLE001 - not every array exposes one
        return None


def stage_copy(rec: dict, budget_s: float, save, size_bytes: int = 1 << 30) -> None:
    """Several ways to copy 1 GiB on the device; the fastest real copy is the ceiling (`copy_gbs`).
    A candidate whose output is its input (elided) or that beats the HBM is rejected."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    t_end = time.perf_counter() + budget_s
    rows = max(1, size_bytes // (1 << 20))  # rows of 1 MiB
    x16 = jax.random.uniform(jax.random.key(1), (rows, 1024, 512), jnp.bfloat16)
    x32 = jax.random.uniform(jax.random.key(2), (rows, 1024, 256), jnp.float32)
    jax.block_until_ready((x16, x32))
    rec["buffers_s"] = round(budget_s - (t_end - time.perf_counter()), 1)

    def device_put_copy(a):
        try:
            return jax.device_put(a, may_alias=False)
        except TypeError:  # older signature
            return jax.device_put(a, donate=False)

    dus = jax.jit(lambda dst, a: lax.dynamic_update_slice(dst, a, (0, 0, 0)), donate_argnums=0)
    state = {"dst": jnp.zeros_like(x16)}

    def dus_step(a):  # the destination is donated: an in-place write of all of `a`
        state["dst"] = dus(state["dst"], a)
        return state["dst"]

    candidates = [
        ("jit a.copy() bf16", jax.jit(lambda a: a.copy()), x16),
        ("jit a * 1 bf16", jax.jit(lambda a: a * 1), x16),
        ("jit a + 0 f32 (old)", jax.jit(lambda a: a + 0), x32),
        ("jnp.array(a, copy=True) bf16", lambda a: jnp.array(a, copy=True), x16),
        ("device_put(a, may_alias=False) bf16", device_put_copy, x16),
        ("jit dynamic_update_slice, donated dst bf16", dus_step, x16),
    ]
    rec["candidates"] = {}
    for name, fn, x in candidates:
        if time.perf_counter() > t_end:
            rec["candidates"][name] = dict(skipped="stage budget spent")
            continue
        c = rec["candidates"][name] = {}
        try:
            out = fn(x)
            jax.block_until_ready(out)
            elided = _pointer(out) is not None and _pointer(out) == _pointer(x)
            del out
            sec = bench(fn, x, repeat=7, target_s=0.01, max_inner=6)
            gbs = 2 * x.nbytes / sec / 1e9
            c.update(ms=sec * 1e3, gbs=gbs, elided=elided)
            if elided or gbs > PLAUSIBLE_MAX_COPY_GBS:
                c["rejected"] = "output is the input buffer (elided)" if elided else "faster than the HBM: not a copy"
        except Exception as e:  # noqa: BLE001
            c["error"] = first_line(e)
        save()
    del state["dst"]
    valid = {n: c["gbs"] for n, c in rec["candidates"].items() if "gbs" in c and "rejected" not in c}
    if not valid:
        measured = [c for c in rec["candidates"].values() if "skipped" not in c]
        raise RuntimeError("no copy candidate gave a plausible figure" if measured else
                           f"budget spent before any candidate ran (making the buffers took {rec['buffers_s']} s)")
    rec["copy_best"] = max(valid, key=valid.get)
    rec["copy_gbs"] = valid[rec["copy_best"]]
    rec["buffer_bytes"] = x16.nbytes


def decode_inputs(s: int, b: int = 8, h: int = 32, kh: int = 8, d: int = 128, seed: int = 0):
    """q [b,1,h,d], k/v [b,kh,s,d] bf16 (drawn on the device), q_pos = s-1, kv_len = s."""
    import jax
    import jax.numpy as jnp

    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, 1, h, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, kh, s, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, kh, s, d), jnp.bfloat16)
    q_pos = jnp.full((b, 1), s - 1, jnp.int32)
    kv_len = jnp.full((b,), s, jnp.int32)
    return q, k, v, q_pos, kv_len


def prefill_inputs(t: int, s: int, b: int = 1, h: int = 32, kh: int = 8, d: int = 128, seed: int = 0):
    """A chunk of t queries at the end of s keys: q_pos = s-t .. s-1, kv_len = s (t == s: causal square)."""
    import jax
    import jax.numpy as jnp

    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, h, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, kh, s, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, kh, s, d), jnp.bfloat16)
    q_pos = jnp.broadcast_to(jnp.arange(s - t, s, dtype=jnp.int32)[None], (b, t))
    kv_len = jnp.full((b,), s, jnp.int32)
    return q, k, v, q_pos, kv_len


def kernel_fn(s: int, impl: str, **opts):
    """jit of pallas_kernels' attention over a dense slice of s slots: (q, k, v, q_pos, kv_len) -> (o, lse)."""
    import jax

    from pallas_kernels.attention import SlotPositions, attention

    pos = SlotPositions.dense(s)
    return jax.jit(lambda q, k, v, qp, kl: attention(q, k, v, qp, pos, kl, impl=impl, **opts))


def paged_vs_ragged(q, k, v, q_pos, kv_len, page: int = 64, impl: str = "pallas") -> dict:
    """The paged decode kernel (today's serving decode) against the ragged step's decode-only tiles over
    the same pages: the same keys as a pool of `page`-slot pages (copied once, outside the timing).
    Returns paged_ms, ragged_decode_ms, their ratio (target <= 1.05) and the largest difference of their
    outputs (the same attention, so rounding only)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.attention import SlotPositions, attention, ragged, ragged_attention

    b, kh, s, d = k.shape
    nb = s // page
    pool = [jnp_pages(x, page) for x in (k, v)]
    table = jnp.arange(b * nb, dtype=jnp.int32).reshape(b, nb)
    jax.block_until_ready(pool)
    pos = SlotPositions.dense(s)
    paged = jax.jit(lambda q, k, v, qp, kl, t: attention(q, k, v, qp, pos, kl, impl=impl, block_table=t))
    row = dict(paged_ms=bench(paged, q, *pool, q_pos, kv_len, table) * 1e3)
    tiles = ragged.plan(np.arange(b), np.ones(b, np.int32), np.arange(b), b, ragged.group_shapes(b, b, 32),
                        positions=np.full(b, s - 1))
    flat = jax.jit(lambda q, k, v, qp, kl, t, tl: ragged_attention(q[:, 0], k, v, qp[:, 0], pos, kl, t, tl,
                                                                   impl=impl))
    row["ragged_decode_ms"] = bench(flat, q, *pool, q_pos, kv_len, table, tiles) * 1e3
    row["ragged_vs_paged"] = row["ragged_decode_ms"] / row["paged_ms"]
    row["ragged_max_abs_diff"] = _max_abs_diff(flat(q, *pool, q_pos, kv_len, table, tiles)[0],
                                               paged(q, *pool, q_pos, kv_len, table)[0][:, 0])
    return row


def paged_fp8(q, k, v, q_pos, kv_len, page: int = 64) -> dict:
    """The paged decode kernel over fp8 pages (`--kv-cache-dtype fp8`: 1 byte a value + a float32 scale
    per slot and head, packed) against the same pages in the cache dtype: fp8_paged_ms, the ratio
    (target <= 0.6 at 32K and 128K keys), the bytes each reads, and the output difference (fp8 rounding)."""
    import jax

    from pallas_kernels.attention import SlotPositions, attention
    from pallas_kernels.attention import kv_quant as kvq

    b, kh, s, d = k.shape
    nb = s // page
    pool = [jnp_pages(x, page) for x in (k, v)]
    packed = [kvq.pack(x, "fp8") for x in pool]
    table = jax.numpy.arange(b * nb, dtype=jax.numpy.int32).reshape(b, nb)
    jax.block_until_ready(packed)
    pos = SlotPositions.dense(s)
    full = jax.jit(lambda q, k, v, qp, kl, t: attention(q, k, v, qp, pos, kl, impl="pallas", block_table=t))
    fp8 = jax.jit(lambda q, k, v, qp, kl, t: attention(q, k, v, qp, pos, kl, impl="pallas", block_table=t,
                                                        kv_quant="fp8"))
    row = dict(bf16_paged_ms=bench(full, q, *pool, q_pos, kv_len, table) * 1e3,
               fp8_paged_ms=bench(fp8, q, *packed, q_pos, kv_len, table) * 1e3,
               fp8_bytes_ratio=sum(x.nbytes for x in packed) / sum(x.nbytes for x in pool))
    row["fp8_vs_bf16"] = row["fp8_paged_ms"] / row["bf16_paged_ms"]
    row["fp8_max_abs_diff"] = _max_abs_diff(fp8(q, *packed, q_pos, kv_len, table)[0],
                                            full(q, *pool, q_pos, kv_len, table)[0])
    return row


def jnp_pages(x, page: int):
    """A dense [B, K, S, D] cache as a pool of `page`-slot pages [B·S/page, K, page, D] (sequence b's
    pages b·S/page ..)."""
    import jax.numpy as jnp

    b, kh, s, d = x.shape
    return jnp.swapaxes(x.reshape(b, kh, s // page, page, d), 1, 2).reshape(b * s // page, kh, page, d)


def mla_decode(s: int, b: int = 8, heads: int = 128, page: int = 64, impl: str = "pallas", seed: int = 2) -> dict:
    """DeepSeek's absorbed decode: `heads` query heads over one 576-wide latent kv head (values = its
    first 512 features) in `page`-slot pages, bf16. Returns the kernel's time, its latent GB/s, the query
    blocks it reads each latent tile with (`configs.pick`), and the largest difference from the reference."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import SlotPositions, attention, configs

    kq, kk = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(kq, (b, 1, heads, 576), jnp.bfloat16)
    pool = jax.random.normal(kk, (b * s // page, 1, page, 576), jnp.bfloat16)
    table = jnp.arange(b * s // page, dtype=jnp.int32).reshape(b, s // page)
    q_pos, kv_len = jnp.full((b, 1), s - 1, jnp.int32), jnp.full((b,), s, jnp.int32)
    pos = SlotPositions.dense(s)

    def fn(which):
        return jax.jit(lambda q, k, qp, kl, t: attention(q, k, None, qp, pos, kl, impl=which, v_dim=512,
                                                         block_table=t))

    args = (q, pool, q_pos, kv_len, table)
    sec = bench(fn(impl), *args)
    _, cfg = configs.pick(heads, 576, 512, 2, shared_v=True)
    return dict(mla_heads=heads, mla_ms=sec * 1e3, mla_gbs=pool.nbytes / sec / 1e9,
                mla_query_blocks=-(-heads // cfg.block_q),
                mla_max_abs_diff_vs_reference=_max_abs_diff(fn(impl)(*args)[0], fn("reference")(*args)[0]))


def _max_abs_diff(a, b) -> float:
    import jax.numpy as jnp

    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def stage_decode_kernel(rec: dict, budget_s: float, save, lengths, copy_gbs: float | None) -> None:
    import jax
    import jax.numpy as jnp

    t_end = time.perf_counter() + budget_s
    rec["lengths"] = list(lengths)
    rec["shape"] = "q [8,1,32,128], k/v [8,8,S,128] bf16; cuDNN in [B,T,N,H] (K/V transposed outside)"
    rec["rows"] = []
    last = last_s = None  # seconds the previous length took, and that length
    for s in lengths:
        left = t_end - time.perf_counter()
        if last is not None and left < last * (s / last_s) * 0.6:
            rec["rows"].append(dict(keys=s, error=f"skipped: {left:.0f} s left in the stage budget"))
            continue
        t0 = time.perf_counter()
        row = dict(keys=s)
        rec["rows"].append(row)
        q, k, v, q_pos, kv_len = decode_inputs(s)
        kv_bytes = k.nbytes + v.nbytes
        row["kv_bytes"] = kv_bytes
        outs = {}
        for impl in ("pallas", "reference"):
            try:
                f = kernel_fn(s, impl)
                row[f"{impl}_ms"] = bench(f, q, k, v, q_pos, kv_len) * 1e3
                outs[impl] = f(q, k, v, q_pos, kv_len)[0]
            except Exception as e:  # noqa: BLE001
                row[f"{impl}_error"] = first_line(e)
                if impl == "pallas":
                    row["error"] = f"pallas: {first_line(e)}"
            save()
        kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, S, K, d], once, outside the timing
        jax.block_until_ready((kt, vt))
        for name, impl in (("cudnn", "cudnn"), ("xla_dpa", "xla")):
            try:
                f = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=impl))
                row[f"{name}_ms"] = bench(f, q, kt, vt) * 1e3
                outs[name] = f(q, kt, vt)
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = first_line(e)
            save()
        del kt, vt
        # a speculative verify step: k + 1 = 5 queries per sequence at the end of the same keys (the
        # speed-up of speculation is about acceptance length x (one-query time / this time))
        try:
            qv = jax.random.normal(jax.random.key(1), (q.shape[0], 5) + q.shape[2:], q.dtype)
            qv_pos = jnp.broadcast_to(jnp.arange(s - 5, s, dtype=jnp.int32)[None], (q.shape[0], 5))
            row["pallas_verify5_ms"] = bench(kernel_fn(s, "pallas"), qv, k, v, qv_pos, kv_len) * 1e3
            if row.get("pallas_ms"):
                row["verify5_cost_vs_decode"] = row["pallas_verify5_ms"] / row["pallas_ms"]
            del qv
        except Exception as e:  # noqa: BLE001
            row["pallas_verify5_error"] = first_line(e)
        save()
        try:  # the ragged step's decode-only tiles against the paged decode kernel, over the same pages
            row.update(paged_vs_ragged(q, k, v, q_pos, kv_len))
        except Exception as e:  # noqa: BLE001
            row["ragged_decode_error"] = first_line(e)
        save()
        try:  # fp8 pages against the cache dtype's, same kernel, same pages
            row.update(paged_fp8(q, k, v, q_pos, kv_len))
        except Exception as e:  # noqa: BLE001
            row["fp8_error"] = first_line(e)
        save()
        try:  # DeepSeek decode at 128 query heads over the shared latent (two query blocks of 64 rows)
            row.update(mla_decode(s))
            if copy_gbs:
                row["mla_fraction_of_copy"] = row["mla_gbs"] / copy_gbs
        except Exception as e:  # noqa: BLE001
            row["mla_error"] = first_line(e)
        save()
        if "pallas" in outs:
            if "reference" in outs:
                row["max_abs_diff_vs_reference"] = _max_abs_diff(outs["pallas"], outs["reference"])
            if "cudnn" in outs:
                row["max_abs_diff_vs_cudnn"] = _max_abs_diff(outs["pallas"], outs["cudnn"])
            row["pallas_gbs"] = kv_bytes / (row["pallas_ms"] / 1e3) / 1e9
            if copy_gbs:
                row["fraction_of_copy"] = row["pallas_gbs"] / copy_gbs
            for other in ("reference", "cudnn", "xla_dpa"):
                if row.get(f"{other}_ms"):
                    row[f"speedup_vs_{other}"] = row[f"{other}_ms"] / row["pallas_ms"]
        del outs, q, k, v
        last, last_s = time.perf_counter() - t0, s
        row["seconds"] = round(last, 1)
        save()


def stage_prefill_kernel(rec: dict, budget_s: float, save, t: int = 8192) -> None:
    import jax

    b, h, kh, d = 1, 32, 8, 128
    rec.update(t=t, s=t, batch=b, heads=h, kv_heads=kh, head_dim=d, causal=True)
    q, k, v, q_pos, kv_len = prefill_inputs(t, t, b, h, kh, d)
    flops = attention_flops(b, h, t, t, d, causal=True)
    rec["flops"] = flops
    outs = {}
    try:
        f = kernel_fn(t, "pallas")
        rec["pallas_ms"] = bench(f, q, k, v, q_pos, kv_len, repeat=5) * 1e3
        rec["pallas_tflops"] = flops / (rec["pallas_ms"] / 1e3) / 1e12
        outs["pallas"] = f(q, k, v, q_pos, kv_len)[0]
    except Exception as e:  # noqa: BLE001
        rec["pallas_error"] = first_line(e)
    save()
    kt, vt = jax.numpy.swapaxes(k, 1, 2), jax.numpy.swapaxes(v, 1, 2)
    try:
        f = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"))
        rec["cudnn_ms"] = bench(f, q, kt, vt, repeat=5) * 1e3
        rec["cudnn_tflops"] = flops / (rec["cudnn_ms"] / 1e3) / 1e12
        outs["cudnn"] = f(q, kt, vt)
    except Exception as e:  # noqa: BLE001
        rec["cudnn_error"] = first_line(e)
    if len(outs) == 2:
        rec["max_abs_diff_pallas_vs_cudnn"] = _max_abs_diff(outs["pallas"], outs["cudnn"])
        rec["speedup_vs_cudnn"] = rec["cudnn_ms"] / rec["pallas_ms"]
    rec["cudnn_anchor_ms"] = PREFILL_ANCHOR_CUDNN_MS
    if "pallas_ms" not in rec:
        raise RuntimeError(rec.get("pallas_error", "pallas kernel failed"))


# --- end to end ---------------------------------------------------------------------------------------

def make_checkpoint(out_dir: str, seed: int = 0) -> int:
    """Subprocess mode: write the random bf16 LLAMA_1B checkpoint with transformers (weights drawn on the
    GPU when torch sees one). Prints one JSON line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t = time.perf_counter()
    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA_1B)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):  # drawn on the GPU: seconds, where 1.1B normals on the CPU take a minute
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    made = time.perf_counter() - t
    model.save_pretrained(out_dir, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps(dict(params=n, device=dev, make_s=made, total_s=time.perf_counter() - t)))
    return 0


def hf_peer(spec_path: str) -> int:
    """Subprocess mode: transformers' greedy generate (SDPA, bf16, GPU) on the saved prompts. Appends one
    JSON line per batch to spec["out"] as it goes (a cut-short run keeps what it measured)."""
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    dev = "cuda"
    kw = dict(attn_implementation="sdpa")
    try:
        model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.bfloat16, **kw)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], torch_dtype=torch.bfloat16, **kw)
    model = model.to(dev).eval()
    ids = np.load(spec["ids"])
    n = spec["new_tokens"]
    gen = dict(do_sample=False, pad_token_id=0, use_cache=True)

    def run(x, new):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, **gen)
        torch.cuda.synchronize()
        return y, time.perf_counter() - t

    with torch.inference_mode():
        run(torch.from_numpy(ids[:1, :256]).long().to(dev), 2)  # CUDA / cuBLAS start-up, outside the timings
        for b in spec["batches"]:
            x = torch.from_numpy(ids[:b]).long().to(dev)
            _, ttft = run(x, 1)
            y, total = run(x, n)
            toks = y[:, x.shape[1]:].cpu().tolist()
            line = dict(batch=b, prompt_len=int(x.shape[1]), new_tokens=n, ttft_s=ttft, total_s=total,
                        decode_tokens_per_s=b * (n - 1) / max(total - ttft, 1e-9), tokens=toks,
                        transformers_version=transformers.__version__, torch_version=torch.__version__,
                        peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9)
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")
            del x, y
            torch.cuda.empty_cache()
    return 0


def _subprocess(args, timeout_s: float, env=None) -> subprocess.CompletedProcess:
    """Run a child; on timeout keep its partial output (returncode None)."""
    try:
        return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(1, timeout_s))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(args, None, out, err)


def _tail(text: str, n: int = 3) -> list[str]:
    return [ln[:300] for ln in (text or "").strip().splitlines()[-n:]]


def stage_checkpoint(rec: dict, budget_s: float, save, work: Path, holder: dict, prompt_len: int,
                     max_batch: int, new_tokens: int) -> None:
    """Write the random checkpoint (subprocess, torch), then load it into dcp_jax (holder["e2e"])."""
    t_end = time.perf_counter() + budget_s
    ckpt = work / "llama-1b"
    rec["config"] = LLAMA_1B
    rec["params_from_config"] = llama_param_count(LLAMA_1B)
    p = _subprocess([sys.executable, __file__, "--make-checkpoint", str(ckpt)], budget_s)
    if p.returncode != 0:
        rec["stderr_tail"] = _tail(p.stderr)
        raise RuntimeError("timed out" if p.returncode is None else
                           f"rc {p.returncode}: {(_tail(p.stderr, 1) or ['?'])[0]}")
    rec.update(json.loads(p.stdout.strip().splitlines()[-1]))
    rec["path"] = str(ckpt)
    rec["bytes_on_disk"] = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    save()
    if time.perf_counter() > t_end:
        raise RuntimeError("no time left to load the checkpoint")
    holder["e2e"] = E2E(ckpt, work, prompt_len, max_batch, new_tokens)
    rec["dcp_load_s"] = holder["e2e"].load_s


def _e2e_row(stats: dict, b: int, prompt_len: int, n: int, chunk: int, copy_gbs: float | None) -> dict:
    row = dict(batch=b, prompt_len=prompt_len, new_tokens=n, prefill_chunk=chunk,
               **{k: stats.get(k) for k in ("ttft_s", "decode_s", "decode_tokens_per_s", "compile_s",
                                             "kv_bytes_per_device")})
    if copy_gbs and stats.get("decode_tokens_per_s"):
        roof = decode_roofline(LLAMA_1B, b, prompt_len, n, copy_gbs)
        row.update(roofline_tokens_per_s=roof["tokens_per_s"], roofline_bytes_per_step=roof["bytes_per_step"],
                   roofline_fraction=stats["decode_tokens_per_s"] / roof["tokens_per_s"])
    return row


def batch_pages(batch: int, tokens: int) -> int:
    """Pages per context rank (the null page included) for `batch` sequences of `tokens` each on a 1 x 1
    mesh with the default page size: a pool for one batch, not for the GPU's free memory."""
    from dcp_jax.serving.config import DEFAULT_PAGE_SIZE

    return 1 + batch * -(-tokens // DEFAULT_PAGE_SIZE)


class E2E:
    """The dcp_jax side of the end-to-end stages: one loaded model, prompts shared with transformers."""

    def __init__(self, ckpt: Path, work: Path, prompt_len: int, max_batch: int, new_tokens: int):
        import numpy as np

        from dcp_jax import LLM

        t = time.perf_counter()
        # every request decodes at once (max_num_seqs = the batch), and one scheduler iteration may
        # prefill the whole batch, so decode runs at the full batch as transformers' generate does
        n = prompt_len + new_tokens
        self.llm = LLM.load(str(ckpt), dtype="bfloat16", max_num_seqs=max_batch, decode_steps=16,
                            max_num_batched_tokens=max_batch * prompt_len, max_model_len=n,
                            num_pages=batch_pages(max_batch, n))
        self.load_s = time.perf_counter() - t
        rng = np.random.default_rng(0)
        vocab = self.llm.model.config.vocab_size
        self.ids = rng.integers(min(3, vocab - 1), vocab, size=(max_batch, prompt_len), dtype=np.int32)
        self.ids_path = work / "prompt_ids.npy"
        np.save(self.ids_path, self.ids)
        self.prompt_len, self.new_tokens = prompt_len, new_tokens
        self.tokens = {}  # batch -> greedy tokens of the last run
        self.sized = (None, None)  # ((batch, chunk), the LLM for them)

    def llm_for(self, b: int, chunk: int):
        """An LLM over the loaded weights with `b` slots and prefill chunk `chunk`, its pool holding the
        `b` requests' whole contexts; the last one is kept (a second run of the same sizes compiles
        nothing), an earlier one and its pool dropped first."""
        import gc

        from dcp_jax import LLM

        if self.sized[0] != (b, chunk):
            self.sized = (None, None)
            gc.collect()  # the previous pool goes before the next is allocated
            base, n = self.llm, self.prompt_len + self.new_tokens
            self.sized = ((b, chunk), LLM(
                base.model, base.mesh, base.tokenizer, max_num_seqs=b, decode_steps=base.decode_steps,
                max_num_batched_tokens=base.max_num_batched_tokens, max_model_len=n, prefill_chunk=chunk,
                num_pages=batch_pages(b, n)))
        return self.sized[1]

    def run(self, b: int, chunk: int, copy_gbs: float | None) -> dict:
        t = time.perf_counter()
        from dcp_jax import SamplingParams

        out = self.llm_for(b, chunk).generate([row.tolist() for row in self.ids[:b]],
                                              SamplingParams(max_tokens=self.new_tokens,
                                                             ignore_eos=True))
        row = _e2e_row(out.stats, b, self.prompt_len, self.new_tokens, chunk, copy_gbs)
        row["wall_s"] = time.perf_counter() - t
        self.tokens[b] = out.tokens
        return row


def stage_e2e_dcp(rec: dict, budget_s: float, save, e2e: E2E, batch: int, chunk: int,
                  copy_gbs: float | None) -> None:
    t_end = time.perf_counter() + budget_s
    rec.update(prompt_len=e2e.prompt_len, new_tokens=e2e.new_tokens, load_s=e2e.load_s, runs={})
    cold = e2e.run(batch, chunk, copy_gbs)
    cold["run"] = "first (compiled before timing; first execution)"
    rec["runs"][str(batch)] = cold
    save()
    again = cold["wall_s"] - (cold.get("compile_s") or 0)
    if time.perf_counter() + 1.3 * again < t_end:  # a second, warm run when it fits
        warm = e2e.run(batch, chunk, copy_gbs)
        warm["run"] = "second (warm)"
        warm["first_run"] = {k: cold.get(k) for k in ("ttft_s", "decode_tokens_per_s", "compile_s")}
        rec["runs"][str(batch)] = warm
    else:
        rec["note"] = "one run only (no time for a warm second run)"


def greedy_match(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    pre = [prefix_match(a, b) for a, b in zip(ours, theirs)]
    return dict(row0=pre[0] if pre else 0, compared=len(theirs[0]) if theirs else 0, rows=len(pre),
                rows_equal=sum(1 for p, t in zip(pre, theirs) if p == len(t)), prefix_by_row=pre)


def stage_e2e_transformers(rec: dict, budget_s: float, save, e2e: E2E, batches, ckpt: Path, work: Path) -> None:
    out = work / "hf_peer.jsonl"
    out.unlink(missing_ok=True)
    spec = work / "hf_peer.json"
    spec.write_text(json.dumps(dict(checkpoint=str(ckpt), ids=str(e2e.ids_path), batches=list(batches),
                                    new_tokens=e2e.new_tokens, out=str(out))))
    p = _subprocess([sys.executable, __file__, "--hf-peer", str(spec)], budget_s)
    rec.update(runs={}, tokens={})
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            rec["tokens"][str(r["batch"])] = r.pop("tokens")
            rec["runs"][str(r["batch"])] = r
    if p.returncode != 0:
        rec["stderr_tail"] = _tail(p.stderr)
        raise RuntimeError("timed out" if p.returncode is None else
                           f"rc {p.returncode}: {(_tail(p.stderr, 1) or ['?'])[0]}")


def stage_prefill_chunk_sweep(rec: dict, budget_s: float, save, e2e: E2E, chunks, batch: int,
                              copy_gbs: float | None) -> None:
    t_end = time.perf_counter() + budget_s
    rec.update(batch=batch, prompt_len=e2e.prompt_len, runs=[], ttft_by_chunk={})
    last = None
    for c in chunks:
        left = t_end - time.perf_counter()
        if last is not None and left < 1.1 * last:
            rec.setdefault("skipped", []).append(c)
            continue
        t = time.perf_counter()
        try:
            row = e2e.run(batch, c, copy_gbs)
        except Exception as e:  # noqa: BLE001
            row = dict(prefill_chunk=c, error=first_line(e))
        rec["runs"].append(row)
        if row.get("ttft_s") is not None:
            rec["ttft_by_chunk"][str(c)] = row["ttft_s"]
            rec["best_prefill_chunk"] = int(min(rec["ttft_by_chunk"], key=rec["ttft_by_chunk"].get))
        last = time.perf_counter() - t
        save()
    ok = [r for r in rec["runs"] if r.get("decode_tokens_per_s")]
    if not ok:
        raise RuntimeError(next((r["error"] for r in rec["runs"] if r.get("error")), "no run finished"))
    # batch 4's e2e figures: TTFT at the e2e chunk (else the best), decode from the warm runs (the decode
    # program is the same for every chunk: the first run's decode includes its first execution)
    at = next((r for r in ok if r["prefill_chunk"] == rec.get("e2e_chunk")), None) or min(ok, key=lambda r: r["ttft_s"])
    row = dict(at)
    warm = [r["decode_tokens_per_s"] for r in ok[1:]] or [ok[0]["decode_tokens_per_s"]]
    row["decode_tokens_per_s"] = statistics.median(warm)
    row["decode_s"] = None
    row["decode_note"] = f"median of {len(warm)} run(s) after the first (same decode program for every chunk)"
    if copy_gbs:
        row.update(_e2e_row(dict(row), batch, e2e.prompt_len, e2e.new_tokens, row["prefill_chunk"], copy_gbs))
    rec["e2e"] = {str(batch): row}


def stage_scan_cost(rec: dict, budget_s: float, save, ckpt: Path, batch: int = 16, prompt_len: int = 2048,
                    new_tokens: int = 32) -> None:
    """Decode speed with the layers scanned (weights stacked, one lax.scan: the default) against one stack
    per layer (`scan_layers=False`). XLA:CPU copies each scanned layer's weights out of the stack every
    step (~16-22% of a CPU decode step); this measures whether XLA:GPU does. A short context, so the
    weights dominate each step."""
    import numpy as np

    from dcp_jax import LLM, SamplingParams

    t_end = time.perf_counter() + budget_s
    ids = None
    rec.update(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, runs={})
    for scan in (True, False):
        if time.perf_counter() > t_end:
            rec["note"] = "out of time"
            break
        t = time.perf_counter()
        llm = LLM.load(str(ckpt), dtype="bfloat16", max_num_seqs=batch, decode_steps=16,
                       max_num_batched_tokens=batch * prompt_len, scan_layers=scan,
                       max_model_len=prompt_len + new_tokens, num_pages=batch_pages(batch, prompt_len + new_tokens))
        load_s = time.perf_counter() - t
        if ids is None:
            vocab = llm.model.config.vocab_size
            ids = np.random.default_rng(1).integers(min(3, vocab - 1), vocab, size=(batch, prompt_len)).tolist()
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        llm.generate(ids, params)  # compile + first execution
        out = llm.generate(ids, params)
        rec["runs"]["scanned" if scan else "per_layer"] = dict(
            decode_tokens_per_s=out.stats["decode_tokens_per_s"], ttft_s=out.stats["ttft_s"],
            load_s=load_s)
        save()
        del llm, out
    runs = rec["runs"]
    if "scanned" in runs and "per_layer" in runs:
        rec["scanned_over_per_layer"] = runs["scanned"]["decode_tokens_per_s"] / runs["per_layer"]["decode_tokens_per_s"]


KERNEL_TEST_FILES = ("tests/test_kernels.py", "tests/test_ragged.py")


def stage_kernel_tests(rec: dict, budget_s: float, save) -> None:
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        raise RuntimeError(f"pytest is not installed for {sys.executable}")
    env = dict(os.environ, DCP_JAX_KERNEL_TESTS_ON_DEVICE="1")
    # tests/conftest.py defaults JAX_PLATFORMS to "cpu" (the tests' 8 simulated devices): keep the CPU
    # and put the GPU first, so the kernel tests compile for the GPU.
    plat = env.get("JAX_PLATFORMS", "")
    if "cuda" not in plat and "gpu" not in plat:
        env["JAX_PLATFORMS"] = "cuda,cpu"
    rec["jax_platforms"] = env["JAX_PLATFORMS"]
    t = time.perf_counter()
    # every test runs (no -x): a failing shape does not hide the ones after it; -rfE lists each failure
    p = _subprocess([sys.executable, "-m", "pytest", *KERNEL_TEST_FILES, "-q", "-rfE", "-p", "no:cacheprovider"],
                    budget_s, env=env)
    rec["seconds_pytest"] = round(time.perf_counter() - t, 1)
    rec["rc"] = p.returncode
    rec["counts"] = parse_pytest(p.stdout)
    rec["tail"] = _tail(p.stdout, 2)
    if p.returncode is None:
        raise RuntimeError(f"timed out after {budget_s:.0f} s")
    if p.returncode != 0:
        n = len(rec["counts"].get("failures", []))
        raise RuntimeError(f"{n} failed, first: {rec['counts']['first_failure']}" if n
                           else (_tail(p.stdout + p.stderr, 1) or ["?"])[0])


# =====================================================================================================
# The run
# =====================================================================================================

class StageTimeout(Exception):
    pass


class Runner:
    """Runs stages in order under caps and one overall deadline; saves the results after every step."""

    def __init__(self, out: Path, deadline_s: float, budgets: dict, results: dict):
        self.out, self.budgets, self.results = out, budgets, results
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + deadline_s
        self.results.setdefault("stages", {})

    def save(self):
        self.results["meta"]["elapsed_s"] = time.perf_counter() - self.t0
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1, default=str))
        tmp.replace(self.out)

    def log(self, msg):
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def stage(self, name: str, fn, *args, **kwargs):
        rec = self.results["stages"].setdefault(name, {})
        budget = min(self.budgets[name], self.deadline - time.perf_counter() - 3)
        rec["budget_s"] = round(budget, 1)
        if budget < MIN_STAGE_S:
            rec.update(status="skipped", error=f"no time left ({budget:.0f} s)")
            self.log(f"{name}: skipped, no time left")
            self.save()
            return rec
        self.log(f"{name}: start (budget {budget:.0f} s)")
        t = time.perf_counter()

        def on_alarm(signum, frame):  # backstop: a stage past its budget + grace is interrupted
            raise StageTimeout(f"stage {name} ran past its budget ({budget:.0f} s)")

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(int(budget + 20))
        try:
            fn(rec, budget, self.save, *args, **kwargs)
            rec["status"] = "ok"
        except (Exception, StageTimeout) as e:  # noqa: BLE001 - every failure is recorded, the run goes on
            rec["status"] = "timeout" if isinstance(e, StageTimeout) else "failed"
            rec["error"] = first_line(e)
            rec["traceback_tail"] = traceback.format_exc().strip().splitlines()[-4:]
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        rec["seconds"] = round(time.perf_counter() - t, 1)
        self.log(f"{name}: {rec['status']} in {rec['seconds']} s" + (f" ({rec['error']})" if rec.get("error") else ""))
        self.save()
        return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8K kernel only; batch 4 at 4K context, one chunk")
    p.add_argument("--out", type=Path, help="results JSON (default: a file in a temporary directory)")
    p.add_argument("--report", type=Path, metavar="JSON", help="print a results file and its table; no jax")
    p.add_argument("--print-json", action="store_true", help="with --report: print the JSON before the table")
    p.add_argument("--deadline-s", type=float, default=float(os.environ.get("GPU_CHECK_DEADLINE_S", 430)))
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk of the e2e runs")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--make-checkpoint", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--hf-peer", metavar="SPEC", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.report:
        return report(args.report, args.print_json)
    if args.make_checkpoint:
        return make_checkpoint(args.make_checkpoint)
    if args.hf_peer:
        return hf_peer(args.hf_peer)

    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the transformers child shares the GPU
    import warnings

    warnings.filterwarnings("ignore", message=".*[Tt]riton.*deprecated.*")
    try:
        import jax

        backend = jax.default_backend()
    except Exception as e:  # noqa: BLE001 - no jax, or no backend at all
        print(f"{NO_GPU} ({first_line(e)})", file=sys.stderr)
        return 2
    # GPU_CHECK_ALLOW_CPU=1: for working on this script only (every GPU figure then fails, recorded)
    if backend != "gpu" and not os.environ.get("GPU_CHECK_ALLOW_CPU"):
        print(NO_GPU, file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))

    wanted = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = set(wanted) - set(STAGES)
    if unknown:
        print(f"unknown stages {sorted(unknown)}; choose from {','.join(STAGES)}", file=sys.stderr)
        return 2
    lengths = [8192] if args.quick else [8192, 32768, 131072]
    prompt_len = 4096 if args.quick else 32768
    chunks = [args.chunk] if args.quick else list(dict.fromkeys([args.chunk, 4096, 1024, 512, 2048]))
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    out = args.out or work / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    dev = jax.devices()[0]
    results = dict(meta=dict(jax_version=jax.__version__, backend=backend, device_kind=dev.device_kind,
                             num_sms=getattr(dev, "core_count", None), devices=len(jax.devices()),
                             python=sys.version.split()[0], quick=args.quick, deadline_s=args.deadline_s,
                             prompt_len=prompt_len,
                             started=time.strftime("%Y-%m-%d %H:%M:%S")))
    run = Runner(out, args.deadline_s, QUICK_BUDGETS if args.quick else BUDGETS, results)
    run.save()
    run.log(f"{dev.device_kind}, jax {jax.__version__}; results -> {out}")
    st = results["stages"]

    def copy_gbs():
        return st.get("copy", {}).get("copy_gbs")

    if "copy" in wanted:
        run.stage("copy", stage_copy)
    if "decode_kernel" in wanted:
        run.stage("decode_kernel", stage_decode_kernel, lengths, copy_gbs())
    need_model = {"e2e_dcp", "e2e_transformers", "prefill_chunk_sweep", "scan_cost"} & set(wanted)
    holder = {}
    if need_model:
        run.stage("checkpoint", stage_checkpoint, work, holder, prompt_len, 4 if args.quick else 16,
                  args.new_tokens)
        if "e2e" not in holder:
            for s in sorted(need_model):
                st[s] = dict(status="skipped", error="no model (checkpoint stage failed)")
            run.save()
    e2e = holder.pop("e2e", None)
    if e2e is not None:
        sweep = functools.partial(run.stage, "prefill_chunk_sweep", stage_prefill_chunk_sweep, e2e, chunks, 4,
                                  copy_gbs())
        st.setdefault("prefill_chunk_sweep", {})["e2e_chunk"] = args.chunk
        if "e2e_dcp" in wanted and not args.quick:
            run.stage("e2e_dcp", stage_e2e_dcp, e2e, 16, args.chunk, copy_gbs())
        if "prefill_chunk_sweep" in wanted and args.quick:  # quick: batch 4 is the only e2e run
            sweep()
        if "e2e_transformers" in wanted:
            run.stage("e2e_transformers", stage_e2e_transformers, e2e, [4] if args.quick else [16, 4],
                      Path(st["checkpoint"]["path"]), work)
        if "prefill_chunk_sweep" in wanted and not args.quick:
            sweep()
        if "scan_cost" in wanted:
            run.stage("scan_cost", stage_scan_cost, Path(st["checkpoint"]["path"]), 4 if args.quick else 16)
        hf = st.get("e2e_transformers", {})
        for b in (16, 4):  # our greedy tokens against transformers', widest batch both ran
            theirs = (hf.get("tokens") or {}).get(str(b))
            if theirs and b in e2e.tokens:
                hf["greedy_match"] = dict(greedy_match(e2e.tokens[b], theirs), batch=b)
                hf["dcp_tokens_row0"] = e2e.tokens[b][0]
                break
        run.save()
        del e2e
    if "prefill_kernel" in wanted:
        run.stage("prefill_kernel", stage_prefill_kernel, 8192)
    if "kernel_tests" in wanted:
        run.stage("kernel_tests", stage_kernel_tests)
    results["meta"]["skipped_stages"] = [n for n, r in st.items() if r.get("status") == "skipped"]
    run.save()
    failed = [n for n, r in st.items() if r.get("status") in ("failed", "timeout")]
    run.log(f"done; failed stages: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
