"""The real model served as a user serves it: `python -m dcp_jax.serve --model
smollm2-135m-instruct` on a (tp=1, dcp=2) mesh, in a child process on a loopback port, asked with
the official `openai` client: a chat answer, a JSON-schema answer, and a stream that says what the
plain answer says.

One server for the module (its compile is most of the cost); short prompts, few tokens. The model
is fetched into the model cache when it is not there (`python -m dcp_jax.fetch`; CI fetches it
first)."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
# the context holds the prompts (under 40 tokens with the template) and their answers; a step
# budget of 64 tokens prefills each prompt in one step and keeps the ragged programs compiled at
# start to three (16, 32 and 64 tokens)
SIZES = ["--max-model-len", "128", "--max-num-seqs", "2", "--max-num-batched-tokens", "64"]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CAPITAL = {"type": "object",
           "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
           "required": ["city", "country"], "additionalProperties": False}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dcp_jax.fetch import fetch

    fetch(MODEL)  # a no-op when cached; else the download does not count against the start
    port = free_port()
    cmd = [sys.executable, "-m", "dcp_jax.serve", "--model", MODEL, "--mesh", "tp=1,dcp=2", *SIZES,
           "--port", str(port), "--log-level", "warning"]
    # the child inherits conftest's environment: XLA's cheap codegen, the compilation cache
    # (its output to a file: a pipe nobody reads while the tests run could fill and stall it)
    log = tmp_path_factory.mktemp("serve") / "output.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(os.environ, JAX_PLATFORMS="cpu"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=300, max_retries=0)
        yield {"base": base, "client": client}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    output = log.read_text()
    assert proc.returncode == 0 and "Traceback" not in output, output[-3000:]


@functools.cache
def answer(client, messages: str, max_tokens: int):
    """The greedy (non-streamed) chat answer to `messages` (JSON text), asked once per module."""
    return client.chat.completions.create(model=MODEL, messages=json.loads(messages),
                                          temperature=0, max_tokens=max_tokens)


def test_served_as_the_real_model_on_a_dcp_mesh(server):
    assert [m.id for m in server["client"].models.list().data] == [MODEL]
    text = httpx.get(server["base"] + "/metrics", timeout=30).text
    gauges = dict(re.findall(r"^dcp_jax:(tp|dcp) ([0-9.]+)$", text, re.MULTILINE))
    assert gauges == {"tp": "1.0", "dcp": "2.0"}


def test_chat_says_paris(server):
    r = answer(server["client"], json.dumps(FRANCE), 16)
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and 0 < r.usage.completion_tokens <= 16


def test_json_schema_answer_parses_and_validates(server):
    jsonschema = pytest.importorskip("jsonschema")
    r = server["client"].chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name the capital of France as JSON."}],
        temperature=0, max_tokens=32,
        response_format={"type": "json_schema",
                          "json_schema": {"name": "capital", "schema": CAPITAL}})
    content = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", content  # the object closed within max_tokens
    obj = json.loads(content)
    jsonschema.validate(obj, CAPITAL)
    # the model's answer: '{"city":"Paris","country":"FRANCE"}'
    assert "paris" in obj["city"].lower() and "france" in obj["country"].lower(), content


def test_stream_says_what_the_answer_says(server):
    c = server["client"]
    plain = answer(c, json.dumps(FRANCE), 16).choices[0]
    chunks = list(c.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0,
                                            max_tokens=16, stream=True))
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    deltas = [ch.delta.content for ch in choices if ch.delta.content]
    assert "".join(deltas) == plain.message.content and len(deltas) > 1, deltas
    assert choices[-1].finish_reason == plain.finish_reason
