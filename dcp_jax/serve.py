"""The OpenAI-compatible server: `python -m dcp_jax.serve [--model DIR] [--mesh tp=2,dcp=4] [--port 8000]`.

With no --model it serves the embedded tiny model on the mesh the default CLI run picks. The server
builds one `LLM` (the same object `python -m dcp_jax.generate` and notebooks use): its context and KV
pool are fixed at start (--max-model-len, default the checkpoint's; --kv-cache-memory, default as
`LLM`'s), and every program is compiled before the port opens, so the first request pays no compile
time. Command-line mistakes end with one `error: ...` line and exit 2, like `python -m dcp_jax.generate`.

On several processes (the `--coordinator/--num-processes/--process-id` or `--distributed` flags of
`python -m dcp_jax.generate`, docs/MULTIHOST.md) every process loads and compiles the same model; process
0 serves HTTP and leads, the others follow its steps (`dcp_jax.serving.lockstep`) and serve nothing.
"""

from __future__ import annotations

import os
import sys

from dcp_jax.cli import (
    RUN_ERROR,
    USAGE_ERROR,
    CliParser,
    UsageError,
    add_engine_args,
    byte_size,
    engine_kwargs,
    integer,
    mesh_shape,
    positive_float,
    positive_int,
)
from dcp_jax.errors import UserError
from dcp_jax.processes import add_distributed_args, check_distributed_args, is_multi, start


def build_parser():
    p = CliParser(prog="python -m dcp_jax.serve", description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to serve on (default 127.0.0.1; 0.0.0.0: every address)")
    p.add_argument("--port", type=integer("--port", 0, 65535), default=8000,
                   help="the TCP port to serve on (default 8000; 0: a free one)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    p.add_argument("--max-pending", type=positive_int("--max-pending"), default=256,
                   help="unfinished requests held at once; more get 503 (default 256)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="every /v1 route needs 'Authorization: Bearer KEY' (default: $DCP_JAX_API_KEY; none: open); "
                        "/health and /metrics stay open; --role prefill/decode share it for their control channel")
    p.add_argument("--max-request-bytes", type=byte_size("--max-request-bytes"), default=None, metavar="SIZE",
                   help="the largest request body accepted (default 32MiB); larger ones get 413")
    p.add_argument("--shutdown-timeout", type=positive_float("--shutdown-timeout"), default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds requests in flight get to finish before the rest are aborted "
                        "(then the exit status is 0; default 30)")
    t = p.add_argument_group("chat: templates, tools and reasoning (dcp_jax.agents)")
    t.add_argument("--chat-template", default=None, metavar="FILE",
                   help="serve this Jinja chat template instead of the checkpoint's (e.g. one that "
                        "renders tools)")
    t.add_argument("--tool-call-parser", default=None, metavar="NAME", choices=tool_parsers(),
                   help="read tool calls out of chat and Messages answers in this model "
                        "family's format (" + ", ".join(tool_parsers())
                        + "); needed for tool_choice auto")
    t.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   choices=reasoning_parsers(),
                   help="move the model's thinking into reasoning_content (chat) or thinking "
                        "blocks (the Messages API's, when asked) ("
                        + ", ".join(reasoning_parsers()) + ")")
    # --- prefill/decode disaggregation (dcp_jax.disagg, docs/DISAGG.md) ---------------------------------
    g = p.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--role", choices=("single", "prefill", "decode"), default="single",
                   help="single: prefill and decode here (default); prefill: only prefill, for a decode instance; "
                        "decode: serve clients, prompts prefilled by the instance at --prefill-at")
    g.add_argument("--prefill-at", default=None, metavar="HOST:PORT", help="the prefill instance (--role decode)")
    g.add_argument("--interleave", type=positive_int("--interleave"), default=1,
                   help="KV interleave size of this role's pool (--role prefill/decode; default 1)")
    g.add_argument("--transfer-timeout", type=positive_float("--transfer-timeout"), default=60.0,
                   metavar="SECONDS",
                   help="bound on one request's prefill and on its KV pull (decode) / on an unpulled offer (prefill)")
    g.add_argument("--prefill-queue-timeout", type=positive_float("--prefill-queue-timeout"), default=60.0,
                   metavar="SECONDS", help="bound on one request's wait in the prefill instance's queue, apart from "
                                           "--transfer-timeout (decode: asked for; prefill: for calls naming none)")
    g.add_argument("--transfer-host", default=None, metavar="HOST",
                   help="the address the KV transfer server binds (--role prefill/decode; default: --host)")
    g.add_argument("--transfer-advertise", default=None, metavar="HOST",
                   help="the host name the peer instance reaches the transfer server by (default: the bound "
                        "address; needed when it binds 0.0.0.0)")
    add_distributed_args(p)
    return p


def tool_parsers() -> list[str]:
    from dcp_jax.agents.parsers import TOOL_PARSERS

    return list(TOOL_PARSERS)


def reasoning_parsers() -> list[str]:
    from dcp_jax.agents.reasoning import REASONING_PARSERS

    return list(REASONING_PARSERS)


def check_role_args(args) -> str | None:
    """The one-line usage error of an inconsistent role, or None."""
    chat = [f for f, v in (("--chat-template", args.chat_template),
                           ("--tool-call-parser", args.tool_call_parser),
                           ("--reasoning-parser", args.reasoning_parser)) if v is not None]
    if args.role != "single" and chat:
        return (f"{chat[0]} is for --role single: the disaggregated roles serve the checkpoint's "
                "template without tool or reasoning parsers")
    if args.role == "decode" and not args.prefill_at:
        return "--role decode needs --prefill-at HOST:PORT (the prefill instance's --host and --port)"
    if args.prefill_at and args.role != "decode":
        return "--prefill-at is for --role decode: give --role decode, or drop --prefill-at"
    if args.prefill_at:
        host, _, port = args.prefill_at.rpartition(":")
        if not host or not port.isdigit():
            return f"--prefill-at takes HOST:PORT, got {args.prefill_at!r}"
    if args.role == "single" and args.interleave != 1:
        return "--interleave applies to --role prefill and --role decode (a single instance uses 1)"
    if args.role == "single" and (args.transfer_host or args.transfer_advertise):
        return "--transfer-host and --transfer-advertise are for --role prefill and --role decode"
    bind = args.transfer_host or args.host
    if args.role != "single" and bind in ("0.0.0.0", "::", "") and not args.transfer_advertise:
        return (f"the KV transfer server binds {bind or 'every address'}: give --transfer-advertise HOST, the name "
                "the peer instance reaches this host by")
    if args.role == "prefill" and is_multi(args):
        return ("--role prefill runs on one process: a prefill instance spanning processes is not supported "
                "(the decode instance may: --role decode with the multi-process flags)")
    if args.role != "single" and args.speculative is not None:
        return (f"--speculative is not supported with --role {args.role}: serve speculative decoding "
                "from a single instance (--role single)")
    return None


def run(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        tp, dcp = mesh_shape(args)
        llm_kw = engine_kwargs(args)
        check_distributed_args(args)
        if (problem := check_role_args(args)) is not None:
            raise UsageError(problem)
        if (status := check_chat_template(args.chat_template)) is not None:
            return status
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    multi = is_multi(args)
    # several processes: this share runs in a supervised child (a lost peer becomes one line)
    if (status := start("dcp_jax.serve", argv, args, (tp or 1) * (dcp or 1) if tp or dcp else None,
                        stream=True)) is not None:
        return status
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        print("error: the server needs the 'serve' extra: pip install 'dcp_jax[serve]'", file=sys.stderr)
        return RUN_ERROR
    from dcp_jax.launch import bind_socket

    llm_kw.update(tp=tp, dcp=dcp, max_num_seqs=args.max_num_seqs or 8, dist_timeout=args.dist_timeout)
    api_key = args.api_key if args.api_key is not None else os.environ.get("DCP_JAX_API_KEY") or None
    try:  # process 0 serves HTTP: its port, bound before the model loads (a taken one: at once)
        sock = bind_socket(args.host, args.port) if not multi or _leads() else None
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    if args.role != "single":  # dcp_jax.disagg: the two roles share the key (/v1 and the control channel)
        from dcp_jax.disagg.server import run_role

        if sock is not None:
            sock.close()  # (the role binds it again when it serves)
        return run_role(args, llm_kw, api_key, lockstep_timeout=args.dist_timeout if multi else None)
    from dcp_jax.launch import follow, make_app, serve_forever
    from dcp_jax.serving.lockstep import LockstepError

    if sock is None:  # a follower: no HTTP
        return follow(args.model, timeout_s=args.dist_timeout, **llm_kw)
    try:
        app, llm = make_app(args.model, served_model_name=args.served_model_name, max_pending=args.max_pending,
                            api_key=api_key, max_request_bytes=args.max_request_bytes,
                            lockstep_timeout=args.dist_timeout if multi else None,
                            tool_call_parser=args.tool_call_parser,
                            reasoning_parser=args.reasoning_parser,
                            chat_template=args.chat_template, **llm_kw)
    except (ValueError, ImportError, LockstepError) as e:  # UserError and the library's own ValueErrors
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR
    port = sock.getsockname()[1]  # (--port 0: the one picked)
    print(f"serving {llm.source} on http://{args.host}:{port}/v1 (tp={llm.mesh.shape['tp']} x "
          f"dcp={llm.mesh.shape['dcp']}, max_model_len {llm.config.max_model_len:,})", file=sys.stderr)
    return serve_forever(app, args.host, port, args.log_level, args.shutdown_timeout, sock=sock)


def check_chat_template(path) -> int | None:
    """--chat-template FILE, read and compiled before the model loads: a template that does not
    parse is a usage error (UsageError), a file that cannot be read one error line and RUN_ERROR."""
    if path is None:
        return None
    from dcp_jax.chat_template import check_template, read_template

    try:
        source = read_template(path)
    except UserError as e:  # as a missing --model is
        print(f"error: --chat-template: {e}", file=sys.stderr)
        return RUN_ERROR
    try:
        check_template(source, path)
    except UserError as e:
        raise UsageError(f"--chat-template: {e}") from None
    return None


def _leads() -> bool:
    import jax

    return jax.process_index() == 0


def main():
    sys.exit(run())


if __name__ == "__main__":
    main()
