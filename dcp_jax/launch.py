"""Server launch, shared by `python -m dcp_jax.serve`, its disaggregated roles, notebooks and tests: load
the `LLM` every role serves, wrap it in the OpenAI app, run uvicorn (on this thread or a background one).
"""

from __future__ import annotations

import sys
from pathlib import Path

from dcp_jax.cli import DEFAULT_MODEL, RUN_ERROR

DEFAULT_EMBEDDED_MAX_MODEL_LEN = 256  # the embedded model was trained on 256-byte windows


def load_llm(model_dir=None, *, tp: int | None = None, dcp: int | None = None, max_model_len: int | None = None,
             **llm_kw):
    """The `LLM` a server role serves: (LLM, checkpoint path, embedded?). Without `model_dir`, the
    embedded tiny model on the mesh the default CLI run picks, with a 256-token context. `llm_kw`: as
    `LLM.load`. Nothing is compiled yet (the caller compiles what it runs before the port opens).
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


def openai_app(runner, llm, path: Path, embedded: bool, served_model_name: str | None = None):
    """The OpenAI-compatible FastAPI app over `runner` (an AsyncEngine driving `llm`'s engine)."""
    from dcp_jax.serving.openai import create_app
    from dcp_jax.serving.protocol import ChatTemplate

    template = ChatTemplate.from_tokenizer_config(path / "tokenizer_config.json") if path.is_dir() else None
    name = served_model_name or ("dcp-jax-tiny" if embedded else path.resolve().name)
    return create_app(runner, model_name=name, max_model_len=llm.config.max_model_len, tokenizer=llm.tokenizer,
                      chat_template=template, tp=llm.mesh.shape["tp"], dcp=llm.mesh.shape["dcp"])


def make_app(model_dir=None, *, served_model_name: str | None = None, max_pending: int = 256, **llm_kw):
    """Load the model, size the pool, compile, and return (FastAPI app, LLM); `llm_kw` as `load_llm`.
    Raises UserError/ValueError on bad sizes or checkpoints."""
    from dcp_jax.serving.async_engine import AsyncEngine

    llm, path, embedded = load_llm(model_dir, **llm_kw)
    llm.engine.runner.compile_all()  # before the port opens: the first request pays no compile time
    return openai_app(AsyncEngine(llm.engine, max_pending=max_pending), llm, path, embedded, served_model_name), llm


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


def serve_forever(app, host: str, port: int, log_level: str) -> int:
    """uvicorn on this thread until it stops; an exit status (one error line when it cannot serve)."""
    import uvicorn

    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    except (OSError, SystemExit) as e:  # e.g. the port is taken
        print(f"error: could not serve on {host}:{port}: {e}", file=sys.stderr)
        return RUN_ERROR
    return 0
