"""The command line: `python -m dcp_jax.generate [--model DIR] [--tp N --dcp N] [--prompt TEXT] ...`.

With no arguments it runs the embedded tiny model (trained by scripts/train_tiny.py) on a long built-in
prompt over tp=2 x dcp=4 (8 simulated CPU devices without an accelerator, every local device with one),
streams the text, and reports what DCP saved. Every user mistake ends with one line on stderr and a
non-zero exit: 2 for command-line misuse, 1 for problems found later (model directory, weights, sizes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dcp_jax.cli import (
    ASSETS,
    DEFAULT_MODEL,
    RUN_ERROR,
    USAGE_ERROR,
    CliParser,
    UsageError,
    add_engine_args,
    add_sampling_args,
    check_dir,
    check_structured,
    engine_kwargs,
    interleave_arg,
    mesh_shape,
    sampling_kwargs,
    structured,  # noqa: F401  (its older home)
    token_ids_arg,
)
from dcp_jax.errors import UserError
from dcp_jax.processes import add_distributed_args, check_distributed_args, is_multi, start
from pallas_kernels.attention.api import implementations

DEFAULT_PROMPT = ASSETS / "default_prompt.txt"
# The embedded model was trained on 256-byte windows: its prompt + new tokens stay within them, sampled
# (greedy decoding of a byte-level model soon repeats itself); the cache is reserved for 16K tokens.
DEFAULT_NEW_TOKENS = 96
DEFAULT_MAX_SEQ_LEN = 16384
DEFAULT_SAMPLING = dict(temperature=0.7, top_k=20)


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m dcp_jax.generate", description=__doc__.split("\n\n")[0])
    add_engine_args(p, context_alias="--max-seq-len",
                    max_num_seqs_help="requests decoding at once (default: the number of prompts, at most 8)")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="save the loaded model as an orbax checkpoint in DIR (atomically)")
    p.add_argument("--interleave", type=interleave_arg, default=1,
                   help="KV placement interleave size, or 'contiguous' (default 1: round-robin)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", type=token_ids_arg, default=[],
                   help="prompt token ids, e.g. 1,2,3 (repeat for a batch)")
    p.add_argument("--chat", action="append", default=[], metavar="TEXT",
                   help="a user message, through the model's chat template (repeat for a batch)")
    add_sampling_args(p, helps=dict(
        max_tokens=f"tokens to generate at most (default 32; {DEFAULT_NEW_TOKENS} for the default "
                   "run)",
        temperature="0 = greedy (the default, but 0.7 with top-k 20 for the default run)"))
    p.add_argument("--impl", choices=implementations(), default=None,
                   help="attention kernel (default: Pallas on GPU, jnp reference on CPU)")
    p.add_argument("--logprobs", action="store_true", help="report the log-probability of each token")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_distributed_args(p)
    return p


def sampling_params(args, default_run: bool):
    """The run's `SamplingParams`: the flags given, and the defaults of this CLI (32 new tokens; the
    default run's 96, sampled at temperature 0.7 with top-k 20 unless either is given)."""
    from dcp_jax.sampling import SamplingParams

    kw = sampling_kwargs(args)
    kw.setdefault("max_tokens", DEFAULT_NEW_TOKENS if default_run else 32)
    if default_run and "temperature" not in kw and "top_k" not in kw:
        kw.update(DEFAULT_SAMPLING)
    return SamplingParams(**kw)


def check_save(path: str) -> None:
    """UsageError unless --save's `path` can take an orbax checkpoint (a directory this process can
    write, and `save_checkpoint`'s own rules): checked before the model loads, so a run never ends
    at a path it cannot write."""
    from dcp_jax.weights import check_save_target

    if not path:
        raise UsageError("--save is empty: give a directory")
    check_dir("--save", path)
    try:
        check_save_target(path)
    except UserError as e:
        raise UsageError(f"--save: {e}") from None


def run(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        given_mesh = mesh_shape(args)
        default_run = args.model is None
        if not (args.prompt or args.prompt_ids or args.chat or default_run or args.save):
            raise UsageError("no prompt: give --prompt TEXT, --chat TEXT or --prompt-ids 1,2,3")
        if "" in args.prompt:
            raise UsageError("--prompt is empty: give some text (or --prompt-ids 1,2,3)")
        if args.save is not None:
            check_save(args.save)
        engine_kw = engine_kwargs(args)
        check_distributed_args(args)
        params = sampling_params(args, default_run)
        check_structured(params)
    except (UsageError, UserError) as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR

    if (status := start("dcp_jax.generate", argv, args, (given_mesh[0] or 1) * (given_mesh[1] or 1)
                        if any(given_mesh) else None)) is not None:
        return status
    try:
        llm, prompts = load(args, given_mesh, engine_kw)
        if not prompts:
            return 0
        import jax

        leader = not is_multi(args) or jax.process_index() == 0  # only process 0 reports
        show = _Display(llm, quiet=args.json or args.quiet or not leader,
                        stream=leader and not args.json and len(prompts) == 1 and params.n == 1)
        if show.stream and args.model is None and not args.prompt:
            print(f"prompt ({len(prompts[0]):,} bytes of Python's documentation, held out from training):\n"
                  f"{prompts[0]}", end="", flush=True)
        out = llm.generate(prompts, params, on_chunk=show.prefill, on_token=show.token)
        show.close()
    except ValueError as e:  # UserError and the library's own ValueErrors (bad mesh, bad sizes)
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR
    return print_results(args, params, llm, out, streamed=show.stream) if leader else 0


def load(args, given_mesh, engine_kw: dict):
    """The `LLM` the flags describe (saved first with --save) and the prompts to run on it."""
    import jax

    from dcp_jax import mesh as mesh_lib
    from dcp_jax.llm import LLM

    default_run = args.model is None
    model_dir = Path(args.model) if args.model else DEFAULT_MODEL
    if any(given_mesh):
        tp, dcp = given_mesh[0] or 1, given_mesh[1] or 1
    elif default_run:
        tp, dcp = mesh_lib.local_mesh_shape(max_tp=2)
        note = mesh_lib.local_mesh_note(tp, dcp, jax.local_devices()[0].platform)
        if note:
            print(note, file=sys.stderr)
    else:
        tp, dcp = 1, 1
    prompts = list(args.prompt) + list(args.prompt_ids) + list(args.chat)
    if default_run and not prompts and not args.save:
        prompts = [DEFAULT_PROMPT.read_text()]
    if default_run and engine_kw["max_model_len"] is None:
        # the default run reserves a whole 16K-token context, which is what its KV report measures
        engine_kw["max_model_len"] = DEFAULT_MAX_SEQ_LEN
    # no more decode slots than prompts: an idle slot still costs its rows in every decode step
    max_num_seqs = args.max_num_seqs or max(1, min(8, len(prompts)))
    # one run compiles what it needs as it needs it (a server compiles every program first)
    llm = LLM.load(model_dir, tp=tp, dcp=dcp, interleave=args.interleave, impl=args.impl,
                   compile="lazy", max_num_seqs=max_num_seqs, dist_timeout=args.dist_timeout,
                   **engine_kw)
    if args.chat:  # the conversations' prompt ids, through the checkpoint's chat template
        n = len(prompts) - len(args.chat)
        prompts[n:] = [llm.chat_prompt([{"role": "user", "content": t}]) for t in args.chat]
    if args.save:
        try:
            step = llm.save(args.save)
        except OSError as e:  # (checked before loading; the disk can still fill or change)
            raise UserError(f"--save {args.save!r}: cannot write the checkpoint "
                            f"({e.strerror or e}): give a directory you can write") from None
        print(f"loaded {llm.source}; saved orbax checkpoint {args.save} (step {step})")
    return llm, prompts


def print_results(args, params, llm, out, *, streamed: bool) -> int:
    """Print what the run gave (one JSON object with --json; else each output, unless `streamed`,
    the logprobs asked and the report); the exit status (RUN_ERROR when a prompt failed, after the
    others are reported)."""
    failed = [(i, e) for i, e in enumerate(out.errors or []) if e is not None]
    for i, e in failed:  # the others ran: report them, then fail
        print(f"error: prompt {i}: {e}", file=sys.stderr)
    status = RUN_ERROR if failed else 0
    if args.json:
        obj = {"tokens": out.tokens}
        if out.text is not None:
            obj["text"] = out.text
        if args.logprobs:
            obj["logprobs"] = out.logprobs
        if params.top_logprobs:
            obj["top_logprobs"] = out.top_logprobs
        if params.prompt_logprobs is not None:
            obj["prompt_logprobs"], obj["prompt_top_logprobs"] = out.prompt_logprobs, out.prompt_top_logprobs
        obj["stats"] = dict(out.stats, model=llm.source)
        print(json.dumps(obj))
        return status
    if not streamed:
        for i, toks in enumerate(out.tokens):
            print(f"[{i}] {out.text[i] if out.text is not None else toks}")
    if args.logprobs:
        for i, lp in enumerate(out.logprobs):
            print(f"logprobs [{i}]: {[round(x, 4) for x in lp]}")
    if params.top_logprobs:
        for i, tops in enumerate(out.top_logprobs):
            print(f"top logprobs [{i}]: {[[(t, round(x, 4)) for t, x in alts] for alts in tops]}")
    if params.prompt_logprobs is not None:
        for i, lp in enumerate(out.prompt_logprobs):
            print(f"prompt logprobs [{i}]: {[None if x is None else round(x, 4) for x in lp]}")
    print(report(out.stats, llm.model.config.num_kv_heads, llm.source))
    return status


def report(s: dict, kv_heads: int, source: str) -> str:
    """The closing report: mesh, KV bytes per device against TP alone, TTFT, decode speed."""
    n = s["tp"] * s["dcp"]
    tp_only = s["kv_bytes_total"] // min(n, kv_heads)

    def mib(x):
        return f"{x / 2**20:,.2f} MiB"

    return "\n".join([
        "",
        f"model       {source}",
        f"mesh        tp={s['tp']} x dcp={s['dcp']} ({n} devices), interleave {s['interleave']}",
        f"context     {s['prompt_tokens']:,} prompt + {s['generated_tokens']:,} generated tokens in "
        f"{s['batch']} request(s), up to {s['max_seq_len']:,} tokens each",
        f"KV pool     {s['kv_pages']:,} page(s) of {s['page_size']} slots x {s['kv_shards']} shard(s): "
        f"{s['kv_capacity_tokens']:,} tokens of capacity, {s['preemptions']} preemption(s)",
        f"KV cache    {mib(s['kv_bytes_per_device'])} per device; TP alone on {n} devices would hold "
        f"{mib(tp_only)} per device ({'the MLA latent has no head axis' if kv_heads == 1 else f'{kv_heads} kv heads'}: "
        f"{tp_only / s['kv_bytes_per_device']:.1f}x more); "
        f"whole cache {mib(s['kv_bytes_total'])}",
        f"speed       TTFT {s['ttft_s']:.3f} s, decode {s['decode_tokens_per_s']:.1f} tokens/s "
        f"(compile {s['compile_s']:.1f} s, not included)",
    ] + ([f"speculation {s['speculative']}, k={s['num_speculative_tokens']}: {s['spec_accepted_tokens']:,} of "
          f"{s['spec_drafted_tokens']:,} drafts accepted ({100 * s['spec_acceptance_rate']:.1f}%), "
          f"mean acceptance length {s['mean_acceptance_length']:.2f} tokens per step; "
          f"{s['spec_on_iterations']} decode iteration(s) speculated, {s['spec_off_iterations']} "
          f"plain" + (f" (last switch: {s['spec_last_switch']})" if s["spec_last_switch"] else "")]
         if "speculative" in s else []))


class _Display:
    """Progress bars on a terminal (stderr) and the generated text streamed on stdout as it comes."""

    def __init__(self, llm, *, quiet: bool, stream: bool):
        self.llm, self.stream = llm, stream
        self.bars = not quiet and sys.stderr.isatty()
        self.prefill_bar = self.decode_bar = None
        self.ids, self.shown = [], ""

    def prefill(self, done: int, total: int):
        if not self.bars:
            return
        if self.prefill_bar is None:
            from tqdm import tqdm

            self.prefill_bar = tqdm(total=total, desc="prefill", unit="tok", leave=False, file=sys.stderr)
        self.prefill_bar.update(done - self.prefill_bar.n)

    def token(self, step: int, tokens):
        if self.prefill_bar is not None:
            self.prefill_bar.close()
            self.prefill_bar = None
        if self.bars and self.decode_bar is None:
            from tqdm import tqdm

            self.decode_bar = tqdm(desc="decode", unit="tok", leave=False, file=sys.stderr)
        if self.decode_bar is not None:
            self.decode_bar.update(1)
        if self.stream and tokens[0] >= 0:
            self.ids.append(int(tokens[0]))
            # without a tokenizer the ids stream as space-separated numbers (each text extends the last)
            text = self.llm.decode(self.ids) if self.llm.tokenizer is not None else " ".join(map(str, self.ids))
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next byte
                return
            new = text[len(self.shown):] if text.startswith(self.shown) else "\n" + text
            self.shown = text
            if self.decode_bar is not None:
                self.decode_bar.clear()
            sys.stdout.write(new)
            sys.stdout.flush()
            if self.decode_bar is not None:
                self.decode_bar.refresh()

    def close(self):
        for bar in (self.prefill_bar, self.decode_bar):
            if bar is not None:
                bar.close()
        if self.stream:
            sys.stdout.write("\n")
            sys.stdout.flush()


def main():
    sys.exit(run())


if __name__ == "__main__":
    main()
