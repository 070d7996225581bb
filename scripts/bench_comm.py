"""Collective bytes per decode step per device, read from XLA's compiled HLO (no allocation, no run).

For a model of real width (Llama-3.1-8B shapes by default, with `--layers` of them: per-layer traffic
is the same in every layer) the one-token decode step is compiled against abstract inputs for each
mesh and context length, and every collective in the compiled program is summed as the bytes a ring
implementation moves per device, up to its (n-1)/n factor: the gathered result of an all-gather, the
operand of a reduce-scatter or all-to-all, twice the operand of an all-reduce (a reduce-scatter then
an all-gather). DCP's claim: this does not grow with the context.

    python scripts/bench_comm.py            # meshes of 8 devices, contexts 4K .. 1M
    python scripts/bench_comm.py --quick --json   # tiny model, tp=2 x dcp=4, every variant, 4K and 64K

Variants compared (on every mesh with dcp > 1; with dcp = 1 there is nothing to combine and only
"scatter" is measured):
  scatter             all_gather of the LSE, `psum_scatter` of the weighted outputs over heads (the default)
  psum                all_gather of the LSE, `psum` of the full weighted outputs (every rank keeps all heads)
  all_to_all          one `all_to_all` of each rank's outputs and LSE, sliced by the heads each rank will
                      own, then a local merge (`merge_partials`); same output sharding as scatter
  scatter+q_gather    scatter, with q_proj split over ("tp","dcp") and q all-gathered over "dcp"
                      (`CausalLM(q_gather=True)`) instead of every dcp rank computing its tp group's q
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

MODELS = {
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0, max_position_embeddings=131072),
    "tiny": dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=128, intermediate_size=384,
                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 20),
}
_COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s+(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?:-start)?\(([^)]*)\)")
_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([0-9,]*)\]")
_BYTES = dict(pred=1, s8=1, u8=1, s16=2, u16=2, bf16=2, f16=2, s32=4, u32=4, f32=4, s64=8, u64=8, f64=8)


def _shape_bytes(text: str) -> int:
    return sum(_BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for t, dims in _SHAPE.findall(text))


_RING = {"all-reduce": 2}


_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_CALLED = re.compile(r"(body|calls|to_apply|branch_computations)=\{?%?([\w.\-]+(?:, %?[\w.\-]+)*)\}?")


def _executions(lines: list[str]) -> dict[str, int]:
    """How many times each computation runs per call of the module: a while loop's body runs its known
    trip count times per run of its caller (the scanned layers: one body, `layers` runs); computations
    called otherwise run once per caller run. Bodies without a known trip count count once."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in lines:
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
            comps[current] = []
            entry = current if m.group(1) else entry
        elif current is not None:
            comps[current].append(line)
    runs = {entry: 1}
    todo = [entry]
    while todo:
        comp = todo.pop()
        for line in comps.get(comp, []):
            trip = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            for kind, names in _CALLED.findall(line):
                times = int(trip.group(1)) if kind == "body" and trip else 1
                for name in re.split(r",\s*%?", names):
                    if name in comps and name not in runs:
                        runs[name] = runs[comp] * times
                        todo.append(name)
    return {name: runs.get(name, 1) for name in comps}


def _collectives(hlo: str):
    """(kind, ring bytes) of every collective the module runs per call (see the module docstring); one
    in a loop body counts once per iteration (`_executions`)."""
    # XLA prints /*index=5*/ inside long tuples: drop comments, or their "=" hides the tuple's first elements
    lines = [re.sub(r"/\*.*?\*/", "", line) for line in hlo.splitlines()]
    runs = _executions(lines)
    shapes = {}
    for line in lines:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ([^ ]+)", line)
        if m:
            shapes[m.group(1)] = m.group(2)
    current = None
    for line in lines:
        c = _COMPUTATION.match(line)
        if c:
            current = c.group(2)
            continue
        m = _COLLECTIVE.search(line)
        if not m or "-done" in line:
            continue
        result, kind, operands = m.groups()
        operand_bytes = sum(_shape_bytes(shapes.get(o.strip().lstrip("%"), "")) for o in operands.split(","))
        for _ in range(runs.get(current, 1)):
            yield kind, _RING.get(kind, 1) * max(_shape_bytes(result), operand_bytes)


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes per collective kind in an HLO module (ring cost)."""
    out: dict[str, int] = {}
    for kind, nbytes in _collectives(hlo):
        out[kind] = out.get(kind, 0) + nbytes
    return out


def collective_counts(hlo: str) -> dict[str, int]:
    """How many collectives of each kind an HLO module launches."""
    out: dict[str, int] = {}
    for kind, _ in _collectives(hlo):
        out[kind] = out.get(kind, 0) + 1
    return out


VARIANTS = ("scatter", "psum", "all_to_all", "scatter+q_gather")


def step_hlo(model_name: str, layers: int, tp: int, dcp: int, context: int, variant: str, batch: int) -> str:
    from dcp_jax import make_mesh
    from dcp_jax.config import ModelConfig
    from dcp_jax.dense import Engine
    from dcp_jax.mesh import named
    from dcp_jax.model import CausalLM

    cfg = ModelConfig.from_dict(dict(MODELS[model_name], num_hidden_layers=layers))
    mesh = make_mesh(tp, dcp)

    def abstract(name, shape, spec, kv_rep=1):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=named(mesh, spec))

    combine, _, option = variant.partition("+")
    engine = Engine(CausalLM(cfg, abstract, mesh, q_gather=option == "q_gather"), mesh, combine=combine)
    layout = engine.layout(context)
    cache, logits = engine.abstract_state(batch, layout)
    step = engine.prefill_fn(layout)  # one token through every layer: the decode step's program
    tok = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    vec_i = jax.ShapeDtypeStruct((batch,), jnp.int32)
    vec_b = jax.ShapeDtypeStruct((batch,), jnp.bool_)
    lowered = step.lower(engine.params, cache, logits, tok, tok, jax.ShapeDtypeStruct((batch, 1), jnp.bool_),
                         vec_i, vec_i, vec_b)
    return lowered.compile().as_text()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny model, two contexts, the 2 x 4 mesh")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from dcp_jax.mesh import ensure_cpu_devices

    ensure_cpu_devices(8)
    if args.quick:
        model, meshes, contexts = "tiny", [(2, 4)], [4096, 65536]
    else:
        model, meshes = args.model, [(8, 1), (4, 2), (2, 4), (1, 8)]
        contexts = [4096, 16384, 65536, 262144, 1048576]
    rows = []
    for tp, dcp in meshes:
        for variant in args.variants:
            if dcp == 1 and variant != "scatter":  # one context rank: every variant is the same program
                continue
            for context in contexts:
                t = time.perf_counter()
                hlo = step_hlo(model, args.layers, tp, dcp, context, variant, args.batch)
                kinds, counts = collective_bytes(hlo), collective_counts(hlo)
                rows.append(dict(model=model, layers=args.layers, batch=args.batch, tp=tp, dcp=dcp, context=context,
                                 variant=variant, collective_bytes_per_step=sum(kinds.values()),
                                 collectives_per_step=sum(counts.values()),
                                 **{f"bytes_{k.replace('-', '_')}": v for k, v in sorted(kinds.items())},
                                 **{f"count_{k.replace('-', '_')}": v for k, v in sorted(counts.items())},
                                 compile_s=round(time.perf_counter() - t, 2)))
                if not args.json:
                    r = rows[-1]
                    print(f"tp={tp} dcp={dcp} {variant:16s} context {context:>8,}: "
                          f"{r['collective_bytes_per_step']:>12,} B/step in {r['collectives_per_step']} "
                          f"collectives  {kinds}", flush=True)
    # the claim: flat in context, per mesh and variant
    spread = {}
    for r in rows:
        spread.setdefault((r["tp"], r["dcp"], r["variant"]), []).append(r["collective_bytes_per_step"])
    worst = max((max(v) - min(v)) / max(min(v), 1) for v in spread.values())
    if args.json:
        print(json.dumps({"rows": rows, "max_relative_change_over_context": worst}))
    else:
        print(f"largest change of collective bytes over contexts {contexts[0]:,}..{contexts[-1]:,}: "
              f"{100 * worst:.3f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
