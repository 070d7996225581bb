"""Per-device memory of real models under TP alone and TP x DCP, from XLA's own figures (no allocation).

For each model (by its published shapes), each (tp, dcp) of 8 and of 16 devices and each context, the
decode loop is compiled against abstract inputs (`jax.ShapeDtypeStruct` with shardings) and
`compiled.memory_analysis()` gives the bytes one device holds. Layers are identical, so the loop is
compiled with 2 layers and 1 layer: XLA's argument bytes of the two differ by exactly one layer's
weights + KV cache, which scales to the model's depth; the temporaries come from the 2-layer program.
The script checks XLA's per-layer figure against the arrays' shard shapes before using it. Temporaries are
XLA:CPU's: they include float32 copies of bf16 weights that CPU dots need (e.g. the lm_head shard), which a
GPU compile would not make, so they overstate what an H200 needs.

DeepSeek-V3.2's rows add its indexer's keys (128 values per token and layer beside the 576-value
latent, sharded like it): `index_bytes_per_device` and `index_bytes_total`, parts of the KV figures.

From these: the longest context that fits one device's budget (default 141 GB, an H200; `--budget-gb`)
at batch 1, and the largest batch at 128K.

    python scripts/bench_memory.py                  # all models, meshes of 8 and 16, 8K..1M
    python scripts/bench_memory.py --quick --json   # one model, 8 devices, two contexts
    python scripts/bench_memory.py --models DeepSeek-V3 Llama-3.1-70B --contexts 131072 --kv-cache-dtype fp8
Writes docs/bench_memory.json and docs/bench_memory.png (context that fits vs dcp) unless --quick, or a
subset of contexts, or an 8-bit cache is asked.

`--kv-cache-dtype fp8|int8`: 8-bit KV pages (`pallas_kernels/attention/kv_quant.py`). The bf16 cache is
compiled as above and its XLA figure scaled by the row layout, exactly: a row of D features costs D + 4
bytes (its values and float32 scale) against 2D in bfloat16 (D = head dim, or MLA's latent width).
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

ROOT = Path(__file__).resolve().parent.parent
LLAMA_31 = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, num_key_value_heads=8, rope_theta=500000.0,
                max_position_embeddings=131072)
MODELS = {  # published shapes (config.json of each release)
    "Llama-3.1-8B": dict(LLAMA_31, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32),
    "Llama-3.1-70B": dict(LLAMA_31, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64),
    "Llama-3.1-405B": dict(LLAMA_31, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                           num_attention_heads=128),
    "Qwen2.5-32B": dict(architectures=["Qwen2ForCausalLM"], vocab_size=152064, hidden_size=5120,
                        intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, rope_theta=1000000.0, max_position_embeddings=131072),
    # MLA + MoE: 3 dense layers then 58 MoE layers (256 routed experts, top-8, one shared expert).
    "DeepSeek-V3": dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
                        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                        n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                        first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True,
                        max_position_embeddings=163840,
                        rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                                          beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
}
# DeepSeek-V3.2(-Exp): V3's shapes plus the lightning indexer (DeepSeek Sparse Attention): one index
# key of 128 values per token and layer beside the 576-value latent, placed like it.
MODELS["DeepSeek-V3.2"] = dict(MODELS["DeepSeek-V3"], architectures=["DeepseekV32ForCausalLM"],
                               index_topk=2048, index_n_heads=64, index_head_dim=128)
CONTEXTS = [8192, 131072, 1048576]
DTYPE = jnp.bfloat16
# DeepSeek-V3 is published with float8 (e4m3) projection and expert weights (embeddings, norms, router
# and lm_head in bf16); its rows store those weights in float8 (the per-block scales, ~0.02%, are not
# modelled), computing in bf16. Other models: bf16 throughout.
FP8_WEIGHTS = {"DeepSeek-V3", "DeepSeek-V3.2"}


def meshes(devices: int, cfg) -> list[tuple[int, int]]:
    from dcp_jax.model import kv_replication

    out = []
    for tp in range(1, devices + 1):
        if devices % tp:
            continue
        try:
            kv_replication(cfg, tp)
        except ValueError:
            continue
        out.append((tp, devices // tp))
    return out


def analyse(name: str, layers: int, tp: int, dcp: int, context: int, batch: int, latent: str = "sharded",
            first_dense: int | None = None):
    """(argument bytes, temp bytes, kv shard bytes, weight shard bytes, index-key shard bytes) of
    the compiled decode loop (the index keys: DeepSeek-V3.2's, a part of the kv bytes; 0 otherwise).

    latent (MLA): "sharded" over the whole mesh (dcp_jax) or "replicated" on every device (TP alone).
    first_dense (MoE): how many of the `layers` are dense.
    """
    from dcp_jax import make_mesh
    from dcp_jax.config import ModelConfig
    from dcp_jax.dense import Engine
    from dcp_jax.mesh import AXES, named
    from dcp_jax.model import CausalLM

    overrides = dict(num_hidden_layers=layers)
    if first_dense is not None:
        overrides["first_k_dense_replace"] = first_dense
    cfg = ModelConfig.from_dict(dict(MODELS[name], **overrides))
    mesh = make_mesh(tp, dcp)
    fp8 = name in FP8_WEIGHTS

    def abstract(hf_name, shape, spec, kv_rep=1):
        dtype = jnp.float8_e4m3fn if fp8 and hf_name.endswith("proj.weight") else DTYPE
        return jax.ShapeDtypeStruct(shape, dtype, sharding=named(mesh, spec))

    model = CausalLM(cfg, abstract, mesh, latent_axes=AXES if latent == "sharded" else ())
    engine = Engine(model, mesh)
    layout = engine.layout(context)
    memory = engine.decode_program(batch, layout, 1).memory_analysis()
    cache, _ = engine.abstract_state(batch, layout)

    def shard_bytes(tree):
        return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.tree.leaves(tree))

    index = [stack[1] for stack in cache] if cfg.indexer else []
    return (memory.argument_size_in_bytes, memory.temp_size_in_bytes, shard_bytes(cache),
            shard_bytes(engine.params), shard_bytes(index))


def measure(name: str, tp: int, dcp: int, context: int, batch: int, latent: str = "sharded") -> dict:
    from dcp_jax.config import ModelConfig
    from dcp_jax.layout import kv_cache_bytes
    from dcp_jax.model import kv_replication

    full = ModelConfig.from_dict(MODELS[name])
    run = lambda layers, **kw: analyse(name, layers, tp, dcp, context, batch, latent, **kw)  # noqa: E731
    moe = full.moe is not None and full.moe.first_dense > 0
    # one layer, then two: XLA's argument bytes differ by one layer's weights + KV cache on one device
    arg1, _, kv1, w1, idx1 = run(1, **(dict(first_dense=1) if moe else {}))
    # (MoE: dense + MoE layer)
    arg2, temp2, kv2, w2, idx2 = run(2, **(dict(first_dense=1) if moe else {}))
    per_layer = arg2 - arg1
    assert per_layer == (kv2 - kv1) + (w2 - w1), (per_layer, kv2 - kv1, w2 - w1)
    kv_layer = kv2 - kv1
    if moe:  # dense layers weigh differently: two dense layers against one
        arg_dd, temp_dd, kv_dd, w_dd, _ = run(2, first_dense=2)
        assert arg_dd - arg1 == (kv_dd - kv1) + (w_dd - w1)
        dense_w, moe_w = w_dd - w1, w2 - w1
        weights = (w1 - dense_w) + full.moe.first_dense * dense_w + (full.num_layers - full.moe.first_dense) * moe_w
        temp2 = max(temp2, temp_dd)
    else:
        weights = (w1 - (w2 - w1)) + full.num_layers * (w2 - w1)  # embeddings/norms + L layers
    kv = full.num_layers * kv_layer
    rep = kv_replication(full, tp)
    index_dim = full.indexer.head_dim if full.indexer else 0
    if full.mla:  # one latent per token: key = [c_kv | k_pe], value = its first kv_lora_rank (not stored twice)
        # (DeepSeek-V3.2: and one index key per token)
        kv_total = kv_cache_bytes(batch=batch, num_layers=full.num_layers, kv_heads=1, max_seq_len=context,
                                  k_dim=full.mla.latent_dim + index_dim, v_dim=0, dtype=DTYPE)
    else:
        kv_total = kv_cache_bytes(batch=batch, num_layers=full.num_layers, kv_heads=full.num_kv_heads,
                                  max_seq_len=context, k_dim=full.head_dim, v_dim=full.head_dim, dtype=DTYPE)
    return dict(model=name, tp=tp, dcp=dcp, devices=tp * dcp, context=context, batch=batch,
                kv_heads=full.num_kv_heads, kv_replication=rep, kv_bytes_per_device=kv,
                kv_bytes_total=kv_total, weight_bytes_per_device=weights, temp_bytes_per_device=temp2,
                xla_layer_bytes=per_layer, layout=layout_name(full, latent),
                **(index_rows(full, batch, context, full.num_layers * (idx2 - idx1))
                   if index_dim else {}))


def index_rows(cfg, batch: int, context: int, per_device: int) -> dict:
    """DeepSeek-V3.2's index keys: their bytes per device (XLA's) and in all (counted once)."""
    from dcp_jax.layout import kv_cache_bytes

    total = kv_cache_bytes(batch=batch, num_layers=cfg.num_layers, kv_heads=1, max_seq_len=context,
                           k_dim=cfg.indexer.head_dim, v_dim=0, dtype=DTYPE)
    return {"index_bytes_per_device": per_device, "index_bytes_total": total}


def layout_name(cfg, latent: str) -> str:
    if not cfg.mla:
        return "kv heads over tp, sequence over dcp"
    return "latent sequence over tp x dcp" if latent == "sharded" else "latent replicated (TP alone)"


def kv_shards(cfg, tp: int, dcp: int, latent: str) -> int:
    """Into how many parts the layout splits the cache (what XLA's per-device figure must show)."""
    if cfg.mla:
        return tp * dcp if latent == "sharded" else 1
    return min(tp, cfg.num_kv_heads) * dcp


def eight_bit(row, kind: str) -> dict:
    """`row` (bf16 KV, XLA's figures) with its KV bytes as 8-bit pages of the same placement."""
    from dcp_jax.config import ModelConfig
    from pallas_kernels.attention import kv_quant as kvq

    cfg = ModelConfig.from_dict(MODELS[row["model"]])
    if cfg.indexer:
        raise SystemExit(f"{row['model']}: dcp_jax serves DeepSeek-V3.2's sparse attention with no "
                         "8-bit KV cache yet; drop --kv-cache-dtype or --models it")
    d = cfg.mla.latent_dim if cfg.mla else cfg.head_dim
    ratio = kvq.width(d, kind) / (2 * d)
    return dict(row, kv_cache_dtype=kind, kv_bytes_per_device=int(row["kv_bytes_per_device"] * ratio),
                kv_bytes_total=int(row["kv_bytes_total"] * ratio), kv_ratio_vs_bf16=2 * d / kvq.width(d, kind))


def fits(row, budget: float) -> dict:
    used = row["weight_bytes_per_device"] + row["kv_bytes_per_device"] + row["temp_bytes_per_device"]
    per_token = row["kv_bytes_per_device"] / (row["context"] * row["batch"])  # linear in context and batch
    free = budget - row["weight_bytes_per_device"] - row["temp_bytes_per_device"]
    return dict(row, fits=bool(used <= budget), bytes_per_device=used,
                max_context_batch1=int(max(free, 0) // per_token) if free > 0 else 0,
                max_batch_at_128k=int(max(free, 0) // (per_token * 131072)) if free > 0 else 0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-gb", type=float, default=141.0, help="bytes per device, in GB (1e9)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), help="a subset of the models (default: all)")
    p.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",")], default=None,
                   help="comma-separated contexts (default 8192,131072,1048576)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8"), default="auto",
                   help="the KV pages' format (8-bit: the bf16 figures scaled by the row layout)")
    args = p.parse_args(argv)
    budget = args.budget_gb * 1e9

    from dcp_jax.config import ModelConfig
    from dcp_jax.mesh import ensure_cpu_devices

    if args.quick:
        plan = [("Llama-3.1-8B", 8, [131072])]
    else:
        plan = [(m, d, args.contexts or CONTEXTS) for m in (args.models or MODELS) for d in (8, 16)]
    ensure_cpu_devices(max(d for _, d, _ in plan))
    rows = []
    for name, devices, contexts in plan:
        cfg = ModelConfig.from_dict(MODELS[name])
        layouts = [(tp, dcp, "sharded") for tp, dcp in (meshes(devices, cfg) if not args.quick else [(1, 8), (8, 1)])]
        if cfg.mla:  # the TP-alone baseline: the latent replicated on every device
            layouts.insert(0, (devices, 1, "replicated"))
        for tp, dcp, latent in layouts:
            for context in contexts:
                t = time.perf_counter()
                row = measure(name, tp, dcp, context, 1, latent)
                if args.kv_cache_dtype != "auto":
                    row = eight_bit(row, args.kv_cache_dtype)
                row = fits(row, budget)
                row["analysis_s"] = round(time.perf_counter() - t, 2)
                # XLA's KV bytes per device are exactly total / (min(tp, kv_heads) * dcp); MLA: / (tp * dcp)
                assert abs(row["kv_bytes_per_device"] * kv_shards(cfg, tp, dcp, latent) - row["kv_bytes_total"]) \
                    <= kv_shards(cfg, tp, dcp, latent), row
                if "index_bytes_per_device" in row:  # the index keys: placed like the latent
                    shards = kv_shards(cfg, tp, dcp, latent)
                    error = row["index_bytes_per_device"] * shards - row["index_bytes_total"]
                    assert abs(error) <= shards, row
                rows.append(row)
                if not args.json:
                    tag = " (replicated latent)" if latent == "replicated" else ""
                    if "index_bytes_per_device" in row:  # (DeepSeek-V3.2: its index keys' share)
                        index_gb = row["index_bytes_per_device"] / 1e9
                        tag += f" (index keys {index_gb:.2f} GB of the KV)"
                    print(f"{name:15s} tp={tp:2d} dcp={dcp:2d}{tag} ctx {context:>9,}: weights "
                          f"{row['weight_bytes_per_device'] / 1e9:7.2f} GB  KV {row['kv_bytes_per_device'] / 1e9:8.2f} GB"
                          f"  temp {row['temp_bytes_per_device'] / 1e9:6.3f} GB  fits {row['fits']!s:5s}  "
                          f"longest context {row['max_context_batch1']:>12,}  batch@128K {row['max_batch_at_128k']:>5,}",
                          flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))
    if args.quick or args.contexts or args.kv_cache_dtype != "auto":
        if not (args.quick or args.json):
            summary(rows, budget)
    else:
        (ROOT / "docs").mkdir(exist_ok=True)
        out = ROOT / "docs" / "bench_memory.json"
        if args.models and out.exists():  # a subset re-measured: keep the other models' rows
            done = {r["model"] for r in rows}
            rows = [r for r in json.loads(out.read_text())["rows"] if r["model"] not in done] + rows
        out.write_text(json.dumps({"rows": rows}, indent=1))
        summary(rows, budget)
        plot(rows)
    return 0


def summary(rows, budget):
    print(f"\nBudget {budget / 1e9:.0f} GB per device; at 128K context, batch 1:")
    for name in MODELS:
        for devices in (8, 16):
            sel = [r for r in rows if r["model"] == name and r["devices"] == devices and r["context"] == 131072]
            if not sel:
                continue
            tp_only = next((r for r in sel if r["dcp"] == 1 and "replicated" in r.get("layout", "")), None) or next(
                (r for r in sel if r["dcp"] == 1), None)
            best = max(sel, key=lambda r: (r["max_context_batch1"], r["max_batch_at_128k"]))
            fmt = lambda r: (f"tp={r['tp']} x dcp={r['dcp']}: longest context {r['max_context_batch1']:,}, "
                             f"largest batch at 128K {r['max_batch_at_128k']:,}")
            print(f"  {name:15s} on {devices:2d}: TP alone {fmt(tp_only) if tp_only else 'n/a'} | best {fmt(best)}")


def plot(rows):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, devices in zip(axes, (8, 16)):
        for name in MODELS:
            for layout in sorted({r.get("layout", "") for r in rows if r["model"] == name}):
                sel = sorted({(r["dcp"], r["max_context_batch1"]) for r in rows
                              if r["model"] == name and r["devices"] == devices and r["context"] == 131072
                              and r.get("layout", "") == layout})
                replicated = "replicated" in layout
                if sel:
                    ax.plot([d for d, _ in sel], [max(c, 1) for _, c in sel], "x" if replicated else "o-",
                            label=f"{name} ({layout})" if "latent" in layout else name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("dcp (tp = devices / dcp)")
        ax.set_title(f"{devices} H200-sized devices (141 GB)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("longest context that fits (tokens, batch 1)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(ROOT / "docs" / "bench_memory.png", dpi=100)


if __name__ == "__main__":
    sys.exit(main())
