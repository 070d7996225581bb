"""The OpenAI-compatible server: `python -m dcp_jax.serve [--model DIR] [--mesh tp=2,dcp=4] [--port 8000]`.

With no --model it serves the embedded tiny model on the mesh the default CLI run picks. The KV pool is
sized once at start (--kv-cache-memory, else --max-num-seqs x --max-model-len tokens) and every program
is compiled before the port opens, so the first request pays no compile time. Command-line mistakes end
with one `error: ...` line and exit 2, like `python -m dcp_jax.generate`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dcp_jax.generate import (
    DEFAULT_MODEL,
    RUN_ERROR,
    USAGE_ERROR,
    CliParser,
    UsageError,
    add_speculative_args,
    byte_size,
    mesh_arg,
    positive_float,
    positive_int,
    speculative_kwargs,
)

DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_EMBEDDED_MAX_MODEL_LEN = 256  # the embedded model was trained on 256-byte windows


def build_parser():
    p = CliParser(prog="python -m dcp_jax.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face or orbax checkpoint (default: the embedded tiny model)")
    p.add_argument("--mesh", type=mesh_arg, default=None, help="tp=N,dcp=M")
    p.add_argument("--tp", type=positive_int("--tp"), default=None, help="tensor-parallel size (default 1)")
    p.add_argument("--dcp", type=positive_int("--dcp"), default=None, help="decode-context-parallel size (default 1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=lambda t: 0 if t == "0" else positive_int("--port")(t), default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")
    p.add_argument("--kv-cache-memory", type=byte_size, default=None, metavar="SIZE",
                   help="KV cache bytes per device (default: max-num-seqs x max-model-len tokens)")
    p.add_argument("--max-num-seqs", type=positive_int("--max-num-seqs"), default=8, help="requests decoding at once")
    p.add_argument("--max-model-len", type=positive_int("--max-model-len"), default=None,
                   help=f"the context: prompt + generated tokens per request (default {DEFAULT_MAX_MODEL_LEN}, "
                        f"{DEFAULT_EMBEDDED_MAX_MODEL_LEN} for the embedded model)")
    p.add_argument("--page-size", type=positive_int("--page-size"), default=None, help="slots per KV page (default 64)")
    p.add_argument("--prefill-chunk", type=positive_int("--prefill-chunk"), default=None,
                   help="prompt tokens per prefill program call (default 256 on CPU, 2048 on GPU)")
    p.add_argument("--decode-steps", type=positive_int("--decode-steps"), default=8,
                   help="decode steps per program call: more is faster, fewer streams and admits more finely (default 8)")
    p.add_argument("--max-pending", type=positive_int("--max-pending"), default=256,
                   help="unfinished requests held at once; more get 503 (default 256)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of cached full blocks of a prompt's prefix (default on)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_speculative_args(p)
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
                   help="bound on one request's prefill + KV pull (decode) / on an unpulled offer (prefill)")
    return p


def check_role_args(args) -> str | None:
    """The one-line usage error of an inconsistent role, or None."""
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
    return None


def load_engine(model_dir=None, *, tp: int | None = None, dcp: int | None = None, dtype: str = "float32",
                page_size: int | None = None, max_num_seqs: int = 8, kv_cache_memory=None,
                max_model_len: int | None = None, prefill_chunk: int | None = None, decode_steps: int = 8,
                enable_prefix_caching: bool = True, interleave: int = 1, speculative: str | None = None,
                num_speculative_tokens: int = 4, draft_model=None):
    """Load the model and size the serving engine's pool once, as every server role does:
    (LLM, ServingEngine, max_model_len, checkpoint path, embedded?). The prefill program is compiled and
    the pool allocated; the caller compiles what else it runs. Raises UserError/ValueError on bad sizes
    or checkpoints. `speculative` ("ngram" | "draft" with `draft_model`): as `LLM.load`."""
    import math

    from dcp_jax import mesh as mesh_lib
    from dcp_jax.engine import LLM, default_prefill_chunk

    embedded = model_dir is None
    path = Path(model_dir) if model_dir is not None else DEFAULT_MODEL
    if tp is None and dcp is None and embedded:
        tp, dcp = mesh_lib.local_mesh_shape(max_tp=2)
    tp, dcp = tp or 1, dcp or 1
    llm = LLM.load(path, tp=tp, dcp=dcp, dtype=dtype, page_size=page_size, max_num_seqs=max_num_seqs,
                   kv_cache_memory=kv_cache_memory, decode_steps=decode_steps, interleave=interleave,
                   enable_prefix_caching=enable_prefix_caching, speculative=speculative,
                   num_speculative_tokens=num_speculative_tokens, draft_model=draft_model)
    max_model_len = max_model_len or (DEFAULT_EMBEDDED_MAX_MODEL_LEN if embedded else DEFAULT_MAX_MODEL_LEN)
    if max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {max_model_len}")
    window = llm.model.config.sliding_window
    if window and max_model_len > window:
        raise ValueError(f"the model uses a {window}-token sliding window, which dcp_jax does not implement; "
                         f"give --max-model-len <= {window}")
    chunk = prefill_chunk or default_prefill_chunk(llm.mesh.devices.flat[0].platform)
    chunk = min(chunk, max(16, 1 << math.ceil(math.log2(max_model_len))))  # no longer than a whole context
    engine = llm.server(max_model_len, chunk, llm.num_pages(max_model_len))
    engine.prefill_program(chunk)  # compile before the port opens
    engine.allocate()
    return llm, engine, max_model_len, path, embedded


def openai_app(runner, llm, max_model_len: int, path: Path, embedded: bool, served_model_name: str | None = None):
    """The OpenAI-compatible FastAPI app over `runner` (an AsyncEngine driving `llm`'s serving engine)."""
    from dcp_jax.serving.openai import ChatTemplate, create_app

    template = ChatTemplate.from_tokenizer_config(path / "tokenizer_config.json") if path.is_dir() else None
    name = served_model_name or ("dcp-jax-tiny" if embedded else path.resolve().name)
    return create_app(runner, model_name=name, max_model_len=max_model_len, tokenizer=llm.tokenizer,
                      chat_template=template, tp=llm.mesh.shape["tp"], dcp=llm.mesh.shape["dcp"])


def make_app(model_dir=None, *, served_model_name: str | None = None, max_pending: int = 256, **engine_kw):
    """Load the model, size the pool, compile, and return (FastAPI app, LLM); `engine_kw` as `load_engine`.
    Raises UserError/ValueError on bad sizes or checkpoints."""
    from dcp_jax.serving.async_engine import AsyncEngine

    llm, engine, max_model_len, path, embedded = load_engine(model_dir, **engine_kw)
    engine.step_program()  # compile before the port opens
    return openai_app(AsyncEngine(engine, max_pending=max_pending), llm, max_model_len, path, embedded,
                      served_model_name), llm


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0):
    """Run `app` with uvicorn on a background thread of this process (notebooks, tests, benchmarks):
    returns (base URL "http://host:port", stop()) once it listens (port 0: a free one), or raises
    RuntimeError when it did not start within `timeout_s`."""
    import threading
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="dcp-jax-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"the server did not start on {host}:{port} within {timeout_s:g} s")
        time.sleep(0.05)
    bound = server.servers[0].sockets[0].getsockname()[1]

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout_s)
        if thread.is_alive():
            raise RuntimeError("the server did not stop")

    return f"http://{host}:{bound}", stop


def run(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.mesh and (args.tp or args.dcp):
            raise UsageError("give either --mesh or --tp/--dcp, not both")
        speculative = speculative_kwargs(args)
        if (problem := check_role_args(args)) is not None:
            raise UsageError(problem)
        if args.role != "single" and args.speculative is not None:
            raise UsageError(f"--speculative is not supported with --role {args.role}: serve speculative decoding "
                             "from a single instance (--role single)")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return USAGE_ERROR
    try:
        import uvicorn
    except ImportError:
        print("error: the server needs the 'serve' extra: pip install 'dcp_jax[serve]'", file=sys.stderr)
        return RUN_ERROR
    tp, dcp = args.mesh or (args.tp, args.dcp)
    if args.role != "single":  # dcp_jax.disagg
        from dcp_jax.disagg.server import run_role

        return run_role(args, tp, dcp)
    try:
        app, llm = make_app(args.model, tp=tp, dcp=dcp, served_model_name=args.served_model_name,
                            kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                            max_model_len=args.max_model_len, page_size=args.page_size,
                            prefill_chunk=args.prefill_chunk, max_pending=args.max_pending, dtype=args.dtype,
                            decode_steps=args.decode_steps, enable_prefix_caching=args.enable_prefix_caching,
                            **speculative)
    except (ValueError, ImportError) as e:  # UserError and the library's own ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR
    print(f"serving {llm.source} on http://{args.host}:{args.port}/v1 (tp={llm.mesh.shape['tp']} x "
          f"dcp={llm.mesh.shape['dcp']})", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except (OSError, SystemExit) as e:  # e.g. the port is taken
        print(f"error: could not serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return RUN_ERROR
    return 0


def main():
    sys.exit(run())


if __name__ == "__main__":
    main()
