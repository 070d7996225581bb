"""Sweep the Pallas attention kernel's block sizes, stages and warps on a GPU; print the configs.py rows.

  decode   batch 8, 32 q / 8 kv heads, head dim 128, bf16, one query token, at 32K keys (and 128K with
           --long): block_k 64/128/256 × num_stages 2/3/4/5 × num_warps 4/8
  prefill  a chunk of 2048 queries at the end of --prefill-context keys (default 16384: the chunk sees a
           cached prefix and its own causal diagonal), batch 1, same heads:
           block_q 64/128 × block_k 32/64/128 × num_stages 2/3 × num_warps 4/8

Each config is passed to `attention(..., impl="pallas", block_k=, num_stages=, num_warps=[, block_q=])`;
configs that fail to compile (shared memory, registers) are recorded with their error's first line and
skipped. The run is time-bounded (--budget-s: half for decode, the rest for prefill; what does not fit
is listed as not run). It prints a sorted table per shape and, last, the rows to paste into
`pallas_kernels/attention/configs.py` TABLE. --json prints one JSON object instead of the tables.

    PYTHONPATH=. python3 scripts/sweep_kernel.py [--long] [--budget-s 240] [--json]
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

DECODE_SPACE = dict(block_k=(64, 128, 256), num_stages=(2, 3, 4, 5), num_warps=(4, 8))
PREFILL_SPACE = dict(block_q=(64, 128), block_k=(32, 64, 128), num_stages=(2, 3), num_warps=(4, 8))
HEADS, KV_HEADS, HEAD_DIM, DECODE_BATCH = 32, 8, 128, 8


def space(phase: str) -> list[dict]:
    """Every config of a phase's sweep, as kernel options."""
    grid = DECODE_SPACE if phase == "decode" else PREFILL_SPACE
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


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


def table_row(phase: str, opts: dict, block_q: int, head_dim: int = HEAD_DIM) -> str:
    """One entry of configs.TABLE, as it is written there."""
    return (f'("{phase}", {head_dim}): KernelConfig(block_q={opts.get("block_q", block_q)}, '
            f'block_k={opts["block_k"]}, num_warps={opts["num_warps"]}, num_stages={opts["num_stages"]}),')


def format_table(results: list[dict]) -> str:
    """Per shape, fastest first; failures and configs not run at the end."""
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


def sweep_shape(name: str, phase: str, inputs, s: int, configs: list[dict], t_end: float, figure, results: list):
    """Time the default config and then each of `configs` on one shape until t_end."""
    import jax

    gc = _gpu_check()
    ref = None
    for opts in [None, *configs]:
        row = dict(shape=name, phase=phase, options="default" if opts is None else opts)
        results.append(row)
        if time.perf_counter() > t_end:
            row["error"] = "not run: budget spent"
            continue
        try:
            f = gc.kernel_fn(s, "pallas", **(opts or {}))
            o = f(*inputs)[0]
            jax.block_until_ready(o)
            sec = gc.bench(f, *inputs, repeat=5, target_s=0.01)
            row.update(ms=sec * 1e3, figure=figure(sec))
            if ref is None:
                ref = o
            else:
                row["max_abs_diff_vs_default"] = gc._max_abs_diff(o, ref)
            del o
        except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded and skipped
            row["error"] = gc.first_line(e)


def _gpu_check():
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_check

    return gpu_check


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--long", action="store_true", help="decode at 128K keys too")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--prefill-context", type=int, default=16384)
    p.add_argument("--phases", default="decode,prefill")
    args = p.parse_args(argv)

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

    gc = _gpu_check()
    t0 = time.perf_counter()
    phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    results: list[dict] = []
    decode_end = t0 + args.budget_s * (0.5 if "prefill" in phases else 1.0)
    if "decode" in phases:
        lengths = [32768, 131072] if args.long else [32768]
        for i, s in enumerate(lengths):
            inputs = gc.decode_inputs(s, DECODE_BATCH, HEADS, KV_HEADS, HEAD_DIM)
            kv_bytes = inputs[1].nbytes + inputs[2].nbytes
            # share the decode half evenly over the lengths still to go
            end = time.perf_counter() + (decode_end - time.perf_counter()) / (len(lengths) - i)
            sweep_shape(f"decode {s // 1024}K", "decode", inputs, s, space("decode"), end,
                        lambda sec, b=kv_bytes: f"{b / sec / 1e9:.0f} GB/s", results)
            del inputs
    if "prefill" in phases:
        t, s = args.chunk, max(args.prefill_context, args.chunk)
        inputs = gc.prefill_inputs(t, s, 1, HEADS, KV_HEADS, HEAD_DIM)
        # FLOPs of the chunk: the prefix in full, the diagonal block causal
        flops = (gc.attention_flops(1, HEADS, t, s - t, HEAD_DIM, causal=False)
                 + gc.attention_flops(1, HEADS, t, t, HEAD_DIM, causal=True))
        sweep_shape(f"prefill {t}@{s // 1024}K", "prefill", inputs, s, space("prefill"), t0 + args.budget_s,
                    lambda sec: f"{flops / sec / 1e12:.0f} TFLOP/s", results)
        del inputs

    best = {ph: best_config([r for r in results if r["phase"] == ph]) for ph in phases}
    paste = [table_row(ph, best[ph], configs.TABLE[(ph, 128)].block_q) for ph in phases if best[ph]]
    out = dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__, seconds=time.perf_counter() - t0,
               results=results, best=best, configs_rows=paste)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0 if paste else 1
    print(format_table(results))
    print(f"\n{len([r for r in results if r.get('ms')])} configs timed, "
          f"{len([r for r in results if r.get('error', '').startswith('not run')])} not run (budget), "
          f"{len([r for r in results if r.get('error') and not r['error'].startswith('not run')])} failed; "
          f"{out['seconds']:.0f} s")
    print("\n# rows for pallas_kernels/attention/configs.py TABLE (decode block_q stays the table's cap):")
    for line in paste or ["# none: no config ran on every shape"]:
        print(line)
    return 0 if paste else 1


if __name__ == "__main__":
    sys.exit(main())
