"""Compile time of the serving programs against depth: a shallow and a deep model of the same width,
compiled side by side in one run (the layers are one lax.scan, so the deep one should cost about the
same), with XLA's instruction count of each program; and what the scan costs at run time: decode
tokens/s with the layers scanned vs one program per layer (`scan_layers=False`), alternating in one
run. Prints a table, or one JSON object with --json.

    python scripts/bench_compile.py                   # 4 vs 32 layers, Llama-3.1-8B width, 1 x 2 mesh
    python scripts/bench_compile.py --quick --json    # the tiny width; the decode comparison on 2 layers
"""

from __future__ import annotations

import argparse
import json
import sys
import time

WIDTHS = {
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072),
    "tiny": dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=128, intermediate_size=384,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096),
}


def measure(width: str, layers: int, tp: int, dcp: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from dcp_jax import make_mesh
    from dcp_jax.config import ModelConfig
    from dcp_jax.llm import LLM
    from dcp_jax.mesh import named
    from dcp_jax.model import CausalLM

    cfg = ModelConfig.from_dict(dict(WIDTHS[width], num_hidden_layers=layers))
    mesh = make_mesh(tp, dcp)

    def abstract(name, shape, spec, kv_rep=1):  # nothing allocated: the programs compile from shapes
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=named(mesh, spec))

    row = dict(width=width, layers=layers, tp=tp, dcp=dcp)
    best = {}
    for _ in range(repeats):
        runner = LLM(CausalLM(cfg, abstract, mesh), mesh, page_size=64, max_model_len=4096, prefill_chunk=256,
                     num_pages=65).engine.runner
        for name, build in (("decode", runner.decode_program), ("prefill", lambda: runner.ragged_program(256))):
            t = time.perf_counter()
            prog = build()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
            row[f"{name}_instructions"] = sum(1 for line in prog.as_text().splitlines() if " = " in line)
    row.update({f"{k}_compile_s": round(v, 3) for k, v in best.items()})
    return row


def decode_speed(context: int, new_tokens: int, repeats: int, layers: int = 8) -> list[dict]:
    """Decode tokens/s and TTFT of one request with `context` prompt tokens on a random `layers`-layer
    Llama of hidden 512: `LLM.generate` (paged, continuous batching) and the dense static `Engine`, each with the
    layers scanned and with one stack per layer; alternating, best of `repeats`."""
    import numpy as np

    from dcp_jax import SamplingParams, make_mesh
    from dcp_jax.config import ModelConfig
    from dcp_jax.dense import Engine
    from dcp_jax.llm import LLM
    from dcp_jax.model import CausalLM, random_source

    cfg = ModelConfig.from_dict(dict(architectures=["LlamaForCausalLM"], vocab_size=4096, hidden_size=512,
                                     intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2,
                                     num_hidden_layers=layers, max_position_embeddings=1 << 16))
    mesh = make_mesh(1, 1)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, size=context).tolist()
    runs = {}
    for scan in (True, False):
        model = CausalLM(cfg, random_source(cfg, mesh), mesh, scan_layers=scan)
        # one request: a one-slot pool for its whole context (as generate sized it per call before)
        llm = LLM(model, mesh, max_model_len=context + new_tokens, max_num_seqs=1)
        dense = Engine(model, mesh)
        runs[("paged", scan)] = lambda llm=llm: llm.generate(
            [prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        runs[("dense", scan)] = lambda dense=dense: dense.generate([prompt], max_new_tokens=new_tokens,
                                                                     ignore_eos=True)
    best: dict = {}
    tokens = set()
    for _ in range(repeats):
        for key, run in runs.items():
            out = run()
            tok_s, ttft = best.get(key, (0.0, float("inf")))
            best[key] = (max(tok_s, out.stats["decode_tokens_per_s"]), min(ttft, out.stats["ttft_s"]))
            tokens.add(tuple(out.tokens[0]))
    assert len(tokens) == 1, "the four programs disagree"
    return [dict(engine=engine, scan_layers=scan, context=context, layers=layers,
                 decode_tokens_per_s=round(best[(engine, scan)][0], 2), ttft_s=round(best[(engine, scan)][1], 3))
            for engine, scan in runs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", choices=sorted(WIDTHS), default="llama-3.1-8b")
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[4, 32])
    p.add_argument("--repeats", type=int, default=2, help="compiles per program (the best is reported)")
    p.add_argument("--quick", action="store_true", help="tiny width, one repeat")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens of the decode-speed comparison")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.repeats, args.context = "tiny", 1, 256

    from dcp_jax.mesh import ensure_cpu_devices

    ensure_cpu_devices(2)
    rows = [measure(args.width, n, 1, 2, args.repeats) for n in args.layers]
    ratios = {name: rows[-1][f"{name}_compile_s"] / rows[0][f"{name}_compile_s"] for name in ("decode", "prefill")}
    # quick: 2 layers (the unscanned programs unroll every layer: 8 would compile four times the code)
    speed = decode_speed(args.context, 8 if args.quick else 32, args.repeats + 1, layers=2 if args.quick else 8)
    by = {(r["engine"], r["scan_layers"]): r["decode_tokens_per_s"] for r in speed}
    speed_ratio = by[("paged", True)] / by[("paged", False)]
    if args.json:
        print(json.dumps(dict(rows=rows, ratio_deepest_to_shallowest=ratios, decode_speed=speed,
                              scanned_to_per_layer_decode=speed_ratio)))
        return 0
    print(f"{'layers':>6} {'decode s':>9} {'prefill s':>9} {'decode instr':>13} {'prefill instr':>14}")
    for r in rows:
        print(f"{r['layers']:>6} {r['decode_compile_s']:>9.3f} {r['prefill_compile_s']:>9.3f} "
              f"{r['decode_instructions']:>13} {r['prefill_instructions']:>14}")
    print(f"{args.layers[-1]} / {args.layers[0]} layers compile time: decode {ratios['decode']:.2f}x, "
          f"prefill {ratios['prefill']:.2f}x")
    print(f"\ndecode of one {args.context}-token request, {speed[0]['layers']} layers of hidden 512 (best of {args.repeats + 1}):")
    for r in speed:
        print(f"  {r['engine']:>5} engine, {'layers scanned' if r['scan_layers'] else 'one stack per layer':>19}: "
              f"{r['decode_tokens_per_s']:7.2f} tok/s, TTFT {r['ttft_s']:.3f} s")
    print(f"  paged, scanned / per layer: {speed_ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
