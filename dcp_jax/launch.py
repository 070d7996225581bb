"""Server launch, shared by `python -m dcp_jax.serve`, its disaggregated roles, notebooks and tests:
load the `LLM` every role serves, wrap it in the OpenAI app, run uvicorn (on this thread or a
background one).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from dcp_jax.cli import DEFAULT_MODEL, RUN_ERROR
from dcp_jax.errors import UserError

DEFAULT_EMBEDDED_MAX_MODEL_LEN = 256  # the embedded model was trained on 256-byte windows


def load_llm(model_dir=None, *, tp: int | None = None, dcp: int | None = None, max_model_len: int | None = None,
             **llm_kw):
    """The `LLM` a server role serves: (LLM, checkpoint path, embedded?). Without `model_dir`, the
    embedded tiny model on the mesh the default CLI run picks, with a 256-token context. `llm_kw`:
    as `LLM.load`. Nothing is compiled yet (the caller compiles what it runs before the port opens).
    Raises UserError/ValueError on bad sizes or checkpoints."""
    from dcp_jax import mesh as mesh_lib
    from dcp_jax.llm import LLM

    embedded = model_dir is None
    path = Path(model_dir) if model_dir is not None else DEFAULT_MODEL
    if tp is None and dcp is None and embedded:
        tp, dcp = mesh_lib.local_mesh_shape(max_tp=2)
    if embedded and max_model_len is None:
        max_model_len = DEFAULT_EMBEDDED_MAX_MODEL_LEN
    llm = LLM.load(path, tp=tp or 1, dcp=dcp or 1, max_model_len=max_model_len, **llm_kw)
    return llm, path, embedded


def openai_app(runner, llm, path: Path, embedded: bool, served_model_name: str | None = None, **app_kw):
    """The OpenAI-compatible FastAPI app over `runner` (an AsyncEngine driving `llm`'s engine);
    `app_kw`: `create_app`'s api_key, max_request_bytes, tool_call_parser and reasoning_parser."""
    from dcp_jax.server.app import create_app
    name = served_model_name or ("dcp-jax-tiny" if embedded else path.resolve().name)
    app = create_app(runner, model_name=name, max_model_len=llm.config.max_model_len, tokenizer=llm.tokenizer,
                     chat_template=llm.chat_template, tp=llm.mesh.shape["tp"],
                     dcp=llm.mesh.shape["dcp"], **app_kw)
    app.state.engine = runner  # what `serve_forever` watches
    return app


def make_app(model_dir=None, *, served_model_name: str | None = None, max_pending: int = 256,
             api_key: str | None = None, max_request_bytes: int | None = None, lockstep_timeout: float | None = None,
             tool_call_parser: str | None = None, reasoning_parser: str | None = None, **llm_kw):
    """Load the model, size the pool, compile, and return (FastAPI app, LLM); `llm_kw` as
    `load_llm` (chat_template: a template file served instead of the checkpoint's).
    `lockstep_timeout` (several processes, this one process 0): the engine leads the others'
    (`follow`). `tool_call_parser`, `reasoning_parser`: the chat endpoint's (`dcp_jax.agents`).
    Raises UserError/ValueError on bad sizes, checkpoints or parser names."""
    from dcp_jax.agents.parsers import check_tool_parser
    from dcp_jax.agents.reasoning import check_reasoning_parser
    from dcp_jax.serving.async_engine import AsyncEngine

    check_tool_parser(tool_call_parser)  # before the model loads
    check_reasoning_parser(reasoning_parser)

    llm, path, embedded = load_llm(model_dir, **serve_kw(llm_kw, lockstep_timeout))
    llm.engine.runner.compile_all()  # before the port opens: the first request pays no compile time
    if lockstep_timeout is not None:
        join_lockstep(llm, lockstep_timeout)
    app_kw = dict(api_key=api_key, tool_call_parser=tool_call_parser,
                  reasoning_parser=reasoning_parser)
    app_kw |= {} if max_request_bytes is None else dict(max_request_bytes=max_request_bytes)
    return openai_app(AsyncEngine(llm.engine, max_pending=max_pending), llm, path, embedded, served_model_name,
                      **app_kw), llm


def serve_kw(llm_kw: dict, lockstep_timeout: float | None) -> dict:
    """`load_llm`'s keywords for a server role: on several processes (`lockstep_timeout`), an engine
    whose lockstep has process 0 lead and the others follow (`LLM(lockstep="serve")`)."""
    if lockstep_timeout is None:
        return llm_kw
    return dict(llm_kw, lockstep="serve", dist_timeout=lockstep_timeout)


def join_lockstep(llm, timeout_s: float):
    """Several processes: wait until every process has compiled (a barrier of the distributed
    runtime); returns the lockstep `llm`'s engine was built with (process 0 leads). Raises
    LockstepError when a peer does not arrive within ten times `timeout_s` (compiling takes about as
    long everywhere)."""
    from dcp_jax.serving.lockstep import LockstepError, RuntimeStore

    try:
        RuntimeStore().client.wait_at_barrier("dcp_jax/ready", int(10 * timeout_s * 1000))
    except Exception as e:  # noqa: BLE001 - the runtime's own error type
        raise LockstepError(f"the processes did not all get ready to serve within {10 * timeout_s:g} s "
                            f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]})") from e
    return llm.engine.lockstep


def follow(model_dir=None, *, timeout_s: float, **llm_kw) -> int:
    """A process other than 0 of a multi-process server: load and compile the same model, then take
    process 0's steps until it stops. Returns an exit status (one error line when it cannot go
    on)."""
    from dcp_jax.serving.lockstep import LockstepError

    try:
        llm, _, _ = load_llm(model_dir, **serve_kw(llm_kw, timeout_s))
        llm.engine.runner.compile_all()
        lockstep = join_lockstep(llm, timeout_s)
        with llm.engine.lock:
            lockstep.follow(llm.engine)
    # UserError and the library's own ValueErrors
    except (ValueError, ImportError, LockstepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR
    return 0


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


def bind_socket(host: str, port: int):
    """A TCP socket bound to host:port as uvicorn binds it (SO_REUSEADDR; IPv6 when `host` has a
    colon), not yet listening: `serve_forever(sock=)` serves on it. Raises UserError, one line
    naming --host or --port and the fix, when the address is taken or not this machine's."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(bind_error(host, port, e), field="port" if e.errno in (
            errno.EADDRINUSE, errno.EACCES) else "host") from None
    return sock


def bind_error(host: str, port: int, e: OSError) -> str:
    """What binding (or listening on) host:port failing with `e` means, and the fix, in one line."""
    import errno
    import socket

    local = "e.g. 127.0.0.1 (or 0.0.0.0: all of them)"
    if isinstance(e, socket.gaierror):
        return (f"--host {host} does not resolve to an address ({e.strerror}): give an address of "
                f"this machine, {local}")
    if e.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use: give another --port (or stop the "
                "program listening there)")
    if e.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host} is not an address of this machine: give one of its addresses, "
                + local)
    if e.errno == errno.EACCES:
        return (f"binding port {port} on {host} is not permitted: give a --port above 1023 (or "
                "run with the privilege to bind it)")
    return f"cannot serve on {host}:{port} ({e.strerror or e}): check --host and --port"


def serve_forever(app, host: str, port: int, log_level: str, shutdown_timeout: float = 30.0,
                  sock=None) -> int:
    """uvicorn on this thread until it stops; an exit status, with one error line when it could not
    serve. `sock`: a socket `bind_socket` bound to host:port (default: bind it here).

    SIGTERM / SIGINT drain: the port closes, requests in flight get `shutdown_timeout` seconds to
    finish, the rest are aborted, and the status is 0. If the engine thread dies
    (`app.state.engine.failure`), /health fails at once and the process ends with status 1 within a
    second, so a supervisor restarts it.
    """
    import contextlib
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        # uvicorn re-raises the signal after draining: exit with 0 instead
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handlers = {sig: signal.signal(sig, lambda *_: self.handle_exit(sig, None))
                        for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in handlers.items():
                    signal.signal(sig, handler)

    try:
        sock = bind_socket(host, port) if sock is None else sock
        try:  # here: uvloop's server would ignore a listen that fails (a port taken since the bind)
            sock.listen(2048)
        except OSError as e:
            sock.close()
            raise UserError(bind_error(host, port, e)) from None
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR
    server = Server(uvicorn.Config(app, host=host, port=sock.getsockname()[1], log_level=log_level,
                                   timeout_graceful_shutdown=shutdown_timeout))
    engine, died = getattr(app.state, "engine", None), []

    def watch():
        while not server.should_exit:
            if engine is not None and engine.failure is not None:
                died.append(engine.failure)
                server.should_exit = True
                return
            time.sleep(0.2)

    threading.Thread(target=watch, name="dcp-jax-watchdog", daemon=True).start()
    try:
        server.run(sockets=[sock])
    except OSError as e:
        print(f"error: {bind_error(host, port, e)}", file=sys.stderr)
        return RUN_ERROR
    except SystemExit:  # uvicorn's exit when the app's startup failed (its log says why)
        print(f"error: could not serve on {host}:{port}: the app did not start (see the log above)",
              file=sys.stderr)
        return RUN_ERROR
    finally:
        server.should_exit = True  # (the watchdog's end)
        sock.close()
    if died:
        print(f"error: the engine stopped ({type(died[0]).__name__}: {died[0]}); exiting so a supervisor can "
              "restart the server", file=sys.stderr)
        return RUN_ERROR
    if not server.started:
        print(f"error: could not serve on {host}:{port}", file=sys.stderr)
        return RUN_ERROR
    return 0
