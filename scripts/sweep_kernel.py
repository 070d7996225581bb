"""Sweep the paged Pallas attention kernel's block sizes, stages and warps on a GPU; print configs.py rows.

What serving runs is the *paged* kernel, whose KV block lies inside one page (block_k <= page_size), so
the sweep runs that kernel over a page pool (pages in a shuffled order, as an allocator leaves them) at
the engine's page sizes (--page-sizes, default 64 = the engine's default, and 128), for each head-dim case:

  d64      32 q / 8 kv heads, head dim 64
  d128     32 q / 8 kv heads, head dim 128 (Llama-3-8B)
  d256     16 q / 8 kv heads, head dim 256 (Gemma-2-9B)
  mla      128 q heads over one 576-wide latent kv head whose first 512 features are the values
           (DeepSeek-V3's absorbed attention at tp = 1)

and two phases, all bf16:

  decode   batch 8, one query token per sequence at --context keys (default 32768):
           block_k 16/32/64/128/256 × num_stages 2/3/4 × num_warps 4/8
  prefill  batch 1, a --chunk (2048) query chunk at the end of --prefill-context (16384) keys:
           block_q 32/64/128 × block_k 16/32/64/128 × num_stages 2/3 × num_warps 4/8

A config whose KV block exceeds the page, or whose shared memory (`configs.smem_bytes`) exceeds one
block's limit, is listed as skipped; one that fails to compile is recorded with its error's first line.
Each shape gets an even share of --budget-s (what does not fit is listed as not run). Printed: a sorted
table per shape, then per (phase, head dim) the best config at the engine's default page size as a row
to paste into `pallas_kernels/attention/configs.py` TABLE, and whether a larger page's larger KV blocks
were faster (then a KV block spanning pages would be worth building). --json prints one JSON object.

    PYTHONPATH=. python3 scripts/sweep_kernel.py [--cases d128,mla] [--phases decode] [--budget-s 300] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = "no GPU: run on a GPU machine"

DECODE_SPACE = dict(block_k=(16, 32, 64, 128, 256), num_stages=(2, 3, 4), num_warps=(4, 8))
PREFILL_SPACE = dict(block_q=(32, 64, 128), block_k=(16, 32, 64, 128), num_stages=(2, 3), num_warps=(4, 8))
# name -> (query heads, kv heads, key head dim, value head dim, values shared with the keys)
CASES = {
    "d64": (32, 8, 64, 64, False),
    "d128": (32, 8, 128, 128, False),
    "d256": (16, 8, 256, 256, False),
    "mla": (128, 1, 576, 512, True),
}
DECODE_BATCH = 8
DEFAULT_PAGE = 64  # serving's DEFAULT_PAGE_SIZE: the rows pasted into the table are swept at it


def space(phase: str) -> list[dict]:
    """Every config of a phase's sweep, as kernel options."""
    grid = DECODE_SPACE if phase == "decode" else PREFILL_SPACE
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def skip_reason(opts: dict, phase: str, case: str, page: int, rows: int, itemsize: int = 2) -> str | None:
    """Why a config cannot run on a shape (its KV block exceeds the page, or shared memory one block's
    limit), else None. Decode's block_q is the call's own (its rows rounded up to a power of two)."""
    from pallas_kernels.attention import configs

    if opts["block_k"] > page:
        return f"skipped: block_k {opts['block_k']} > page {page}"
    _, _, dk, dv, shared_v = CASES[case]
    bq = opts.get("block_q") or configs.pick(rows, dk, dv, itemsize, shared_v)[1].block_q
    cfg = configs.KernelConfig(bq, opts["block_k"], opts["num_warps"], opts["num_stages"])
    smem = configs.smem_bytes(cfg, dk, dv, itemsize, shared_v)
    if smem > configs.SMEM_LIMIT:
        return f"skipped: shared memory {smem // 1024} KiB > {configs.SMEM_LIMIT // 1024} KiB"
    return None


def best_config(results: list[dict]) -> dict | None:
    """The options with the smallest geometric mean of (time / fastest time) over the shapes swept;
    only configs that ran on every shape count."""
    shapes = sorted({r["shape"] for r in results})
    ok = [r for r in results if r.get("ms") is not None and r["options"] != "default"]
    fastest = {s: min((r["ms"] for r in ok if r["shape"] == s), default=None) for s in shapes}
    by_opts: dict[str, list[float]] = {}
    for r in ok:
        by_opts.setdefault(json.dumps(r["options"], sort_keys=True), []).append(r["ms"] / fastest[r["shape"]])
    full = {k: v for k, v in by_opts.items() if len(v) == len(shapes)}
    if not full:
        return None
    key = min(full, key=lambda k: math.exp(sum(map(math.log, full[k])) / len(full[k])))
    return json.loads(key)


def table_bucket(case: str) -> int:
    """The TABLE key (widest head dim up to) that a case's row goes under."""
    _, _, dk, dv, _ = CASES[case]
    return 1024 if max(dk, dv) > 256 else max(dk, dv)


def table_row(phase: str, opts: dict, block_q: int, head_dim: int = 128) -> str:
    """One entry of configs.TABLE, as it is written there."""
    return (f'("{phase}", {head_dim}): KernelConfig(block_q={opts.get("block_q", block_q)}, '
            f'block_k={opts["block_k"]}, num_warps={opts["num_warps"]}, num_stages={opts["num_stages"]}),')


def format_table(results: list[dict]) -> str:
    """Per shape, fastest first; skipped, failed and not run at the end."""
    cols = ("shape", "options", "ms", "figure", "vs default", "max abs diff vs default", "error")
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    default = {r["shape"]: r.get("ms") for r in results if r["options"] == "default"}

    def key(r):
        return (r["shape"], r.get("ms") is None, r.get("ms") or 0.0)

    for r in sorted(results, key=key):
        opts = r["options"] if r["options"] == "default" else " ".join(f"{k}={v}" for k, v in r["options"].items())
        ms = r.get("ms")
        vs = f"{default[r['shape']] / ms:.2f}×" if ms and default.get(r["shape"]) else ""
        diff = r.get("max_abs_diff_vs_default")
        lines.append("| " + " | ".join([
            r["shape"], opts, f"{ms:.4f}" if ms else "", r.get("figure", ""), vs,
            f"{diff:.1e}" if diff is not None else "", (r.get("error") or "").replace("|", "/")[:120]]) + " |")
    return "\n".join(lines)


def paged_inputs(case: str, phase: str, page: int, context: int, chunk: int, seed: int = 0,
                 batch: int | None = None):
    """(args, fn, bytes read, FLOPs) for one shape: q, a shuffled page pool (k, and v unless shared),
    q_pos, kv_len, block table; fn(impl, **opts) is the jitted paged attention over them."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.attention import SlotPositions, attention

    h, kh, dk, dv, shared_v = CASES[case]
    b, t = (batch or DECODE_BATCH, 1) if phase == "decode" else (batch or 1, chunk)
    s = -(-context // page) * page
    nb = s // page
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, t, h, dk), jnp.bfloat16)
    k = jax.random.normal(kk, (b * nb, kh, page, dk), jnp.bfloat16)
    v = None if shared_v else jax.random.normal(kv, (b * nb, kh, page, dv), jnp.bfloat16)
    table = jax.random.permutation(kp, b * nb).astype(jnp.int32).reshape(b, nb)
    q_pos = jnp.broadcast_to(jnp.arange(s - t, s, dtype=jnp.int32)[None], (b, t))
    kv_len = jnp.full((b,), s, jnp.int32)
    pos = SlotPositions.dense(s)

    def fn(impl, **opts):
        def f(q, k, v, qp, kl, tb):
            return attention(q, k, v, qp, pos, kl, impl=impl, block_table=tb,
                             v_dim=dv if shared_v else None, **opts)
        return jax.jit(f)

    nbytes = k.nbytes + (0 if v is None else v.nbytes)
    # FLOPs: every query against the cached prefix, plus the chunk's causal diagonal
    flops = 2 * b * h * t * (dk + dv) * ((s - t) + (t + 1) / 2)
    return (q, k, v, q_pos, kv_len, table), fn, nbytes, flops


def sweep_shape(name: str, phase: str, case: str, page: int, args, fn, configs: list[dict], t_end: float, figure,
                results: list, impl: str = "pallas") -> None:
    """Time the default config and then each of `configs` on one shape until t_end."""
    import jax

    gc = _gpu_check()
    rows = args[0].shape[1] * CASES[case][0] // CASES[case][1]
    ref = None
    for opts in [None, *configs]:
        row = dict(shape=name, phase=phase, case=case, page=page, options="default" if opts is None else opts)
        results.append(row)
        why = None if opts is None else skip_reason(opts, phase, case, page, rows)
        if why:
            row["error"] = why
            continue
        if time.perf_counter() > t_end:
            row["error"] = "not run: budget spent"
            continue
        try:
            f = fn(impl, **(opts or {}))
            o = f(*args)[0]
            jax.block_until_ready(o)
            sec = gc.bench(f, *args, repeat=5, target_s=0.01)
            row.update(ms=sec * 1e3, figure=figure(sec))
            if ref is None:
                ref = o
            else:
                row["max_abs_diff_vs_default"] = gc.max_abs_diff(o, ref)
            del o
        except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded and skipped
            row["error"] = gc.first_line(e)


def larger_pages(results: list[dict], phase: str, case: str) -> str | None:
    """A line when a page larger than the default gave a faster best config (larger KV blocks win)."""
    best = {}
    for r in results:
        if r["phase"] == phase and r["case"] == case and r.get("ms") and r["options"] != "default":
            best[r["page"]] = min(best.get(r["page"], math.inf), r["ms"])
    if DEFAULT_PAGE not in best:
        return None
    wins = {p: best[DEFAULT_PAGE] / ms for p, ms in best.items() if p > DEFAULT_PAGE and ms < best[DEFAULT_PAGE]}
    if not wins:
        return None
    p = max(wins, key=wins.get)
    return (f"# {phase} {case}: page {p} (KV blocks up to {p}) is {wins[p]:.2f}x faster than page {DEFAULT_PAGE} "
            f"at its best: a larger page_size, or a KV block spanning pages, is worth it")


def _gpu_check():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    return gpu_check


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"head-dim cases, of {','.join(CASES)}")
    p.add_argument("--phases", default="decode,prefill")
    p.add_argument("--page-sizes", default=f"{DEFAULT_PAGE},128")
    p.add_argument("--context", type=int, default=32768, help="decode keys per sequence")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prefill-context", type=int, default=16384)
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    try:
        pages = [int(x) for x in args.page_sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--page-sizes takes comma-separated integers, got {args.page_sizes!r}")
    if bad := [c for c in cases if c not in CASES]:
        p.error(f"unknown case {bad[0]!r}: choose from {', '.join(CASES)}")
    if bad := [x for x in phases if x not in ("decode", "prefill")]:
        p.error(f"unknown phase {bad[0]!r}: choose decode and/or prefill")
    if DEFAULT_PAGE not in pages:
        p.error(f"--page-sizes must include {DEFAULT_PAGE}, the engine's default (its rows go into the table)")

    import os
    import warnings

    warnings.filterwarnings("ignore", message=".*[Tt]riton.*deprecated.*")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax

        backend = jax.default_backend()
    except Exception as e:  # noqa: BLE001
        print(f"{NO_GPU} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr)
        return 2
    if backend != "gpu":
        print(NO_GPU, file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from pallas_kernels.attention import configs

    t0 = time.perf_counter()
    shapes = [(ph, c, pg) for ph in phases for c in cases for pg in sorted(pages)]
    results: list[dict] = []
    for i, (phase, case, page) in enumerate(shapes):
        end = time.perf_counter() + (t0 + args.budget_s - time.perf_counter()) / (len(shapes) - i)
        ctx = args.context if phase == "decode" else max(args.prefill_context, args.chunk)
        inputs, fn, nbytes, flops = paged_inputs(case, phase, page, ctx, args.chunk)
        name = f"{phase} {case} page {page} @{ctx // 1024}K"
        figure = ((lambda sec, b=nbytes: f"{b / sec / 1e9:.0f} GB/s") if phase == "decode"
                  else (lambda sec, f=flops: f"{f / sec / 1e12:.0f} TFLOP/s"))
        sweep_shape(name, phase, case, page, inputs, fn, space(phase), end, figure, results)
        del inputs

    paste, notes, best = [], [], {}
    for phase in phases:
        for case in cases:
            rows = [r for r in results if r["phase"] == phase and r["case"] == case and r["page"] == DEFAULT_PAGE]
            cfg = best_config(rows)
            best[f"{phase} {case}"] = cfg
            bucket = table_bucket(case)
            if cfg:
                paste.append(table_row(phase, cfg, configs.entry(phase, bucket).block_q, bucket))
            if line := larger_pages(results, phase, case):
                notes.append(line)
    out = dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__, seconds=time.perf_counter() - t0,
               results=results, best=best, configs_rows=paste, larger_pages=notes,
               command="PYTHONPATH=. python3 scripts/sweep_kernel.py " + " ".join(argv or sys.argv[1:]))
    if args.json:
        print(json.dumps(out, indent=1))
        return 0 if paste else 1
    print(format_table(results))
    timed = len([r for r in results if r.get("ms")])
    skipped = len([r for r in results if (r.get("error") or "").startswith(("not run", "skipped"))])
    failed = len([r for r in results if r.get("error") and not r["error"].startswith(("not run", "skipped"))])
    print(f"\n{timed} configs timed, {skipped} skipped or not run, {failed} failed; {out['seconds']:.0f} s")
    print(f"\n# rows for pallas_kernels/attention/configs.py TABLE, swept at page {DEFAULT_PAGE} by: {out['command']}")
    print("# (decode block_q stays the table's cap; a d64 row adds a 64 bucket)")
    for line in paste or ["# none: no config ran on every shape"]:
        print(line)
    for line in notes:
        print(line)
    return 0 if paste else 1


if __name__ == "__main__":
    sys.exit(main())
