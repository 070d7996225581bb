"""Tools and thinking in Anthropic's Messages API, end to end: the llama-tokenizer fixture (a random
model) on a (tp=1, dcp=2) mesh behind a real uvicorn server, served with the brief hermes fixture
template (--chat-template) and --tool-call-parser hermes, asked with the official `anthropic`
client.

A random model calls no tool by itself, so: tool_choice any and a named tool run under the tools'
grammar (every sampled call's input validates against its schema), and a greedy one is the round
trip (tool_use, then its tool_result, then a final answer); auto and thinking are shown on a second
app over the same engine with --reasoning-parser qwen3, whose answers are forced to a text in
hermes' format (a structured choice put on each request by the engine client that app sees,
`Forced`), which the parsers read into thinking, text and tool_use blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from tests.test_tools_server import Shared
from tests.util import FIXTURES, templated_checkpoint

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("uvicorn")

MODEL = "tiny-llama-messages-tools"
TEMPLATE = FIXTURES / "chat_templates" / "hermes_brief.jinja"
SIZES = {"max_num_seqs": 16, "max_model_len": 384, "page_size": 8, "prefill_chunk": 64,
         "decode_steps": 2}
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 8},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC", "JST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS_LINE = "<tools>get_weather(city,days);get_time(zone);</tools>\n"  # the template's
GREEDY = {"extra_body": {"temperature": 0}}
SAMPLED = {"extra_body": {"temperature": 1.0}}
SINGLE = {"type": "any", "disable_parallel_tool_use": True}
# what the forced app's model says: thinking, text, a hermes call
THOUGHT, SAY = "The user wants the weather.", "Let me check."
PARIS = {"city": "Paris", "days": 2}
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(PARIS)}}}\n</tool_call>'
ANSWER = f"<think>{THOUGHT}</think>\n{SAY}\n{CALL}"
THINK = {"type": "enabled", "budget_tokens": 100}


class Forced(Shared):
    """The served engine seen by a second app (its own parsers), which neither starts nor stops
    it; with `force(text)`, every request's answer is that text (a structured choice)."""

    answer = None

    def force(self, text: str) -> None:
        self.answer = text

    def submit(self, request):
        sampling = dataclasses.replace(request.sampling, structured={"choice": [self.answer]})
        return self.inner.submit(dataclasses.replace(request, sampling=sampling))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from fastapi.testclient import TestClient

    from dcp_jax.launch import make_app, serve_in_thread
    from dcp_jax.server.app import create_app

    ckpt = templated_checkpoint(tmp_path_factory.mktemp("tools") / "model",
                                template="{{ messages }}")  # not the one served
    app, llm = make_app(ckpt, tp=1, dcp=2, served_model_name=MODEL, chat_template=TEMPLATE,
                        tool_call_parser="hermes", **SIZES)
    base, stop = serve_in_thread(app, timeout_s=30)
    forced = Forced(app.state.client)
    thinking = create_app(forced, model_name=MODEL, tool_call_parser="hermes",
                          reasoning_parser="qwen3")
    with TestClient(thinking) as tc:  # (the anthropic client over it: TestClient is an httpx one)
        yield {"base": base, "llm": llm, "forced": forced, "tc": tc,
               "client": anthropic.Anthropic(base_url=base, api_key="x", timeout=120,
                                             max_retries=0),
               "thinking": anthropic.Anthropic(base_url="http://testserver", api_key="x",
                                               http_client=tc, max_retries=0)}
    stop()


def n_tokens(llm, text: str) -> int:
    return len(llm.tokenizer.encode(text, add_special_tokens=False).ids)


def blocks(message) -> list[tuple]:
    """A message's content without its tool_use ids (new in every answer)."""
    return [(b.type, b.name, b.input) if b.type == "tool_use" else
            (b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]


def events(tc_or_base, body: dict) -> list[dict]:
    """The event stream's data objects, in order."""
    if isinstance(tc_or_base, str):
        r = httpx.post(tc_or_base + "/v1/messages", json=body, timeout=120)
    else:
        r = tc_or_base.post("/v1/messages", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[len("data: "):]) for line in r.text.splitlines()
            if line.startswith("data: ")]


def check_block_events(stream: list[dict]) -> list[tuple[str, list[dict]]]:
    """Anthropic's event sequence (message_start; per block a start, deltas and a stop, the blocks
    indexed 0, 1, ... one after another; message_delta, message_stop): each block's start and
    deltas."""
    assert stream[0]["type"] == "message_start" and stream[0]["message"]["content"] == []
    assert [e["type"] for e in stream[-2:]] == ["message_delta", "message_stop"]
    out, open_ = [], None
    for e in stream[1:-2]:
        if e["type"] == "content_block_start":
            assert open_ is None and e["index"] == len(out)
            out.append((e["content_block"]["type"], [e["content_block"]]))
            open_ = e["index"]
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_
            out[-1][1].append(e["delta"])
        else:
            assert e == {"type": "content_block_stop", "index": open_}
            open_ = None
    assert open_ is None
    return out


def test_any_tool_round_trip_whole_and_streamed(server):
    """any (one call, greedy): a tool_use block whose input validates, the same whole and streamed
    (its input as input_json_delta pieces); its tool_result goes back into the prompt as the
    template renders it, and the final answer (auto) is text."""
    c, llm = server["client"], server["llm"]
    kw = {"model": MODEL, "max_tokens": 120, "messages": ASK, "tools": TOOLS,
          "tool_choice": SINGLE}
    r = c.messages.create(**kw, **GREEDY)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    call = r.content[0]
    assert call.id.startswith("toolu_") and call.name in SCHEMAS
    jsonschema.validate(call.input, SCHEMAS[call.name])
    with c.messages.stream(**kw, **GREEDY) as s:
        final = s.get_final_message()
    assert blocks(final) == blocks(r) and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == r.usage.output_tokens
    body = dict(kw, stream=True, temperature=0)
    [(kind, [start, *deltas])] = check_block_events(events(server["base"], body))
    assert kind == "tool_use" and start["input"] == {} and start["name"] == call.name
    assert {d["type"] for d in deltas} == {"input_json_delta"} and len(deltas) > 2
    assert json.loads("".join(d["partial_json"] for d in deltas)) == call.input
    # the round trip: the call and its result rendered into the next prompt, a text answer
    history = [*ASK, {"role": "assistant", "content": r.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "sunny, 18 C"}]}]
    arguments = json.dumps(call.input, ensure_ascii=False)
    rendered = (f"{TOOLS_LINE}<user>Weather in Paris?\n<assistant>\n<tool_call>\n"
                f'{{"name": "{call.name}", "arguments": {arguments}}}\n</tool_call>\n'
                "<tool_response>sunny, 18 C</tool_response>\n<assistant>\n")
    counted = c.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS)
    assert counted.input_tokens == n_tokens(llm, rendered)
    answer = c.messages.create(model=MODEL, max_tokens=12, messages=history, tools=TOOLS,
                               **GREEDY)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == n_tokens(
        llm, rendered)


def test_count_tokens_counts_the_tools_as_rendered(server):
    c, llm = server["client"], server["llm"]
    plain = c.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    assert plain == n_tokens(llm, "<user>Weather in Paris?\n<assistant>\n")
    for choice in ({"type": "auto"}, SINGLE, {"type": "tool", "name": "get_time"},
                   {"type": "none"}):  # (none: the tools are still shown, none is called)
        with_tools = c.messages.count_tokens(model=MODEL, messages=ASK, tools=TOOLS,
                                             tool_choice=choice).input_tokens
        assert with_tools == plain + n_tokens(llm, TOOLS_LINE), choice


def test_any_and_named_tool_validate_in_every_sample(server):
    """45 sampled answers at once: any with one call, any with parallel calls, the named tool;
    every call's input validates against its tool's schema."""
    client = anthropic.AsyncAnthropic(base_url=server["base"], api_key="x", timeout=120,
                                      max_retries=0)
    choices = [SINGLE] * 15 + [{"type": "any"}] * 15 + [{"type": "tool", "name": "get_time"}] * 15

    async def ask_all():
        async with client:
            return await asyncio.gather(*[
                client.messages.create(model=MODEL, max_tokens=150, messages=ASK, tools=TOOLS,
                                       tool_choice=choice, **SAMPLED) for choice in choices])

    answers = asyncio.run(ask_all())
    for choice, r in zip(choices, answers, strict=True):
        calls = [b for b in r.content if b.type == "tool_use"]
        assert calls and [b.type for b in r.content] == ["tool_use"] * len(calls), r.content
        for b in calls:
            assert b.name == choice.get("name", b.name)
            jsonschema.validate(b.input, SCHEMAS[b.name])
        if choice == {"type": "any"}:  # parallel: as many as it makes before max_tokens
            assert r.stop_reason in ("tool_use", "max_tokens")
        else:  # one call: it ends by itself
            assert len(calls) == 1 and r.stop_reason == "tool_use", r
    assert len(answers) == 45


def test_auto_and_thinking_blocks_whole_and_streamed(server):
    """auto, read by the parsers: with thinking enabled a thinking block, then the text, then the
    tool_use (stop_reason tool_use); streamed as thinking_delta, text_delta and input_json_delta
    pieces that reassemble to the same blocks; without thinking the thinking is left out."""
    c, tc = server["thinking"], server["tc"]
    server["forced"].force(ANSWER)
    kw = {"model": MODEL, "max_tokens": 200, "messages": ASK, "tools": TOOLS}
    r = c.messages.create(**kw, thinking=THINK)
    assert blocks(r) == [("thinking", THOUGHT), ("text", SAY), ("tool_use", "get_weather", PARIS)]
    assert r.stop_reason == "tool_use" and r.content[0].signature == ""
    assert r.content[2].id.startswith("toolu_")
    with c.messages.stream(**kw, thinking=THINK) as s:
        final = s.get_final_message()
    assert blocks(final) == blocks(r) and final.stop_reason == "tool_use"
    streamed = check_block_events(events(tc, dict(kw, thinking=THINK, stream=True)))
    assert [kind for kind, _ in streamed] == ["thinking", "text", "tool_use"]
    (_, thought), (_, said), (_, called) = streamed
    assert "".join(d["thinking"] for d in thought[1:]) == THOUGHT and len(thought) > 2
    assert "".join(d["text"] for d in said[1:]) == SAY
    assert json.loads("".join(d["partial_json"] for d in called[1:])) == PARIS
    # thinking not asked for: taken out of the answer all the same, and left out
    plain = c.messages.create(**kw)
    assert blocks(plain) == blocks(r)[1:] and plain.stop_reason == "tool_use"
    streamed = check_block_events(events(tc, dict(kw, stream=True)))
    assert [kind for kind, _ in streamed] == ["text", "tool_use"]
    # no call: a text answer ends the turn
    server["forced"].force(f"<think>{THOUGHT}</think>It is sunny.")
    r = c.messages.create(**kw, thinking=THINK)
    assert (blocks(r), r.stop_reason) == ([("thinking", THOUGHT), ("text", "It is sunny.")],
                                          "end_turn")


def test_thinking_and_tool_round_trip_through_the_parsers(server):
    """The assistant's blocks sent back as they came (thinking, text, tool_use) and the tool's
    result: the template shows the thinking, the call and the result; the final answer is text."""
    c, llm = server["thinking"], server["llm"]
    server["forced"].force(ANSWER)
    r = c.messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=TOOLS, thinking=THINK)
    call = r.content[2]
    history = [*ASK, {"role": "assistant", "content": r.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": "sunny", "is_error": False}]}]
    rendered = (f"{TOOLS_LINE}<user>Weather in Paris?\n<assistant><think>{THOUGHT}</think>{SAY}\n"
                f"{CALL}\n<tool_response>sunny</tool_response>\n<assistant>\n")
    assert c.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS,
                                   thinking=THINK).input_tokens == n_tokens(llm, rendered)
    server["forced"].force("It is sunny.")
    final = c.messages.create(model=MODEL, max_tokens=120, messages=history, tools=TOOLS,
                              thinking=THINK)
    assert (blocks(final), final.stop_reason) == ([("text", "It is sunny.")], "end_turn")


def test_thinking_needs_a_reasoning_parser_and_auto_a_tool_parser(server):
    from fastapi.testclient import TestClient

    from dcp_jax.server.app import create_app

    c = server["client"]  # hermes, no reasoning parser
    with pytest.raises(anthropic.BadRequestError, match="--reasoning-parser") as e:
        c.messages.create(model=MODEL, max_tokens=120, messages=ASK, thinking=THINK)
    assert e.value.body["error"]["message"].startswith("thinking")
    plain = create_app(server["forced"], model_name=MODEL)  # no parsers at all
    with TestClient(plain) as tc:
        r = tc.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": ASK,
                                          "tools": TOOLS})
        error = r.json()["error"]
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert error["type"] == "invalid_request_error"
        assert "tool_choice" in error["message"] and "--tool-call-parser" in error["message"]
