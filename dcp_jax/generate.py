"""The command line: `python -m dcp_jax.generate --model DIR [--tp N --dcp N] --prompt TEXT ...`.

Every user mistake ends with one line on stderr and a non-zero exit: 2 for command-line misuse, 1 for
problems found later (model directory, weights, prompt too long). On a CPU-only machine the mesh's
devices are simulated.
"""

from __future__ import annotations

import argparse
import json
import sys

from dcp_jax.errors import UserError

USAGE_ERROR, RUN_ERROR = 2, 1


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        raise _Usage(f"{message} (see --help)")


class _Usage(Exception):
    pass


def _positive(name):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value
    return parse


def _non_negative_float(name, upper=None):
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not value >= 0 or (upper is not None and value > upper):
            raise argparse.ArgumentTypeError(
                f"{name} must be in [0, {upper}], got {text}" if upper else f"{name} must be >= 0, got {text}")
        return value
    return parse


def _ids(text):
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _interleave(text):
    return "contiguous" if text == "contiguous" else _positive("--interleave")(text)


def _mesh(text):
    try:
        parts = dict(p.split("=", 1) for p in text.split(","))
        if set(parts) != {"tp", "dcp"}:
            raise ValueError
        return int(parts["tp"]), int(parts["dcp"])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes tp=N,dcp=M, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m dcp_jax.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--tp", type=_positive("--tp"), default=None, help="tensor-parallel size (default 1)")
    p.add_argument("--dcp", type=_positive("--dcp"), default=None, help="decode-context-parallel size (default 1)")
    p.add_argument("--mesh", type=_mesh, default=None, help="both at once: tp=2,dcp=4")
    p.add_argument("--interleave", type=_interleave, default=1,
                   help="KV placement interleave size, or 'contiguous' (default 1: round-robin)")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", type=_ids, default=[],
                   help="prompt token ids, e.g. 1,2,3 (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=32)
    p.add_argument("--max-seq-len", type=_positive("--max-seq-len"), default=None,
                   help="cache capacity per sequence (default: longest prompt + max new tokens)")
    p.add_argument("--prefill-chunk", type=_positive("--prefill-chunk"), default=256)
    p.add_argument("--temperature", type=_non_negative_float("--temperature"), default=0.0,
                   help="0 = greedy")
    p.add_argument("--top-k", type=lambda t: 0 if t == "0" else _positive("--top-k")(t), default=0)
    p.add_argument("--top-p", type=_non_negative_float("--top-p", 1.0), default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--impl", choices=("reference", "pallas", "pallas_interpret"), default=None,
                   help="attention kernel (default: Pallas on GPU, jnp reference on CPU)")
    p.add_argument("--logprobs", action="store_true", help="report the log-probability of each token")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def run(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.mesh and (args.tp or args.dcp):
            raise _Usage("give either --mesh or --tp/--dcp, not both")
        tp, dcp = args.mesh or (args.tp or 1, args.dcp or 1)
        if not args.prompt and not args.prompt_ids:
            raise _Usage("no prompt: give --prompt TEXT or --prompt-ids 1,2,3")
        if args.top_p == 0:
            raise _Usage("--top-p must be > 0")
    except _Usage as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR

    try:
        from dcp_jax.engine import LLM

        llm = LLM.load(args.model, tp=tp, dcp=dcp, interleave=args.interleave, dtype=args.dtype,
                       impl=args.impl)
        prompts = list(args.prompt) + list(args.prompt_ids)
        out = llm.generate(prompts, max_new_tokens=args.max_new_tokens, max_seq_len=args.max_seq_len,
                           prefill_chunk=args.prefill_chunk, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    except ValueError as e:  # UserError and the library's own ValueErrors (bad mesh, bad sizes)
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR

    if args.json:
        obj = {"tokens": out.tokens}
        if out.text is not None:
            obj["text"] = out.text
        if args.logprobs:
            obj["logprobs"] = out.logprobs
        obj["stats"] = out.stats
        print(json.dumps(obj))
    else:
        for i, toks in enumerate(out.tokens):
            print(f"[{i}] {out.text[i] if out.text is not None else toks}")
            if args.logprobs:
                print(f"    logprobs: {[round(x, 4) for x in out.logprobs[i]]}")
        s = out.stats
        print(f"mesh tp={s['tp']} x dcp={s['dcp']}  kv/device {s['kv_bytes_per_device']:,} B of "
              f"{s['kv_bytes_total']:,} B  ttft {s['ttft_s']:.3f} s  decode {s['decode_tokens_per_s']:.1f} tok/s "
              f"(compile {s['compile_s']:.1f} s)")
    return 0


def main():
    sys.exit(run())


if __name__ == "__main__":
    main()
