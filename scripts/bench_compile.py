"""Compile time of the serving programs against depth: a shallow and a deep model of the same width,
compiled side by side in one run (the layers are one lax.scan, so the deep one should cost about the
same), with XLA's instruction count of each program; and what the scan costs at run time: decode
tokens/s with the layers scanned vs one program per layer (`scan_layers=False`), alternating in one
run. Prints a table, or one JSON object with --json.

    python scripts/bench_compile.py                   # 4 vs 32 layers, Llama-3.1-8B width, 1 x 2 mesh
    python scripts/bench_compile.py --quick --json    # the tiny width; the decode comparison on 2 layers

`--notebook`: what a user of `LLM.load` waits for instead (dcp_jax.compilation), each figure from a
fresh process: the llama fixture on 1 x 2 asked about a 3,000-token document, then a second question
about it: the second question's TTFT with prefix caching and without (and with caching but
`compile="lazy"`, the step size a cache hit needs compiled inside the request, as before `load`
compiled every program); then `LLM.load`'s load + compile time in a first and a second process
sharing a fresh persistent compilation cache.

    python scripts/bench_compile.py --notebook [--document 3000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "llama-tokenizer"

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
        for name, build in (("decode", runner.programs.decode_program), ("prefill", lambda: runner.programs.ragged_program(256))):
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


def notebook_child(spec: dict) -> dict:
    """In a fresh process: the notebook case with `spec`'s caching and compile mode; or with
    spec["startup"], only `LLM.load` (its default compile) timed."""
    t0 = time.perf_counter()
    import jax

    from dcp_jax.llm import LLM
    from dcp_jax.mesh import ensure_cpu_devices

    counts = {"hits": 0, "misses": 0}

    def on(event, **kw):
        for name in counts:
            counts[name] += event == "/jax/compilation_cache/cache_" + name

    jax.monitoring.register_event_listener(on)
    ensure_cpu_devices(2)
    t = time.perf_counter()
    llm = LLM.load(FIXTURE, tp=1, dcp=2, max_model_len=spec["document"] + 256,
                   compile=spec["compile"], enable_prefix_caching=spec["caching"],
                   compilation_cache=spec["cache"])
    out = dict(spec, load_s=time.perf_counter() - t, import_s=t - t0, cache_hits=counts["hits"],
               cache_misses=counts["misses"], programs=len(llm.engine.runner.compiled))
    if spec.get("startup"):
        return out
    document = llm.encode((ROOT / "README.md").read_text() * 4)[:spec["document"]]

    def ask(question: str):  # the document's tokens, then the question's
        ids = llm.tokenizer.encode(question, add_special_tokens=False).ids
        return llm.generate(document + ids, max_new_tokens=8)

    # 3,000 tokens: the first question's last chunk is a step of 128, the second's tail (past the
    # document's full blocks) one of 64: a size the first never ran
    first, second = ask(" Question: what does the document say about DCP?"), ask(" Why?")
    return dict(out, first_ttft_s=first.stats["ttft_s"], second_ttft_s=second.stats["ttft_s"],
                second_new_compilations=second.stats["new_compilations"],
                second_compile_s=second.stats["compile_s"],
                second_prefix_hit_tokens=second.stats["prefix_hit_tokens"])


def run_child(spec: dict) -> dict:
    """`notebook_child(spec)` in a fresh Python process (2 simulated CPU devices without a GPU)."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the child process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def notebook(document: int) -> dict:
    """The notebook case (three fresh processes, no persistent cache: what a first run sees) and the
    first vs second process's load + compile time with one fresh persistent cache."""
    base = dict(document=document, cache="off")
    runs = {name: run_child(dict(base, caching=caching, compile=mode)) for name, caching, mode in (
        ("caching", True, "all"), ("no_caching", False, "all"), ("caching_lazy", True, "lazy"))}
    with tempfile.TemporaryDirectory(prefix="dcp_jax-bench-xla-") as cache:
        spec = dict(document=document, cache=cache, caching=True, compile="all", startup=True)
        first, second = run_child(spec), run_child(spec)
    ratio = runs["no_caching"]["second_ttft_s"] / runs["caching"]["second_ttft_s"]
    return dict(runs, first_process=first, second_process=second,
                ttft_no_caching_over_caching=ratio,
                load_second_over_first=second["load_s"] / first["load_s"])


def print_notebook(out: dict) -> None:
    print(f"notebook case: llama fixture on 1 x 2, a {out['caching']['document']:,}-token "
          "document, a second question about it (fresh process each, no persistent cache)")
    for name in ("caching", "no_caching", "caching_lazy"):
        r = out[name]
        print(f"  {name:>12}: second question TTFT {r['second_ttft_s']:.3f} s "
              f"(first {r['first_ttft_s']:.3f} s), {r['second_new_compilations']} compile(s) in it "
              f"({r['second_compile_s']:.1f} s), {r['second_prefix_hit_tokens']:,} prefix-hit "
              f"tokens; load {r['load_s']:.1f} s with {r['programs']} programs")
    print(f"  TTFT without caching / with: {out['ttft_no_caching_over_caching']:.1f}x")
    print("load + compile with one fresh persistent compilation cache:")
    for name in ("first_process", "second_process"):
        r = out[name]
        print(f"  {name:>14}: LLM.load {r['load_s']:.1f} s ({r['programs']} programs; cache "
              f"{r['cache_hits']} hits, {r['cache_misses']} misses), imports {r['import_s']:.1f} s")
    print(f"  second / first: {out['load_second_over_first']:.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", choices=sorted(WIDTHS), default="llama-3.1-8b")
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=[4, 32])
    p.add_argument("--repeats", type=int, default=2, help="compiles per program (the best is reported)")
    p.add_argument("--quick", action="store_true", help="tiny width, one repeat")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens of the decode-speed comparison")
    p.add_argument("--json", action="store_true")
    p.add_argument("--notebook", action="store_true",
                   help="the notebook case's TTFTs, a first vs second process's load (see above)")
    p.add_argument("--document", type=int, default=3000, help="--notebook: the document's tokens")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(notebook_child(json.loads(args.child))))
        return 0
    if args.notebook:
        out = notebook(args.document)
        if args.json:
            print(json.dumps(out))
        else:
            print_notebook(out)
        return 0
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
