"""`python -m dcp_jax.serve` as a process: a key at the door, a bounded graceful shutdown that exits 0,
and an engine that dies taking the process with it (so a supervisor restarts it)."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.util import FIXTURES

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(*extra, code: str | None = None, env=None):
    """The server in a child process on a free loopback port: (process, base URL) once /health answers."""
    port = free_port()
    argv = ["--model", str(FIXTURES / "llama-tokenizer"), "--mesh", "tp=1,dcp=1", "--max-model-len", "64",
            "--served-model-name", MODEL, "--port", str(port), "--log-level", "warning", *extra]
    cmd = [sys.executable, "-m", "dcp_jax.serve", *argv] if code is None else [sys.executable, "-c", code, *argv]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            if httpx.get(base + "/health", timeout=2).status_code in (200, 503):
                return proc, base
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def stop(proc, timeout=30) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def test_api_key_and_graceful_shutdown():
    proc, base = start("--shutdown-timeout", "20", env={"DCP_JAX_API_KEY": "s3cret"})
    try:
        # (ignore_eos: sampled at the default temperature 1, the tiny model may end early otherwise)
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401
        assert httpx.get(base + "/v1/models", timeout=30).status_code == 401
        assert httpx.post(base + "/tokenize", json={"prompt": "a"}, timeout=30).status_code == 401
        assert httpx.post(base + "/detokenize", json={"tokens": [5]}, timeout=30).status_code == 401
        assert httpx.get(base + "/health", timeout=30).status_code == 200  # open, and so is /metrics
        assert 'dcp_jax:requests_total{status="401"}' in httpx.get(base + "/metrics", timeout=30).text
        auth = {"Authorization": "Bearer s3cret"}
        ok = httpx.post(base + "/v1/completions", json=body, headers=auth, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert httpx.post(base + "/detokenize", json={"tokens": [5]}, headers=auth, timeout=30).status_code == 200
        # SIGTERM while a stream runs: the port closes, the stream finishes, the exit status is 0
        long = dict(body, max_tokens=50, ignore_eos=True, stream=True)
        with httpx.stream("POST", base + "/v1/completions", json=long, headers=auth, timeout=60) as s:
            lines = s.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""], rest[-3:]
        code, err = stop(proc)  # (it ends within the drain's bound: a hang times out there)
        assert code == 0, err[-2000:]
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()


# The server with its engine's step made to raise an error no step may swallow (a BaseException: what a
# bug in the engine loop looks like), then `python -m dcp_jax.serve`'s own run().
DYING = """
import sys
from dcp_jax.serving import engine as engine_mod
class EngineBug(BaseException):
    pass
def step(self, on_prefill=None):
    raise EngineBug("injected: the engine loop broke")
engine_mod.ServingEngine.step = step
from dcp_jax.serve import run
sys.exit(run(sys.argv[1:]))
"""


def test_a_dead_engine_takes_the_process_down():
    proc, base = start(code=DYING)
    try:
        r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 503
        _, err = proc.communicate(timeout=30)  # it ends by itself (a hang times out here)
        assert proc.returncode == 1, err[-2000:]
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert lines and "the engine stopped" in lines[-1] and "injected: the engine loop broke" in lines[-1]
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()


# --- command-line mistakes: one error line, exit 2 (1 when found at run time), no traceback

def one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_model(monkeypatch):
    """The server's model must not load: each mistake here is caught before."""
    from dcp_jax import launch

    def refuse(*_, **__):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(launch, "load_llm", refuse)


@pytest.mark.parametrize("port", ["70000", "65536", "-1", "http"])
def test_a_port_out_of_range_is_a_usage_error(capsys, no_model, port):
    from dcp_jax.serve import run

    assert run(["--port", port]) == 2
    line = one_error(capsys)
    assert "--port" in line and ("[0, 65535]" in line or "integer" in line), line


def test_a_taken_port_or_foreign_host_is_refused_before_the_model_loads(capsys, no_model):
    from dcp_jax.serve import run

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert run(["--port", port]) == 2
        line = one_error(capsys)
        assert f"port {port} on 127.0.0.1 is already in use" in line, line
        assert "another --port" in line, line
    assert run(["--host", "999.1.1.1"]) == 2  # does not resolve
    line = one_error(capsys)
    assert "--host 999.1.1.1 does not resolve" in line and "127.0.0.1" in line, line
    assert run(["--host", "192.0.2.1", "--port", "0"]) == 2  # TEST-NET-1: no machine's address
    line = one_error(capsys)
    assert "--host 192.0.2.1 is not an address of this machine" in line, line


def test_serve_forever_reports_a_bind_failure_in_one_line(capsys):
    """At run time (the disaggregated roles bind when they serve, and a port may be taken between
    the check and the listen): one line naming the address and --port, exit 1, no uvicorn log."""
    from starlette.applications import Starlette

    from dcp_jax.launch import serve_forever

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_forever(Starlette(), "127.0.0.1", port, "info") == 1
        assert "already in use: give another --port" in one_error(capsys)

    class Taken(socket.socket):  # a port another program took between the bind and the listen
        def listen(self, *_):
            raise OSError(errno.EADDRINUSE, "Address already in use")

    sock = Taken(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    assert serve_forever(Starlette(), "127.0.0.1", port, "warning", sock=sock) == 1
    assert f"port {port} on 127.0.0.1 is already in use" in one_error(capsys)


def test_a_chat_template_is_checked_before_the_model_loads(tmp_path, capsys, no_model):
    from dcp_jax.errors import UserError
    from dcp_jax.serve import run
    from dcp_jax.weights import template_file

    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ bos_token }}\n{% if %}hi{% endif %}\n")
    assert run(["--chat-template", str(bad)]) == 2
    line = one_error(capsys)
    assert line.startswith(f"error: --chat-template: the chat template {bad} does not parse: ")
    assert "(line 2)" in line and "fix the template" in line, line
    assert run(["--chat-template", str(tmp_path / "missing.jinja")]) == 1  # as a missing --model
    line = one_error(capsys)
    assert "--chat-template" in line and "missing.jinja (No such file or directory)" in line, line
    with pytest.raises(UserError, match=r"does not parse: .*\(line 2\)"):  # LLM.load's own check
        template_file(bad, None, tmp_path)
