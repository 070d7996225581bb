"""Serving on CPU: continuous batching against the static-batch baseline, and long-request capacity vs dcp.

Two measurements on one random-weight float32 Llama checkpoint:

  serving   N requests with mixed prompt lengths (log-uniform, default 64 to 16K) and output lengths
            (log-uniform, default 8 to 128), random ids, greedy, ignore_eos (each request produces
            exactly its max_tokens). Three runs on one mesh, in one interpreter, on the same model:
              continuous, all at once   `LLM.engine` + `run_requests`: paged pool, S slots, chunked
                                        prefill, K-step decode; every request arrives at t=0
              continuous, Poisson       the same engine, requests arriving at a Poisson rate near its
                                        measured request throughput (`--load` times it), seeded
              static, all at once       the old dense `Engine.generate`: the same requests in arrival
                                        order in fixed batches of S, each padded to its longest prompt
                                        and run for its longest max_tokens, one batch after the other
            Output tokens/s = useful output tokens / wall; TTFT and TPOT (time per output token after
            the first) p50/p99 per request; pages in use sampled after every scheduler step. Each
            request's greedy tokens under continuous batching must equal its first max_tokens tokens
            from the static run: a mismatch is reported and the script exits with status 1.
  capacity  the same per-device KV budget (bytes) on a dcp=1 mesh and a dcp=N mesh, each in its own
            interpreter: many long requests all at once with many slots; the peak number of requests
            decoding in the same step (each with its whole prompt in the cache) and kv_capacity_tokens.

Compilation is excluded on both sides: the serving engine's two programs are compiled ahead of time
and exercised by a small warm-up run before the timed runs; the dense engine compiles each batch shape
inside `generate` and reports it as stats["compile_s"], which is subtracted from that batch's wall time.

Each mesh runs in an interpreter that sees exactly tp·dcp simulated CPU devices (XLA's CPU thread
pool is max(cores, devices); see scripts/bench_decode.py).

    python scripts/bench_serving.py                 # 32 requests, 64..16K prompts; capacity 1x1 vs 1x4
    python scripts/bench_serving.py --quick --json  # tiny checkpoint, 12 requests of 16..512 tokens
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers
import random_llama  # noqa: E402

# Hugging Face LlamaConfig fields of the generated checkpoints (random weights; head_dim 64 / 16).
MODELS = {
    "bench": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=768, vocab_size=1024, max_position_embeddings=32768),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=192, vocab_size=256, max_position_embeddings=4096),
}

# Sizes of the default and the --quick run (command-line flags override them one by one).
DEFAULTS = dict(
    model="bench", requests=32, prompt_min=64, prompt_max=16384, output_min=8, output_max=128,
    max_num_seqs=8, prefill_chunk=256, page_size=64, decode_steps=8,
    cap_requests=16, cap_prompt=4064, cap_output=32, cap_page_size=64, cap_fit=3, cap_chunk=4096,
    client_requests=32, client_prompt=(64, 2048), client_output=(8, 64), client_concurrency=[1, 4, 16],
)
QUICK = dict(
    model="tiny", requests=12, prompt_min=16, prompt_max=512, output_min=4, output_max=32,
    max_num_seqs=4, prefill_chunk=128, page_size=16, decode_steps=8,
    cap_requests=10, cap_prompt=240, cap_output=16, cap_page_size=16, cap_fit=2, cap_chunk=256,
    client_requests=8, client_prompt=(16, 256), client_output=(4, 16), client_concurrency=[1, 4],
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- the checkpoint --------------------------------------------------------------------------------
def hf_config(model: str) -> dict:
    m = MODELS[model]
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                head_dim=m["hidden_size"] // m["num_attention_heads"], rms_norm_eps=1e-5, rope_theta=10000.0,
                tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=1,
                eos_token_id=2, torch_dtype="float32", use_cache=True, **m)


def ensure_checkpoint(path: Path, model: str) -> Path:
    """`path` as is when it holds a config.json; else write the random `model` checkpoint there."""
    return random_llama.ensure_checkpoint(path, hf_config(model))


# --- the workload ----------------------------------------------------------------------------------
def log_uniform(rng, lo: int, hi: int, n: int) -> list[int]:
    """n integers drawn log-uniformly from [lo, hi]."""
    return [int(x) for x in np.clip(np.round(np.exp(rng.uniform(math.log(lo), math.log(hi), n))), lo, hi)]


def make_workload(n: int, prompt_range, output_range, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    lens = log_uniform(rng, *prompt_range, n)
    outs = log_uniform(rng, *output_range, n)
    return [dict(id=f"r{i}", prompt=rng.integers(3, vocab, size=p).tolist(), max_tokens=o)
            for i, (p, o) in enumerate(zip(lens, outs))]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` requests/s; the first request comes at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


def pct(values, q):
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


# --- worker side (one interpreter per mesh) --------------------------------------------------------
def load_llm(spec: dict, **kw):
    from dcp_jax.mesh import ensure_cpu_devices

    ensure_cpu_devices(spec["tp"] * spec["dcp"])
    from dcp_jax.llm import LLM

    # Prefix caching off by default: the runs share one pool and the same prompts, and the comparison is
    # continuous batching against static batches (scripts/bench_prefix.py measures the cache);
    # --prefix-caching turns it on, to check it costs nothing when no prefix is shared.
    return LLM.load(spec["checkpoint"], tp=spec["tp"], dcp=spec["dcp"],
                    enable_prefix_caching=spec.get("prefix_caching", False), **kw)


def continuous_run(server, workload: list[dict], arrivals=None) -> dict:
    """Serve `workload` through `server`; per-request times and tokens, pages in use, work done."""
    from dcp_jax.serving.engine import run_requests
    from dcp_jax.serving.request import Request

    reqs = [Request(w["id"], w["prompt"], max_tokens=w["max_tokens"], ignore_eos=True) for w in workload]
    finished: dict[str, float] = {}
    pages, active, work = [], [], dict(prefill_calls=0, prefill_tokens=0, decode_steps=0)
    chunk, slots = server.config.prefill_chunk, server.config.max_num_seqs

    def on_prefill(n):
        work["prefill_calls"] += 1
        work["prefill_tokens"] += n

    def on_step(plan):
        t = time.perf_counter()
        for r in reqs:
            if r.finish_reason is not None and r.request_id not in finished:
                finished[r.request_id] = t
        pages.append(server.scheduler.stats()["pages_used"])
        active.append(len(plan.decode_slots) + len(plan.prefills))
        work["decode_steps"] += plan.decode_steps  # the program runs every slot for K steps

    result = run_requests(server, reqs, arrivals=arrivals, on_step=on_step, on_prefill=on_prefill)
    per = []
    for r in reqs:
        if r.error is not None:
            raise SystemExit(f"error: request {r.request_id} failed: {r.error}")
        ttft = result["first_token_s"][r.request_id]
        first_abs = r.arrival_time + ttft
        n = len(r.output_token_ids)
        end = finished[r.request_id]
        per.append(dict(id=r.request_id, prompt_tokens=r.num_prompt_tokens, output_tokens=n, ttft_s=ttft,
                        tpot_s=(end - first_abs) / (n - 1) if n > 1 else None, latency_s=end - r.arrival_time,
                        preemptions=r.num_preemptions, tokens=list(r.output_token_ids)))
    out_tokens = sum(p["output_tokens"] for p in per)
    return dict(
        wall_s=result["wall_s"], requests=per, output_tokens=out_tokens,
        pages_used_max=max(pages), pages_used_mean=float(np.mean(pages)), pages_total=result["pages_total"],
        kv_capacity_tokens=result["kv_capacity_tokens"], preemptions=result["preemptions"], steps=len(pages),
        peak_active=max(active),
        # work the device did: prefill pieces are padded to the compiled chunk, decode runs every slot
        prefill_tokens_computed=work["prefill_calls"] * chunk, prefill_tokens_useful=work["prefill_tokens"],
        decode_tokens_computed=work["decode_steps"] * slots,
        decode_tokens_useful=out_tokens - len(per))


def static_run(engine, workload: list[dict], batch: int, prefill_chunk: int) -> dict:
    """The dense engine over `workload` in arrival order, `batch` requests at a time, each batch padded to
    its longest prompt and run for its longest max_tokens. Compile time (stats["compile_s"]) is
    subtracted from each batch's wall time; requests all arrive at t=0."""
    per, clock, computed = [], 0.0, dict(prefill=0, decode=0)
    for b0 in range(0, len(workload), batch):
        group = workload[b0:b0 + batch]
        longest = max(len(w["prompt"]) for w in group)
        steps = max(w["max_tokens"] for w in group)
        t = time.perf_counter()
        gen = engine.generate([w["prompt"] for w in group], max_new_tokens=steps, max_seq_len=longest + steps,
                              prefill_chunk=prefill_chunk, ignore_eos=True)
        run_s = time.perf_counter() - t - gen.stats["compile_s"]
        ttft, decode_s = gen.stats["ttft_s"], gen.stats["decode_s"]
        chunk = min(prefill_chunk, longest)
        computed["prefill"] += len(group) * math.ceil(longest / chunk) * chunk
        computed["decode"] += len(group) * (steps - 1)
        for w, tokens in zip(group, gen.tokens):
            m = w["max_tokens"]
            per_token = decode_s / (steps - 1) if steps > 1 else None
            per.append(dict(id=w["id"], prompt_tokens=len(w["prompt"]), output_tokens=m, ttft_s=clock + ttft,
                            tpot_s=per_token if m > 1 else None,
                            latency_s=clock + ttft + (per_token or 0.0) * (m - 1), tokens=tokens[:m]))
        log(f"  static batch {b0 // batch}: {len(group)} x {longest} prompt tokens, {steps} steps: "
            f"{run_s:.2f} s (+ {gen.stats['compile_s']:.1f} s compile)")
        clock += run_s
    out_tokens = sum(p["output_tokens"] for p in per)
    return dict(wall_s=clock, requests=per, output_tokens=out_tokens,
                prefill_tokens_computed=computed["prefill"],
                prefill_tokens_useful=sum(len(w["prompt"]) for w in workload),
                decode_tokens_computed=computed["decode"], decode_tokens_useful=out_tokens - len(per))


def serving_worker(spec: dict) -> dict:
    s = spec["max_num_seqs"]
    workload = spec["workload"]
    max_model_len = max(len(w["prompt"]) + w["max_tokens"] for w in workload)
    budget = spec.get("kv_cache_memory")
    llm = load_llm(spec, max_num_seqs=s, page_size=spec["page_size"], decode_steps=spec["decode_steps"],
                   kv_cache_memory=budget, max_model_len=max_model_len, prefill_chunk=spec["prefill_chunk"])
    import jax

    from dcp_jax.dense import Engine
    from dcp_jax.serving.engine import run_requests
    from dcp_jax.serving.request import Request

    # the pool: the KV budget when one is given, else max_num_seqs sequences of the longest request
    pages = 1 + s * llm.paged_layout().blocks_for(max_model_len)
    server = llm.engine if budget is not None or llm.config.num_pages == pages else llm.engine_with(num_pages=pages)
    tc = time.perf_counter()
    server.runner.compile_all()  # the prefill and decode programs, and the pool
    compile_s = time.perf_counter() - tc
    # warm-up (not timed): both programs run once, two prefill pieces and two decode calls
    warm = [Request("warm", [3] * (spec["prefill_chunk"] + 1), max_tokens=2 * spec["decode_steps"] + 1,
                    ignore_eos=True)]
    run_requests(server, warm)
    log(f"  serving engine: {len(jax.devices())} devices, compile {compile_s:.1f} s, pool "
        f"{server.scheduler.stats()['pages_total']} pages")

    t = time.perf_counter()
    burst = continuous_run(server, workload)
    log(f"  continuous, all at once: {burst['wall_s']:.2f} s ({time.perf_counter() - t:.0f} s)")
    rate = spec["rate"] or spec["load"] * len(workload) / burst["wall_s"]
    arrivals = poisson_arrivals(len(workload), rate, spec["seed"] + 1)
    poisson = continuous_run(server, workload, arrivals)
    poisson["rate_rps"] = rate
    log(f"  continuous, Poisson {rate:.2f} req/s: {poisson['wall_s']:.2f} s")
    dense = Engine(llm.model, llm.mesh, interleave=llm.interleave, impl=llm.impl)  # the static baseline
    static = static_run(dense, workload, s, spec["prefill_chunk"])
    log(f"  static: {static['wall_s']:.2f} s")
    return dict(devices=len(jax.devices()), compile_s=compile_s, max_model_len=max_model_len,
                burst=burst, poisson=poisson, static=static)


def capacity_worker(spec: dict) -> dict:
    """Decode steps K = 1, so a request decodes one token per scheduler step while the next ones prefill:
    its output length then keeps it resident long enough for the pool to fill up."""
    workload = spec["workload"]
    max_model_len = max(len(w["prompt"]) + w["max_tokens"] for w in workload)
    llm = load_llm(spec, max_num_seqs=spec["max_num_seqs"], page_size=spec["page_size"], decode_steps=1,
                   kv_cache_memory=spec["kv_cache_memory"], max_model_len=max_model_len,
                   prefill_chunk=spec["prefill_chunk"])
    import jax

    from dcp_jax.serving.engine import run_requests
    from dcp_jax.serving.request import Request
    from dcp_jax.serving.runner import page_bytes_per_device

    server = llm.engine
    server.runner.compile_all()
    peak = dict(decoding=0, running=0)
    reqs = [Request(w["id"], w["prompt"], max_tokens=w["max_tokens"], ignore_eos=True) for w in workload]

    def on_step(plan):
        peak["decoding"] = max(peak["decoding"], len(plan.decode_slots))
        peak["running"] = max(peak["running"], len(plan.decode_slots) + len(plan.prefills))

    result = run_requests(server, reqs, on_step=on_step)
    errors = [r.error for r in reqs if r.error is not None]
    if errors:
        raise SystemExit(f"error: capacity run tp={spec['tp']} dcp={spec['dcp']}: {errors[0]}")
    page_bytes = page_bytes_per_device(llm.model, llm.mesh, spec["page_size"], server.runner.dtype)
    return dict(tp=spec["tp"], dcp=spec["dcp"], devices=len(jax.devices()), budget_bytes=spec["kv_cache_memory"],
                page_bytes_per_device=page_bytes, pages_total=result["pages_total"],
                kv_capacity_tokens=result["kv_capacity_tokens"], peak_decoding=peak["decoding"],
                peak_active=peak["running"], preemptions=result["preemptions"], wall_s=result["wall_s"],
                requests=len(reqs), tokens=[list(r.output_token_ids) for r in reqs])


def run_worker(kind: str, spec: dict) -> dict:
    """`kind`'s worker in a fresh interpreter (this script with --worker), which asks for exactly its
    mesh's devices before JAX starts."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", kind],
                          input=json.dumps(spec), stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"error: the {kind} run on tp={spec['tp']} dcp={spec['dcp']} failed "
                         f"(exit {proc.returncode}); its error is printed above")
    return json.loads(lines[-1])


# --- the report ------------------------------------------------------------------------------------
def serving_row(name: str, run: dict, reference: dict) -> dict:
    per = run["requests"]
    ref = {p["id"]: p["tokens"] for p in reference["requests"]}
    ttft, tpot = [p["ttft_s"] for p in per], [p["tpot_s"] for p in per]
    row = dict(
        run=name, requests=len(per), output_tokens=run["output_tokens"], wall_s=run["wall_s"],
        output_tokens_per_s=run["output_tokens"] / run["wall_s"],
        ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99), tpot_p50_s=pct(tpot, 50), tpot_p99_s=pct(tpot, 99),
        latency_p50_s=pct([p["latency_s"] for p in per], 50), latency_p99_s=pct([p["latency_s"] for p in per], 99),
        pages_used_max=run.get("pages_used_max"), pages_used_mean=run.get("pages_used_mean"),
        pages_total=run.get("pages_total"), kv_capacity_tokens=run.get("kv_capacity_tokens"),
        preemptions=run.get("preemptions"), rate_rps=run.get("rate_rps"),
        prefill_tokens_computed=run["prefill_tokens_computed"], prefill_tokens_useful=run["prefill_tokens_useful"],
        decode_tokens_computed=run["decode_tokens_computed"], decode_tokens_useful=run["decode_tokens_useful"],
        exact_tokens=all(p["tokens"] == ref[p["id"]] for p in per),
    )
    row["mismatched"] = [p["id"] for p in per if p["tokens"] != ref[p["id"]]]
    return row


def fmt(x, spec, scale=1.0):
    return "-" if x is None else format(x if scale == 1 else x * scale, spec)


def table(report: dict) -> str:
    rows, cap, ratios = report["rows"], report["capacity_rows"], report["ratios"]
    w = report["workload"]
    out = [f"serving: {w['requests']} requests, prompts {w['prompt_min']}..{w['prompt_max']} "
           f"(total {w['prompt_tokens']}, mean {w['prompt_tokens'] / w['requests']:.0f}), outputs "
           f"{w['output_min']}..{w['output_max']} (total {w['output_tokens']}); mesh tp={report['mesh'][0]} "
           f"dcp={report['mesh'][1]}, {report['max_num_seqs']} slots, prefill chunk {report['prefill_chunk']}, "
           f"page {report['page_size']}, K={report['decode_steps']}"]
    head = (f"{'run':<26} {'wall_s':>7} {'out_tok/s':>9} {'ttft p50/p99 s':>15} {'tpot p50/p99 ms':>16} "
            f"{'pages max/mean/total':>21} {'preempt':>7} {'prefill comp/useful':>20} {'decode comp/useful':>19} exact")
    out += [head, "-" * len(head)]
    for r in rows:
        pages = (f"{r['pages_used_max']}/{r['pages_used_mean']:.0f}/{r['pages_total']}"
                 if r["pages_total"] is not None else "- (dense)")
        prefill = f"{r['prefill_tokens_computed']}/{r['prefill_tokens_useful']}"
        decode = f"{r['decode_tokens_computed']}/{r['decode_tokens_useful']}"
        tpot = f"{fmt(r['tpot_p50_s'], '.1f', 1e3)}/{fmt(r['tpot_p99_s'], '.1f', 1e3)}"
        out.append(
            f"{r['run']:<26} {r['wall_s']:>7.2f} {r['output_tokens_per_s']:>9.1f} "
            f"{fmt(r['ttft_p50_s'], '.2f') + '/' + fmt(r['ttft_p99_s'], '.2f'):>15} {tpot:>16} {pages:>21} "
            f"{fmt(r['preemptions'], 'd'):>7} {prefill:>20} {decode:>19} {r['exact_tokens']}")
    out.append(f"continuous (all at once) / static output tokens/s: {ratios['throughput_speedup']:.2f}x; "
               f"Poisson / static: {ratios['poisson_vs_static']:.2f}x; exact tokens: {report['exact_tokens']}")
    out.append("wall excludes compilation (serving: compiled ahead + warm-up run; static: each batch's "
               "stats['compile_s'] subtracted); static TTFT = batch start + its ttft_s, all requests at t=0;\n"
               "Poisson TTFT from each arrival; pages sampled after every scheduler step; comp/useful = tokens "
               "the device computed (padding included) / tokens requests needed")
    c = report["capacity"]
    if not cap:
        return "\n".join(out)
    out.append("")
    out.append(f"capacity: {c['requests']} requests of {c['prompt']} prompt + {c['output']} output tokens at once, "
               f"{c['max_num_seqs']} slots, page {c['page_size']}, the same KV budget of {c['budget_bytes']:,} "
               f"bytes per device (a dcp=1 pool for {c['fit']} such requests)")
    head = (f"{'tp':>2} {'dcp':>3} {'devices':>7} {'page B/dev':>10} {'pages':>6} {'kv_capacity_tokens':>18} "
            f"{'peak decoding':>13} {'peak active':>11} {'preempt':>7} {'wall_s':>7}")
    out += [head, "-" * len(head)]
    for r in cap:
        out.append(f"{r['tp']:>2} {r['dcp']:>3} {r['devices']:>7} {r['page_bytes_per_device']:>10} "
                   f"{r['pages_total']:>6} {r['kv_capacity_tokens']:>18} {r['peak_decoding']:>13} "
                   f"{r['peak_active']:>11} {r['preemptions']:>7} {r['wall_s']:>7.1f}")
    out.append("peak decoding: the most requests decoding in one step (each with its whole prompt in the cache); "
               "peak active: decoding + prefilling in one step\n(a request admitted with a partial chunk may be "
               "preempted again when the pool is full)")
    out.append(f"dcp={cap[-1]['dcp']} / dcp=1: peak decoding {ratios['capacity_ratio']:.2f}x, kv_capacity_tokens "
               f"{ratios['kv_capacity_ratio']:.2f}x (target >= {cap[-1]['dcp']}); same tokens on both meshes: "
               f"{c['same_tokens']}")
    return "\n".join(out)


def sizes(args, defaults: dict, quick: dict, keys) -> dict:
    """The run's sizes: `quick` with --quick, else `defaults`, with each of `keys` that was given on the
    command line (not None in `args`) overriding its entry. Shared by the benchmark scripts."""
    size = dict(quick if args.quick else defaults)
    size.update({k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    return size


def parse_mesh(text: str) -> tuple[int, int]:
    try:
        tp, dcp = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"mesh must be TPxDCP, e.g. 1x4, got {text!r}") from None
    return tp, dcp


# --- client mode: a running server, driven by the official openai client -----------------------------
def client_requests(base_url: str, model: str, workload: list[dict], concurrency: int) -> dict:
    """Send `workload` as streamed completions at `concurrency` clients; request rate, output tokens/s,
    TTFT (to the first streamed token) and TPOT (the rest of the stream per token) p50/p99."""
    import concurrent.futures

    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", timeout=900, max_retries=0)

    def one(w):
        t0 = time.perf_counter()
        first, usage = None, None
        # logprobs=1: every chunk names its tokens, so a model without a tokenizer (no text) is timed too
        stream = client.completions.create(model=model, prompt=w["prompt"], max_tokens=w["max_tokens"],
                                           temperature=0, logprobs=1, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        for chunk in stream:
            choice = chunk.choices[0] if chunk.choices else None
            if first is None and choice is not None and (choice.text or (choice.logprobs and choice.logprobs.tokens)):
                first = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
        end = time.perf_counter()
        out = usage.completion_tokens if usage is not None else 0
        first = first or end
        return dict(ttft=first - t0, tpot=(end - first) / (out - 1) if out > 1 else None, out=out)

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, workload))
    wall = time.perf_counter() - t
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    return dict(concurrency=concurrency, requests=len(results), wall_s=wall, request_rate=len(results) / wall,
                output_tokens=sum(r["out"] for r in results),
                output_tokens_per_s=sum(r["out"] for r in results) / wall,
                ttft_p50_s=pct([r["ttft"] for r in results], 50), ttft_p99_s=pct([r["ttft"] for r in results], 99),
                tpot_p50_s=pct(tpots, 50) if tpots else None, tpot_p99_s=pct(tpots, 99) if tpots else None)


def start_server(checkpoint: Path, size: dict, tp: int, dcp: int, max_model_len: int):
    """Our own server on a free loopback port, in this process: (base URL, stop function)."""
    from dcp_jax.launch import make_app, serve_in_thread

    app, _ = make_app(checkpoint, tp=tp, dcp=dcp, served_model_name="bench", max_num_seqs=size["max_num_seqs"],
                      max_model_len=max_model_len, page_size=size["page_size"], prefill_chunk=size["prefill_chunk"],
                      decode_steps=size["decode_steps"])
    try:
        base, stop = serve_in_thread(app, timeout_s=120)
    except RuntimeError as e:
        raise SystemExit(f"error: {e}") from None
    return base + "/v1", stop


def client_mode(args, size: dict) -> int:
    """`--client URL|auto`: the client benchmark at each of `--concurrency` (a fresh workload of mixed
    lengths per level, the same seed), against a running server or (auto) our own on a loopback port."""
    requests, (p_lo, p_hi), (o_lo, o_hi) = size["client_requests"], size["client_prompt"], size["client_output"]
    concurrencies = args.concurrency or size["client_concurrency"]
    tmp, stop = None, None
    try:
        if args.client == "auto":
            tmp = tempfile.TemporaryDirectory(prefix="bench_serving.") if args.checkpoint is None else None
            checkpoint = ensure_checkpoint(Path(tmp.name) / size["model"] if tmp else args.checkpoint, size["model"])
            vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
            base, stop = start_server(checkpoint, size, *args.mesh, max_model_len=p_hi + o_hi + 1)
            model = "bench"
        else:
            from openai import OpenAI

            base = args.client.rstrip("/")
            base = base if base.endswith("/v1") else base + "/v1"
            model = OpenAI(base_url=base, api_key="unused", max_retries=0).models.list().data[0].id
            vocab = args.vocab
        rows = []
        for c in concurrencies:
            workload = make_workload(requests, (p_lo, p_hi), (o_lo, o_hi), vocab, args.seed)
            t = time.perf_counter()
            rows.append(client_requests(base, model, workload, c))
            log(f"client: concurrency {c}: {rows[-1]['output_tokens_per_s']:.1f} output tok/s "
                f"({time.perf_counter() - t:.0f} s)")
    finally:
        if stop is not None:
            stop()
        if tmp is not None:
            tmp.cleanup()
    report = dict(client=args.client, url=base, model=model, requests=requests, prompt_range=[p_lo, p_hi],
                  output_range=[o_lo, o_hi], rows=rows)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"client: {requests} streamed completions per level, prompts {p_lo}..{p_hi}, outputs {o_lo}..{o_hi}, "
          f"greedy; {base} ({model})")
    print("(the server streams each request's tokens in bursts of its decode steps per program call, so TPOT is "
          "what a client sees: the stream after the first text, per token)")
    print(f"{'concurrency':>11} {'req/s':>7} {'out tok/s':>10} {'ttft p50/p99 s':>15} {'tpot p50/p99 ms':>16}")
    for r in rows:
        tpot = (f"{r['tpot_p50_s'] * 1e3:.2f}/{r['tpot_p99_s'] * 1e3:.2f}" if r["tpot_p50_s"] is not None else "-")
        print(f"{r['concurrency']:>11} {r['request_rate']:>7.2f} {r['output_tokens_per_s']:>10.1f} "
              f"{r['ttft_p50_s']:>7.2f}/{r['ttft_p99_s']:<7.2f} {tpot:>16}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny checkpoint, 12 requests of 16..512 tokens (< 60 s)")
    p.add_argument("--json", action="store_true", help="print one JSON object (rows, capacity_rows, ratios)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="HF Llama checkpoint dir, created when missing (default: a temp dir, deleted after)")
    p.add_argument("--mesh", type=parse_mesh, default=(1, 1), help="TPxDCP mesh of the serving runs (default 1x1)")
    p.add_argument("--dcp", type=int, default=4, help="the capacity run's dcp mesh, against dcp=1 (default 4)")
    p.add_argument("--requests", type=int, help="requests in the serving workload (default 32; quick 12)")
    p.add_argument("--prompt-range", type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="MIN,MAX prompt tokens, log-uniform (default 64,16384; quick 16,512)")
    p.add_argument("--output-range", type=lambda s: tuple(int(x) for x in s.split(",")),
                   help="MIN,MAX output tokens, log-uniform (default 8,128; quick 4,32)")
    p.add_argument("--max-num-seqs", type=int, help="slots of the serving engine = static batch size (default 8)")
    p.add_argument("--prefill-chunk", type=int, help="prefill chunk of both engines (default 256; quick 128)")
    p.add_argument("--page-size", type=int, help="slots per page of the serving runs (default 64; quick 16)")
    p.add_argument("--decode-steps", type=int, help="decode steps per program call, K (default 8)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV bytes per device of the serving pool (default: max-num-seqs sequences of the longest)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrival rate, requests/s (default: --load "
                   "times the all-at-once run's request throughput)")
    p.add_argument("--load", type=float, default=1.0, help="see --rate (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-capacity", action="store_true", help="skip the capacity comparison")
    p.add_argument("--prefix-caching", action="store_true",
                   help="serve with prefix caching on (its cost when no prefix is shared; the Poisson run "
                        "then repeats cached prompts)")
    p.add_argument("--client", default=None, metavar="URL|auto",
                   help="client mode: drive a running OpenAI-compatible server at URL (or, with 'auto', our own "
                        "on a loopback port) with the openai client at each --concurrency; nothing else runs")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="client mode: comma-separated concurrency levels (default 1,4,16; quick 1,4)")
    p.add_argument("--vocab", type=int, default=256, help="client mode with a URL: ids are drawn below this")
    p.add_argument("--worker", choices=["serving", "capacity"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.load(sys.stdin)
        print(json.dumps(serving_worker(spec) if args.worker == "serving" else capacity_worker(spec)))
        return 0

    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(
        ["python", "scripts/bench_serving.py", *argv])
    if args.json:
        log(f"$ {command}")
    else:
        print(f"$ {command}", flush=True)
    size = sizes(args, DEFAULTS, QUICK, ("requests", "max_num_seqs", "prefill_chunk", "page_size", "decode_steps"))
    if args.prompt_range:
        size["prompt_min"], size["prompt_max"] = args.prompt_range
    if args.output_range:
        size["output_min"], size["output_max"] = args.output_range
    if size["output_min"] < 2:
        p.error("outputs must be >= 2 tokens (TPOT needs a token after the first)")
    if args.client is not None:
        return client_mode(args, size)
    tp, dcp = args.mesh

    tmp = tempfile.TemporaryDirectory(prefix="bench_serving.") if args.checkpoint is None else None
    try:
        checkpoint = ensure_checkpoint(Path(tmp.name) / size["model"] if tmp else args.checkpoint, size["model"])
        cfg = json.loads((checkpoint / "config.json").read_text())
        vocab = cfg["vocab_size"]
        workload = make_workload(size["requests"], (size["prompt_min"], size["prompt_max"]),
                                 (size["output_min"], size["output_max"]), vocab, args.seed)
        t0 = time.perf_counter()
        log(f"serving: {len(workload)} requests on tp={tp} dcp={dcp} ({checkpoint})")
        serving = run_worker("serving", dict(
            checkpoint=str(checkpoint), tp=tp, dcp=dcp, workload=workload, max_num_seqs=size["max_num_seqs"],
            prefill_chunk=size["prefill_chunk"], page_size=size["page_size"], decode_steps=size["decode_steps"],
            kv_cache_memory=args.kv_cache_memory, rate=args.rate, load=args.load, seed=args.seed,
            prefix_caching=args.prefix_caching))
        log(f"serving done ({time.perf_counter() - t0:.0f} s)")

        capacity_rows, capacity = [], {}
        if not args.no_capacity:
            # the budget: pages (plus the null page) for `cap_fit` requests on a dcp=1 mesh
            n_prompt, n_out, page = size["cap_prompt"], size["cap_output"], size["cap_page_size"]
            kv_heads = max(cfg["num_key_value_heads"] // tp, 1)
            page_bytes = page * kv_heads * cfg["head_dim"] * 2 * cfg["num_hidden_layers"] * 4  # float32 k and v
            blocks = -(-(n_prompt + n_out - 1) // page)
            budget = (1 + size["cap_fit"] * blocks) * page_bytes
            rng = np.random.default_rng(args.seed + 2)
            cap_workload = [dict(id=f"c{i}", prompt=rng.integers(3, vocab, size=n_prompt).tolist(), max_tokens=n_out)
                            for i in range(size["cap_requests"])]
            for d in (1, args.dcp):
                t = time.perf_counter()
                row = run_worker("capacity", dict(
                    checkpoint=str(checkpoint), tp=tp, dcp=d, workload=cap_workload,
                    max_num_seqs=max(32, size["cap_requests"]), page_size=page, prefill_chunk=size["cap_chunk"],
                    kv_cache_memory=budget))
                if row["page_bytes_per_device"] != page_bytes:
                    log(f"WARNING: dcp={d}: a page costs {row['page_bytes_per_device']} bytes per device, "
                        f"the budget assumed {page_bytes}")
                log(f"capacity dcp={d}: peak {row['peak_decoding']} decoding, {row['kv_capacity_tokens']} tokens "
                    f"({time.perf_counter() - t:.0f} s)")
                capacity_rows.append(row)
            capacity = dict(requests=size["cap_requests"], prompt=n_prompt, output=n_out, page_size=page,
                            max_num_seqs=max(32, size["cap_requests"]), fit=size["cap_fit"], budget_bytes=budget,
                            same_tokens=capacity_rows[0]["tokens"] == capacity_rows[-1]["tokens"])
            for r in capacity_rows:
                del r["tokens"]
    finally:
        if tmp is not None:
            tmp.cleanup()

    static = serving["static"]
    rows = [serving_row("continuous, all at once", serving["burst"], static),
            serving_row("continuous, Poisson", serving["poisson"], static),
            serving_row("static batches, all at once", static, static)]
    exact = rows[0]["exact_tokens"] and rows[1]["exact_tokens"]
    ratios = dict(throughput_speedup=rows[0]["output_tokens_per_s"] / rows[2]["output_tokens_per_s"],
                  poisson_vs_static=rows[1]["output_tokens_per_s"] / rows[2]["output_tokens_per_s"])
    if capacity_rows:
        one, many = capacity_rows[0], capacity_rows[-1]
        ratios["capacity_ratio"] = many["peak_decoding"] / max(one["peak_decoding"], 1)
        ratios["kv_capacity_ratio"] = many["kv_capacity_tokens"] / one["kv_capacity_tokens"]
    report = dict(
        command=command, mesh=[tp, dcp], devices=serving["devices"], model=cfg, quick=args.quick,
        max_num_seqs=size["max_num_seqs"], prefill_chunk=size["prefill_chunk"], page_size=size["page_size"],
        decode_steps=size["decode_steps"], max_model_len=serving["max_model_len"],
        serving_compile_s=serving["compile_s"],
        workload=dict(requests=len(workload), seed=args.seed, prompt_min=size["prompt_min"],
                      prompt_max=size["prompt_max"], output_min=size["output_min"], output_max=size["output_max"],
                      prompt_tokens=sum(len(w["prompt"]) for w in workload),
                      output_tokens=sum(w["max_tokens"] for w in workload),
                      prompt_lengths=[len(w["prompt"]) for w in workload],
                      output_lengths=[w["max_tokens"] for w in workload]),
        rows=rows, capacity=capacity, capacity_rows=capacity_rows, ratios=ratios, exact_tokens=exact,
        timing_note="compile excluded: serving programs compiled ahead and warmed up; static: stats['compile_s'] "
                    "subtracted per batch")
    if args.json:
        print(json.dumps(report))
    else:
        print(table(report))
    if not exact:
        bad = sorted(set(rows[0]["mismatched"]) | set(rows[1]["mismatched"]))
        log(f"FAIL: continuous-batching tokens differ from the static baseline's for {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
