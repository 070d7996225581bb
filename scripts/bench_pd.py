"""Prefill/decode disaggregation on CPU: the KV handoff per prompt length, and a pair against one instance.

One interpreter, one random-weight float32 Llama checkpoint, 8 simulated CPU devices:

  handoff   one request per prompt length through `DisaggregatedLLM` (prefill tp x dcp -> decode
            tp x dcp), after a warm-up of the same shape: stage_s (gathering the request's pages into
            single-device pieces on the prefill side), transfer_s (jax.experimental.transfer pulling
            them onto the decode devices), write_s (the decode side's reshard program writing them into
            its pages), and the bytes the transfer delivered against the prompt's KV bytes (each kv head
            once): the excess is under one source page per source rank. 'max/device' is the most KV one
            decode device held for the handoff (its pulled pieces and any copies, measured from the
            arrays), against 'KV/device', the prompt's KV over the decode side's dcp x min(tp, kv heads).
  lengths   one request for each block count up to the longest prompt that the handoff rows did not
            see: the prefill side's gather programs compiled for them (`Stager.gather_sizes`: padded
            block counts; one per block count before 1b38a1d), and that first pass's wall time.
  serving   the same N requests (mixed prompt lengths, greedy, ignore_eos) through the pair and
            through one instance on the decode side's mesh (`LLM`), side by side: TTFT p50/p99 (pair:
            until the request's KV is in the decode pool), TPOT (decode time per decode step: every
            running request gets one token per step), wall time. The pair's greedy tokens must equal
            the single instance's; a mismatch exits with status 1.

Both sides share this machine's cores (simulated devices), so the pair's prefill does not run beside
its decode the way two hosts would; the numbers show the handoff's cost, not a disaggregation speed-up.

    python scripts/bench_pd.py                 # 'bench' model, prompts 64..4096, 8 requests
    python scripts/bench_pd.py --quick --json  # tiny model, prompts 16..512, 6 requests (< 60 s)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers
import bench_serving  # noqa: E402

DEFAULTS = dict(model="bench", lengths=[64, 256, 1024, 4096], requests=8, prompt_range=(64, 2048), output=32,
                page_size=64, prefill_chunk=256)
QUICK = dict(model="tiny", lengths=[16, 64, 256, 512], requests=6, prompt_range=(16, 256), output=16,
             page_size=16, prefill_chunk=128)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mesh(text: str) -> dict:
    tp, dcp = (int(x) for x in text.lower().split("x"))
    return dict(tp=tp, dcp=dcp)


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, prompts 16..512, 6 requests")
    p.add_argument("--json", action="store_true", help="print one JSON object (handoff rows, serving rows)")
    p.add_argument("--checkpoint", type=Path, default=None, help="a Llama checkpoint (default: a random one)")
    p.add_argument("--prefill", type=mesh, default=dict(tp=1, dcp=2), help="prefill side TPxDCP (default 1x2)")
    p.add_argument("--decode", type=mesh, default=dict(tp=1, dcp=4), help="decode side TPxDCP (default 1x4)")
    p.add_argument("--decode-interleave", type=int, default=1, help="decode side interleave (default 1)")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else DEFAULTS
    n_dev = args.prefill["tp"] * args.prefill["dcp"] + args.decode["tp"] * args.decode["dcp"]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", max(n_dev, 1))
    from dcp_jax import LLM, DisaggregatedLLM

    tmp = tempfile.TemporaryDirectory()
    ckpt = bench_serving.ensure_checkpoint(args.checkpoint or Path(tmp.name) / cfg["model"], cfg["model"])
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    ps = cfg["page_size"]
    lo, hi = cfg["prompt_range"]
    out_n = cfg["output"]
    # one context length and prefill chunk for every call: the longest handoff prompt + 2, or the
    # longest serving prompt + its output
    max_len = max(max(cfg["lengths"]) + 2, hi + out_n)
    side = dict(page_size=ps, enable_prefix_caching=False, max_model_len=max_len, prefill_chunk=cfg["prefill_chunk"])
    pair = DisaggregatedLLM.load(ckpt, prefill=dict(args.prefill, **side),
                                 decode=dict(args.decode, interleave=args.decode_interleave, **side))
    devices = jax.devices()
    n_p = args.prefill["tp"] * args.prefill["dcp"]
    one = LLM.load(ckpt, devices=devices[n_p:n_dev], interleave=args.decode_interleave, **args.decode, **side)
    model_cfg = one.model.config
    per_token = model_cfg.num_layers * 2 * model_cfg.num_kv_heads * model_cfg.head_dim * 4
    per_device = args.decode["dcp"] * min(args.decode["tp"], model_cfg.num_kv_heads)  # devices sharing the KV
    rng = np.random.default_rng(0)
    from dcp_jax import SamplingParams

    kw = dict(ignore_eos=True)

    # --- handoff per prompt length -----------------------------------------------------------------
    handoff = []
    for n in cfg["lengths"]:
        prompt = [int(t) for t in rng.integers(3, vocab, n)]
        pair.generate([prompt], SamplingParams(max_tokens=2, **kw))  # compile this shape
        s = pair.generate([prompt], SamplingParams(max_tokens=2, **kw)).stats
        kv = n * per_token
        row = dict(prompt_tokens=n, stage_ms=s["stage_s"] * 1e3, transfer_ms=s["transfer_s"] * 1e3,
                   write_ms=s["write_s"] * 1e3, handoff_ms=(s["stage_s"] + s["transfer_s"] + s["write_s"]) * 1e3,
                   transfer_bytes=s["transfer_bytes"], prompt_kv_bytes=kv, excess_bytes=s["transfer_bytes"] - kv,
                   one_page_per_rank_bytes=pair.prefill_llm.paged_layout().num_shards * ps * per_token,
                   max_device_bytes=s["max_device_bytes"], kv_per_device_bytes=kv // per_device,
                   prefill_ms=s["prefill_s"] * 1e3)
        handoff.append(row)
        log(f"handoff {n}: {row['handoff_ms']:.1f} ms, {row['transfer_bytes']} B")

    # --- new prompt lengths: the prefill side's gathers compiled on first use ---------------------------
    stager, src = pair.prefill.stager, pair.prefill_llm.paged_layout()
    seen = {src.blocks_for(n) for n in cfg["lengths"]}  # the handoff rows compiled these block counts already
    new_lengths = [b * src.tokens_per_block - 1 for b in range(1, src.blocks_for(max_len - 2) + 1) if b not in seen]
    before = len(stager.compiled)
    t0 = time.perf_counter()
    for n in new_lengths:
        pair.generate([[int(t) for t in rng.integers(3, vocab, n)]],
                      SamplingParams(max_tokens=2, **kw))
    first_use = dict(prompt_lengths=len(new_lengths), block_counts=len(new_lengths),  # one length per block count
                     gathers_compiled=len(stager.compiled) - before, wall_s=time.perf_counter() - t0)
    log(f"{len(new_lengths)} new lengths: {first_use['gathers_compiled']} gathers compiled")

    # --- the pair against one instance ---------------------------------------------------------------
    lens = bench_serving.log_uniform(rng, lo, hi, cfg["requests"])
    prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in lens]
    runs, tokens = [], {}
    for name, gen in (("one instance", one.generate), ("pair", pair.generate)):
        gen(prompts, max_new_tokens=out_n, **kw)  # warm-up: compile every program
        t0 = time.perf_counter()
        g = gen(prompts, max_new_tokens=out_n, **kw)
        wall = time.perf_counter() - t0
        s = g.stats
        ttft = [r["ttft_s"] for r in s["requests"]]
        tokens[name] = g.tokens
        runs.append(dict(run=name, wall_s=wall, ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99),
                         tpot_ms=s["decode_s"] / max(s["decode_steps"], 1) * 1e3,
                         out_tokens_per_s=s["generated_tokens"] / wall,
                         transfer_bytes=s.get("transfer_bytes"), transfer_s=s.get("transfer_s")))
        log(f"{name}: {wall:.2f} s")
    same = tokens["pair"] == tokens["one instance"]
    ratios = dict(ttft_p50=runs[1]["ttft_p50_s"] / runs[0]["ttft_p50_s"], tpot=runs[1]["tpot_ms"] / runs[0]["tpot_ms"],
                  wall=runs[1]["wall_s"] / runs[0]["wall_s"])
    pm, dm = args.prefill, args.decode
    report = dict(model=cfg["model"], prefill=pm, decode=dict(dm, interleave=args.decode_interleave), page_size=ps,
                  requests=cfg["requests"], output_tokens=out_n, handoff=handoff, first_use=first_use, serving=runs,
                  ratios_pair_over_one=ratios, tokens_equal=same, jax=jax.__version__)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"pair prefill {pm['tp']}x{pm['dcp']} -> decode {dm['tp']}x{dm['dcp']} (interleave "
              f"{args.decode_interleave}), pages of {ps}, {cfg['model']} model, float32, CPU")
        print(f"{'prompt':>7} {'stage ms':>9} {'pull ms':>8} {'write ms':>9} {'handoff ms':>11} {'bytes':>10} "
              f"{'prompt KV':>10} {'excess':>8} {'1 page/rank':>11} {'max/device':>10} {'KV/device':>10}")
        for r in handoff:
            print(f"{r['prompt_tokens']:>7} {r['stage_ms']:>9.2f} {r['transfer_ms']:>8.2f} {r['write_ms']:>9.2f} "
                  f"{r['handoff_ms']:>11.2f} {r['transfer_bytes']:>10} {r['prompt_kv_bytes']:>10} "
                  f"{r['excess_bytes']:>8} {r['one_page_per_rank_bytes']:>11} {r['max_device_bytes']:>10} "
                  f"{r['kv_per_device_bytes']:>10}")
        f = first_use
        print(f"\n{f['prompt_lengths']} new prompt lengths ({f['block_counts']} block counts), one request each: "
              f"{f['gathers_compiled']} gather programs compiled on the prefill side, {f['wall_s']:.1f} s")
        print(f"\n{cfg['requests']} requests, prompts {lo}..{hi}, {out_n} output tokens each, all at once")
        print(f"{'run':<13} {'wall s':>7} {'ttft p50/p99 s':>15} {'tpot ms':>8} {'out tok/s':>10}")
        for r in runs:
            print(f"{r['run']:<13} {r['wall_s']:>7.2f} {r['ttft_p50_s']:>7.2f}/{r['ttft_p99_s']:<7.2f} "
                  f"{r['tpot_ms']:>8.2f} {r['out_tokens_per_s']:>10.1f}")
        print(f"pair / one: ttft p50 x{ratios['ttft_p50']:.2f}, tpot x{ratios['tpot']:.2f}, wall x{ratios['wall']:.2f}; "
              f"greedy tokens equal: {same}")
    if not same:
        log("error: the pair's greedy tokens differ from the single instance's")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
