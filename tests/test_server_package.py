"""The HTTP front end (`dcp_jax.server`) stands on its `EngineClient` alone: an app over a fake
client (no model, no JAX program) answers completions, chat, streams and errors; the engine side
never imports the server; the handlers reach the engine only through the client."""

from __future__ import annotations

import ast
import asyncio
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from dcp_jax.server.client import EngineClient  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fake"


def imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_the_engine_side_never_imports_the_server():
    for path in sorted((ROOT / "dcp_jax" / "serving").glob("*.py")):
        assert not {m for m in imported(path) if m.startswith("dcp_jax.server")}, path


def test_handlers_reach_the_engine_only_through_the_client():
    for path in sorted((ROOT / "dcp_jax" / "server").glob("*.py")):
        if path.name == "client.py":  # the adapter: the one place that knows AsyncEngine
            continue
        assert "dcp_jax.serving.async_engine" not in imported(path), path
        assert ".engine." not in path.read_text(), path


class FakeClient(EngineClient):
    """An engine that answers every request with tokens 5, 6, 7 (then "length"), its first prompt
    token served from the prefix cache, or refuses it."""

    tokenizer = None
    chat_template = None
    max_model_len, vocab_size, eos_token_ids = 32, 100, (1,)
    failure = None
    stats: dict = {}

    def __init__(self, refuse: str | None = None):
        self.refuse, self.cancelled, self.submitted, self.started = refuse, [], [], False

    def submit(self, request):
        from dcp_jax.serving.async_engine import Update

        self.submitted.append(request)
        sink: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        if self.refuse is not None:
            sink.put_nowait(Update([], [], now, True, "error", self.refuse))
            return sink
        sink.put_nowait(Update([5], [-0.5], now, num_cached_tokens=1))
        sink.put_nowait(Update([6, 7], [-0.25, -0.125], now, True, "length", num_cached_tokens=1))
        return sink

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    def subscribe(self, on_stats, on_finish):
        self.on_stats, self.on_finish = on_stats, on_finish

    def start(self):
        self.started = True

    def shutdown(self):
        self.started = False


def fake_app(client):
    from dcp_jax.server.app import create_app

    return create_app(client, model_name=MODEL)


def test_an_app_over_a_fake_engine_client():
    from fastapi.testclient import TestClient

    fake = FakeClient()
    with TestClient(fake_app(fake)) as tc:
        assert fake.started
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": [3, 4], "max_tokens": 3,
                                             "logprobs": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"] == [-0.5, -0.25, -0.125]
        usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                 "prompt_tokens_details": {"cached_tokens": 1}}  # the engine's count, carried
        assert r.json()["usage"] == usage
        stream = tc.post("/v1/completions", json={"model": MODEL, "prompt": [3, 4], "max_tokens": 3,
                                                  "stream": True,
                                                  "stream_options": {"include_usage": True}})
        assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
        assert json.loads(stream.text.split("data: ")[-2])["usage"] == usage
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": [3, 4], "max_tokens": 40})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": "text"})
        assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user",
                                                                               "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
        assert tc.get("/v1/models").json()["data"][0]["max_model_len"] == 32
        assert tc.get("/health").json() == {"status": "ok"}
        r = tc.post("/detokenize", json={"tokens": [1]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert not fake.started


def test_a_refused_request_is_a_400_and_a_user_error_names_its_field():
    from fastapi.testclient import TestClient

    from dcp_jax.errors import UserError
    from dcp_jax.server.intake import sampling_error

    with TestClient(fake_app(FakeClient(refuse="no room"))) as tc:
        r = tc.post("/v1/completions", json={"model": MODEL, "prompt": [3, 4], "max_tokens": 3})
        assert r.status_code == 400 and r.json()["error"]["message"] == "no room"
    # the param comes from the error's field (a SamplingParams argument, named as the body names it)
    def param(field, top=("logprobs", 0), structured=None):
        return sampling_error(UserError("out of range", field=field), top, structured).param

    assert param("top_p") == "top_p" and param("bad_words_ids") == "bad_words"
    assert param("top_logprobs", ("logprobs", 30)) == "logprobs"
    assert param("structured", structured="guided_regex") == "guided_regex"
    e = sampling_error(UserError("bad", field="top_logprobs"), ("top_logprobs", 30), None)
    assert e.param == "top_logprobs" and "must be an integer in [0, 20], got 30" in e.message
