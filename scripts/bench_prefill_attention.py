"""A long prompt's causal attention on CPU: the CPU path, its two dots alone, and torch's SDPA.

Where a long prompt's time to first token goes on CPU (docs/PERFORMANCE.md): one layer's attention
of the benchmark Llama (8 query / 4 kv heads of 64, float32) over a --context-token prompt, three
ways, in seconds per layer:

  ours   the serving engine's path: `ragged_attention` (reference) over a page pool, the prompt in
         --chunk-token steps cut into the engine's tiles, as `LLM` prefills it
  dots   the same walk's two matrix products alone (scores = Q·Kᵀ, then scores·[V | 1]) over
         each chunk's span up to its last token in the reference's 512-slot blocks, with no
         softmax, no mask and no page gather: what XLA:CPU's dots cost at these shapes, a floor
         for this walk (it multiplies each chunk's diagonal block whole: (n + 1) / n of the
         causal FLOPs for n chunks, 6% more at 16)
  torch  `scaled_dot_product_attention(is_causal=True)` over the whole prompt in one call (what
         transformers' prefill runs), in the --peer-python interpreter at --peer-threads threads

ours and dots alternate in rounds in one process (this machine is shared); torch runs in its own
process after them. GFLOP/s counts the causal attention's FLOPs (4 · heads · dim · S² / 2).

    python scripts/bench_prefill_attention.py                  # 16K prompt, 1024-token chunks
    python scripts/bench_prefill_attention.py --quick          # small, seconds, no torch
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.attention import api, ragged
from pallas_kernels.attention.common import SlotPositions

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers
import bench_decode  # noqa: E402  (its peer runner and peer interpreter)

# the benchmark Llama's attention, the pool's page, the reference walk's block
HEADS, KV_HEADS, DIM, PAGE, BLOCK = 8, 4, 64, 64, 512

PEER_SOURCE = r'''
import json, sys, time
import torch
a = json.load(open(sys.argv[1]))
torch.set_num_threads(a["threads"])
s, h, kh, d = a["context"], a["heads"], a["kv_heads"], a["dim"]
q, k, v = torch.randn(1, h, s, d), torch.randn(1, kh, s, d), torch.randn(1, kh, s, d)
sdpa = torch.nn.functional.scaled_dot_product_attention
f = lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True)
f()
best = []
for _ in range(a["rounds"]):
    t = time.perf_counter(); f(); best.append(time.perf_counter() - t)
print(json.dumps(dict(torch_s=min(best), torch_version=torch.__version__)))
'''


def causal_flops(context: int) -> float:
    return 4.0 * HEADS * DIM * context * context / 2


def ours_fn(context: int, chunk: int, k, v, table):
    """(jitted call, its per-chunk inputs): one chunk's attention as the serving step runs it."""
    from dcp_jax.serving.config import ServingConfig

    n = chunk  # a lone prompt's step: its chunk alone (nothing decodes), one row
    shapes = ragged.group_shapes(n, 1, ServingConfig.ragged_tile)

    @jax.jit
    def run(q, q_pos, kv_len, tiles):
        return api.ragged_attention(q, k, v, q_pos, SlotPositions.dense(context), kv_len, table,
                                    tiles, impl="reference")

    def inputs(c, rng):
        start = c * chunk
        tiles = ragged.plan(np.array([0]), np.array([chunk]), np.array([0]), n, shapes,
                            positions=np.array([start]))
        q = jnp.asarray(rng.standard_normal((n, HEADS, DIM), np.float32))
        q_pos = jnp.asarray(np.arange(start, start + chunk, dtype=np.int32))
        return q, q_pos, jnp.asarray([start + chunk], jnp.int32), tiles

    return run, inputs


def dots_fn(context: int, chunk: int, kc, vc):
    """(jitted call, its per-chunk inputs): the walk's two dots alone over chunk c's causal span."""
    g = HEADS // KV_HEADS

    @jax.jit
    def run(qg, blocks):
        def step(i, acc):
            kb = lax.dynamic_slice_in_dim(kc, i * BLOCK, BLOCK, 1)
            vb = lax.dynamic_slice_in_dim(vc, i * BLOCK, BLOCK, 1)
            vb1 = jnp.concatenate([vb, jnp.ones((*vb.shape[:-1], 1), vb.dtype)], -1)
            sc = jnp.einsum("krd,ksd->krs", qg, kb, precision=lax.Precision.HIGHEST)
            return acc + jnp.einsum("krs,ksd->krd", sc, vb1, precision=lax.Precision.HIGHEST)
        return lax.fori_loop(0, blocks, step, jnp.zeros((*qg.shape[:2], DIM + 1), jnp.float32))

    def inputs(c, rng):
        qg = jnp.asarray(rng.standard_normal((KV_HEADS, g * chunk, DIM), np.float32))
        return qg, jnp.int32(-(-(c + 1) * chunk // BLOCK))

    return run, inputs


def measure(context: int, chunk: int, rounds: int, seed: int = 0) -> dict:
    """Seconds per layer of ours and dots (the best round of each, alternating)."""
    rng = np.random.default_rng(seed)
    pages = context // PAGE
    pool = (pages + 1, KV_HEADS, PAGE, DIM)
    k = jnp.asarray(rng.standard_normal(pool, np.float32))
    v = jnp.asarray(rng.standard_normal(pool, np.float32))
    table = jnp.asarray(np.arange(1, pages + 1, dtype=np.int32)[None])
    span = -(-context // BLOCK) * BLOCK  # contiguous copies for the dots, whole blocks
    kc = jnp.zeros((KV_HEADS, span, DIM)).at[:, :context].set(jnp.moveaxis(k[1:], 1, 0).reshape(
        KV_HEADS, context, DIM))
    vc = jnp.zeros((KV_HEADS, span, DIM)).at[:, :context].set(jnp.moveaxis(v[1:], 1, 0).reshape(
        KV_HEADS, context, DIM))
    ways = dict(ours=ours_fn(context, chunk, k, v, table), dots=dots_fn(context, chunk, kc, vc))
    best = {name: float("inf") for name in ways}
    for _ in range(rounds):
        for name, (run, inputs) in ways.items():
            total = 0.0
            for c in range(context // chunk):
                args = inputs(c, rng)
                jax.block_until_ready(run(*args))  # (compiles once; warms the chunk's buffers)
                t = time.perf_counter()
                jax.block_until_ready(run(*args))
                total += time.perf_counter() - t
            best[name] = min(best[name], total)
    return {f"{name}_s": s for name, s in best.items()}


def run_peer(python: str, context: int, rounds: int, threads: int) -> dict:
    args = dict(context=context, heads=HEADS, kv_heads=KV_HEADS, dim=DIM, rounds=rounds,
                threads=threads)
    return bench_decode.run_python(python, PEER_SOURCE, args, threads, error_key="torch_error")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=16384, help="prompt tokens (default 16384)")
    ap.add_argument("--chunk", type=int, default=1024,
                    help="prefill chunk (default 1024: the CPU idle budget's, a lone prompt's)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (best taken)")
    ap.add_argument("--peer-python", default=None,
                    help="interpreter with torch (default: bench_decode's peer, "
                         f"{bench_decode.DEFAULT_PEER_PYTHON}, if present)")
    ap.add_argument("--peer-threads", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true", help="skip torch")
    ap.add_argument("--quick", action="store_true", help="context 2048, chunk 512, no torch")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.quick:
        args.context, args.chunk, args.no_peer = 2048, 512, True
    for name in ("context", "chunk", "rounds", "peer_threads"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.context % args.chunk or args.chunk % PAGE:
        ap.error(f"--chunk must divide --context and be a multiple of {PAGE} (the page)")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    row = dict(context=args.context, chunk=args.chunk, device=jax.devices()[0].device_kind,
               **measure(args.context, args.chunk, args.rounds))
    python = None if args.no_peer else args.peer_python
    if python is None and not args.no_peer and bench_decode.DEFAULT_PEER_PYTHON.exists():
        python = str(bench_decode.DEFAULT_PEER_PYTHON)
    if python:
        row.update(run_peer(python, args.context, args.rounds, args.peer_threads))
    if args.json:
        print(json.dumps(row))
        return 0
    flops = causal_flops(args.context)
    print(f"one layer's causal attention over {args.context} tokens ({args.chunk}-token chunks), "
          f"{flops / 1e9:.1f} GFLOP")
    print(f"{'way':6} {'s/layer':>8} {'GFLOP/s':>8} {'over torch':>10}")
    for way in ("ours", "dots", "torch"):
        s = row.get(f"{way}_s")
        if s is None:
            continue
        over = f"{s / row['torch_s']:.2f}x" if "torch_s" in row else "-"
        print(f"{way:6} {s:8.3f} {flops / s / 1e9:8.1f} {over:>10}")
    if "torch_error" in row:
        print(f"torch: {row['torch_error']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
