"""Command-line helpers shared by `python -m dcp_jax.generate`, `python -m dcp_jax.serve` and the
disaggregated roles: the argument types (their one-line parser is `dcp_jax.errors.CliParser`), the
flags every entry point takes to build an `LLM`, and their mapping to `LLM.load`'s keywords (one
place: a flag added here reaches every entry point); and the flags of a `SamplingParams`
(`add_sampling_args`: one per row of `dcp_jax.sampling_params.RULES`, whose type and range it takes:
a numeric parameter needs no flag code).
"""

from __future__ import annotations

import argparse
from pathlib import Path

# (the one-line parser, its error and the exit codes live with UserError; the entry points take
# them from here, with the flags)
from dcp_jax.errors import RUN_ERROR, USAGE_ERROR, CliParser, UsageError, UserError  # noqa: F401
from dcp_jax.serving.config import parse_bytes

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_MODEL = ASSETS / "tiny"  # the embedded model every entry point runs without --model


def integer(name, low: int = 1, high: int | None = None):
    """An argparse type: an integer in [low, high] (no upper bound without `high`) for the flag `name`."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if high is not None and not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{name} must be in [{low}, {high}], got {value}")
        if value < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {value}")
        return value
    return parse


def positive_int(name):
    return integer(name, 1)


def non_negative_int(name):
    return integer(name, 0)


def alternatives(name):
    """An argparse type: how many alternatives a logprobs flag reports, an integer in [0, 20]."""
    from dcp_jax.sampling import MAX_TOP_LOGPROBS

    return integer(name, 0, MAX_TOP_LOGPROBS)


top_logprobs_arg = alternatives("--top-logprobs")


def non_negative_float(name, upper=None, positive=False):
    """An argparse type: a number >= 0 (> 0 when `positive`), at most `upper` when given."""
    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        low_ok = value > 0 if positive else value >= 0  # False for NaN
        if not low_ok or (upper is not None and value > upper):
            low, bound = ("(0", "> 0") if positive else ("[0", ">= 0")
            raise argparse.ArgumentTypeError(
                f"{name} must be in {low}, {upper:g}], got {text}" if upper is not None else
                f"{name} must be {bound}, got {text}")
        return value
    return parse


def penalty_arg(name):
    """An argparse type: a presence or frequency penalty, a number in [-2, 2]."""
    from dcp_jax.penalties import MAX_PENALTY

    def parse(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number, got {text!r}") from None
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise argparse.ArgumentTypeError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {text}")
        return value
    return parse


def positive_float(name, upper=None):
    """An argparse type: a number > 0, at most `upper` when given."""
    return non_negative_float(name, upper, positive=True)


def token_ids(name):
    """An argparse type: comma-separated token ids for the flag `name`."""
    def parse(text):
        try:
            ids = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} takes comma-separated integers, got {text!r}") from None
        if not ids:
            raise argparse.ArgumentTypeError(f"{name} is empty")
        return ids
    return parse


token_ids_arg = token_ids("--prompt-ids")


def logit_bias_arg(text):
    """An argparse type: --logit-bias ID=BIAS, a token id and a number in [-100, 100]."""
    from dcp_jax.sampling import MAX_BIAS

    tid, sep, bias = text.partition("=")
    try:
        pair = int(tid), float(bias)
    except ValueError:
        pair = None
    if not sep or pair is None or not -MAX_BIAS <= pair[1] <= MAX_BIAS:
        raise argparse.ArgumentTypeError(f"--logit-bias takes ID=BIAS with a bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                         f"got {text!r}")
    return pair


def json_or_file(name):
    """An argparse type: JSON text, or the path of a file holding it."""
    import json

    def parse(text):
        if not text.lstrip().startswith(("{", "[")):
            try:
                text = Path(text).read_text()
            except OSError as e:
                raise argparse.ArgumentTypeError(
                    f"{name} takes JSON or a file of it; {text!r} is neither ({e.strerror})") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{name} is not valid JSON ({e})") from None
    return parse


def text_or_file(name):
    """An argparse type: a grammar's text, or the path of a file holding it. Every Lark or GBNF
    rule has a ':' (`start: ...`, `root ::= ...`), so a one-line value without one is a file name,
    and a file that is not there is an error (not a grammar that fails to parse); any other value is
    a file's name when such a file exists, else the grammar itself."""
    def read(text):
        try:
            return Path(text).read_text()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or "not UTF-8 text"
            rule = "" if ":" in text else " has no rule (no ':') and"
            raise argparse.ArgumentTypeError(f"{name} takes a grammar or a file of it; {text!r}"
                                             f"{rule} cannot be read as a file ({why})") from None

    def parse(text):
        if "\n" not in text and ":" not in text:
            return read(text)
        try:
            is_file = "\n" not in text and Path(text).is_file()
        except OSError:  # e.g. a grammar longer than a file name may be
            is_file = False
        return read(text) if is_file else text
    return parse


def check_dir(flag: str, value) -> None:
    """UsageError (one line: the flag, the path, why, the fix) unless `value` names a directory
    this process can write in or make. Nothing is left behind: the check makes a directory where
    the first missing one would go (or in the directory itself) and removes it."""
    import os
    import tempfile

    path = base = Path(value).expanduser()
    where = f"{flag} {str(value)!r}"
    try:
        if path.exists() and not path.is_dir():
            raise UsageError(f"{where} is a file, not a directory: give a directory")
        base = path.absolute()
        while not base.exists():
            base = base.parent
        if not base.is_dir():
            raise UsageError(f"{where}: {base} is a file, so no directory can be made under it: "
                             "give another directory")
        os.rmdir(tempfile.mkdtemp(prefix=".dcp_jax-check-", dir=base))
    except OSError as e:
        raise UsageError(f"{where}: cannot make a directory in {base} ({e.strerror or e}): "
                         "give a directory you can write") from None


def byte_size(name):
    """An argparse type: a memory size ("512MiB", "2GB", bytes) for the flag `name`."""
    def parse(text):
        try:
            return parse_bytes(text)
        except UserError as e:
            raise argparse.ArgumentTypeError(f"{name}: {e}") from None
    return parse


def interleave_arg(text):
    return "contiguous" if text == "contiguous" else positive_int("--interleave")(text)


def mesh_arg(text):
    try:
        parts = dict(p.split("=", 1) for p in text.split(","))
        if set(parts) != {"tp", "dcp"}:
            raise ValueError
        return int(parts["tp"]), int(parts["dcp"])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mesh takes tp=N,dcp=M, got {text!r}") from None


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative", choices=("ngram", "draft"), default=None,
                   help="propose drafts by n-gram lookup in the context, or with a draft model (--draft-model); "
                        "the target verifies them in one forward (greedy output unchanged)")
    s.add_argument("--num-speculative-tokens", type=positive_int("--num-speculative-tokens"), default=None,
                   metavar="K", help="drafts per verify step (default 4)")
    s.add_argument("--draft-model", default=None, metavar="DIR",
                   help="--speculative draft: a smaller checkpoint with the target's vocabulary")
    s.add_argument("--speculative-auto-off", action=argparse.BooleanOptionalAction, default=None,
                   help="decode plainly for a while where speculation measures slower than "
                        "plain decoding, then try it again (default on; "
                        "--no-speculative-auto-off: always speculate)")


def speculative_kwargs(args) -> dict:
    """LLM.load's speculative keywords from the flags, or UsageError for a combination that cannot run."""
    if args.draft_model is not None and args.speculative != "draft":
        raise UsageError("--draft-model needs --speculative draft")
    if args.speculative == "draft" and args.draft_model is None:
        raise UsageError("--speculative draft needs --draft-model DIR (a checkpoint with the same vocabulary)")
    if args.num_speculative_tokens is not None and args.speculative is None:
        raise UsageError("--num-speculative-tokens needs --speculative ngram|draft")
    if args.speculative_auto_off is not None and args.speculative is None:
        raise UsageError("--speculative-auto-off needs --speculative ngram|draft")
    out = dict(speculative=args.speculative, draft_model=args.draft_model,
               num_speculative_tokens=args.num_speculative_tokens or 4)
    if args.speculative_auto_off is not None:
        out["speculative_auto_off"] = args.speculative_auto_off
    return out


def add_engine_args(p: argparse.ArgumentParser, *, max_num_seqs_help: str = "requests decoding at once (default 8)",
                    context_alias: str | None = None) -> None:
    """The flags that build an `LLM` (model, mesh, dtype, the pool and the scheduler), for every entry point.
    `context_alias`: another name for --max-model-len (the generate CLI's --max-seq-len)."""
    from dcp_jax.weights import DTYPE_NAMES

    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory or orbax checkpoint (default: the embedded tiny model)")
    p.add_argument("--tp", type=positive_int("--tp"), default=None, help="tensor-parallel size (default 1)")
    p.add_argument("--dcp", type=positive_int("--dcp"), default=None, help="decode-context-parallel size (default 1)")
    p.add_argument("--mesh", type=mesh_arg, default=None, help="both at once: tp=2,dcp=4")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default="auto",
                   help="weights and KV dtype (default auto: bfloat16 on GPUs, where float32 dots run without "
                        "tensor cores; float32 on CPUs)")
    k = p.add_argument_group("paged KV cache and continuous batching")
    names = ["--max-model-len"] + ([context_alias] if context_alias else [])
    k.add_argument(*names, dest="max_model_len", type=integer("--max-model-len", 2), default=None,
                   help="the context: prompt + generated tokens per request (default: the checkpoint's "
                        "max_position_embeddings, lowered to what the KV pool holds)")
    k.add_argument("--page-size", type=positive_int("--page-size"), default=None,
                   help="slots per page; one block-table entry covers page-size x dcp tokens (default 64)")
    k.add_argument("--max-num-seqs", type=positive_int("--max-num-seqs"), default=None, help=max_num_seqs_help)
    k.add_argument("--max-num-batched-tokens", type=positive_int("--max-num-batched-tokens"), default=None,
                   metavar="N", help="tokens of one iteration's ragged step: a token of each decoding request "
                                     "and the prompt chunks (default: one prefill chunk + max-num-seqs)")
    k.add_argument("--idle-batched-tokens", type=positive_int("--idle-batched-tokens"), default=None,
                   metavar="N", help="tokens of an iteration in which no request decodes (a lone "
                                     "prompt's chunks; default 1024 on CPU unless "
                                     "--max-num-batched-tokens or --prefill-chunk is given, "
                                     "else that budget)")
    k.add_argument("--prefill-chunk", type=positive_int("--prefill-chunk"), default=None,
                   help="prompt tokens an iteration prefills when every slot decodes: the default budget's share "
                        "(default 256 on CPU, 2048 on GPU)")
    k.add_argument("--decode-steps", type=positive_int("--decode-steps"), default=8,
                   help="decode steps per program call: more is faster, fewer streams and admits more finely "
                        "(default 8)")
    k.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached full blocks (page-size x dcp tokens) of a prompt's prefix; the "
                        "tokens are the same either way (default on)")
    k.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="run consecutive layers as one lax.scan (compile time flat in depth; default) or "
                        "one program per layer (--no-scan-layers: no per-step slicing of stacked weights)")
    k.add_argument("--kv-cache-memory", type=byte_size("--kv-cache-memory"), default=None, metavar="SIZE",
                   help="KV cache bytes per device, e.g. 512MiB or 2GB (default: 0.9 of each GPU; on CPU at "
                        "most 256 MiB in all, and no more than max-num-seqs contexts need)")
    k.add_argument("--kv-host-memory", type=byte_size("--kv-host-memory"), default=None, metavar="SIZE",
                   help="host memory (per process) for KV blocks evicted from the prefix cache, e.g. 4GiB: "
                        "a prompt whose prefix was evicted copies it back instead of prefilling it again")
    k.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8"), default="auto",
                   help="KV pages in the model dtype (auto) or 8-bit with a scale per token and kv head: about "
                        "half the bytes of bfloat16")
    k.add_argument("--gpu-memory-utilization", type=positive_float("--gpu-memory-utilization", 1.0),
                   default=None, metavar="F",
                   help="GPU only: size the KV pool to this fraction of each GPU's memory, less what is in use")
    add_speculative_args(p)
    p.add_argument("--compilation-cache", default=None, metavar="DIR|off",
                   help="JAX's persistent compilation cache: a later run loads the programs this "
                        "one compiles (default: $DCP_JAX_CACHE_DIR, else a cache configured in "
                        "JAX, else ~/.cache/dcp_jax/xla; 'off': none)")


def mesh_shape(args) -> tuple[int | None, int | None]:
    """(tp, dcp) from --mesh or --tp/--dcp (None where not given), or UsageError when both are given."""
    if args.mesh and (args.tp or args.dcp):
        raise UsageError("give either --mesh or --tp/--dcp, not both")
    return args.mesh or (args.tp, args.dcp)


def engine_kwargs(args) -> dict:
    """`LLM.load`'s keywords from the flags of `add_engine_args` (UsageError for a combination that
    cannot run). The mesh, the interleave and max_num_seqs's default are the entry point's."""
    from dcp_jax.compilation import OFF

    if args.kv_cache_memory is not None and args.gpu_memory_utilization is not None:
        raise UsageError("give --kv-cache-memory or --gpu-memory-utilization, not both")
    cache = args.compilation_cache
    if cache is not None and cache.strip().lower() not in OFF:
        check_dir("--compilation-cache", cache)
    return dict(dtype=args.dtype, max_model_len=args.max_model_len, page_size=args.page_size,
                max_num_batched_tokens=args.max_num_batched_tokens, prefill_chunk=args.prefill_chunk,
                idle_batched_tokens=args.idle_batched_tokens,
                decode_steps=args.decode_steps, enable_prefix_caching=args.enable_prefix_caching,
                scan_layers=args.scan_layers, kv_cache_memory=args.kv_cache_memory,
                gpu_memory_utilization=args.gpu_memory_utilization, kv_host_memory=args.kv_host_memory,
                kv_cache_dtype=args.kv_cache_dtype, compilation_cache=args.compilation_cache,
                **speculative_kwargs(args))


# the flags of a RULES row whose name is not its flag (the first one names it in errors)
SAMPLING_FLAGS = {"max_tokens": ("--max-new-tokens", "--max-tokens")}


def rule_arg(flag: str, name: str):
    """An argparse type for the flag of `SamplingParams`' `name`: its `RULES` row's type and
    range."""
    from dcp_jax.sampling_params import RULES

    rule = RULES[name]

    def parse(text):
        try:
            value = rule.kind(text)
        except ValueError:
            what = "an integer" if rule.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}") from None
        if not rule.ok(value, optional=False):
            raise argparse.ArgumentTypeError(f"{flag} must be {rule.describe(optional=False)}, "
                                             f"got {text}")
        return value
    return parse


def add_sampling_args(p: argparse.ArgumentParser, helps: dict | None = None) -> None:
    """The flags of a `SamplingParams`: one per `RULES` row (--top-k for top_k; default None: not
    given), and the parameters that are not numbers. `helps`: an entry point's own help by name."""
    from dcp_jax.sampling_params import RULES

    g = p.add_argument_group("sampling (SamplingParams)")
    for name, rule in RULES.items():
        flags = SAMPLING_FLAGS.get(name, ("--" + name.replace("_", "-"),))
        g.add_argument(*flags, dest=name, type=rule_arg(flags[0], name), default=None,
                       help=(helps or {}).get(name, rule.help))
    g.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-sequence token")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeat for more; needs a tokenizer)")
    g.add_argument("--stop-token-ids", type=token_ids("--stop-token-ids"), default=None,
                   metavar="IDS",
                   help="stop at any of these token ids, e.g. 5,6")
    g.add_argument("--bad-word", dest="bad_words", action="append", default=[], metavar="TEXT",
                   help="a word never generated (repeat for more; vLLM's bad_words)")
    g.add_argument("--logit-bias", action="append", type=logit_bias_arg, default=[],
                   metavar="ID=BIAS",
                   help="added to token ID's logit before sampling ([-100, 100]; repeat for more)")
    g.add_argument("--allowed-token-ids", type=token_ids("--allowed-token-ids"), default=None,
                   metavar="IDS",
                   help="the only token ids that may be generated, e.g. 5,6,7")
    s = g.add_mutually_exclusive_group()
    s.add_argument("--json-schema", type=json_or_file("--json-schema"), default=None,
                   metavar="SCHEMA",
                   help="the output is JSON valid under this schema (JSON text or a file)")
    s.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    s.add_argument("--regex", default=None, help="the output matches this regular expression")
    s.add_argument("--choice", action="append", default=None, metavar="TEXT",
                   help="the output is one of these (repeat the flag for each)")
    s.add_argument("--grammar", type=text_or_file("--grammar"), default=None,
                   help="the output follows this Lark (or GBNF) grammar: its text, or a file "
                        "holding it (a one-line value without ':' is a file name)")


def structured(args) -> dict | None:
    """The structured-output flag given (at most one: argparse checks), as SamplingParams'
    `structured`."""
    spec = dict(json=args.json_schema, json_object=args.json_object or None, regex=args.regex,
                choice=args.choice, grammar=args.grammar)
    return {k: v for k, v in spec.items() if v is not None} or None


# the flag of each kind of structured output (SamplingParams' `structured`)
STRUCTURED_FLAGS = dict(json="--json-schema", json_object="--json-object", regex="--regex",
                        choice="--choice", grammar="--grammar")


def check_structured(params) -> None:
    """UsageError naming the flag when the structured output asked (a `SamplingParams`') cannot
    compile: what can be checked before the model loads (a tokenizer's own checks, such as its
    special tokens, come with the model)."""
    if params.structured is None:
        return
    from dcp_jax.structured import check

    try:
        check(params.structured)
    except UserError as e:
        raise UsageError(f"{STRUCTURED_FLAGS[params.structured[0]]}: {e}") from None


def sampling_kwargs(args) -> dict:
    """`SamplingParams`' keywords from the flags of `add_sampling_args`: every flag whose dest is a
    field's name and that was given (the others keep SamplingParams' defaults), with --logit-bias
    (the last bias of a repeated id) and the structured-output flags made into their fields."""
    from dcp_jax.sampling_params import SamplingParams

    return dict(SamplingParams.fields_of(args), logit_bias=dict(args.logit_bias),
                structured=structured(args))
