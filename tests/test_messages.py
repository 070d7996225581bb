"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), end to end: a real
uvicorn server on a loopback port with an API key, driven by the official `anthropic` client (and
httpx for what that client will not send), on the llama-tokenizer fixture over a (tp=1, dcp=2)
mesh; and the conversion of a Messages request into the OpenAI chat request the server serves."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dcp_jax import LLM
from tests.util import templated_checkpoint

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from dcp_jax.server import anthropic as wire

MODEL = "tiny-llama"
KEY = "sekrit"
MAX_MODEL_LEN = 128
SIZES = {"max_num_seqs": 4, "max_model_len": MAX_MODEL_LEN, "page_size": 8, "prefill_chunk": 32,
             "decode_steps": 2}
# a template in the shape of the llama-tokenizer fixture's test template that also renders what tool
# calls bring: an assistant's calls (their arguments as an object), a tool result's call id and
# error mark
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['tool_call_id'] is defined %}[{{ m['tool_call_id'] }}"
    "{% if m['is_error'] is defined %} error{% endif %}] {% endif %}{{ m['content'] }}"
    "{% for c in m['tool_calls'] | default([]) %}<call {{ c['id'] }}>{{ c['function']['name'] }}"
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
SYSTEM = "Be brief."
HI = [{"role": "user", "content": "Hi there"}]
EVENTS = ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
          "message_delta", "message_stop"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dcp_jax.launch import make_app, serve_in_thread

    ckpt = templated_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", TEMPLATE)
    app, served = make_app(ckpt, tp=1, dcp=2, served_model_name=MODEL, api_key=KEY, **SIZES)
    # the reference: a second LLM over the same model (the served one's engine is the server's)
    llm = LLM(served.model, served.mesh, served.tokenizer, **SIZES)
    base, stop = serve_in_thread(app, timeout_s=30)
    client = anthropic.Anthropic(base_url=base, api_key=KEY, timeout=60, max_retries=0)
    yield {"base": base, "client": client, "llm": llm, "served": served}
    stop()  # raises if the server thread does not end


def sampled(**kw) -> dict:
    """Sampling parameters as the client sends them: newer `anthropic` clients have no temperature,
    top_p or top_k arguments (the API still takes the fields), so through extra_body."""
    return {"extra_body": kw}


def ids_of(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(text, add_special_tokens=False).ids


def greedy(llm, text: str, n: int):
    """The greedy answer to a rendered prompt: (text, tokens, finish reason)."""
    out = llm.generate([ids_of(llm, text)], max_new_tokens=n)
    return out.text[0], len(out.tokens[0]), out.finish_reasons[0]


def post(server, path: str, body, headers=None) -> httpx.Response:
    kw = ({"content": body, "headers": {"content-type": "application/json"}}
          if isinstance(body, bytes) else {"json": body})
    kw["headers"] = dict(kw.get("headers", {}), **({"x-api-key": KEY} if headers is None
                                                   else headers))
    return httpx.post(server["base"] + path, timeout=60, **kw)


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), chunk
        obj = json.loads(data[len("data: "):])
        assert obj["type"] == name[len("event: "):]
        out.append((obj["type"], obj))
    return out


def test_message_as_the_chat_template_renders_it(server):
    c, llm = server["client"], server["llm"]
    r = c.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=HI,
                          **sampled(temperature=0))
    prompt = "<s><system>Be brief.\n<user>Hi there\n<assistant>"
    text, n, finish = greedy(llm, prompt, 8)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert r.id.startswith("msg_") and [b.type for b in r.content] == ["text"]
    assert r.content[0].text == text
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert r.stop_sequence is None and r.usage.output_tokens == n
    u = r.usage  # the prompt: what was computed plus what the prefix cache served
    assert u.input_tokens + u.cache_read_input_tokens == len(ids_of(llm, prompt))
    assert u.cache_creation_input_tokens == 0
    # the same through the chat path, and count_tokens counts that prompt
    messages = [{"role": "system", "content": SYSTEM}] + HI
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                 "max_tokens": 8, "temperature": 0}).json()
    assert chat["choices"][0]["message"]["content"] == text
    count = c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=HI)
    assert count.input_tokens == chat["usage"]["prompt_tokens"] == len(ids_of(llm, prompt))
    # system as text blocks (cache_control marks are taken: the prefix cache needs none)
    blocks = [{"type": "text", "text": "Be", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "brief."}]
    joined = c.messages.count_tokens(model=MODEL, system=blocks, messages=HI)
    assert joined.input_tokens == len(ids_of(llm, "<s><system>Be\nbrief.\n<user>Hi there\n"
                                                  "<assistant>"))


def test_stream_is_anthropics_event_sequence(server):
    c = server["client"]
    whole = c.messages.create(model=MODEL, max_tokens=8, system=SYSTEM, messages=HI,
                              **sampled(temperature=0))
    r = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 8, "system": SYSTEM,
                                      "messages": HI, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    names = [name for name, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas > 1 and names == EVENTS[:2] + ["content_block_delta"] * deltas + EVENTS[3:]
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    text = "".join(e["delta"]["text"] for name, e in events if name == "content_block_delta")
    assert text == whole.content[0].text
    # the client's own stream reassembles the same message
    with c.messages.stream(model=MODEL, max_tokens=8, system=SYSTEM, messages=HI,
                           **sampled(temperature=0)) as stream:
        assert "".join(stream.text_stream) == whole.content[0].text
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason,
                                                              whole.usage.output_tokens)


def test_stop_sequences_and_max_tokens(server):
    c, llm = server["client"], server["llm"]
    prompt = "<s><user>Hi there\n<assistant>"
    text, n, _ = greedy(llm, prompt, 16)
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from its middle
    cut = text[:text.find(stop)]
    r = c.messages.create(model=MODEL, max_tokens=16, messages=HI, **sampled(temperature=0),
                          stop_sequences=["never said", stop])
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", stop, cut)
    with c.messages.stream(model=MODEL, max_tokens=16, messages=HI, **sampled(temperature=0),
                           stop_sequences=[stop]) as stream:
        assert "".join(stream.text_stream) == cut
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    # max_tokens: the answer cut at that many tokens
    r = c.messages.create(model=MODEL, max_tokens=3, messages=HI, **sampled(temperature=0))
    assert (r.stop_reason, r.usage.output_tokens) == ("max_tokens", 3) and 3 < n
    assert r.content[0].text == greedy(llm, prompt, 3)[0]


def test_temperature_top_p_top_k(server):
    # top_k 1 and a tiny top_p keep only the most likely token: greedy at any temperature (so each
    # is applied); at temperature 1 with wide top_k and top_p, samples are not all the greedy one
    c = server["client"]
    want = c.messages.create(model=MODEL, max_tokens=8, messages=HI,
                             **sampled(temperature=0)).content[0].text
    for kw in ({"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-6},
               {"top_k": 1}):
        r = c.messages.create(model=MODEL, max_tokens=8, messages=HI, **sampled(**kw))
        assert r.content[0].text == want, kw
    texts = {c.messages.create(model=MODEL, max_tokens=8, messages=HI,
                               **sampled(temperature=1.0, top_k=50, top_p=0.99)).content[0].text
             for _ in range(4)}
    assert texts != {want}


def test_tool_history_and_prefill_are_rendered(server):
    # an assistant's tool_use blocks are its tool calls, each tool_result a tool message (in block
    # order, text after it a user message); a final assistant message is a prefill the answer goes
    # on from
    c, llm = server["client"], server["llm"]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
             "content": [{"type": "text", "text": "no such"}]},
            {"type": "text", "text": "And?"}]},
        {"role": "assistant", "content": "It is"}]
    prompt = ('<s><user>Weather?\n<assistant>Checking.<call t1>weather{"city": "Paris"}</call>\n'
              "<tool>[t1] sunny\n<tool>[t2 error] no such\n<user>And?\n<assistant>It is")
    assert c.messages.count_tokens(model=MODEL, messages=messages).input_tokens == \
        len(ids_of(llm, prompt))
    r = c.messages.create(model=MODEL, max_tokens=6, messages=messages, **sampled(temperature=0))
    assert r.content[0].text == greedy(llm, prompt, 6)[0]


def test_cache_read_input_tokens_are_the_prefix_cache_hits(server):
    # a long prompt asked again: cache_read_input_tokens is the prefix cache's hit count for it
    # (its whole blocks of 16 tokens before its last token), whole and streamed (message_start and
    # message_delta); input_tokens the rest of the prompt
    c, kv = server["client"], server["served"].engine.scheduler.kv
    words = np.random.default_rng(34).choice(["cache", "read", "input", "tokens", "hit"], 22)
    messages = [{"role": "user", "content": " ".join(words)}]
    n = c.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert 48 < n < MAX_MODEL_LEN - 8
    body = {"model": MODEL, "max_tokens": 2, "messages": messages}
    for k in range(3):
        before = kv.prefix_hit_tokens  # (counted when it is admitted: before its first token)
        if k < 2:
            u = c.messages.create(**body, **sampled(temperature=0)).usage
            used = [u.input_tokens, u.cache_read_input_tokens]
        else:
            events = sse_events(post(server, "/v1/messages", dict(body, stream=True)).text)
            heads = (events[0][1]["message"]["usage"], events[-2][1]["usage"])
            used = [heads[1]["input_tokens"], heads[1]["cache_read_input_tokens"]]
            assert heads[0]["cache_read_input_tokens"] == used[1]
        hits = kv.prefix_hit_tokens - before
        assert used == [n - hits, hits] and hits == (0 if k == 0 else (n - 1) // 16 * 16), (k, used)


def test_any_without_a_tool_parser_is_a_json_list_call(server):
    # this server has no tool-call parser: auto is refused (BAD), any and a named tool run as
    # chat's required does without one, a JSON list under the tools' grammar, read back as calls
    c = server["client"]
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"], "additionalProperties": False}
    zone = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}},
            "required": ["zone"], "additionalProperties": False}
    tools = [dict(TOOL, input_schema=city), {"name": "clock", "input_schema": zone}]
    for choice in ({"type": "any", "disable_parallel_tool_use": True},
                   {"type": "tool", "name": "clock"}):
        kw = {"model": MODEL, "max_tokens": 80, "messages": HI, "tools": tools,
              "tool_choice": choice}
        r = c.messages.create(**kw, **sampled(temperature=0))
        assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"], r
        name, arguments = r.content[0].name, r.content[0].input
        assert name == choice.get("name", name) and len(arguments) == 1
        assert (arguments["zone"] in ("CET", "UTC") if name == "clock" else
                isinstance(arguments["city"], str) and len(arguments["city"]) <= 6)
        with c.messages.stream(**kw, **sampled(temperature=0)) as stream:
            final = stream.get_final_message()
        assert [(b.name, b.input) for b in final.content] == [(name, arguments)]


def test_api_key_rule(server):
    # Anthropic's clients send x-api-key; Bearer works too (on every route); anything else is a
    # 401 in Anthropic's shape on its routes
    body = {"model": MODEL, "max_tokens": 2, "messages": HI}
    for headers in ({"x-api-key": KEY}, {"authorization": f"Bearer {KEY}"}):
        assert post(server, "/v1/messages", body, headers).status_code == 200
        assert post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                    headers).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": KEY},
                    {"authorization": "Bearer wrong"}):
        r = post(server, "/v1/messages", body, headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.json()["type"] == "error" and "x-api-key" in r.json()["error"]["message"]
    wrong = anthropic.Anthropic(base_url=server["base"], api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, max_tokens=2, messages=HI)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi"}, {"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # OpenAI's


OK = {"model": MODEL, "max_tokens": 4, "messages": HI}
TOOL = {"name": "weather", "description": "today's weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
BAD = [  # (body, the field its message names, status)
    (b"{not json", "JSON", 400),
    (dict(OK, model="claude-sonnet-4-5"), "claude-sonnet-4-5", 404),
    ({"model": MODEL, "messages": HI}, "max_tokens", 400),
    (dict(OK, max_tokens=0), "max_tokens", 400),
    (dict(OK, max_tokens="4"), "max_tokens", 400),
    (dict(OK, max_tokens=10_000), "max_tokens", 400),
    (dict(OK, messages=[]), "messages", 400),
    (dict(OK, messages=[{"role": "assistant", "content": " "}]), "messages", 400),
    (dict(OK, messages=[{"role": "user", "content": "x" * 100_000}]), "messages", 400),
    (dict(OK, messages=[{"role": "system", "content": "hi"}]), "messages.0.role", 400),
    (dict(OK, messages=[{"role": "user", "content": 5}]), "messages.0.content", 400),
    (dict(OK, messages=[{"role": "user", "content": "hi", "name": "x"}]), "messages.0", 400),
    (dict(OK, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages.0.content.0.type", 400),
    (dict(OK, messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
     "messages.0.content.0", 400),
    (dict(OK, messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "forever"}}]}]),
     "messages.0.content.0.cache_control", 400),
    (dict(OK, messages=[HI[0], {"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]),
     "messages.1.content.0.type", 400),
    (dict(OK, messages=[{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]), "messages.0.content.0.tool_use_id", 400),
    (dict(OK, messages=[HI[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]),
     "messages.1.content.0.input", 400),
    (dict(OK, messages=[HI[0], {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), "messages.1", 400),
    (dict(OK, system=5), "system", 400),
    (dict(OK, system=[{"type": "image"}]), "system.0.type", 400),
    (dict(OK, temperature=1.5), "temperature", 400),
    (dict(OK, temperature="hot"), "temperature", 400),
    (dict(OK, top_p=0), "top_p", 400),
    (dict(OK, top_k=-1), "top_k", 400),
    (dict(OK, stop_sequences="x"), "stop_sequences", 400),
    (dict(OK, stop_sequences=[""]), "stop_sequences", 400),
    (dict(OK, stop_sequences=["x"] * 17), "stop_sequences", 400),
    (dict(OK, stream="yes"), "stream", 400),
    (dict(OK, metadata={"user_id": 5}), "metadata", 400),
    (dict(OK, metadata={"session": "x"}), "metadata", 400),
    # thinking: its shape first, then (this server has no reasoning parser) the parser it needs
    (dict(OK, thinking={"type": "enabled", "budget_tokens": 2}), "--reasoning-parser", 400),
    (dict(OK, thinking={"type": "adaptive"}), "--reasoning-parser", 400),
    (dict(OK, thinking={"type": "sometimes"}), "thinking.type", 400),
    (dict(OK, thinking={"type": "disabled", "budget_tokens": 2}), "thinking", 400),
    (dict(OK, thinking={"type": "enabled", "budget_tokens": 4}), "thinking.budget_tokens", 400),
    (dict(OK, thinking={"type": "enabled", "budget_tokens": "2"}), "thinking.budget_tokens",
     400),
    (dict(OK, thinking={"type": "enabled"}), "thinking.budget_tokens", 400),
    (dict(OK, thinking={"type": "adaptive", "display": "omitted"}), "thinking.display", 400),
    (dict(OK, messages=[HI[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": 5, "signature": ""}]}]), "messages.1.content.0", 400),
    (dict(OK, messages=[HI[0], {"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "x"}]}]), "messages.1.content.0.type", 400),
    (dict(OK, messages=[{"role": "user", "content": [
        {"type": "thinking", "thinking": "x", "signature": ""}]}]), "messages.0.content.0.type",
     400),
    (dict(OK, n=2), "n", 400),  # not a field of the Messages API
    # auto (the default with tools) needs the server's tool-call parser: this one has none
    (dict(OK, tools=[TOOL]), "--tool-call-parser", 400),
    (dict(OK, tools=[TOOL], tool_choice={"type": "auto"}), "tool_choice", 400),
    (dict(OK, tools=[dict(TOOL, name="a b")]), "tools.0.name", 400),
    (dict(OK, tools=[TOOL, TOOL]), "tools.1.name", 400),
    (dict(OK, tools=[dict(TOOL, input_schema={"type": "string"})]), "tools.0.input_schema", 400),
    (dict(OK, tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools.0.type",
     400),
    (dict(OK, tool_choice={"type": "any"}), "tool_choice", 400),
    (dict(OK, tool_choice={"type": "sometimes"}), "tool_choice", 400),
    (dict(OK, tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name",
     400),
    (dict(OK, tools=[TOOL], tool_choice={"type": "auto", "disable_parallel_tool_use": "y"}),
     "tool_choice.disable_parallel_tool_use", 400),
    (dict(OK, tools=[TOOL], tool_choice={"type": "none", "disable_parallel_tool_use": True}),
     "tool_choice.disable_parallel_tool_use", 400),
    (dict(OK, tools=[dict(TOOL, description=5)]), "tools.0.description", 400),
]


@pytest.mark.parametrize("case", BAD, ids=range(len(BAD)))
def test_bad_requests_are_anthropic_errors_naming_the_field(server, case):
    body, field, status = case
    r = post(server, "/v1/messages", body)
    assert r.status_code == status, r.text
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error" if status == 400 else "not_found_error",
        "message": r.json()["error"]["message"]}}
    assert field in r.json()["error"]["message"], (field, r.text)


def test_the_client_raises_anthropics_errors_and_count_tokens_checks_too(server):
    c = server["client"]
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        c.messages.create(model=MODEL, max_tokens=4, messages=HI, **sampled(temperature=2))
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=HI)
    with pytest.raises(anthropic.BadRequestError, match="--tool-call-parser"):
        c.messages.count_tokens(model=MODEL, messages=HI, tools=[TOOL])  # (auto: no parser)
    r = post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": HI, "max_tokens": 4})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "document"}]}]})
    assert r.status_code == 400 and "messages.0.content.0.type" in r.json()["error"]["message"]


# --- the conversion (no server) ------------------------------------------------------------------
def test_tools_and_tool_choice_in_openais_form():
    tools = [TOOL, {"name": "clock", "input_schema": {"type": "object"}}]
    functions = [{"type": "function", "function": {"name": "weather",
                                                   "parameters": TOOL["input_schema"],
                                                   "description": "today's weather"}},
                 {"type": "function", "function": {"name": "clock",
                                                   "parameters": {"type": "object"}}}]
    assert wire.openai_tools(None, None) == {} == wire.openai_tools([], {"type": "none"})
    assert wire.openai_tools(tools, None) == {"tools": functions}
    for choice, want in (({"type": "auto"}, {"tool_choice": "auto"}),
                         ({"type": "any"}, {"tool_choice": "required"}),
                         ({"type": "none"}, {"tool_choice": "none"}),
                         ({"type": "tool", "name": "clock"},
                          {"tool_choice": {"type": "function", "function": {"name": "clock"}}}),
                         ({"type": "any", "disable_parallel_tool_use": True},
                          {"tool_choice": "required", "parallel_tool_calls": False})):
        assert wire.openai_tools(tools, choice) == dict(want, tools=functions), choice


def test_a_request_as_an_openai_chat_request():
    body = wire.MessagesBody.model_validate({
        "model": MODEL, "max_tokens": 7, "system": SYSTEM, "temperature": 0.5, "top_k": 3,
        "stop_sequences": ["x"], "stream": True, "metadata": {"user_id": "u"},
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": [
                      {"type": "thinking", "thinking": "hm", "signature": "s"},
                      {"type": "tool_use", "id": "t", "name": "f", "input": {"x": 1}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                  {"role": "assistant", "content": ""}]})  # an empty prefill: none
    assert wire.chat_request(body) == {
        "model": MODEL, "max_tokens": 7, "temperature": 0.5, "top_k": 3, "stop": ["x"],
        "stream": True,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a\nb"},
                     {"role": "assistant", "content": "", "reasoning_content": "hm",
                      "tool_calls": [{"id": "t", "type": "function",
                                      "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                     {"role": "tool", "tool_call_id": "t", "content": ""}]}


def test_continue_final_message_ends_at_its_text():
    from dcp_jax.chat_template import ChatTemplate
    from dcp_jax.errors import UserError
    from tests.util import TEMPLATE as PLAIN

    t = ChatTemplate(PLAIN, bos_token="<s>")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert t.render(msgs, False, continue_final_message=True) == "<s><user>Hi\n<assistant>Hello"
    stripping = ChatTemplate("{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}")
    assert stripping.render([{"role": "assistant", "content": " Go "}], False,
                            continue_final_message=True) == "[Go"
    hiding = ChatTemplate("{% for m in messages %}{{ m['role'] }};{% endfor %}")
    with pytest.raises(UserError, match="final message"):
        hiding.render(msgs, False, continue_final_message=True)
    with pytest.raises(ValueError, match="exclude"):
        t.render(msgs, True, continue_final_message=True)


def test_block_stream_orders_each_deltas_pieces():
    """A delta may end one call's arguments, carry text and begin the next call: the events keep
    the blocks one after another (the open call's arguments, then the text, then the new call);
    hidden thinking opens no block; an answer with nothing is one empty text block."""
    from dcp_jax.agents import CallDelta, MessageDelta

    def replay(deltas, thinking=True):
        s = wire.BlockStream(thinking)
        out = [e for d in deltas for e in s.feed(d)] + s.finish()
        return [json.loads(e.split("data: ", 1)[1]) for e in out]

    got = replay([MessageDelta(reasoning_content="hm"),
                  MessageDelta(content="Hi", tool_calls=(CallDelta(0, "call_a", "f"),
                                                         CallDelta(0, arguments='{"x"'))),
                  MessageDelta(content="so", tool_calls=(CallDelta(0, arguments=": 1}"),
                                                         CallDelta(1, "call_b", "g"),
                                                         CallDelta(1, arguments="{}")))])
    starts = [(e["index"], e["content_block"]) for e in got if e["type"] == "content_block_start"]
    assert starts == [(0, {"type": "thinking", "thinking": "", "signature": ""}),
                      (1, {"type": "text", "text": ""}),
                      (2, {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}),
                      (3, {"type": "text", "text": ""}),
                      (4, {"type": "tool_use", "id": "toolu_b", "name": "g", "input": {}})]
    pieces = [(e["index"], e["delta"]) for e in got if e["type"] == "content_block_delta"]
    assert pieces == [(0, {"type": "thinking_delta", "thinking": "hm"}),
                      (1, {"type": "text_delta", "text": "Hi"}),
                      (2, {"type": "input_json_delta", "partial_json": '{"x"'}),
                      (2, {"type": "input_json_delta", "partial_json": ": 1}"}),
                      (3, {"type": "text_delta", "text": "so"}),
                      (4, {"type": "input_json_delta", "partial_json": "{}"})]
    kinds = [e["type"] for e in got]  # each block stops before the next starts
    assert kinds.count("content_block_stop") == 5 and all(
        kinds[i - 1] == "content_block_stop" for i, k in enumerate(kinds)
        if k == "content_block_start" and i)
    assert [e["type"] for e in replay([MessageDelta(reasoning_content="hm")], thinking=False)] \
        == ["content_block_start", "content_block_stop"]
    assert replay([])[0]["content_block"] == {"type": "text", "text": ""}
