"""`python -m dcp_jax.serve` as a process: a key at the door, a bounded graceful shutdown that exits 0,
and an engine that dies taking the process with it (so a supervisor restarts it)."""

from __future__ import annotations

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
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""], rest[-3:]
        code, err = stop(proc)
        assert code == 0 and time.monotonic() - t0 < 25, err[-2000:]
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
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=30)  # it ends by itself
        assert proc.returncode == 1 and time.monotonic() - t0 < 10, err[-2000:]
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert lines and "the engine stopped" in lines[-1] and "injected: the engine loop broke" in lines[-1]
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
