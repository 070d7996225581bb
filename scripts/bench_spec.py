"""Speculative decoding on CPU: decode tokens/s and mean acceptance length with and without it, side by side.

Two tasks where drafts can hit, each run plain (the K-step decode loop) and speculative in one process,
greedy, with the tokens checked equal (a mismatch is reported and the script exits 1). Each speculative
method runs twice: as configured by default (speculation turns itself off where it measures slower than
plain decoding: `dcp_jax.spec.policy`) and "-always" (`speculative_auto_off=False`: every decode
iteration speculates, the verify loop's own speed):

  docs       the embedded tiny model (byte-level, trained on Python's documentation) continuing 8
             documentation snippets at once: plain, n-gram lookup, and a draft model — the target's
             first 2 of 4 layers (`dcp_jax.spec.layer_skip_draft`, saved as an orbax checkpoint and
             loaded through `draft_model=DIR`, as a user would)
  repeat     one request with a 16K-token random prompt on a random-weight Llama (hidden 256, 4 layers,
             vocabulary 1024) whose weights are scaled down (scale 0.1) until the next token depends
             mostly on the current one: greedy decoding falls into short cycles, which n-gram lookup
             predicts — the long-context case of quoting or editing what is already there; plain,
             n-gram, and a draft model of the target's first layer (memory-bound at 16K: a draft
             step reads a quarter of what a target step reads)

Every engine is built and warmed up first (one generate each: a program's first run pays for what it
allocates once), then the runs go round `--repeats` times, one generate per engine per round, so the
figures of one round are side by side in time (the machine's other load hits them alike); a row
reports its median round, and its speed-up is the median of its rounds' ratios to plain decoding's
round beside it (paired, so drift of the machine's load between rounds cancels). Reported per run:
decode tokens/s (tokens the decode/verify programs produced over their own time, prefill excluded),
time per decode step (plain: one step of the K-step loop; verify: one verify step, M of them per
program call), drafted / accepted tokens, the mean acceptance length (tokens a sequence gains per
verify step: 1 + accepted / steps), the decode iterations that speculated and that did not
(auto-off) and the speed-up over plain decoding. The speed-up is about acceptance length x (plain
step time / verify step time).

    python scripts/bench_spec.py                  # 16K context, 256 new tokens; docs: 8 x 128 bytes
    python scripts/bench_spec.py --quick --json   # 2K context, 64 new tokens
    python scripts/bench_spec.py --repeats 5      # five rounds (default 3)
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared helpers
import bench_serving  # noqa: E402

DEFAULTS = dict(context=16384, new_tokens=256, k=4, docs=8, doc_bytes=128, doc_new=128, scale=0.1,
                prefill_chunk=256, page_size=64, decode_steps=8, repeats=3)
# quick: a 512-token chunk takes the 4 snippets (384 tokens) in one ragged step, one step size per engine
QUICK = dict(context=2048, new_tokens=64, k=4, docs=4, doc_bytes=96, doc_new=64, scale=0.1,
             prefill_chunk=512, page_size=16, decode_steps=8, repeats=3)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def doc_prompts(n: int, size: int) -> list[str]:
    """`n` windows of `size` bytes from the end of Python's documentation topics (the text the embedded
    model learned; its last 5% was held out from training)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics)).encode("ascii", "ignore").decode()
    tail = text[int(len(text) * 0.95):]
    step = (len(tail) - size) // n
    return [tail[i * step:i * step + size] for i in range(n)]


def measure(llm, prompts, new_tokens: int) -> dict:
    """One greedy generate; the figures of its decode phase."""
    from dcp_jax import SamplingParams

    out = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    s = out.stats
    steps = max(s["decode_steps"], 1)  # decode steps of the batch, or verify steps
    row = dict(decode_tokens_per_s=s["decode_tokens_per_s"], decode_s=s["decode_s"],
               step_ms=1e3 * s["decode_s"] / steps, steps=s["decode_steps"], tokens=out.tokens,
               prefill_s=s["prefill_s"], compile_s=s["compile_s"])
    # this call's speculation figures (generate's stats count its own decode iterations)
    for key in ("spec_drafted_tokens", "spec_accepted_tokens", "spec_acceptance_rate",
                "mean_acceptance_length", "spec_on_iterations", "spec_off_iterations",
                "spec_last_switch"):
        if key in s:
            row[key] = s[key]
    return row


def rounds(llms: dict, prompts, new_tokens: int, repeats: int, label: str) -> dict:
    """Warm every engine up (one generate), then `repeats` rounds of one generate per engine; each
    run's median round (by decode tokens/s), with every round's tokens/s and the warm-up's, and its
    speed-up: the median of its rounds' ratios to the "plain" run's round beside it."""
    cold = {name: measure(llm, prompts, new_tokens) for name, llm in llms.items()}
    seen = {name: [] for name in llms}
    for i in range(repeats):
        for name, llm in llms.items():
            seen[name].append(measure(llm, prompts, new_tokens))
        log(f"  {label} round {i + 1}: " + ", ".join(
            f"{name} {seen[name][-1]['decode_tokens_per_s']:.1f}" for name in llms) + " tok/s")
    runs = {}
    for name, rows in seen.items():
        order = sorted(rows, key=lambda r: r["decode_tokens_per_s"])
        ratios = [r["decode_tokens_per_s"] / p["decode_tokens_per_s"]
                  for r, p in zip(rows, seen["plain"])]
        runs[name] = dict(order[len(order) // 2], rounds_tokens_per_s=[
            round(r["decode_tokens_per_s"], 1) for r in rows],
            cold_tokens_per_s=cold[name]["decode_tokens_per_s"],
            rounds_speedup=[round(x, 3) for x in ratios], speedup=float(np.median(ratios)))
        runs[name]["exact_rounds"] = all(r["tokens"] == rows[0]["tokens"] for r in rows)
    return runs


def spec_kinds(k: int, draft) -> list[tuple[str, dict]]:
    """(row name, speculative keywords) of each speculative run: n-gram and the draft model, each with
    the rule that turns speculation off (the default) and always on."""
    out = []
    for method, extra in (("ngram", {}), ("draft", dict(draft_model=draft))):
        for suffix, auto in (("", True), ("-always", False)):
            out.append((method + suffix, dict(speculative=method, num_speculative_tokens=k,
                                              speculative_auto_off=auto, **extra)))
    return out


def docs_task(size: dict, tp: int, dcp: int, tmp: Path) -> dict:
    from dcp_jax.generate import DEFAULT_MODEL
    from dcp_jax.llm import LLM
    from dcp_jax.spec import layer_skip_draft

    prompts = doc_prompts(size["docs"], size["doc_bytes"])
    # the context: the longest snippet (one token per byte) and its continuation
    common = dict(tp=tp, dcp=dcp, page_size=size["page_size"], max_num_seqs=size["docs"],
                  decode_steps=size["decode_steps"], prefill_chunk=size["prefill_chunk"],
                  max_model_len=max(len(p.encode()) for p in prompts) + size["doc_new"])
    plain = LLM.load(DEFAULT_MODEL, **common)
    draft_dir = tmp / "tiny-draft"
    LLM(layer_skip_draft(plain.model, plain.mesh, 2), plain.mesh, plain.tokenizer).save(draft_dir)
    llms = {"plain": plain}
    for name, kw in spec_kinds(size["k"], draft_dir):
        llms[name] = LLM.load(DEFAULT_MODEL, **common, **kw)
    runs = rounds(llms, prompts, size["doc_new"], size["repeats"], "docs")
    return dict(prompts=len(prompts), prompt_bytes=size["doc_bytes"], new_tokens=size["doc_new"], runs=runs)


def repeat_task(size: dict, tp: int, dcp: int) -> dict:
    from dcp_jax import LLM, SpeculativeConfig, make_mesh
    from dcp_jax.config import ModelConfig
    from dcp_jax.model import CausalLM, random_source
    from dcp_jax.spec import layer_skip_draft

    cfg = ModelConfig.from_dict(bench_serving.hf_config("bench"))
    mesh = make_mesh(tp, dcp)
    model = CausalLM(cfg, random_source(cfg, mesh, seed=0, scale=size["scale"]), mesh)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, size["context"] - size["new_tokens"])]
    common = dict(page_size=size["page_size"], max_num_seqs=1, decode_steps=size["decode_steps"],
                  max_model_len=size["context"], prefill_chunk=size["prefill_chunk"])
    draft = layer_skip_draft(model, mesh, 1)
    llms = {"plain": LLM(model, mesh, **common)}
    for name, kw in spec_kinds(size["k"], draft):
        spec = SpeculativeConfig(kw["speculative"], size["k"], draft=kw.get("draft_model"),
                                 auto_off=kw["speculative_auto_off"])
        llms[name] = LLM(model, mesh, **common, speculative=spec)
    runs = rounds(llms, [prompt], size["new_tokens"], size["repeats"], "repeat")
    return dict(context=size["context"], prompt_tokens=len(prompt), new_tokens=size["new_tokens"],
                scale=size["scale"], runs=runs)


def finish(task: dict) -> list[str]:
    """Whether every run's tokens equal plain's; returns mismatching runs."""
    plain = task["runs"]["plain"]
    bad = []
    for name, r in task["runs"].items():
        r["exact"] = r["tokens"] == plain["tokens"] and r["exact_rounds"]
        if not r["exact"]:
            bad.append(name)
    return bad


def table(report: dict) -> str:
    # a step: one decode step of the batch (plain; K per program call) or one verify step (one call)
    lines = [f"{'task / run':22} {'decode tok/s':>12} {'speed-up':>9} {'ms/step':>8} {'tok/step':>8} "
             f"{'drafted':>8} {'accepted':>9} {'accept len':>10} {'on/off':>7} {'exact':>6}"]
    for task in ("docs", "repeat"):
        t = report.get(task)
        if t is None:
            continue
        for name, r in t["runs"].items():
            n_tok = sum(len(x) for x in r["tokens"]) - len(r["tokens"])  # the first token is prefill's
            on_off = (f"{r['spec_on_iterations']}/{r['spec_off_iterations']}"
                      if "spec_on_iterations" in r else "")
            accept = (format(r["mean_acceptance_length"], ".2f")
                      if "mean_acceptance_length" in r else "")
            lines.append(
                f"{task + ' / ' + name:22} {r['decode_tokens_per_s']:12.1f} {r['speedup']:8.2f}x "
                f"{r['step_ms']:8.2f} {n_tok / max(r['steps'], 1):8.2f} "
                f"{r.get('spec_drafted_tokens', ''):>8} {r.get('spec_accepted_tokens', ''):>9} "
                f"{accept:>10} {on_off:>7} {'yes' if r['exact'] else 'NO':>6}")
        for name, r in t["runs"].items():
            if r.get("spec_last_switch"):
                lines.append(f"  {task} / {name}: last switch {r['spec_last_switch']}")
    for task, target in (("repeat", 1.8), ("docs", 1.2)):
        t = report.get(task)
        if t is None:
            continue
        r = t["runs"]["ngram"]
        where = f"{t['context']:,}-token context" if task == "repeat" else f"{t['prompts']} snippets"
        lines.append(f"{task}: {where}, n-gram k={report['size']['k']}: {r['speedup']:.2f}x plain "
                     f"decode tokens/s (target {target}x), always on "
                     f"{t['runs']['ngram-always']['speedup']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2K context, 64 new tokens, 4 snippets (< 2 min)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--mesh", type=bench_serving.parse_mesh, default=(1, 1), help="TPxDCP mesh (default 1x1)")
    p.add_argument("--tasks", default="docs,repeat", help="comma-separated: docs, repeat (default both)")
    p.add_argument("--context", type=int, help="repeat task: prompt + new tokens (default 16384; quick 2048)")
    p.add_argument("--new-tokens", type=int, help="repeat task: tokens to generate (default 256; quick 64)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, help="drafts per verify step (default 4)")
    p.add_argument("--repeats", type=int, help="rounds after the warm-up, one generate per engine each "
                   "(default 3); each row reports its median round")
    args = p.parse_args(argv)
    command = shlex.join(["python", "scripts/bench_spec.py", *(sys.argv[1:] if argv is None else argv)])
    size = bench_serving.sizes(args, DEFAULTS, QUICK, ("context", "new_tokens", "k", "repeats"))
    if size["repeats"] < 1:
        p.error(f"--repeats takes an integer >= 1, got {size['repeats']}")
    tasks = [t for t in args.tasks.split(",") if t]
    if not set(tasks) <= {"docs", "repeat"}:
        p.error(f"--tasks takes docs and/or repeat, got {args.tasks!r}")
    tp, dcp = args.mesh
    from dcp_jax.mesh import ensure_cpu_devices

    ensure_cpu_devices(tp * dcp)
    report = dict(command=command, size=size, mesh=dict(tp=tp, dcp=dcp))
    bad = []
    with tempfile.TemporaryDirectory(prefix="bench_spec.") as tmp:
        for task in tasks:
            log(f"{task} on tp={tp} dcp={dcp}")
            t0 = time.perf_counter()
            report[task] = docs_task(size, tp, dcp, Path(tmp)) if task == "docs" else repeat_task(size, tp, dcp)
            bad += [f"{task}/{name}" for name in finish(report[task])]
            log(f"  {time.perf_counter() - t0:.1f} s")
    report["mismatches"] = bad
    if args.json:
        print(json.dumps(report))
    else:
        print(f"$ {command}")
        print(table(report))
        if bad:
            print(f"NOT EXACT: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
