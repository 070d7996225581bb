"""8-bit KV pages (`--kv-cache-dtype int8|fp8`) against the model-dtype cache, on CPU, in one run:

  capacity   KV bytes per device one page costs (XLA-placed pool arrays, their shards: `kv_bytes`) for
             the same pool on float32 and 8-bit pages, and the tokens one budget then holds; the
             formula: a row of D features costs D + 4 bytes (its float32 scale) against 2D (bfloat16)
             or 4D (float32), so 128-wide heads give 1.94x / 3.88x and MLA's 576-wide latent 1.99x / 3.97x
  accuracy   each fixture's prompt + greedy continuation scored through the paged cache
             (prompt logprobs: every token attends the quantized KV): max and mean |logprob - float32's|,
             how many prompts keep all of their first 16 greedy tokens, and the largest top-2 gap of
             the model-dtype cache where one changed (how near a tie the changed tokens were)
  loss       the embedded model's held-out loss (nats per byte, the last 5% of pydoc_data as
             scripts/corpus.py splits it, 255-byte windows) with each cache, and the same greedy
             count over the windows' first 160 bytes

    python scripts/bench_kv_quant.py            # --windows 64 by default
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]
FIXTURES = ROOT / "tests" / "fixtures"
KINDS = ("auto", "int8", "fp8")


def fixture_rows(names):
    from dcp_jax import LLM, SamplingParams

    rows = []
    for name in names:
        exp = json.loads((FIXTURES / name / "expected.json").read_text())
        seqs = [p + g for p, g in zip(exp["prompts"], exp["greedy"])]
        lps, greedy, kv = {}, {}, {}
        for kind in KINDS:
            llm = LLM.load(FIXTURES / name, tp=1, dcp=2, page_size=4, kv_cache_dtype=kind, max_model_len=128,
                           impl="reference")
            out = llm.generate(seqs, SamplingParams(max_tokens=1, prompt_logprobs=0))
            lps[kind] = np.concatenate([np.asarray(x[1:], np.float64) for x in out.prompt_logprobs])
            greedy[kind] = llm.generate(exp["prompts"], SamplingParams(max_tokens=16, ignore_eos=True, top_logprobs=2))
            kv[kind] = llm.engine.kv_bytes()["kv_bytes_per_device"]
        for kind in KINDS[1:]:
            d = np.abs(lps[kind] - lps["auto"])
            rows.append(dict(fixture=name, kv=kind, max_abs=float(d.max()), mean_abs=float(d.mean()),
                             greedy16_same=sum(a == b for a, b in zip(greedy[kind].tokens, greedy["auto"].tokens)),
                             flip_gap=first_flip_gap(greedy["auto"], greedy[kind]),
                             prompts=len(seqs), kv_bytes_ratio=kv["auto"] / kv[kind]))
    return rows


def first_flip_gap(ref, out) -> float | None:
    """The largest top-2 logprob gap of the reference (model-dtype cache) at the first token where a
    greedy continuation differs from it (None when none differs): how close to a tie the flips were."""
    gaps = []
    for i, (want, got) in enumerate(zip(ref.tokens, out.tokens)):
        j = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if j is not None:
            (_, top1), (_, top2) = ref.top_logprobs[i][j][:2]
            gaps.append(top1 - top2)
    return max(gaps) if gaps else None


def held_out_losses(windows: int) -> dict:
    import corpus

    from dcp_jax import LLM, SamplingParams
    from dcp_jax.cli import DEFAULT_MODEL

    _, held = corpus.split()
    starts = np.linspace(0, len(held) - 256, windows).astype(int)
    texts = [list(held[s:s + 255]) for s in starts]
    out, greedy = {}, {}
    for kind in KINDS:
        llm = LLM.load(DEFAULT_MODEL, tp=1, dcp=2, kv_cache_dtype=kind, max_model_len=256, max_num_seqs=16,
                       impl="reference")
        gen = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=0))
        out[kind] = -float(np.mean(np.concatenate([np.asarray(x[1:], np.float64) for x in gen.prompt_logprobs])))
        # greedy continuations of each window's first 160 bytes (as the default run's prompt)
        greedy[kind] = llm.generate([t[:160] for t in texts], SamplingParams(max_tokens=16, ignore_eos=True,
                                                                             top_logprobs=2))
    same = {k: sum(a == b for a, b in zip(greedy["auto"].tokens, greedy[k].tokens)) for k in KINDS[1:]}
    gaps = {k: first_flip_gap(greedy["auto"], greedy[k]) for k in KINDS[1:]}
    return dict(loss=out, greedy16_same=same, flip_gap=gaps, windows=len(texts))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=64, help="held-out windows of the embedded model (default 64)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    import dcp_jax

    dcp_jax.ensure_cpu_devices(2)
    rows = fixture_rows(["llama-gqa", "mistral", "qwen3", "deepseek-v3"])
    held = held_out_losses(args.windows)
    losses = held["loss"]
    widths = {f"D={d}": {"vs bfloat16": 2 * d / (d + 4), "vs float32": 4 * d / (d + 4)} for d in (8, 64, 128, 576)}
    if args.json:
        print(json.dumps(dict(accuracy=rows, held_out_loss=losses, embedded_greedy=held, capacity_formula=widths)))
        return 0
    print("capacity (bytes per token and kv head: D + 4 against 2D / 4D)")
    for k, v in widths.items():
        print(f"  {k:6} {v['vs bfloat16']:.2f}x bfloat16, {v['vs float32']:.2f}x float32")
    print("accuracy (fixtures, float32 models, mesh 1x2; logprobs of prompt + greedy continuation)")
    print("  (greedy16: prompts whose 16 greedy tokens equal the model-dtype cache's; flip gap: the largest top-2")
    print("   logprob gap of the model-dtype cache at a first differing token, i.e. how near a tie the flips were)")
    print(f"  {'fixture':12} {'kv':5} {'max|dlp|':>9} {'mean|dlp|':>10} {'greedy16':>9} {'flip gap':>9} {'KV bytes':>9}")

    def gap(x):
        return "-" if x is None else f"{x:.4f}"

    for r in rows:
        print(f"  {r['fixture']:12} {r['kv']:5} {r['max_abs']:9.4f} {r['mean_abs']:10.5f} "
              f"{r['greedy16_same']:>5}/{r['prompts']:<3} {gap(r['flip_gap']):>9} {r['kv_bytes_ratio']:8.2f}x")
    base = losses["auto"]
    print("embedded model, held-out loss (nats/byte): " + ", ".join(
        f"{k} {v:.4f} ({100 * (v / base - 1):+.2f}%)" for k, v in losses.items()))
    print("embedded model, greedy16: " + ", ".join(
        f"{k} {held['greedy16_same'][k]}/{held['windows']} (flip gap {gap(held['flip_gap'][k])})" for k in KINDS[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
