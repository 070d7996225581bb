"""The CPU path's decode attention over a paged cache: the page walk against the block walk, side by side.

One decode step's attention over every layer (a jitted loop over the layers of a stacked page pool, as
the engine's decode loop runs it): B rows of one query token, lengths log-uniform in a range (rows of
unequal lengths, as a serving step holds them), through `pallas_kernels.attention.reference`:

  pages   the page walk (the default for paged rows of at most 8 query tokens): each row reads the
          pages it sees, `pages_per_step` pages a step
  blocks  the block walk (pages_per_step=0): every row read up to the furthest row's last slot

Both are timed in alternating rounds in one process (this machine is shared: the ratio is the figure);
`pages read` is what each walk gathers per layer (the page walk's last step is padded to a full step).

    python scripts/bench_attention.py            # the short and mixed serving shapes, and equal lengths
    python scripts/bench_attention.py --quick    # small shapes, seconds
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import reference
from pallas_kernels.attention.common import SlotPositions

PAGE = 64  # slots per page
# name: rows, length range (tokens); the model: 8 layers, 8 query / 4 kv heads of 64
CASES = {"short": (32, (16, 160)), "mixed": (8, (32, 2176)), "equal": (32, (160, 160))}
QUICK = {"short": (8, (8, 250)), "equal": (8, (200, 200))}


def case(rows, lengths, layers, heads=8, kv_heads=4, dim=64, page=PAGE, seed=0):
    rng = np.random.default_rng(seed)
    lo, hi = lengths
    lens = np.exp(rng.uniform(np.log(lo), np.log(hi), rows)).astype(np.int32) if lo < hi else np.full(rows, lo)
    nb = -(-hi // page)
    pool = (layers, 1 + rows * nb, kv_heads, page, dim)
    table = np.zeros((rows, nb), np.int32)
    for r, n in enumerate(lens):
        table[r, :-(-n // page)] = 1 + r * nb + np.arange(-(-n // page))
    args = dict(k=jnp.asarray(rng.standard_normal(pool), jnp.float32),
                v=jnp.asarray(rng.standard_normal(pool), jnp.float32),
                q=jnp.asarray(rng.standard_normal((rows, 1, heads, dim)), jnp.float32),
                q_pos=jnp.asarray(lens[:, None] - 1), kv_len=jnp.asarray(lens), block_table=jnp.asarray(table))
    pages = dict(pages=int(sum(-(-lens // page))), blocks=rows * -(-int(lens.max()) // page))
    return args, nb * page, pages


def step_fn(layers, slots, pages_per_step):
    kv_pos = SlotPositions.dense(slots)

    @jax.jit
    def step(a):
        def layer(i, acc):
            o, lse = reference.attention(a["q"] + acc, a["k"], a["v"], a["q_pos"], kv_pos, a["kv_len"], scale=0.125,
                                         block_table=a["block_table"], layer=i, pages_per_step=pages_per_step)
            return acc + 1e-3 * o
        return jax.lax.fori_loop(0, layers, layer, jnp.zeros_like(a["q"]))
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    ap.add_argument("--rounds", type=int, default=15, help="alternating timing rounds (each: 3 calls per walk)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pages-per-step", type=int, default=32)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.layers < 1 or args.pages_per_step < 1:
        ap.error("--rounds, --layers and --pages-per-step must be > 0")
    print(f"{'case':8} {'rows':>4} {'lengths':>10} {'pages read (page/block walk)':>29} {'page walk ms':>13} "
          f"{'block walk ms':>14} {'ratio':>6}")
    for name, (rows, lengths) in (QUICK if args.quick else CASES).items():
        a, slots, pages = case(rows, lengths, args.layers)
        fns = {"pages": step_fn(args.layers, slots, args.pages_per_step), "blocks": step_fn(args.layers, slots, 0)}
        outs = {k: f(a).block_until_ready() for k, f in fns.items()}  # compile, and the two walks agree
        np.testing.assert_allclose(np.asarray(outs["pages"]), np.asarray(outs["blocks"]), rtol=1e-4, atol=1e-5)
        times = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, f in fns.items():
                for _ in range(3):
                    t = time.perf_counter()
                    f(a).block_until_ready()
                    times[k].append(time.perf_counter() - t)
        ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
        step = min(args.pages_per_step, slots // PAGE * rows)  # the walk's pages per step
        read = f"{-(-pages['pages'] // step) * step} / {pages['blocks']}"
        print(f"{name:8} {rows:4} {f'{lengths[0]}..{lengths[1]}':>10} {read:>29} {ms['pages']:13.2f} "
              f"{ms['blocks']:14.2f} {ms['blocks'] / ms['pages']:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
