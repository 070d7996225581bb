"""The HTTP front end answers a recorded set of requests as it did when they were recorded.

`tests/fixtures/http_replay.json` holds (request, status, normalised body) for representative
requests of every endpoint: completions and chat (whole and streamed, with logprobs, echo, n, stop),
tokenize, and the errors test_server.py sends (bad fields, unsupported parameters, bad JSON, a body
past the size limit, an unknown model, a missing API key). Bodies are normalised (ids, timestamps,
per-chunk splits of a stream, float noise) so that only what the front end decides is compared.
Greedy decoding throughout.

Recording (on the code whose answers are the reference):
    DCP_JAX_RECORD_HTTP=1 python -m pytest tests/test_http_replay.py -p no:cacheprovider
writes the fixture and skips; without the variable the test replays it and compares.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.util import FIXTURES, templated_checkpoint

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

RECORDING = FIXTURES / "http_replay.json"
MODEL = "tiny-llama"
KEY = "sekrit"
MAX_MODEL_LEN = 64
HI = [{"role": "user", "content": "hi"}]


def _cmpl(**kw):
    base = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4, "temperature": 0}
    return ("POST", "/v1/completions", dict(base, **kw))


def _chat(**kw):
    return ("POST", "/v1/chat/completions", dict({"model": MODEL, "messages": HI, "max_tokens": 4,
                                                  "temperature": 0}, **kw))


def _raw(path: str, body: bytes):
    return ("POST", path, {"__raw__": body.decode("utf-8", "surrogatepass")})


REQUESTS = [
    ("GET", "/health", None), ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
    ("GET", "/v1/models/gpt-4", None), ("GET", "/tokenizer_info", None), ("GET", "/nowhere", None),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "Hello world"}),
    ("POST", "/tokenize", {"prompt": "Hello world", "return_token_strs": True}),
    ("POST", "/tokenize", {"messages": HI}),
    ("POST", "/tokenize", {"messages": HI, "add_generation_prompt": False}),
    ("POST", "/tokenize", {"prompt": "a", "messages": HI}), ("POST", "/tokenize", {}),
    ("POST", "/tokenize", {"model": "other", "prompt": "a"}), ("POST", "/tokenize", {"prompt": 5}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [5, 6, 7]}),
    ("POST", "/detokenize", {"tokens": [1, 10**6]}),
    ("POST", "/detokenize", {"tokens": "1,2"}),
    # completions
    _cmpl(), _cmpl(logprobs=2), _cmpl(prompt=[5, 6, 7, 8]), _cmpl(prompt=[[5, 6, 7, 8]]),
    _cmpl(prompt=["Hello"]),
    _cmpl(stream=True), _cmpl(stream=True, logprobs=1, stream_options={"include_usage": True}),
    _cmpl(echo=True, logprobs=1, max_tokens=0), _cmpl(echo=True, max_tokens=2),
    _cmpl(prompt_logprobs=1, max_tokens=1), _cmpl(n=2, seed=3, temperature=0.7),
    _cmpl(stop=["o"], max_tokens=8), _cmpl(max_completion_tokens=2),
    _cmpl(ignore_eos=True, min_tokens=2),
    _cmpl(guided_choice=["alpha", "beta"], max_tokens=8),
    _cmpl(structured_outputs={"regex": "[a-c]{3}"}),
    # chat
    _chat(), _chat(logprobs=True, top_logprobs=2), _chat(stream=True),
    _chat(stream=True, stream_options={"include_usage": True}, logprobs=True),
    _chat(prompt_logprobs=0, max_tokens=1),
    _chat(response_format={"type": "json_object"}, max_tokens=6),
]
BAD_COMPLETIONS = [
    {"model": MODEL}, {"prompt": "hi"}, {"model": MODEL, "prompt": 5}, {"max_tokens": "8"},
    {"temperature": "hot"},
    {"model": "gpt-4"}, {"model": "x" * 200}, {"max_tokens": -1}, {"max_tokens": 0},
    {"max_tokens": 10_000},
    {"prompt": list(range(2, 2 + MAX_MODEL_LEN - 4)), "max_tokens": 5},
    {"prompt": list(range(2, 2 + MAX_MODEL_LEN))},
    {"prompt": [300]}, {"prompt": []}, {"prompt": ["a", "b"]}, {"prompt": "x" * 100_000}, {"n": 0},
    {"n": 17},
    {"best_of": 3}, {"suffix": "x"}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1},
    {"top_k": 1_000_000_000_000}, {"seed": 4294967296}, {"logprobs": 50}, {"logprobs": 21},
    {"logprobs": -1},
    {"stop": 3}, {"stop": ""}, {"stop": ["x"] * 17}, {"stream_options": {"include_usage": True}},
    {"stream": True, "stream_options": {"include_usage": "yes"}},
    {"max_tokens": 2, "min_tokens": 3},
    {"repetition_penalty": 0}, {"presence_penalty": 2.5}, {"frequency_penalty": -3},
    {"bad_words": [""]},
    {"bad_words": [f"w{i}" for i in range(40)]}, {"prompt_logprobs": 21},
    {"prompt_logprobs": 1, "stream": True},
    {"min_p": 1.5}, {"logit_bias": {"5": 101}}, {"logit_bias": {"five": 1}},
    {"logit_bias": {str(i): 1 for i in range(301)}}, {"logit_bias": {"300": 1}},
    {"allowed_token_ids": []},
    {"allowed_token_ids": [999]}, {"guided_decoding_backend": "xgrammar"},
    {"response_format": {"type": "yaml"}},
    {"response_format": {"type": "json_schema", "json_schema": {}}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}},
    {"structured_outputs": {"regex": "a", "choice": ["a"]}},
    {"guided_regex": "a", "response_format": {"type": "json_object"}}, {"unknown_field": 1},
]
BAD_CHATS = [
    {"messages": []}, {"messages": [{"content": "hi"}]}, {"messages": "hi"}, {"logprobs": 1},
    {"top_logprobs": 2},
    {"logprobs": True, "top_logprobs": 21}, {"tools": [{"type": "function"}]},
    {"tool_choice": "auto"},
    {"functions": [{"name": "f"}]}, {"echo": True}, {"model": "gpt-4"},
    {"messages": [{"role": "user"}]},
]
REQUESTS += [_cmpl(**bad) for bad in BAD_COMPLETIONS] + [_chat(**bad) for bad in BAD_CHATS]
REQUESTS += [_raw("/v1/completions", b"{not json"), _raw("/v1/completions", b"[1, 2]"),
             _raw("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode()),
             _raw("/v1/completions", b'{"model": "%s", "prompt": "hi", "x": %s%s}'
                  % (MODEL.encode(), b"[" * 50_000, b"]" * 50_000)),
             _raw("/v1/completions",
                  b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"x" * 300_000)),
             _raw("/v1/chat/completions", b""), ("POST", "/v1/completions", {"prompt": "hi"}),
             ("POST", "/v1/chat/completions", {"model": MODEL})]
REQUESTS += [("POST", "/v1/completions", {"__no_key__": True, "model": MODEL, "prompt": "hi"}),
             ("GET", "/v1/models", {"__no_key__": True}), ("GET", "/health", {"__no_key__": True}),
             ("GET", "/metrics", None)]

VOLATILE = {"id", "created"}


def _round(x):
    return float(f"{x:.4g}") if isinstance(x, float) else x


def normalise(obj):
    """ids and timestamps blanked, floats to 4 significant digits (logprobs), recursively."""
    if isinstance(obj, dict):
        return {k: ("*" if k in VOLATILE and v is not None else normalise(v))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [normalise(x) for x in obj]
    return _round(obj)


def _merge_choice(into: dict, choice: dict) -> None:
    """One stream choice's chunks joined: texts and logprob lists concatenated, the last finish
    reason."""
    for key, value in choice.items():
        if key == "index":
            continue
        if key == "delta":
            d = into.setdefault("delta", {})
            for k, v in value.items():
                d[k] = (d.get(k) or "") + v if isinstance(v, str) else v
        elif key == "logprobs" and value is not None:
            lp = into.setdefault("logprobs", {})
            for k, v in value.items():
                lp[k] = (lp.get(k) or []) + v if isinstance(v, list) else v
        elif key == "text":
            into["text"] = into.get("text", "") + value
        elif value is not None or key not in into:
            into[key] = value


def normalise_stream(text: str):
    """A server-sent-event stream, independent of how the tokens were split into chunks: per choice
    its merged chunks, then the other events (usage, errors) in order, and whether it ended with
    [DONE]."""
    choices, others, done = {}, [], False
    for event in re.findall(r"^data: (.*)$", text, flags=re.M):
        if event == "[DONE]":
            done = True
            continue
        obj = json.loads(event)
        if obj.get("choices"):
            for c in obj["choices"]:
                head = {"object": obj.get("object"), "model": obj.get("model")}
                merged = choices.setdefault(c["index"], head)
                _merge_choice(merged, c)
        else:
            others.append(normalise(obj))
    return {"choices": [normalise(choices[j]) for j in sorted(choices)], "others": others,
            "done": done}


def describe(method: str, path: str, body) -> str:
    """The request as the recording names it: long bodies cut, with a digest of the whole."""
    import hashlib

    text = json.dumps(body, ensure_ascii=True, sort_keys=True)
    if len(text) <= 240:
        return f"{method} {path} {text}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{method} {path} {text[:200]}... ({len(text)} chars, sha256 {digest})"


def send(client, method: str, path: str, body):
    """(status, normalised body) of one recorded request."""
    headers = {"authorization": f"Bearer {KEY}"}
    if isinstance(body, dict) and body.get("__no_key__"):
        body = {k: v for k, v in body.items() if k != "__no_key__"} or None
        headers = {}
    if method == "GET":
        r = client.get(path, headers=headers)
    elif isinstance(body, dict) and "__raw__" in body:
        raw = body["__raw__"].encode("utf-8", "surrogatepass")
        headers["content-type"] = "application/json"
        r = client.post(path, content=raw, headers=headers)
    else:
        r = client.post(path, json=body, headers=headers)
    kind = r.headers.get("content-type", "")
    if path == "/metrics":  # the metric families (their values: timings, counts of earlier tests)
        out = sorted(set(re.findall(r"^# TYPE (\S+) (\S+)$", r.text, flags=re.M)))
        out = [list(x) for x in out]
    elif kind.startswith("text/event-stream"):
        out = normalise_stream(r.text)
    elif kind.startswith("application/json"):
        out = normalise(r.json())
    else:
        out = r.text
    return r.status_code, out


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from dcp_jax.launch import make_app

    ckpt = templated_checkpoint(tmp_path_factory.mktemp("ckpt") / "model")
    app, _ = make_app(ckpt, tp=1, dcp=1, served_model_name=MODEL, max_num_seqs=4,
                      max_model_len=MAX_MODEL_LEN, page_size=8, prefill_chunk=32, decode_steps=2,
                      api_key=KEY, max_request_bytes=200_000)
    with TestClient(app) as tc:
        yield tc


def test_replay(client):
    if os.environ.get("DCP_JAX_RECORD_HTTP"):
        records = [{"request": describe(m, p, b), "status": s, "response": out}
                   for m, p, b in REQUESTS for s, out in [send(client, m, p, b)]]
        RECORDING.write_text(json.dumps(records, indent=1, ensure_ascii=True) + "\n")
        pytest.skip(f"recorded {len(records)} requests into {RECORDING}")
    records = json.loads(RECORDING.read_text())
    assert [r["request"] for r in records] == [describe(*req) for req in REQUESTS]
    mismatches = []
    for rec, req in zip(records, REQUESTS):
        got = send(client, *req)
        if got != (rec["status"], rec["response"]):
            mismatches.append((rec["request"], (rec["status"], rec["response"]), got))
    assert not mismatches, json.dumps(mismatches[:3], indent=1)[:6000]
