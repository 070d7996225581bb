"""Serving on CPU: the ragged step against the code it replaced and against transformers' continuous
batching, workload by workload; and long-request capacity vs dcp.

Workloads (random-weight float32 Llama checkpoints, random ids, greedy, ignore_eos: each request produces
exactly its max_tokens; prompt and output lengths log-uniform in their ranges):

  short   256 requests of 16..128 prompt tokens and 32 output tokens, all at once (chat-shaped traffic;
          a 30M-parameter Llama, 32 slots)
  mixed   24 requests of 32..2,048 prompt and 8..128 output tokens, all at once and Poisson arrivals at
          about the burst's request rate (`--load` times it; the same rate for every code under test)
  long    32 requests of 64..16K prompt and 8..128 output tokens, all at once, and the old dense engine's
          static batches (each padded to its longest prompt and run for its longest output)
  real    the real model (--real-model: SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32, 30
          layers; fetched into the model cache when missing), 32 chat requests all at once (16
          slots): one user turn each, an instruction and notes, rendered by the checkpoint's chat
          template to 40..400 tokens, and 16..64 output tokens; run only when named (--workloads
          real). transformers loads the same GGUF and serves the same token ids; its greedy tokens
          are counted against ours (requests identical, where the others first differ), not
          required equal: float32 rounds differently in the two frameworks, and a near-tie may
          pick another token.

Each workload runs in a fresh interpreter per code under test, on one mesh (S slots, the same token
budget, page size and K); the interpreters stay up and the codes take turns run by run (`--repeat` rounds),
so every round times each code on the same host state:
  ours          this checkout: one ragged step per iteration (decode tokens and prefill chunks of many
                requests under one budget, padded to a step size), the K-step decode loop when nothing
                prefills
  --baseline R  the same script's worker over git revision R of the package (a temporary worktree on
                PYTHONPATH): e.g. the one-request-chunk-per-call engine the ragged step replaced
  ours ngram    --speculative ngram: ours with n-gram speculation (k = 4, turning itself off
                where it measures slower than plain decoding), its tokens equal to plain ours'
  transformers  `model.generate_batch`'s paged continuous-batching manager on the same checkpoint (per
                request max_new_tokens; --transformers PYTHON: an interpreter with torch and transformers)
Output tokens/s = useful output tokens / wall; TTFT and TPOT (time per output token after the first)
p50/p99 per request; rows computed / useful: the token rows the device programs ran (ragged steps padded
to their step size, prefill chunks to the compiled chunk, decode loops every slot for K steps) over the
rows the requests needed (prompt tokens + output tokens after the first). Every run's greedy tokens must
equal ours (and the static run's): a mismatch is reported and the script exits with status 1.

Compilation and warm-up are excluded on every side: our programs are compiled ahead and exercised by a
warm-up run; transformers' manager serves a warm-up batch first; the dense engine's stats["compile_s"] is
subtracted from each static batch.

  floor     per workload, the least time any code could take here: the checkpoint's weight matmuls alone
            (every linear layer and the LM head as one jitted chain, no attention, norms, sampling or host
            work): the output tokens in the fewest decode steps (every slot full), each prompt token at a
            full step's cost per row beyond a decode step's; a code's wall over it bounds what any other
            code could gain over it (--no-floor skips it).

  capacity  the same per-device KV budget (bytes) on a dcp=1 mesh and a dcp=N mesh, each in its own
            interpreter: many long requests all at once with many slots; the peak number of requests
            decoding in the same step (each with its whole prompt in the cache) and kv_capacity_tokens;
            with --kv-cache-dtype int8|fp8, both meshes again on 8-bit pages (the two savings multiply).

Each mesh runs in an interpreter that sees exactly tp·dcp simulated CPU devices (XLA's CPU thread
pool is max(cores, devices); see scripts/bench_decode.py).

    python scripts/bench_serving.py --baseline dd67113~1 --transformers auto   # the three workloads
    python scripts/bench_serving.py --workloads short --repeat 3 ...          # median of 3 runs per code
    python scripts/bench_serving.py --quick --json                           # tiny checkpoint, seconds
    python scripts/bench_serving.py --workloads real --no-capacity --transformers PYTHON  # the model
    python scripts/bench_serving.py --workloads mixed --engine-defaults --baseline REV
"""

from __future__ import annotations

import argparse
import json
import math
import os
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
    # about 30M parameters: the chat-shaped comparison with transformers
    "chat": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=1536, vocab_size=4096, max_position_embeddings=8192),
}

# The real workload's checkpoint: a name `dcp_jax.fetch` knows (fetched into the model cache when
# missing) or a GGUF file's path (--real-model).
REAL_MODEL = "smollm2-135m-instruct"

# Workloads (see the docstring): model, requests, prompt and output ranges, and which runs they get.
WORKLOADS = {
    "short": dict(model="chat", requests=256, prompt=(16, 128), output=(32, 32), poisson=False, static=False,
                  max_num_seqs=32),
    "mixed": dict(model="chat", requests=24, prompt=(32, 2048), output=(8, 128), poisson=True, static=False),
    "long": dict(model="bench", requests=32, prompt=(64, 16384), output=(8, 128), poisson=False, static=True),
    # the real model (--real-model): chat-template-rendered prompts; runs only when named
    "real": dict(model=REAL_MODEL, requests=32, prompt=(40, 400), output=(16, 64), poisson=False,
                 static=False, max_num_seqs=16, chat=True),
}
QUICK_WORKLOADS = {
    "short": dict(model="tiny", requests=48, prompt=(8, 64), output=(12, 12), poisson=False, static=False),
    "mixed": dict(model="tiny", requests=12, prompt=(16, 256), output=(4, 32), poisson=True, static=False),
    "long": dict(model="tiny", requests=8, prompt=(16, 512), output=(4, 16), poisson=False, static=True),
    "real": dict(model=REAL_MODEL, requests=4, prompt=(40, 96), output=(4, 8), poisson=False,
                 static=False, chat=True),
}
OPT_IN = ("real",)  # workloads a run without --workloads leaves out

# Sizes of the default and the --quick run (command-line flags override them one by one).
# --quick: every workload on one engine shape (slots, max_model_len, so one pool), so a run with a
# compilation cache (the tests') compiles each program once.
DEFAULTS = dict(
    model="bench", max_num_seqs=8, max_model_len=None, prefill_chunk=256, page_size=64, decode_steps=8, max_num_batched_tokens=2048,
    cap_requests=16, cap_prompt=4064, cap_output=32, cap_page_size=64, cap_fit=3, cap_chunk=4096,
    client_requests=32, client_prompt=(64, 2048), client_output=(8, 64), client_concurrency=[1, 4, 16],
)
QUICK = dict(
    model="tiny", max_num_seqs=8, max_model_len=544, prefill_chunk=128, page_size=16, decode_steps=8, max_num_batched_tokens=256,
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


# The real workload's chat turns: an instruction, then notes drawn from these sentences, as much of
# them as brings the rendered prompt to its drawn length.
INSTRUCTIONS = [
    "Summarize the notes below in three sentences.",
    "Answer in one paragraph: what is the main point of these notes?",
    "Turn the following notes into a short list of action items.",
    "Rewrite these notes as a friendly email to a colleague.",
    "Which of the facts below surprised you the most, and why?",
    "Explain the notes below to a ten-year-old.",
]
SENTENCES = [
    "The river in the old town floods every few springs, so the bakery keeps its flour up high.",
    "Our team moved the planning meeting to Thursdays because Mondays were full of tickets.",
    "Tomatoes cost a little more at the farmers' market, but they keep a week longer.",
    "The library extended its hours during exam season and added twenty desks upstairs.",
    "Most bugs reported last month came from the date parser, which mishandled leap years.",
    "Honeybees point their hive mates to flowers with a waggle dance that follows the sun.",
    "The new train line cuts the commute from the suburbs from fifty minutes to thirty-five.",
    "Learning the piano as an adult takes patience, but fifteen minutes a day is enough.",
    "The museum's summer exhibition on early photography drew twice the expected visitors.",
    "Our cloud bill dropped by a third after we turned off the test servers at weekends.",
    "Octopuses have three hearts and blue blood, and each arm can taste what it touches.",
    "The school garden produced enough pumpkins this year to give one to every family.",
    "When the power went out, the hospital's backup generators started within ten seconds.",
    "The customer survey shows that people want faster delivery more than lower prices.",
    "Mount Everest grows by a few millimetres every year as the Indian plate pushes north.",
    "The recipe calls for two eggs, but a spoonful of yoghurt works just as well.",
    "Volunteers planted four hundred trees along the highway in a single weekend.",
    "The quarterly report is due on the fifteenth, and finance still needs the receipts.",
    "Cats sleep for twelve to sixteen hours a day, mostly in short naps.",
    "The bridge is closed for repairs from June to August, so buses take the northern route.",
]


def real_model_facts(checkpoint: Path):
    """The GGUF file's tokenizer, chat template and parameter count (its metadata read once, in the
    driver, before any worker)."""
    from dcp_jax import gguf_checkpoint as gg

    reader = gg.open_reader(checkpoint)
    meta = gg.metadata(reader)
    tok, template = gg.tokenizer(meta), gg.chat_template(meta)
    if tok is None or template is None:
        raise SystemExit(f"error: {checkpoint} has no tokenizer or chat template: the real "
                         "workload renders chat prompts")
    return tok, template, int(sum(t.n_elements for t in reader.tensors))


def make_chat_workload(tok, template, n: int, prompt_range, output_range,
                       seed: int) -> list[dict]:
    """`n` chat requests: one user turn each (an instruction and notes) rendered by the checkpoint's
    chat template with its generation prompt, the notes cut at the word that brings the prompt to
    a length drawn log-uniformly from `prompt_range` (or just past it); outputs from
    `output_range` (`tok`, `template`: the checkpoint's tokenizer and chat template)."""
    rng = np.random.default_rng(seed)
    lens = log_uniform(rng, *prompt_range, n)
    outs = log_uniform(rng, *output_range, n)
    out = []
    for i, (target, o) in enumerate(zip(lens, outs)):
        order = rng.permutation(len(SENTENCES))
        words = " ".join(SENTENCES[j] for j in np.tile(order, 4)).split()
        instruction = INSTRUCTIONS[int(rng.integers(len(INSTRUCTIONS)))]

        def ids(k, instruction=instruction, words=words):
            text = instruction + ("\n\n" + " ".join(words[:k]) if k else "")
            rendered = template.render([dict(role="user", content=text)])
            return tok.encode(rendered, add_special_tokens=False).ids

        lo, hi = 0, len(words)  # the fewest words whose prompt reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if len(ids(mid)) < target else (lo, mid)
        out.append(dict(id=f"r{i}", prompt=ids(lo), max_tokens=o))
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` requests/s; the first request comes at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


def median_run(repeats: list[dict]) -> dict:
    """Of one workload's repeated runs (`--repeat`), the run of median wall time (the upper one of an
    even count), with every run's wall in `walls_s`; each repeat's tokens must equal the first's."""
    for run in repeats[1:]:
        if [p["tokens"] for p in run["requests"]] != [p["tokens"] for p in repeats[0]["requests"]]:
            raise SystemExit("error: a repeated run's greedy tokens differ from its first run's")
    pick = dict(sorted(repeats, key=lambda run: run["wall_s"])[len(repeats) // 2])
    pick["walls_s"] = [run["wall_s"] for run in repeats]
    pick["starts_s"] = [run.get("started_s") for run in repeats]  # when each began (epoch seconds)
    return pick


def walls(run: dict) -> str:
    """A run's wall time(s) for the log: the median, and every repeat's when there were several."""
    every = run.get("walls_s", [run["wall_s"]])
    return f"{run['wall_s']:.2f}" + (f" (median of {', '.join(f'{w:.2f}' for w in every)})" if len(every) > 1 else "")


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


# speculation's counters a run reports (its share of them: after minus before)
SPEC_COUNTERS = ("spec_on_iterations", "spec_off_iterations", "spec_prefill_plain_iterations",
                 "spec_drafted_tokens", "spec_accepted_tokens", "spec_verify_steps")


def continuous_run(server, workload: list[dict], arrivals=None) -> dict:
    """Serve `workload` through `server`; per-request times and tokens, pages in use, rows computed. Runs
    against whichever dcp_jax is imported (this checkout, or a --baseline revision's public API)."""
    from dcp_jax.serving.engine import run_requests
    from dcp_jax.serving.request import Request

    reqs = [Request(w["id"], w["prompt"], max_tokens=w["max_tokens"], ignore_eos=True) for w in workload]
    finished: dict[str, float] = {}
    pages, active = [], []
    ragged = "rows_computed" in server.timing  # the ragged step's engine counts its own rows
    timing0 = dict(server.timing)
    work = dict(prefill_calls=0, loop_steps=0)
    chunk, slots = server.config.prefill_chunk, server.config.max_num_seqs

    def on_step(plan):
        work["prefill_calls"] += len(plan.prefills)
        t = time.perf_counter()
        for r in reqs:
            if r.finish_reason is not None and r.request_id not in finished:
                finished[r.request_id] = t
        pages.append(server.scheduler.stats()["pages_used"])
        active.append(len(plan.decode_slots) + len(plan.prefills))
        if not ragged:  # the engine before the ragged step: a decode loop of every slot for K steps
            work["loop_steps"] += plan.decode_steps

    spec0 = server.stats()  # (speculation's counters, when the engine speculates)
    result = run_requests(server, reqs, arrivals=arrivals, on_step=on_step)
    spec1 = server.stats()
    spec = {k: spec1[k] - spec0[k] for k in SPEC_COUNTERS if k in spec1}
    if "spec_last_switch" in spec1:
        spec["spec_last_switch"] = spec1["spec_last_switch"]
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
    step_rows = (server.timing["rows_computed"] - timing0["rows_computed"] if ragged
                 else work["prefill_calls"] * chunk)
    # a ragged engine counts its decode-loop steps itself (those after a ragged step's K - 1 included)
    loop_steps = server.timing["decode_steps"] - timing0["decode_steps"] if ragged else work["loop_steps"]
    return dict(
        wall_s=result["wall_s"], requests=per, output_tokens=sum(p["output_tokens"] for p in per),
        pages_used_max=max(pages), pages_used_mean=float(np.mean(pages)), pages_total=result["pages_total"],
        kv_capacity_tokens=result["kv_capacity_tokens"], preemptions=result["preemptions"], steps=len(pages),
        peak_active=max(active), rows_computed=step_rows + loop_steps * slots,
        ragged_steps=server.timing["ragged_steps"] - timing0["ragged_steps"] if ragged else 0,
        prefill_calls=0 if ragged else work["prefill_calls"], loop_steps=loop_steps, **spec)


def static_run(engine, workload: list[dict], batch: int, prefill_chunk: int) -> dict:
    """The dense engine over `workload` in arrival order, `batch` requests at a time, each batch padded to
    its longest prompt and run for its longest max_tokens. Compile time (stats["compile_s"]) is
    subtracted from each batch's wall time; requests all arrive at t=0."""
    per, clock, computed = [], 0.0, 0
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
        computed += len(group) * (math.ceil(longest / chunk) * chunk + steps - 1)
        for w, tokens in zip(group, gen.tokens):
            m = w["max_tokens"]
            per_token = decode_s / (steps - 1) if steps > 1 else None
            per.append(dict(id=w["id"], prompt_tokens=len(w["prompt"]), output_tokens=m, ttft_s=clock + ttft,
                            tpot_s=per_token if m > 1 else None,
                            latency_s=clock + ttft + (per_token or 0.0) * (m - 1), tokens=tokens[:m]))
        log(f"  static batch {b0 // batch}: {len(group)} x {longest} prompt tokens, {steps} steps: "
            f"{run_s:.2f} s (+ {gen.stats['compile_s']:.1f} s compile)")
        clock += run_s
    return dict(wall_s=clock, requests=per, output_tokens=sum(p["output_tokens"] for p in per),
                rows_computed=computed)


def serving_worker(spec: dict):
    """One workload on one code under test: load, compile and warm up, then (a generator) one run per
    command sent to it: "burst" (all at once), "poisson" (`rate` req/s), "static" (the dense engine's static
    batches). Yields a description of itself first."""
    s = spec["max_num_seqs"]
    workload = spec["workload"]
    max_model_len = spec.get("max_model_len") or max(len(w["prompt"]) + w["max_tokens"] for w in workload)
    budget = spec.get("kv_cache_memory")
    # --engine-defaults: the engine's own chunk and token budgets (the CPU defaults), as generate
    # and the server run; else the run's
    sized = {} if spec.get("engine_defaults") else dict(
        prefill_chunk=spec["prefill_chunk"], max_num_batched_tokens=spec["max_num_batched_tokens"])
    if spec.get("speculative"):  # --speculative's code: ours with it
        sized["speculative"] = spec["speculative"]
    llm = load_llm(spec, max_num_seqs=s, page_size=spec["page_size"], decode_steps=spec["decode_steps"],
                   kv_cache_memory=budget, max_model_len=max_model_len, **sized)
    import jax

    import dcp_jax
    from dcp_jax.dense import Engine
    from dcp_jax.serving.engine import run_requests
    from dcp_jax.serving.request import Request

    # the pool: the KV budget when one is given, else max_num_seqs sequences of the longest request
    pages = 1 + s * llm.paged_layout().blocks_for(max_model_len)
    server = llm.engine if budget is not None or llm.config.num_pages == pages else llm.engine_with(num_pages=pages)
    tc = time.perf_counter()
    server.runner.compile_all()  # every program (each step size), and the pool
    compile_s = time.perf_counter() - tc
    # warm-up (not timed): a long prompt and short ones arriving while it decodes
    warm = [Request("warm", [3] * (spec["prefill_chunk"] + 1), max_tokens=2 * spec["decode_steps"] + 1,
                    ignore_eos=True)] + [Request(f"warm{i}", [4] * 20, max_tokens=4, ignore_eos=True) for i in range(3)]
    run_requests(server, warm, arrivals=[0, 0.01, 0.02, 0.03])
    cfg = server.config  # (a revision before the idle budget has none)
    sizes_used = dict(prefill_chunk=cfg.prefill_chunk,
                      token_budget=getattr(cfg, "token_budget", cfg.max_num_batched_tokens),
                      idle_budget=getattr(cfg, "idle_budget", None))
    log(f"  {spec['code']}: {len(jax.devices())} devices, compile {compile_s:.1f} s, pool "
        f"{server.scheduler.stats()['pages_total']} pages, {sizes_used} "
        f"({Path(dcp_jax.__file__).parent})")
    command = yield dict(devices=len(jax.devices()), compile_s=compile_s, max_model_len=max_model_len,
                         package=str(Path(dcp_jax.__file__).parent), sizes=sizes_used)
    while True:
        started = time.time()  # (the epoch: comparable across the workers)
        if command["run"] == "burst":
            run = continuous_run(server, workload)
        elif command["run"] == "poisson":
            run = continuous_run(server, workload, poisson_arrivals(len(workload), command["rate"], spec["seed"] + 1))
            run["rate_rps"] = command["rate"]
        else:  # the dense engine's static batches (the engine before continuous batching)
            dense = Engine(llm.model, llm.mesh, interleave=llm.interleave, impl=llm.impl)
            run = static_run(dense, workload, s, spec["prefill_chunk"])
        command = yield dict(run, started_s=started)


def transformers_worker(spec: dict):
    """The workload through transformers' continuous batching (`init_continuous_batching`, the
    manager `generate_batch` runs): every request added at once with its own max_new_tokens,
    greedy, no EOS, each token's time recorded (TTFT, TPOT); a warm-up batch first (not timed),
    then (a generator, as `serving_worker`) one "burst" run per command. A GGUF checkpoint (the
    real workload) loads through transformers' GGUF reader, dequantized to float32, and gets a KV
    cache of ours' size (the pool of `max_num_seqs` sequences of the longest request, in pages of
    `page_size`; sized from free memory instead, it takes most of this host's) without prefix
    sharing unless --prefix-caching. Needs torch and transformers, not JAX."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

    torch.set_num_threads(spec.get("torch_threads") or os.cpu_count() or 1)
    path, workload = Path(spec["checkpoint"]), spec["workload"]
    gguf = path.suffix == ".gguf"
    where = (dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name) if gguf
             else dict(pretrained_model_name_or_path=str(path)))
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(w["max_tokens"] for w in workload),
                           eos_token_id=-1, pad_token_id=0)
    cache = {}
    if gguf:
        longest = max(len(w["prompt"]) + w["max_tokens"] for w in workload)
        cache = dict(page_size=spec["page_size"],
                     allow_block_sharing=bool(spec.get("prefix_caching")),
                     num_blocks=spec["max_num_seqs"] * -(-longest // spec["page_size"]))
    cbc = ContinuousBatchingConfig(max_batch_tokens=spec["max_num_batched_tokens"],
                                   max_requests_per_batch=spec["max_num_seqs"], **cache)

    def serve(items):
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
        manager.start()
        try:
            t0 = time.perf_counter()
            ids = {manager.add_request(w["prompt"], request_id=w["id"], record_timestamps=True,
                                       max_new_tokens=w["max_tokens"]): w["id"] for w in items}
            out = {}
            while len(out) < len(ids):
                res = manager.get_result(timeout=1.0)
                if res is not None and res.is_finished():
                    out[ids[res.request_id]] = res
                if time.perf_counter() - t0 > 3600:
                    raise SystemExit("error: transformers did not finish the workload within an hour")
            wall = time.perf_counter() - t0
        finally:
            manager.stop(block=True)
        return {k: transformers_request(k, res, t0) for k, res in out.items()}, wall

    with torch.inference_mode():
        serve([dict(w, id=f"warm{i}") for i, w in enumerate(workload[:min(8, len(workload))])])
        command = yield dict(torch=torch.__version__, transformers=transformers.__version__)
        while True:
            if command["run"] != "burst":
                raise SystemExit(f"error: the transformers worker runs bursts only, not {command['run']!r}")
            started = time.time()
            done, wall = serve(workload)
            per = [done[w["id"]] for w in workload]
            command = yield dict(wall_s=wall, requests=per, output_tokens=sum(p["output_tokens"] for p in per),
                                 started_s=started)


def transformers_request(request_id: str, res, t0: float) -> dict:
    """One finished transformers request as `continuous_run` describes ours: its tokens, and from
    its tokens' timestamps (perf_counter) TTFT from `t0` (every request added), TPOT, latency."""
    tokens, stamps = list(res.generated_tokens), list(res.timestamps or [])
    n = len(tokens)
    if len(stamps) != n:  # no timestamps: tokens only
        return dict(id=request_id, output_tokens=n, tokens=tokens)
    return dict(id=request_id, output_tokens=n, tokens=tokens, ttft_s=stamps[0] - t0,
                tpot_s=(stamps[-1] - stamps[0]) / (n - 1) if n > 1 else None,
                latency_s=stamps[-1] - t0)


def capacity_worker(spec: dict) -> dict:
    """Decode steps K = 1, so a request decodes one token per scheduler step while the next ones prefill:
    its output length then keeps it resident long enough for the pool to fill up."""
    workload = spec["workload"]
    max_model_len = max(len(w["prompt"]) + w["max_tokens"] for w in workload)
    kv = spec.get("kv_cache_dtype", "auto")
    llm = load_llm(spec, max_num_seqs=spec["max_num_seqs"], page_size=spec["page_size"], decode_steps=1,
                   kv_cache_memory=spec["kv_cache_memory"], max_model_len=max_model_len,
                   prefill_chunk=spec["prefill_chunk"], kv_cache_dtype=kv)
    import jax

    from dcp_jax.serving.engine import run_requests
    from dcp_jax.serving.request import Request
    from dcp_jax.serving.runner import page_bytes_per_device

    server = llm.engine
    compiled = server.runner.compile_s  # programs compile on first use (only those this run needs): not timed
    peak = dict(decoding=0, running=0)
    reqs = [Request(w["id"], w["prompt"], max_tokens=w["max_tokens"], ignore_eos=True) for w in workload]

    def on_step(plan):
        peak["decoding"] = max(peak["decoding"], len(plan.decode_slots))
        peak["running"] = max(peak["running"], len(plan.decode_slots) + len(plan.prefills))

    result = run_requests(server, reqs, on_step=on_step)
    errors = [r.error for r in reqs if r.error is not None]
    if errors:
        raise SystemExit(f"error: capacity run tp={spec['tp']} dcp={spec['dcp']}: {errors[0]}")
    dtype = server.runner.programs.dtype
    page_bytes = page_bytes_per_device(llm.model, llm.mesh, spec["page_size"], dtype,
                                       None if kv == "auto" else kv)
    return dict(tp=spec["tp"], dcp=spec["dcp"], kv_cache_dtype=kv, devices=len(jax.devices()),
                budget_bytes=spec["kv_cache_memory"],
                page_bytes_per_device=page_bytes, pages_total=result["pages_total"],
                kv_capacity_tokens=result["kv_capacity_tokens"], peak_decoding=peak["decoding"],
                peak_active=peak["running"], preemptions=result["preemptions"],
                wall_s=result["wall_s"] - (server.runner.compile_s - compiled),
                requests=len(reqs), tokens=[list(r.output_token_ids) for r in reqs])


def floor_worker(spec: dict) -> dict:
    """Per workload, the least time any code could serve it in on this host: the checkpoint's weight
    matmuls alone (one jitted chain of every linear layer, and the LM head at `max_num_seqs` rows: no
    attention, norm, sampling or host work), timed on one device at S = `max_num_seqs` rows (a decode
    step of every slot) and at B = `max_num_batched_tokens` rows (a full step). The output tokens after
    each first need at least D / S steps that decode (a request's next token needs a step of its own; a
    step holds at most S such rows), none cheaper per row than a full decode step; each prompt token
    adds at least a row's share of a full step beyond it, (t(B) - t(S)) / (B - S), whether it rides in a
    decode step or runs in its own: floor_s = D / S * t(S) + P * (t(B) - t(S)) / (B - S)."""
    import jax
    import jax.numpy as jnp

    out, chains = {}, {}
    for name, w in spec["workloads"].items():
        path = Path(w["checkpoint"])
        if str(path) not in chains:
            chains[str(path)] = floor_weights(path)
        e, layers, head = chains[str(path)]
        s, b = w["max_num_seqs"], w["max_num_batched_tokens"]

        @jax.jit
        def chain(x, layers, head, s=s):
            kv = []
            for q, k, v, o, gate, up, down in layers:
                kv += [x @ k.T, x @ v.T]
                x = x + (x @ q.T) @ o.T
                x = x + (jax.nn.silu(x @ gate.T) * (x @ up.T)) @ down.T
            return x[:s] @ head.T, kv

        def seconds(n):
            x = jnp.full((n, e), 0.01, jnp.float32)
            jax.block_until_ready(chain(x, layers, head))
            times = []
            for _ in range(7):
                t0 = time.perf_counter()
                jax.block_until_ready(chain(x, layers, head))
                times.append(time.perf_counter() - t0)
            return float(np.median(times))

        decode_s, full_s = seconds(s), seconds(b)
        row_s = (full_s - decode_s) / (b - s) if b > s else full_s / b
        out[name] = dict(decode_step_s=decode_s, full_step_s=full_s, prompt_row_s=row_s,
                         floor_s=w["decode_rows"] / s * decode_s + w["prompt_rows"] * row_s)
    return out


def floor_weights(path: Path):
    """(hidden size, each layer's (q, k, v, o, gate, up, down) weights, the LM head) of the floor's
    chain: a random checkpoint's own; a GGUF file's shapes, with random values as a random
    checkpoint's (a matmul's time does not depend on them; dequantizing would only add time)."""
    import jax.numpy as jnp

    if path.suffix == ".gguf":
        from dcp_jax import gguf_checkpoint as gg

        reader = gg.open_reader(path)
        cfg = gg.hf_config(gg.metadata(reader), {t.name: t for t in reader.tensors})
        rng = np.random.default_rng(0)

        def w(*shape):
            return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02)

        shapes = random_llama.linear_shapes(cfg).values()  # q, k, v, o, gate, up, down
        layers = [tuple(w(*shape) for shape in shapes) for _ in range(cfg["num_hidden_layers"])]
        return cfg["hidden_size"], layers, w(cfg["vocab_size"], cfg["hidden_size"])
    from safetensors.numpy import load_file

    cfg = json.loads((path / "config.json").read_text())
    t = {k: jnp.asarray(v) for k, v in load_file(str(path / "model.safetensors")).items()}
    names = random_llama.linear_shapes(cfg)  # q, k, v, o, gate, up, down
    layers = [tuple(t[f"model.layers.{i}.{n}.weight"] for n in names)
              for i in range(cfg["num_hidden_layers"])]
    return cfg["hidden_size"], layers, t["lm_head.weight"]


def worker_process(kind: str, python: str | None = None, package: Path | None = None) -> tuple[list[str], dict]:
    """The command line and environment of `kind`'s worker: this script with --worker in a fresh interpreter,
    which asks for exactly its mesh's devices before JAX starts. `python`: another interpreter
    (transformers'); `package`: a checkout whose dcp_jax the worker imports instead of this one (--baseline)."""
    env = dict(os.environ)
    if package is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(package)] + [p for p in [env.get("PYTHONPATH")] if p])
    return [python or sys.executable, str(Path(__file__).resolve()), "--worker", kind], env


def run_worker(kind: str, spec: dict) -> dict:
    """`kind`'s one-shot worker (capacity, floor): the spec in, one JSON object out."""
    argv, env = worker_process(kind)
    proc = subprocess.run(argv, input=json.dumps(spec), stdout=subprocess.PIPE, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        mesh = f" (tp={spec['tp']} dcp={spec['dcp']})" if "tp" in spec else ""
        raise SystemExit(f"error: the {kind} worker{mesh} failed (exit {proc.returncode}); its error is printed above")
    return json.loads(lines[-1])


class Session:
    """A serving or transformers worker (`worker_process`) that stays up: it loads,
    compiles and warms up once, then runs the workload once per `run(...)`, so the codes under test can take
    turns run by run (this host drifts by more than the effects measured: codes timed one after the other
    compare two hosts)."""

    def __init__(self, kind: str, spec: dict, python: str | None = None, package: Path | None = None):
        argv, env = worker_process(kind, python, package)
        self.what = f"the {kind} worker ({spec.get('code', '')} tp={spec.get('tp')} dcp={spec.get('dcp')})"
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info = self.ask(spec)

    def ask(self, message: dict) -> dict:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.proc.wait()
        raise SystemExit(f"error: {self.what} failed (exit {self.proc.returncode}); its error is printed above")

    def run(self, run: str, **kw) -> dict:
        return self.ask(dict(run=run, **kw))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Worktree:
    """A temporary `git worktree` of revision `rev` of this repository (removed on exit)."""

    def __init__(self, rev: str):
        self.rev, self.tmp = rev, tempfile.TemporaryDirectory(prefix="bench_serving.baseline.")
        self.path = Path(self.tmp.name) / "tree"
        repo = Path(__file__).resolve().parent.parent
        proc = subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(self.path), rev],
                              capture_output=True, text=True)
        if proc.returncode:
            self.tmp.cleanup()
            raise SystemExit(f"error: --baseline {rev}: git worktree failed: {proc.stderr.strip().splitlines()[-1]}")
        self.repo = repo

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        subprocess.run(["git", "-C", str(self.repo), "worktree", "remove", "--force", str(self.path)],
                       capture_output=True)
        self.tmp.cleanup()


def serving_runs(spec: dict, codes, workload: dict, args) -> dict:
    """Every code's runs of one workload, {code: {arrivals: run}} (ours' also "compile_s"): a `Session` per
    code (`codes`: (name, worker kind, Session keywords)), taking turns run by run for `--repeat` rounds of
    the burst, then of Poisson arrivals (the serving codes, at one rate: `--rate`, else `--load` times ours'
    burst request rate), then ours' static batches; each the run of median wall (`median_run`)."""
    sessions, runs = {}, {}
    try:
        for code, kind, kw in codes:
            kw = dict(kw)
            sessions[code] = Session(kind, dict(spec, code=code, **kw.pop("spec", {})), **kw)

        def rounds(names, run, **kw):
            got = {code: [] for code in names}
            for _ in range(args.repeat):
                for code in names:
                    got[code].append(sessions[code].run(run, **kw))
            for code in names:
                runs.setdefault(code, {})[run] = median_run(got[code])
                label = f"Poisson {kw['rate']:.2f} req/s" if run == "poisson" else "all at once"
                log(f"  {code}, {label}: {walls(runs[code][run])} s")

        rounds(list(sessions), "burst")
        if workload["poisson"]:
            rate = args.rate or args.load * len(spec["workload"]) / runs["ours"]["burst"]["wall_s"]
            rounds([code for code, kind, _ in codes if kind == "serving"], "poisson", rate=rate)
        if workload["static"]:
            runs["ours"]["static"] = sessions["ours"].run("static")
            log(f"  static: {runs['ours']['static']['wall_s']:.2f} s")
        runs["ours"]["compile_s"] = sessions["ours"].info["compile_s"]
        # the chunk and budgets each serving code ran with (--engine-defaults: its own)
        runs["ours"]["sizes"] = {code: s.info["sizes"] for code, s in sessions.items()
                                 if "sizes" in s.info}
    finally:
        for session in sessions.values():
            session.close()
    return runs


# --- the report ------------------------------------------------------------------------------------
def serving_row(workload: str, code: str, arrivals: str, run: dict, reference: dict, needed: int,
                strict: bool = True) -> dict:
    """One row of the table: `run` (a worker's run) against `reference` (ours, all at once) tokens;
    `needed`: the rows the workload's requests need (prompt tokens + output tokens after the first);
    `strict`: whether a request whose tokens differ fails the run (else it is counted: `identical`
    requests, and where each other one first differs, `diverged_at`)."""
    per = run["requests"]
    ref = {p["id"]: p["tokens"] for p in reference["requests"]}
    ttft, tpot = [p.get("ttft_s") for p in per], [p.get("tpot_s") for p in per]
    row = dict(
        workload=workload, code=code, arrivals=arrivals, requests=len(per), output_tokens=run["output_tokens"],
        wall_s=run["wall_s"], walls_s=run.get("walls_s", [run["wall_s"]]), starts_s=run.get("starts_s"),
        output_tokens_per_s=run["output_tokens"] / run["wall_s"],
        ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99), tpot_p50_s=pct(tpot, 50), tpot_p99_s=pct(tpot, 99),
        pages_used_max=run.get("pages_used_max"), pages_total=run.get("pages_total"),
        preemptions=run.get("preemptions"), rate_rps=run.get("rate_rps"),
        rows_computed=run.get("rows_computed"), rows_useful=needed,
        rows_ratio=run["rows_computed"] / needed if run.get("rows_computed") else None,
        ragged_steps=run.get("ragged_steps"), prefill_calls=run.get("prefill_calls"), loop_steps=run.get("loop_steps"),
        **{k: run[k] for k in (*SPEC_COUNTERS, "spec_last_switch") if k in run},
        exact_tokens=all(p["tokens"] == ref[p["id"]] for p in per))
    row["mismatched"] = [p["id"] for p in per if p["tokens"] != ref[p["id"]]]
    row.update(strict=strict, identical=len(per) - len(row["mismatched"]),
               diverged_at={p["id"]: first_difference(p["tokens"], ref[p["id"]])
                            for p in per if p["tokens"] != ref[p["id"]]})
    return row


def first_difference(a: list[int], b: list[int]) -> int:
    """The index of the first token where `a` and `b` differ (the shorter one's length if one is a
    prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def exact_cell(row: dict) -> str:
    """The table's exact column: True/False, or for a row whose mismatches are counted (not
    required), the identical requests out of all."""
    return str(row["exact_tokens"]) if row["strict"] else f"{row['identical']}/{row['requests']}"


def agreement_lines(rows: list[dict]) -> list[str]:
    """For each row whose greedy tokens are counted against ours rather than required equal: how
    many requests match, and where the others first differ."""
    out = []
    for r in rows:
        if r["strict"]:
            continue
        at = sorted(r["diverged_at"].values())
        where = f"; the others first differ at output token {', '.join(map(str, at))}" if at else ""
        out.append(f"  {r['workload']} {r['code']} {r['arrivals']}: greedy tokens identical to "
                   f"ours on {r['identical']}/{r['requests']} requests{where}")
    return out


def fmt(x, spec, scale=1.0):
    return "-" if x is None else format(x if scale == 1 else x * scale, spec)


def table(report: dict) -> str:
    rows, cap, ratios = report["rows"], report["capacity_rows"], report["ratios"]
    sized = (f"token budget {report['max_num_batched_tokens']}, prefill chunk "
             f"{report['prefill_chunk']}")
    if report.get("engine_defaults"):
        sized = "each code's own CPU defaults of chunk and budgets (--engine-defaults)"
    out = [f"mesh tp={report['mesh'][0]} dcp={report['mesh'][1]}, {report['max_num_seqs']} slots "
           f"(unless said), {sized}, page {report['page_size']}, K={report['decode_steps']}"]
    for name, w in report["workloads"].items():
        out.append(f"{name}: {w['requests']} requests, prompts {w['prompt'][0]}..{w['prompt'][1]} (total "
                   f"{w['prompt_tokens']}), outputs {w['output'][0]}..{w['output'][1]} (total {w['output_tokens']}); "
                   f"model {w['model']} ({w['params'] / 1e6:.1f}M parameters), {w['max_num_seqs']} slots")
        for code, used in w.get("sizes", {}).items():
            out.append(f"  {code}: chunk {used['prefill_chunk']}, token budget "
                       f"{used['token_budget']}, idle budget {used['idle_budget']}")
        if "floor" in w:
            f = w["floor"]
            out.append(f"  floor {f['floor_s']:.2f} s: the weight matmuls alone ({f['decode_step_s'] * 1e3:.1f} ms a "
                       f"decode step of every slot, {f['prompt_row_s'] * 1e3:.3f} ms a prompt row); no code serves "
                       f"this workload faster here, so none beats a code by more than its wall/floor")
    head = (f"{'workload':<8} {'code':<22} {'arrivals':<8} {'wall_s':>7} {'out_tok/s':>9} {'ttft p50/p99 s':>15} "
            f"{'tpot p50/p99 ms':>16} {'rows comp/useful':>20} {'ratio':>6} exact")
    out += ["", head, "-" * len(head)]
    for r in rows:
        tpot = f"{fmt(r['tpot_p50_s'], '.1f', 1e3)}/{fmt(r['tpot_p99_s'], '.1f', 1e3)}"
        ttft = fmt(r["ttft_p50_s"], ".2f") + "/" + fmt(r["ttft_p99_s"], ".2f")
        comp = f"{fmt(r['rows_computed'], 'd')}/{r['rows_useful']}"
        out.append(f"{r['workload']:<8} {r['code'][:22]:<22} {r['arrivals']:<8} {r['wall_s']:>7.2f} "
                   f"{r['output_tokens_per_s']:>9.1f} {ttft:>15} {tpot:>16} {comp:>20} {fmt(r['rows_ratio'], '.2f'):>6} "
                   f"{exact_cell(r)}")
    out.append("rows comp/useful: token rows the programs ran (padding and idle slots included) / prompt tokens + "
               "output tokens after each first; exact: greedy tokens equal ours (all at once)")
    out += agreement_lines(rows)
    if any(len(r["walls_s"]) > 1 for r in rows):
        out.append("each row is the run of median wall time; every run's wall (s):")
        out += [f"  {r['workload']} {r['code']} {r['arrivals']}: {', '.join(f'{w:.2f}' for w in r['walls_s'])}"
                for r in rows]
    for r in rows:  # speculation's own account of the run (the engine's counters)
        if "spec_on_iterations" in r:
            out.append(f"  {r['workload']} {r['code']} {r['arrivals']}: speculated in "
                       f"{r['spec_on_iterations']} of "
                       f"{r['spec_on_iterations'] + r['spec_off_iterations']} decode iterations "
                       f"({r.get('spec_prefill_plain_iterations', 0)} plain beside prefills), "
                       f"{r['spec_accepted_tokens']} of {r['spec_drafted_tokens']} drafts "
                       f"accepted; last switch: {r.get('spec_last_switch') or 'none'}")
    for key, value in ratios.items():
        if key.startswith("ours/") or key.endswith(("tpot_p99/p50", "wall/floor", "ttft p50")):
            out.append(f"  {key}: {value:.2f}x")
    if not cap:
        return "\n".join(out)
    c = report["capacity"]
    out.append("")
    out.append(f"capacity: {c['requests']} requests of {c['prompt']} prompt + {c['output']} output tokens at once, "
               f"{c['max_num_seqs']} slots, page {c['page_size']}, the same KV budget of {c['budget_bytes']:,} "
               f"bytes per device (a dcp=1 pool for {c['fit']} such requests)")
    head = (f"{'kv':>4} {'tp':>2} {'dcp':>3} {'devices':>7} {'page B/dev':>10} {'pages':>6} {'kv_capacity_tokens':>18} "
            f"{'peak decoding':>13} {'peak active':>11} {'preempt':>7} {'wall_s':>7}")
    out += [head, "-" * len(head)]
    for r in cap:
        out.append(f"{r.get('kv_cache_dtype', 'auto'):>4} {r['tp']:>2} {r['dcp']:>3} {r['devices']:>7} "
                   f"{r['page_bytes_per_device']:>10} "
                   f"{r['pages_total']:>6} {r['kv_capacity_tokens']:>18} {r['peak_decoding']:>13} "
                   f"{r['peak_active']:>11} {r['preemptions']:>7} {r['wall_s']:>7.1f}")
    out.append("peak decoding: the most requests decoding in one step (each with its whole prompt in the cache); "
               "peak active: decoding + prefilling in one step\n(a request admitted with a partial chunk may be "
               "preempted again when the pool is full)")
    out.append(f"dcp={cap[1]['dcp']} / dcp=1: peak decoding {ratios['capacity_ratio']:.2f}x, kv_capacity_tokens "
               f"{ratios['kv_capacity_ratio']:.2f}x (target >= {cap[1]['dcp']}); same tokens on both meshes: "
               f"{c['same_tokens']}")
    for name, x in ratios.items():
        if name.startswith("kv_capacity_ratio "):
            out.append(f"{name.split(' ', 1)[1]} / auto dcp=1: kv_capacity_tokens {x:.2f}x")
    return "\n".join(out)


def sizes(args, defaults: dict, quick: dict, keys) -> dict:
    """The run's sizes: `quick` with --quick, else `defaults`, with each of `keys` that was given on the
    command line (not None in `args`) overriding its entry. Shared by the benchmark scripts."""
    size = dict(quick if args.quick else defaults)
    size.update({k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    return size


# The flags' parser and types are this script's own, not dcp_jax.cli's: the same main() parses the
# workers' command lines, and the transformers worker runs in an interpreter without dcp_jax (the
# --baseline worker imports another revision's).
class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, `error: MESSAGE (see --help)`, exit 2."""

    def error(self, message):
        head, _, rest = message.partition(": ")  # "argument --x: --x takes...": once is enough
        if head.startswith("argument ") and rest.startswith(head.split()[-1].split("/")[-1]):
            message = rest
        self.exit(2, f"error: {message} (see --help)\n")


def at_least(name: str, low: int = 1):
    """An argparse type: an integer >= `low` for the flag `name`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"{name} takes an integer >= {low}, got {text!r}")
        return value
    return parse


def positive_float(name: str):
    """An argparse type: a finite number > 0 for the flag `name`."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"{name} takes a number > 0, got {text!r}")
        return value
    return parse


def positive_ints(name: str):
    """An argparse type: comma-separated integers >= 1 for the flag `name`, e.g. 1,4,16."""
    def parse(text):
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(
                f"{name} takes comma-separated integers >= 1, e.g. 1,4,16; got {text!r}")
        return values
    return parse


def int_range(name: str, low: int = 1):
    """An argparse type: MIN,MAX, two integers with `low` <= MIN <= MAX, for the flag `name`."""
    def parse(text):
        try:
            lo, hi = (int(x) for x in text.split(","))
        except ValueError:
            lo = hi = None
        if lo is None or not low <= lo <= hi:
            raise argparse.ArgumentTypeError(
                f"{name} takes MIN,MAX, two integers with {low} <= MIN <= MAX, e.g. 16,256; "
                f"got {text!r}")
        return lo, hi
    return parse


def workload_names(text: str) -> list[str]:
    """An argparse type: --workloads' comma-separated names, each one of WORKLOADS'."""
    names = text.split(",")
    for name in names:
        if name not in WORKLOADS:
            raise argparse.ArgumentTypeError(
                f"--workloads: unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return names


def client_url(text: str) -> str:
    """An argparse type: --client's http(s) URL, or auto."""
    if text != "auto" and not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"--client takes a server's URL (http://HOST:PORT) or auto, got {text!r}")
    return text


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


def served_model(client: str) -> tuple[str, str]:
    """(base URL, the first model it serves) of `--client URL`, or one error line (exit 1) when
    nothing there answers as an OpenAI-compatible server."""
    import openai

    base = client.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        api = openai.OpenAI(base_url=base, api_key="unused", timeout=30, max_retries=0)
        models = api.models.list()
    except openai.APIConnectionError as e:
        raise SystemExit(f"error: --client {client}: nothing answers at {base} "
                         f"({e.__cause__ or e}); start the server first, or give --client auto"
                         ) from None
    except openai.APIStatusError as e:
        raise SystemExit(f"error: --client {client}: GET {base}/models answered HTTP "
                         f"{e.status_code}; give the URL of an OpenAI-compatible server") from None
    if not models.data:
        raise SystemExit(f"error: --client {client}: {base}/models lists no model; load one first")
    return base, models.data[0].id


def client_mode(args, size: dict) -> int:
    """`--client URL|auto`: the client benchmark at each of `--concurrency` (a fresh workload of mixed
    lengths per level, the same seed), against a running server or (auto) our own on a loopback port."""
    requests, (p_lo, p_hi), (o_lo, o_hi) = size["client_requests"], size["client_prompt"], size["client_output"]
    concurrencies = args.concurrency or size["client_concurrency"]
    try:
        import openai
    except ImportError:
        raise SystemExit("error: --client needs the openai package: pip install openai") from None
    tmp, stop = None, None
    try:
        if args.client == "auto":
            tmp = tempfile.TemporaryDirectory(prefix="bench_serving.") if args.checkpoint is None else None
            checkpoint = ensure_checkpoint((args.checkpoint or Path(tmp.name)) / size["model"], size["model"])
            vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
            base, stop = start_server(checkpoint, size, *args.mesh, max_model_len=p_hi + o_hi + 1)
            model = "bench"
        else:
            base, model = served_model(args.client)
            vocab = args.vocab
        rows = []
        for c in concurrencies:
            workload = make_workload(requests, (p_lo, p_hi), (o_lo, o_hi), vocab, args.seed)
            t = time.perf_counter()
            rows.append(client_requests(base, model, workload, c))
            log(f"client: concurrency {c}: {rows[-1]['output_tokens_per_s']:.1f} output tok/s "
                f"({time.perf_counter() - t:.0f} s)")
    except openai.APIError as e:  # a request failed mid-run (served_model checked the server)
        raise SystemExit(f"error: --client {args.client}: a request to {base} failed "
                         f"({type(e).__name__}: {e.__cause__ or e}); is the server still up?"
                         ) from None
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
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny checkpoint, small workloads (a minute or two)")
    p.add_argument("--json", action="store_true", help="print one JSON object (rows, capacity_rows, ratios)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="directory of the generated HF Llama checkpoints, one per model, created when missing "
                        "(default: a temp dir, deleted after)")
    p.add_argument("--mesh", type=parse_mesh, default=(1, 1), help="TPxDCP mesh of the serving runs (default 1x1)")
    p.add_argument("--dcp", type=at_least("--dcp"), default=4,
                   help="the capacity run's dcp mesh, against dcp=1 (default 4)")
    p.add_argument("--requests", type=at_least("--requests"),
                   help="requests of each workload run (default: the workload's)")
    p.add_argument("--prompt-range", type=int_range("--prompt-range"),
                   help="MIN,MAX prompt tokens, log-uniform, of each workload run (default: the workload's)")
    p.add_argument("--output-range", type=int_range("--output-range", 2),
                   help="MIN,MAX output tokens, log-uniform, of each workload run (default: the workload's)")
    p.add_argument("--max-num-seqs", type=at_least("--max-num-seqs"),
                   help="slots of the serving engine = static batch size (default 8)")
    p.add_argument("--prefill-chunk", type=at_least("--prefill-chunk"),
                   help="prefill chunk of both engines (default 256; quick 128)")
    p.add_argument("--page-size", type=at_least("--page-size"),
                   help="slots per page of the serving runs (default 64; quick 16)")
    p.add_argument("--decode-steps", type=at_least("--decode-steps"),
                   help="decode steps per program call, K (default 8)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV bytes per device of the serving pool (default: max-num-seqs sequences of the longest)")
    p.add_argument("--rate", type=positive_float("--rate"), default=None,
                   help="Poisson arrival rate, requests/s (default: --load "
                   "times the all-at-once run's request throughput)")
    p.add_argument("--load", type=positive_float("--load"), default=1.0,
                   help="see --rate (default 1.0)")
    p.add_argument("--seed", type=at_least("--seed", 0), default=0)
    p.add_argument("--repeat", type=at_least("--repeat"), default=1,
                   help="time each workload N times per code under test (after one warm-up) and report the run of "
                        "median wall time, every run's wall beside it (default 1)")
    p.add_argument("--no-capacity", action="store_true", help="skip the capacity comparison")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8"), default="auto",
                   help="also run the capacity comparison on 8-bit KV pages")
    p.add_argument("--prefix-caching", action="store_true",
                   help="serve with prefix caching on (its cost when no prefix is shared; the Poisson run "
                        "then repeats cached prompts)")
    p.add_argument("--client", type=client_url, default=None, metavar="URL|auto",
                   help="client mode: drive a running OpenAI-compatible server at URL (or, with 'auto', our own "
                        "on a loopback port) with the openai client at each --concurrency; nothing else runs")
    p.add_argument("--concurrency", type=positive_ints("--concurrency"), default=None,
                   help="client mode: comma-separated concurrency levels (default 1,4,16; quick 1,4)")
    p.add_argument("--vocab", type=at_least("--vocab", 4), default=256,
                   help="client mode with a URL: ids are drawn in [3, this)")
    p.add_argument("--workloads", type=workload_names, default=None,
                   help="comma-separated workloads to run: short, mixed, long, real (default "
                        "short,mixed,long)")
    p.add_argument("--real-model", default=REAL_MODEL, metavar="NAME|GGUF",
                   help=f"the real workload's checkpoint: a model name dcp_jax.fetch knows "
                        f"(fetched when missing) or a GGUF file (default {REAL_MODEL})")
    p.add_argument("--max-num-batched-tokens", type=at_least("--max-num-batched-tokens"),
                   help="token budget of an iteration (default 2048; quick 256)")
    p.add_argument("--speculative", choices=("ngram",), default=None,
                   help="also serve each workload with n-gram speculation (k=4, turning itself off "
                        "where it measures slower), beside plain decoding; tokens must be equal")
    p.add_argument("--engine-defaults", action="store_true",
                   help="ours and --baseline's serve with the engine's own prefill chunk and token "
                        "budgets (its CPU defaults, as generate and the server run) instead of "
                        "--prefill-chunk and --max-num-batched-tokens")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also run each workload on git revision REV of the package (a temporary worktree)")
    p.add_argument("--transformers", default=None, metavar="PYTHON|auto",
                   help="also run the short, mixed and real workloads through transformers' "
                        "continuous batching in PYTHON, an interpreter with torch and transformers "
                        "(the real workload's GGUF also needs gguf and accelerate; 'auto': this "
                        "one)")
    p.add_argument("--torch-threads", type=at_least("--torch-threads"), default=None, metavar="N",
                   help="transformers' intra-op threads (default: the host's cores; on a host "
                        "shared with other jobs torch's threads wait on each other, and 1 may "
                        "serve faster)")
    p.add_argument("--no-floor", action="store_true",
                   help="skip the floor (each workload's weight matmuls alone, timed in one more interpreter)")
    p.add_argument("--worker", choices=["serving", "capacity", "transformers", "floor"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker in ("serving", "transformers"):  # a Session: the spec, then one command per line
        worker = dict(serving=serving_worker, transformers=transformers_worker)[args.worker]
        gen = worker(json.loads(sys.stdin.readline()))
        print(json.dumps(next(gen)), flush=True)
        for line in sys.stdin:
            print(json.dumps(gen.send(json.loads(line))), flush=True)
        return 0
    if args.worker:
        spec = json.load(sys.stdin)
        print(json.dumps(dict(capacity=capacity_worker, floor=floor_worker)[args.worker](spec)))
        return 0

    command = shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(
        ["python", "scripts/bench_serving.py", *argv])
    if args.json:
        log(f"$ {command}")
    else:
        print(f"$ {command}", flush=True)
    size = sizes(args, DEFAULTS, QUICK, ("requests", "max_num_seqs", "prefill_chunk", "page_size", "decode_steps",
                                         "max_num_batched_tokens"))
    if args.client is not None:
        return client_mode(args, size)
    tp, dcp = args.mesh
    table_w = QUICK_WORKLOADS if args.quick else WORKLOADS
    names = args.workloads or [n for n in table_w if n not in OPT_IN]
    for name in names:
        if name not in table_w:
            p.error(f"--workloads: unknown workload {name!r}; choose from {', '.join(table_w)}")
    workloads = {}
    for name in names:
        w = dict(table_w[name])
        if args.requests:
            w["requests"] = args.requests
        w["prompt"] = args.prompt_range or w["prompt"]
        w["output"] = args.output_range or w["output"]
        if w["output"][0] < 2:
            p.error("outputs must be >= 2 tokens (TPOT needs a token after the first)")
        workloads[name] = w
    transformers_python = args.transformers
    if transformers_python == "auto":
        transformers_python = sys.executable
    sizes_kw = {k: size[k] for k in ("max_num_seqs", "prefill_chunk", "page_size", "decode_steps",
                                      "max_num_batched_tokens")}

    tmp = tempfile.TemporaryDirectory(prefix="bench_serving.")
    root = args.checkpoint or Path(tmp.name)
    baseline = Worktree(args.baseline) if args.baseline else None
    rows, ratios, info, floor_spec = [], {}, {}, {}
    try:
        for name, w in workloads.items():
            checkpoint, params, work = workload_requests(w, root, args)
            spec = dict(checkpoint=str(checkpoint), tp=tp, dcp=dcp, workload=work, kv_cache_memory=args.kv_cache_memory,
                        seed=args.seed, prefix_caching=args.prefix_caching, max_model_len=size["max_model_len"],
                        torch_threads=args.torch_threads, engine_defaults=args.engine_defaults,
                        **sizes_kw)
            if args.max_num_seqs is None and "max_num_seqs" in w:  # the workload's own slots
                spec["max_num_seqs"] = w["max_num_seqs"]
            info[name] = dict(max_num_seqs=spec["max_num_seqs"])
            needed = sum(len(x["prompt"]) + x["max_tokens"] - 1 for x in work)
            info[name] = dict(w, **info[name], prompt_tokens=sum(len(x["prompt"]) for x in work),
                              output_tokens=sum(x["max_tokens"] for x in work), params=params,
                              prompt_lengths=[len(x["prompt"]) for x in work])
            floor_spec[name] = dict(checkpoint=str(checkpoint), max_num_seqs=spec["max_num_seqs"],
                                    max_num_batched_tokens=spec["max_num_batched_tokens"],
                                    decode_rows=needed - info[name]["prompt_tokens"],
                                    prompt_rows=info[name]["prompt_tokens"])
            t0 = time.perf_counter()
            log(f"{name}: {len(work)} requests on tp={tp} dcp={dcp} ({checkpoint})")
            codes = [("ours", "serving", {})]
            if args.speculative:  # beside plain ours: the same engine speculating (auto-off on)
                codes.append((f"ours {args.speculative}", "serving",
                              dict(spec=dict(speculative=args.speculative))))
            if baseline is not None:
                codes.append((f"baseline {args.baseline}", "serving", dict(package=baseline.path)))
            if transformers_python and name != "long":
                codes.append(("transformers", "transformers", dict(python=transformers_python)))
            runs = serving_runs(spec, codes, w, args)
            info[name]["compile_s"] = runs["ours"].pop("compile_s")
            info[name]["sizes"] = runs["ours"].pop("sizes")
            for code, by_arrivals in runs.items():
                # the real model's float32 logits round differently in the two frameworks, so a
                # near-tie may pick another token: agreement with ours is counted, not required
                strict = not (w.get("chat") and code == "transformers")
                for arrivals, run in by_arrivals.items():
                    rows.append(serving_row(name, code, arrivals, run, runs["ours"]["burst"],
                                            needed, strict=strict))
            log(f"{name} done ({time.perf_counter() - t0:.0f} s)")
            by = {(r["code"], r["arrivals"]): r for r in rows if r["workload"] == name}
            for (code, arrivals), r in by.items():
                if code != "ours" and arrivals in ("burst", "poisson") and ("ours", arrivals) in by:
                    ratios[f"ours/{code} {name} {arrivals} output tok/s"] = (
                        by[("ours", arrivals)]["output_tokens_per_s"] / r["output_tokens_per_s"])
                    if r["ttft_p50_s"] and by[("ours", arrivals)]["ttft_p50_s"]:
                        ratios[f"{code}/ours {name} {arrivals} ttft p50"] = (
                            r["ttft_p50_s"] / by[("ours", arrivals)]["ttft_p50_s"])
            for (code, arrivals), r in by.items():
                if arrivals == "poisson" and r["tpot_p50_s"]:
                    ratios[f"{name} {code} poisson tpot_p99/p50"] = r["tpot_p99_s"] / r["tpot_p50_s"]

        if floor_spec and not args.no_floor:  # what the weight matmuls alone take, per workload
            for name, f in run_worker("floor", dict(workloads=floor_spec)).items():
                info[name]["floor"] = f
                for r in rows:
                    if r["workload"] == name and r["arrivals"] == "burst":
                        ratios[f"{name} {r['code']} burst wall/floor"] = r["wall_s"] / f["floor_s"]

        capacity_rows, capacity = [], {}
        if not args.no_capacity:
            model = (QUICK_WORKLOADS if args.quick else WORKLOADS)["long"]["model"]
            checkpoint = ensure_checkpoint(root / model, model)
            cfg = json.loads((checkpoint / "config.json").read_text())
            vocab = cfg["vocab_size"]
            # the budget: pages (plus the null page) for `cap_fit` requests on a dcp=1 mesh
            n_prompt, n_out, page = size["cap_prompt"], size["cap_output"], size["cap_page_size"]
            kv_heads = max(cfg["num_key_value_heads"] // tp, 1)
            page_bytes = page * kv_heads * cfg["head_dim"] * 2 * cfg["num_hidden_layers"] * 4  # float32 k and v
            blocks = -(-(n_prompt + n_out - 1) // page)
            budget = (1 + size["cap_fit"] * blocks) * page_bytes
            rng = np.random.default_rng(args.seed + 2)
            cap_workload = [dict(id=f"c{i}", prompt=rng.integers(3, vocab, size=n_prompt).tolist(), max_tokens=n_out)
                            for i in range(size["cap_requests"])]
            kinds = ["auto"] + ([args.kv_cache_dtype] if args.kv_cache_dtype != "auto" else [])
            for kv, d in [(kv, d) for kv in kinds for d in (1, args.dcp)]:
                t = time.perf_counter()
                row = run_worker("capacity", dict(
                    checkpoint=str(checkpoint), tp=tp, dcp=d, workload=cap_workload,
                    max_num_seqs=max(32, size["cap_requests"]), page_size=page, prefill_chunk=size["cap_chunk"],
                    kv_cache_memory=budget, kv_cache_dtype=kv))
                if kv == "auto" and row["page_bytes_per_device"] != page_bytes:
                    log(f"WARNING: dcp={d}: a page costs {row['page_bytes_per_device']} bytes per device, "
                        f"the budget assumed {page_bytes}")
                log(f"capacity dcp={d} kv {kv}: peak {row['peak_decoding']} decoding, {row['kv_capacity_tokens']} tokens "
                    f"({time.perf_counter() - t:.0f} s)")
                capacity_rows.append(row)
            capacity = dict(requests=size["cap_requests"], prompt=n_prompt, output=n_out, page_size=page,
                            max_num_seqs=max(32, size["cap_requests"]), fit=size["cap_fit"], budget_bytes=budget,
                            same_tokens=capacity_rows[0]["tokens"] == capacity_rows[1]["tokens"])
            for r in capacity_rows:
                del r["tokens"]
            one, many = capacity_rows[0], capacity_rows[1]
            ratios["capacity_ratio"] = many["peak_decoding"] / max(one["peak_decoding"], 1)
            ratios["kv_capacity_ratio"] = many["kv_capacity_tokens"] / one["kv_capacity_tokens"]
            for r in capacity_rows[2:]:  # 8-bit pages against the model dtype's on dcp=1
                ratios[f"kv_capacity_ratio {r['kv_cache_dtype']} dcp={r['dcp']}"] = (
                    r["kv_capacity_tokens"] / one["kv_capacity_tokens"])
    finally:
        if baseline is not None:
            baseline.__exit__()
        tmp.cleanup()

    exact = all(r["exact_tokens"] for r in rows if r["strict"])
    report = dict(command=command, mesh=[tp, dcp], quick=args.quick, workloads=info, rows=rows,
                  torch_threads=args.torch_threads,
                  capacity=capacity, capacity_rows=capacity_rows, ratios=ratios, exact_tokens=exact,
                  baseline=args.baseline, engine_defaults=args.engine_defaults, **sizes_kw,
                  timing_note="compile excluded: programs compiled ahead and warmed up (transformers: a warm-up "
                              "batch); static: stats['compile_s'] subtracted per batch")
    if args.json:
        print(json.dumps(report))
    else:
        print(table(report))
    if not exact:
        bad = sorted({(r["workload"], r["code"], r["arrivals"]) for r in rows
                      if r["strict"] and not r["exact_tokens"]})
        log(f"FAIL: greedy tokens differ from ours (all at once) in {bad}")
        return 1
    return 0


def workload_requests(w: dict, root: Path, args) -> tuple[Path, int, list[dict]]:
    """A workload's checkpoint, its parameter count and its requests: the real model (a GGUF file)
    and chat prompts for the real workload, else a random checkpoint under `root` and random ids."""
    if w.get("chat"):
        checkpoint = real_checkpoint(args.real_model)
        tok, template, params = real_model_facts(checkpoint)
        work = make_chat_workload(tok, template, w["requests"], w["prompt"], w["output"], args.seed)
        return checkpoint, params, work
    checkpoint = ensure_checkpoint(root / w["model"], w["model"])
    cfg = json.loads((checkpoint / "config.json").read_text())
    work = make_workload(w["requests"], w["prompt"], w["output"], cfg["vocab_size"], args.seed)
    return checkpoint, param_count(cfg), work


def real_checkpoint(model: str) -> Path:
    """--real-model: a GGUF file's path, or a name `dcp_jax.fetch` fetches into its cache."""
    from dcp_jax.errors import UserError
    from dcp_jax.fetch import MODELS, fetch

    if model not in MODELS:
        if not Path(model).is_file():
            raise SystemExit(f"error: --real-model {model!r}: no such file, nor a model name "
                             f"({', '.join(MODELS)})")
        return Path(model).resolve()
    try:
        return fetch(model)
    except UserError as e:
        raise SystemExit(f"error: --real-model {model}: {e}") from None


def param_count(cfg: dict) -> int:
    """Parameters of a random_llama checkpoint from its config."""
    e, v = cfg["hidden_size"], cfg["vocab_size"]
    linear = sum(o * i for o, i in random_llama.linear_shapes(cfg).values())
    return 2 * v * e + cfg["num_hidden_layers"] * (linear + 2 * e) + e


if __name__ == "__main__":
    sys.exit(main())
