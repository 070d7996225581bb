"""Prefix caching on CPU: time to first token and throughput with caching on and off, side by side.

One random-weight float32 Llama checkpoint (scripts/bench_serving.py's, via random_llama), two `LLM`
objects over it in one interpreter (`enable_prefix_caching` False / True), each with its one engine
(`LLM.engine` + `run_requests`: the pool, and so the prefix cache, lives across the runs):

  two calls      `LLM.generate` twice, as a notebook would: a 3,000-token document + a question, then the
                 same document + a question twice as long: the second call's TTFT, hit tokens and the
                 programs it compiled (none: the LLM's engine and programs live across calls)
  questions      a long shared document (default 16K tokens) followed by N different short questions,
                 asked one after the other: TTFT of each (the first one pays for the document either way;
                 with caching on the later ones prefill only their question and the document's partial
                 last block)
  batch          N more questions about the same document, all at once: wall time, requests/s, output
                 tokens/s
  conversation   a multi-turn chat that grows: each turn resends the whole transcript (a system prompt,
                 every earlier user message and reply) plus a new user message; TTFT per turn

--working-set instead runs the host-memory tier's workload: 4 documents whose KV together is 4x the
device pool (which holds one), each read once, then questions about them in a random order (3 each,
one at a time). Three sides: the host tier on (`host_blocks` for every document), caching on without
it, and caching off; TTFT p50 of the questions, their hit rate (device + host), the bytes copied back
and the copy bandwidth per rank, and a leak check (no page held, host tier within its capacity).

Greedy, ignore_eos; every request's tokens with caching on must equal those with it off (a mismatch is
reported and the script exits with status 1). Hit rates are the scheduler's stats (prefix_hit_tokens /
prefix_query_tokens over the phase). Compilation is excluded: both servers compile their two programs
and run a warm-up request (of unrelated tokens) before anything is timed.

    python scripts/bench_prefix.py                  # 16K-token document, 8 questions, 4 turns
    python scripts/bench_prefix.py --quick --json   # tiny checkpoint, 1K-token document
    python scripts/bench_prefix.py --working-set    # 16K-token documents, host tier on / off / no caching
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

DEFAULTS = dict(model="bench", doc=16384, questions=8, question=32, output=16, turns=4, system=256,
                message=64, reply=16, page_size=64, prefill_chunk=256, decode_steps=8, call_doc=3000)
QUICK = dict(model="tiny", doc=1024, questions=4, question=16, output=8, turns=3, system=64,
             message=16, reply=8, page_size=16, prefill_chunk=128, decode_steps=8, call_doc=3000)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload(size: dict, vocab: int, seed: int) -> dict:
    """Random token ids (never 0..2: no BOS/EOS look-alikes) for every phase, the same for both runs."""
    rng = np.random.default_rng(seed)
    ids = lambda n: [int(t) for t in rng.integers(3, vocab, n)]  # noqa: E731
    return dict(doc=ids(size["doc"]), questions=[ids(size["question"]) for _ in range(size["questions"])],
                batch=[ids(size["question"]) for _ in range(size["questions"])],
                system=ids(size["system"]), messages=[ids(size["message"]) for _ in range(size["turns"])],
                warmup=ids(size["question"] * 2), call_doc=ids(size["call_doc"]),
                call_questions=[ids(size["question"]), ids(2 * size["question"])])


def run_side(checkpoint: str, size: dict, work: dict, caching: bool, tp: int, dcp: int) -> dict:
    """One LLM (caching on or off) through every phase; TTFTs, walls, tokens and hit rates."""
    from dcp_jax.llm import LLM
    from dcp_jax.serving.engine import run_requests
    from dcp_jax.serving.request import Request

    convo = size["system"] + size["turns"] * (size["message"] + size["reply"])
    max_model_len = max(size["doc"] + size["question"], size["call_doc"] + 2 * size["question"],
                        convo) + size["output"] + 1
    block = size["page_size"] * dcp
    # the batch (N questions at once) and the document's cached blocks fit together
    pages = 1 + (size["questions"] + 1) * -(-max_model_len // block)
    llm = LLM.load(checkpoint, tp=tp, dcp=dcp, page_size=size["page_size"], max_num_seqs=size["questions"],
                   decode_steps=size["decode_steps"], enable_prefix_caching=caching, max_model_len=max_model_len,
                   prefill_chunk=size["prefill_chunk"], num_pages=pages)
    server = llm.engine
    server.runner.compile_all()
    sched = server.scheduler
    counter = iter(range(10**6))

    def run(prompts, max_tokens):
        reqs = [Request(f"q{next(counter)}", p, max_tokens=max_tokens, ignore_eos=True) for p in prompts]
        before = sched.stats()
        result = run_requests(server, reqs)
        after = sched.stats()
        q, h = (after[k] - before[k] for k in ("prefix_query_tokens", "prefix_hit_tokens"))
        return dict(wall_s=result["wall_s"], ttft_s=[result["first_token_s"][r.request_id] for r in reqs],
                    tokens=[r.output_token_ids for r in reqs], query_tokens=q, hit_tokens=h)

    run([work["warmup"]], 2)  # exercises both programs on tokens no phase shares
    doc, out = work["doc"], dict(caching=caching)

    qs = [run([doc + q], size["output"]) for q in work["questions"]]
    out["questions"] = dict(ttft_s=[r["ttft_s"][0] for r in qs], tokens=[r["tokens"][0] for r in qs],
                            wall_s=sum(r["wall_s"] for r in qs), hit_rate=hit_rate(qs))
    b = run([doc + q for q in work["batch"]], size["output"])
    n_out = sum(map(len, b["tokens"]))
    out["batch"] = dict(wall_s=b["wall_s"], requests_per_s=len(b["tokens"]) / b["wall_s"],
                        output_tokens_per_s=n_out / b["wall_s"], tokens=b["tokens"], hit_rate=hit_rate([b]))
    transcript, turns = list(work["system"]), []
    for m in work["messages"]:
        transcript += m
        t = run([transcript], size["reply"])
        transcript += t["tokens"][0]
        turns.append(t)
    out["conversation"] = dict(ttft_s=[t["ttft_s"][0] for t in turns], tokens=[t["tokens"][0] for t in turns],
                               hit_rate=hit_rate(turns))
    from dcp_jax import SamplingParams

    gens = [llm.generate([work["call_doc"] + q], SamplingParams(max_tokens=size["output"],
                                                                ignore_eos=True))
            for q in work["call_questions"]]
    calls = [g.stats for g in gens]
    out["two_calls"] = dict(ttft_s=[c["ttft_s"] for c in calls], hit_tokens=[c["prefix_hit_tokens"] for c in calls],
                            new_compilations=[c["new_compilations"] for c in calls],
                            prompt_tokens=[c["prompt_tokens"] for c in calls], tokens=[g.tokens[0] for g in gens])
    out["stats"] = {k: v for k, v in sched.stats().items() if k.startswith("prefix") or k in (
        "cached_blocks", "evictions", "preemptions", "pages_total")}
    return out


WS_DOCS, WS_QUESTIONS = 4, 3  # documents (4x the device pool) and questions about each


def run_working_set(checkpoint: str, size: dict, seed: int, vocab: int, mode: str, tp: int, dcp: int) -> dict:
    """The working-set workload on one side: mode "host" (the host tier holds every document), "device"
    (prefix caching without it) or "off" (no caching). TTFTs of the questions, hit rates, copy figures."""
    from dcp_jax.llm import LLM
    from dcp_jax.serving.engine import run_requests
    from dcp_jax.serving.request import Request

    rng = np.random.default_rng(seed)
    docs = [[int(t) for t in rng.integers(3, vocab, size["doc"])] for _ in range(WS_DOCS)]
    order = rng.permutation(np.repeat(np.arange(WS_DOCS), WS_QUESTIONS))
    questions = [(int(d), [int(t) for t in rng.integers(3, vocab, size["question"])]) for d in order]
    max_model_len = size["doc"] + size["question"] + size["output"] + 1
    block = size["page_size"] * dcp
    per_doc = -(-max_model_len // block)
    pages = 2 + per_doc  # the device pool holds one document's request: four are 4x it
    llm = LLM.load(checkpoint, tp=tp, dcp=dcp, page_size=size["page_size"], max_num_seqs=1,
                   decode_steps=size["decode_steps"], enable_prefix_caching=mode != "off",
                   max_model_len=max_model_len, prefill_chunk=size["prefill_chunk"], num_pages=pages)
    server = llm.engine_with(host_blocks=WS_DOCS * per_doc if mode == "host" else 0)
    server.runner.compile_all()
    sched, counter = server.scheduler, iter(range(10**6))

    def run(prompt):
        r = Request(f"w{next(counter)}", prompt, max_tokens=size["output"], ignore_eos=True)
        result = run_requests(server, [r])
        return result["first_token_s"][r.request_id], r.output_token_ids

    run([int(t) for t in rng.integers(3, vocab, 2 * size["question"])])  # warm-up: every program once
    for d in docs:  # each document read once (not timed): the pool can keep one of them
        run(d + [3])
    before = sched.stats() | server.runner.copier.counts
    ttft, tokens = [], []
    for d, q in questions:
        t, out = run(docs[d] + q)
        ttft.append(t)
        tokens.append(out)
    after = server.stats() | server.runner.copier.counts
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in (
        "prefix_query_tokens", "prefix_hit_tokens", "host_hit_tokens", "host_bytes_to_device", "host_copy_s")}
    sched.check()
    sched.kv.pool.check(owners=[])
    leaks = dict(pages_used=after["pages_used"], host_blocks=after.get("host_blocks", 0),
                 host_capacity_blocks=after.get("host_capacity_blocks", 0))
    ok = leaks["pages_used"] == 0 and leaks["host_blocks"] <= leaks["host_capacity_blocks"]
    q = delta["prefix_query_tokens"]
    copy_s = delta["host_copy_s"]
    return dict(mode=mode, ttft_s=ttft, ttft_p50_s=float(np.median(ttft)), tokens=tokens,
                # (prefix hits count the host tier's too)
                device_hit_rate=(delta["prefix_hit_tokens"] - delta["host_hit_tokens"]) / q if q
                else 0.0,
                host_hit_rate=delta["host_hit_tokens"] / q if q else 0.0,
                bytes_copied_back=delta["host_bytes_to_device"], copy_s=copy_s,
                copy_gb_s_per_rank=delta["host_bytes_to_device"] / copy_s / (tp * dcp) / 1e9 if copy_s else 0.0,
                host_bytes=after.get("host_bytes", 0), pages=pages, leaks=leaks, no_leaks=ok)


def working_set_table(report: dict) -> str:
    sides = report["sides"]
    lines = [f"working set: {WS_DOCS} documents of {report['size']['doc']:,} tokens = 4x the device pool "
             f"({sides['host']['pages']} pages of {report['size']['page_size']} slots x dcp {report['mesh']['dcp']}); "
             f"{WS_DOCS * WS_QUESTIONS} questions in a random order",
             f"{'':22} {'host tier':>12} {'device only':>12} {'no caching':>12}"]
    h, d, o = (sides[m] for m in ("host", "device", "off"))
    lines.append(f"{'TTFT p50':22} {h['ttft_p50_s'] * 1e3:10.1f}ms {d['ttft_p50_s'] * 1e3:10.1f}ms "
                 f"{o['ttft_p50_s'] * 1e3:10.1f}ms")
    for name, key in (("device hit rate", "device_hit_rate"), ("host hit rate", "host_hit_rate")):
        lines.append(f"{name:22} {h[key]:12.1%} {d[key]:12.1%} {o[key]:12.1%}")
    lines.append(f"{'copied back':22} {h['bytes_copied_back'] / 2**20:10.1f}MiB in {h['copy_s']:.3f} s "
                 f"({h['copy_gb_s_per_rank']:.2f} GB/s per rank); host tier holds {h['host_bytes'] / 2**20:.1f} MiB")
    lines.append(f"TTFT p50: host tier {report['host_vs_device']:.1f}x lower than without it (target 5x), "
                 f"{report['host_vs_off']:.1f}x lower than no caching; leaks: "
                 f"{'none' if all(s['no_leaks'] for s in sides.values()) else 'YES'}; exact: "
                 f"{'yes' if not report['mismatches'] else 'NO: ' + ', '.join(report['mismatches'])}")
    return "\n".join(lines)


def hit_rate(runs) -> float:
    q = sum(r["query_tokens"] for r in runs)
    return sum(r["hit_tokens"] for r in runs) / q if q else 0.0


def compare(off: dict, on: dict) -> list[str]:
    """Phases whose greedy tokens differ between caching off and on (should be none)."""
    return [phase for phase in ("questions", "batch", "conversation", "two_calls")
            if off[phase]["tokens"] != on[phase]["tokens"]]


def table(report: dict) -> str:
    off, on = report["off"], report["on"]
    lines = [f"{'':24} {'caching off':>12} {'caching on':>12} {'speed-up':>9}"]

    def row(name, a, b, unit="ms", scale=1e3, ratio=True):
        r = f"{a / b:8.1f}x" if ratio and b > 0 else ""
        lines.append(f"{name:24} {a * scale:10.1f}{unit:>2} {b * scale:10.1f}{unit:>2} {r:>9}")

    for i, (a, b) in enumerate(zip(off["questions"]["ttft_s"], on["questions"]["ttft_s"])):
        row(f"question {i + 1} TTFT", a, b)
    for i, (a, b) in enumerate(zip(off["conversation"]["ttft_s"], on["conversation"]["ttft_s"])):
        row(f"turn {i + 1} TTFT", a, b)
    row("batch wall", off["batch"]["wall_s"], on["batch"]["wall_s"])
    a, b = off["two_calls"], on["two_calls"]
    row("2nd generate TTFT", a["ttft_s"][1], b["ttft_s"][1])
    lines.append(f"{'2nd generate hit tokens':24} {a['hit_tokens'][1]:12,} {b['hit_tokens'][1]:12,}   "
                 f"(of {b['prompt_tokens'][1]:,}: a {report['size']['call_doc']:,}-token document; "
                 f"programs it compiled: {b['new_compilations'][1]})")
    lines.append(f"{'batch requests/s':24} {off['batch']['requests_per_s']:12.2f} {on['batch']['requests_per_s']:12.2f}")
    lines.append(f"{'batch output tok/s':24} {off['batch']['output_tokens_per_s']:12.1f} "
                 f"{on['batch']['output_tokens_per_s']:12.1f}")
    for phase in ("questions", "batch", "conversation"):
        lines.append(f"{phase + ' hit rate':24} {off[phase]['hit_rate']:12.1%} {on[phase]['hit_rate']:12.1%}")
    lines.append(f"second generate call: TTFT {report['second_call_speedup']:.1f}x lower (target 5x)")
    lines.append(f"later questions: TTFT {report['later_question_speedup_min']:.1f}x lower at least "
                 f"(target 10x); exact: {'yes' if not report['mismatches'] else 'NO: ' + ', '.join(report['mismatches'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny checkpoint, 1K-token document, 4 questions (< 60 s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="HF Llama checkpoint dir, created when missing (default: a temp dir, deleted after)")
    p.add_argument("--mesh", type=bench_serving.parse_mesh, default=(1, 1), help="TPxDCP mesh (default 1x1)")
    p.add_argument("--doc", type=int, help="document tokens (default 16384; quick 1024)")
    p.add_argument("--questions", type=int, help="questions per phase (default 8; quick 4)")
    p.add_argument("--turns", type=int, help="conversation turns (default 4; quick 3)")
    p.add_argument("--prefill-chunk", type=int, help="rows of the prefill program (default 256; quick 128)")
    p.add_argument("--page-size", type=int, help="slots per page (default 64; quick 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--working-set", action="store_true",
                   help="the host tier's workload: documents 4x the device pool, host tier on / off / no caching")
    args = p.parse_args(argv)
    command = shlex.join(["python", "scripts/bench_prefix.py", *(sys.argv[1:] if argv is None else argv)])
    size = bench_serving.sizes(args, DEFAULTS, QUICK, ("doc", "questions", "turns", "prefill_chunk", "page_size"))
    tp, dcp = args.mesh
    from dcp_jax.mesh import ensure_cpu_devices

    ensure_cpu_devices(tp * dcp)
    tmp = tempfile.TemporaryDirectory(prefix="bench_prefix.") if args.checkpoint is None else None
    try:
        checkpoint = bench_serving.ensure_checkpoint(
            Path(tmp.name) / size["model"] if tmp else args.checkpoint, size["model"])
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        report = dict(command=command, size=size, mesh=dict(tp=tp, dcp=dcp))
        if args.working_set:
            return working_set_main(report, str(checkpoint), size, args.seed, vocab, args.json)
        work = workload(size, vocab, args.seed)
        for caching in (False, True):
            log(f"caching {'on' if caching else 'off'}: {size['doc']}-token document on tp={tp} dcp={dcp}")
            t0 = time.perf_counter()
            report["on" if caching else "off"] = run_side(str(checkpoint), size, work, caching, tp, dcp)
            log(f"  {time.perf_counter() - t0:.1f} s")
    finally:
        if tmp is not None:
            tmp.cleanup()
    off, on = report["off"]["questions"]["ttft_s"], report["on"]["questions"]["ttft_s"]
    report["later_question_speedup_min"] = min((a / b for a, b in zip(off[1:], on[1:])), default=0.0)
    report["second_call_speedup"] = report["off"]["two_calls"]["ttft_s"][1] / report["on"]["two_calls"]["ttft_s"][1]
    report["mismatches"] = compare(report["off"], report["on"])
    if args.json:
        print(json.dumps(report))
    else:
        print(f"$ {command}")
        print(table(report))
    return 1 if report["mismatches"] else 0


def working_set_main(report: dict, checkpoint: str, size: dict, seed: int, vocab: int, as_json: bool) -> int:
    tp, dcp = report["mesh"]["tp"], report["mesh"]["dcp"]
    report["sides"] = {}
    for mode in ("host", "device", "off"):
        log(f"working set, {mode}: {WS_DOCS} x {size['doc']}-token documents on tp={tp} dcp={dcp}")
        t0 = time.perf_counter()
        report["sides"][mode] = run_working_set(checkpoint, size, seed, vocab, mode, tp, dcp)
        log(f"  {time.perf_counter() - t0:.1f} s")
    sides = report["sides"]
    report["host_vs_device"] = sides["device"]["ttft_p50_s"] / sides["host"]["ttft_p50_s"]
    report["host_vs_off"] = sides["off"]["ttft_p50_s"] / sides["host"]["ttft_p50_s"]
    report["mismatches"] = [m for m in ("host", "device") if sides[m]["tokens"] != sides["off"]["tokens"]]
    bad = report["mismatches"] or not all(s["no_leaks"] for s in sides.values())
    if as_json:
        print(json.dumps(report))
    else:
        print(f"$ {report['command']}")
        print(working_set_table(report))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
