"""Tool calls and reasoning through the real server on a loopback port, as agents use it: the
llama-tokenizer fixture (a random model) on a (tp=1, dcp=2) mesh, served with a hermes-format chat
template (--chat-template) and --tool-call-parser hermes, asked with the official `openai` client.

A random model calls no tool by itself, so: `required` and named choices run under the tools'
grammar (every sampled call parses and validates against its schema); `auto` is shown with the
answer's text forced by a structured output (guided_choice) to a call in hermes format, which the
parser reads; a tool round trip sends the call's result back and gets a final answer."""

from __future__ import annotations

import json

import pytest

from dcp_jax.server.client import EngineClient
from tests.util import FIXTURES, templated_checkpoint

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

MODEL = "tiny-llama-tools"
# a short hermes-format template (the checkpoint's context is 256 tokens): the tools by name, calls
# in <tool_call> tags, results in <tool_response>
TEMPLATE = """{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>
{% endif %}
{% for m in messages %}
{% if m.role == 'assistant' and m.tool_calls %}<assistant>{{ m.content }}
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>
{% endfor %}
{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>
{% else %}<{{ m.role }}>{{ m.content }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""
WEATHER_ARGS = {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8},
                               "days": {"type": "integer", "minimum": 1, "maximum": 7},
                               "unit": {"enum": ["C", "F"]}},
                "required": ["city", "days"], "additionalProperties": False}
TIME_ARGS = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC", "JST"]}},
             "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_ARGS}}]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TIME_ARGS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call>")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from dcp_jax.launch import make_app, serve_in_thread

    tmp = tmp_path_factory.mktemp("tools")
    ckpt = templated_checkpoint(tmp / "model", template="{{ messages }}")  # not the one served
    (tmp / "hermes.jinja").write_text(TEMPLATE)
    sizes = dict(max_num_seqs=16, max_model_len=256, page_size=8, prefill_chunk=64, decode_steps=2)
    app, llm = make_app(ckpt, tp=1, dcp=2, served_model_name=MODEL,
                        chat_template=tmp / "hermes.jinja", tool_call_parser="hermes", **sizes)
    base, stop = serve_in_thread(app, timeout_s=30)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", timeout=120, max_retries=0)
    yield dict(base=base, client=client, llm=llm, app=app)
    stop()


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or ()]


def test_the_served_template_is_the_flags(server):
    assert server["llm"].chat_template.source == TEMPLATE
    assert server["llm"].chat_template.bos_token == "<s>"  # (the checkpoint's tokenizer_config)


def test_auto_tool_round_trip(server):
    """auto: the answer (forced to a hermes call) comes back as a tool call; its result goes back
    into the prompt as the template renders it; the final answer is text."""
    c = server["client"]
    r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120,
                                  extra_body={"guided_choice": [CALL]})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "days": 2})]
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 18 C"}]
    final = c.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=20,
                                      extra_body={"guided_choice": ["It is sunny."]})
    assert final.choices[0].message.content == "It is sunny."
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    # the prompt was the template's rendering of the call and its result
    rendered = ("<tools>get_weather;get_time;</tools>\n<user>Weather in Paris?\n<assistant>\n"
                f"{CALL}\n<tool_response>sunny, 18 C</tool_response>\n<assistant>")
    ids = server["llm"].tokenizer.encode(rendered, add_special_tokens=False).ids
    assert final.usage.prompt_tokens == len(ids)
    tok = httpx.post(server["base"] + "/tokenize", json={"model": MODEL, "messages": history,
                                                         "tools": TOOLS}, timeout=30).json()
    assert tok["tokens"] == ids


def test_streamed_call_reassembles_to_the_whole_one(server):
    c = server["client"]
    chunks = list(c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120,
                                            stream=True, extra_body={"guided_choice": [CALL]}))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    named = [t for d in deltas for t in d.tool_calls or () if t.function.name]
    pieces = [t.function.arguments for d in deltas for t in d.tool_calls or ()]
    assert [t.function.name for t in named] == ["get_weather"] and named[0].id.startswith("call_")
    assert json.loads("".join(pieces)) == {"city": "Paris", "days": 2} and len(pieces) > 2
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def validate(choice, names) -> None:
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_calls_validate_in_100_of_100(server):
    c, n = server["client"], 0
    for seed in range(5):  # required: any of the tools, one call each
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                      tool_choice="required", parallel_tool_calls=False, n=10,
                                      seed=seed, max_tokens=150)
        for choice in r.choices:
            validate(choice, SCHEMAS)
            assert len(choice.message.tool_calls) == 1
            n += 1
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(5):  # named: that function
        r = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named,
                                      n=10, seed=seed, max_tokens=150)
        for choice in r.choices:
            validate(choice, {"get_time"})
            n += 1
    assert n == 100


def test_required_streamed_is_the_same_call_as_whole(server):
    c = server["client"]
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=7,
              max_tokens=150, temperature=1.0)
    whole = c.chat.completions.create(**kw).choices[0].message
    chunks = list(c.chat.completions.create(**kw, stream=True))
    calls = {}
    for ch in chunks:
        for t in (ch.choices[0].delta.tool_calls or ()) if ch.choices else ():
            if t.function.name:
                calls[t.index] = [t.function.name, t.function.arguments or ""]
            else:
                calls[t.index][1] += t.function.arguments
    assert [tuple(calls[k]) for k in sorted(calls)] == [
        (t.function.name, t.function.arguments) for t in whole.tool_calls]


@pytest.mark.parametrize("body,param", [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": 5}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "nope"}}]}]},
     "messages"),
])
def test_bad_tool_requests_name_the_field(server, body, param):
    body = {"model": MODEL, "messages": ASK, **body}
    r = httpx.post(server["base"] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


class Shared(EngineClient):
    """The served engine seen by a second app (its own parsers): it neither starts nor stops it."""

    def __init__(self, client):
        self.inner, self.tokenizer = client, client.tokenizer
        self.chat_template = client.chat_template

    max_model_len = property(lambda self: self.inner.max_model_len)
    vocab_size = property(lambda self: self.inner.vocab_size)
    eos_token_ids = property(lambda self: self.inner.eos_token_ids)
    stats = property(lambda self: self.inner.stats)
    failure = property(lambda self: self.inner.failure)

    def submit(self, request):
        return self.inner.submit(request)

    def cancel(self, request_id):
        self.inner.cancel(request_id)

    def subscribe(self, on_stats, on_finish):
        pass

    def start(self):
        pass

    def shutdown(self):
        pass


def test_reasoning_goes_to_reasoning_content_and_auto_needs_a_parser(server):
    from fastapi.testclient import TestClient

    from dcp_jax.server.app import create_app

    shared = Shared(server["app"].state.client)
    thinking = create_app(shared, model_name=MODEL, tool_call_parser="hermes",
                          reasoning_parser="qwen3")
    answer = f"<think>The user wants weather.</think>\n{CALL}"
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 150,
            "guided_choice": [answer]}
    with TestClient(thinking) as tc:
        m = tc.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert m["reasoning_content"] == "The user wants weather." and m["content"] is None
        assert json.loads(m["tool_calls"][0]["function"]["arguments"])["city"] == "Paris"
        lines = tc.post("/v1/chat/completions", json=dict(body, stream=True)).text.splitlines()
        deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines
                  if x.startswith("data: {")]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == m["reasoning_content"]
        streamed = "".join(t["function"]["arguments"] for d in deltas
                           for t in d.get("tool_calls", ()))
        assert streamed == m["tool_calls"][0]["function"]["arguments"]
    plain = create_app(shared, model_name=MODEL)  # no tool parser: auto is refused, required runs
    with TestClient(plain) as tc:
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--tool-call-parser" in r.json()["error"]["message"]
        r = tc.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": TOOLS,
                                                  "tool_choice": "required", "max_tokens": 150,
                                                  "parallel_tool_calls": False})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice  # a JSON list, parsed
        call = choice["message"]["tool_calls"][0]["function"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_serve_flags():
    from dcp_jax.serve import run

    assert run(["--tool-call-parser", "nope"]) == 2
    assert run(["--reasoning-parser", "nope"]) == 2
    assert run(["--role", "prefill", "--tool-call-parser", "hermes"]) == 2
    assert run(["--model", str(FIXTURES / "llama-tokenizer"), "--chat-template", "/no/such/file",
                "--max-model-len", "64"]) == 1


def test_llm_chat_gives_tool_calls_as_objects_on_the_same_path(server):
    """LLM.chat (a notebook's) answers as the server does: the same greedy required call, calls as
    ToolCall objects, thinking out of the answer, the same refusals."""
    from dcp_jax import LLM, UserError
    from dcp_jax.agents import ToolCall

    served = server["llm"]
    llm = LLM(served.model, served.mesh, served.tokenizer, chat_template=served.chat_template,
              max_num_seqs=4, max_model_len=256, page_size=8, prefill_chunk=64, decode_steps=2)
    kw = dict(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    out = llm.chat(ASK, max_tokens=150, temperature=0, **kw)
    [call] = out.tool_calls
    assert isinstance(call, ToolCall) and out.message.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    http = server["client"].chat.completions.create(model=MODEL, messages=ASK, max_tokens=150,
                                                     temperature=0, **kw)
    assert [(c.function.name, c.function.arguments) for c in http.choices[0].message.tool_calls] \
        == [(call.name, call.arguments)]
    thought = llm.chat([ASK, ASK], max_tokens=150, tools=TOOLS, tool_parser="hermes",
                       reasoning_parser="qwen3",
                       structured={"choice": [f"<think>Weather, then.</think>{CALL}"]})
    assert len(thought.messages) == 2
    for m in thought.messages:
        assert m.reasoning_content == "Weather, then." and m.content is None
        assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [
            ("get_weather", {"city": "Paris", "days": 2})]
    with pytest.raises(UserError, match="tool-call parser") as e:
        llm.chat(ASK, tools=TOOLS)
    assert e.value.field == "tool_choice"
    with pytest.raises(UserError) as e:
        llm.chat(ASK, structured={"json_object": True}, **kw)
    assert e.value.field == "structured"
