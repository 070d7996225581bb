"""lm-eval's `local-completions` model against `python -m dcp_jax.serve`, on two tiny tasks built from
local text: the harness drives the server through its OpenAI completions API exactly as it drives vLLM's.

    pip install -e '.[lm-eval]'            # lm-eval with its API models (it pulls torch)
    python scripts/lm_eval_server.py       # the embedded model; --model DIR for another checkpoint

  local_choice    multiple choice (loglikelihood: `echo` + `logprobs` + `max_tokens: 0`-style scoring of
                  each choice after its context): a line of the text cut after 60% of its words; the
                  true rest against the rests of 3 other lines; acc and acc_norm (chance: 0.25)
  local_continue  generation (greedy `generate_until` with a stop at the end of the line): the line's
                  first 60% of words, the next 3 words as the target; exact_match

The text is the embedded model's held-out text (the last 5% of Python's documentation topics, as
scripts/train_tiny.py splits them; lines of 8 to 30 words, within the 256 bytes it was trained on)
unless --text FILE names another. The server starts on a loopback port (--serve-python: the interpreter
that runs it, default this one; lm-eval only needs to run here), lm-eval reads the tokenizer through
the server's /tokenize, /detokenize and /tokenizer_info (its "remote" backend: no Hugging Face
tokenizer needed, so the embedded byte-level model works), and the server stops when the run ends.
Prints lm-eval's own results table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the package (this checkout) and the scripts' helpers
NAME = "dcp-jax-eval"


def held_out_text() -> str:
    """The embedded model's held-out text (train_tiny's split)."""
    import corpus

    return corpus.split()[1].decode("utf-8", errors="ignore")


def lines_of(text: str, min_words: int = 8, max_words: int = 30) -> list[list[str]]:
    """The text's lines of `min_words` to `max_words` words, as word lists."""
    return [line.split() for line in text.splitlines() if min_words <= len(line.split()) <= max_words]


def build_tasks(text: str, out: Path, limit: int, seed: int) -> list[str]:
    """Write the two tasks (data + lm-eval YAML) under `out`; returns their names."""
    rng = random.Random(seed)
    lines = lines_of(text)
    if len(lines) < 4:
        raise SystemExit("error: the text has fewer than 4 lines of 8 to 30 words: give a longer --text FILE")
    rng.shuffle(lines)
    lines = lines[:limit]
    choice, cont = [], []
    for i, words in enumerate(lines):
        cut = max(1, int(len(words) * 0.6))
        context, rest = " ".join(words[:cut]), " " + " ".join(words[cut:])
        others = [" " + " ".join(w[max(1, int(len(w) * 0.6)):]) for j, w in enumerate(lines) if j != i]
        options = [rest] + rng.sample(others, 3)
        rng.shuffle(options)
        choice.append(dict(context=context, choices=options, label=options.index(rest)))
        cont.append(dict(context=context, target=" " + " ".join(words[cut:cut + 3])))
    for name, rows in (("choice", choice), ("continue", cont)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    (out / "local_choice.yaml").write_text(
        "task: local_choice\n" + common.format(path=out / "choice.jsonl")
        + "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
          "doc_to_target: '{{label}}'\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (out / "local_continue.yaml").write_text(
        "task: local_continue\n" + common.format(path=out / "continue.jsonl")
        + "output_type: generate_until\ndoc_to_text: '{{context}}'\ndoc_to_target: '{{target}}'\n"
          "target_delimiter: ''\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 24\n  do_sample: false\n"
          "filter_list:\n  - name: first3\n    filter:\n      - function: regex\n"
          "        regex_pattern: '^(\\s*\\S+\\s+\\S+\\s+\\S+)'\n      - function: take_first\n"
          "metric_list:\n  - metric: exact_match\n")
    return ["local_choice", "local_continue"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with status {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"error: the server did not answer /health within {timeout_s:.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint the server loads (default: the embedded model)")
    p.add_argument("--text", type=Path, default=None, help="the text the tasks are cut from (default: the "
                   "embedded model's held-out text)")
    p.add_argument("--limit", type=int, default=40, help="lines of the text each task uses (default 40)")
    p.add_argument("--serve-python", default=sys.executable, help="the interpreter that runs the server")
    p.add_argument("--serve-arg", action="append", default=[], help="one more server flag (repeatable)")
    p.add_argument("--concurrency", type=int, default=4, help="lm-eval's concurrent requests (default 4)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for the server to come up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = p.parse_args(argv)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
        from lm_eval.utils import make_table
    except ImportError:
        print("error: lm-eval is not installed: pip install -e '.[lm-eval]'", file=sys.stderr)
        return 2
    if args.text is not None and not args.text.is_file():
        print(f"error: --text {args.text}: no such file", file=sys.stderr)
        return 2
    text = args.text.read_text() if args.text is not None else held_out_text()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [args.serve_python, "-m", "dcp_jax.serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", NAME, *(["--model", args.model] if args.model else []), *args.serve_arg]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [x for x in [os.environ.get("PYTHONPATH")] if x]))
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_up(base, server, args.startup_timeout)
        with tempfile.TemporaryDirectory() as tmp:
            tasks = build_tasks(text, Path(tmp), args.limit, args.seed)
            t0 = time.perf_counter()
            results = lm_eval.simple_evaluate(
                model="local-completions",
                model_args=(f"base_url={base}/v1/completions,model={NAME},tokenizer_backend=remote,"
                            f"num_concurrent={args.concurrency},max_retries=2,tokenized_requests=True"),
                tasks=tasks, task_manager=TaskManager(include_path=tmp), random_seed=args.seed,
                numpy_random_seed=args.seed, torch_random_seed=args.seed, fewshot_random_seed=args.seed)
            wall = time.perf_counter() - t0
    finally:
        server.terminate()
        try:
            _, err = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
    if results is None:
        print("error: lm-eval returned no results", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(dict(results=results["results"], wall_s=wall), default=str))
    else:
        print(make_table(results))
        print(f"lm-eval wall time {wall:.1f} s against {base} ({args.model or 'the embedded model'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
