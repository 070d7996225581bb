"""dcp_jax.agents without a model: each family's tool-call parser on outputs written in its real
format (single, parallel, with text around, malformed -> plain text), streamed in every chunking
to the same calls as whole; the reasoning parsers; the request side (tools, tool_choice, messages
for the template, each mistake a UserError naming its field); the fixture chat templates rendering
each family's calls so that its parser reads them back; and the grammar of a required call
compiled and walked by llguidance."""

from __future__ import annotations

import json
import random

import pytest

from dcp_jax.agents import (
    OutputParser,
    plan_chat,
    reasoning_parser,
    template_messages,
    tool_grammar,
    tool_parser,
)
from dcp_jax.agents.calls import CallDelta
from dcp_jax.chat_template import ChatTemplate
from dcp_jax.errors import UserError
from tests.util import FIXTURES

TEMPLATES = FIXTURES / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
PARIS = ("get_weather", {"city": "Paris", "days": 3})
CET = ("get_time", {"zone": "CET"})

# each family's outputs in its real format: (text, content, calls)
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
         "</tool_call>", None, [PARIS]),
        ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
         '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
         '"CET"}}\n</tool_call>', "Let me look.", [PARIS, CET]),
        # the name after the arguments; no closing tag at the end of the output
        ('<tool_call>{"arguments": {"zone": "CET"}, "name": "get_time"}', None, [CET]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None, [PARIS]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
         '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [PARIS, CET]),
        ('Here: <|python_tag|>{"type": "function", "name": "get_time", "parameters": '
         '{"zone": "CET"}}', "Here:", [CET]),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', None,
         [PARIS]),
        ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
         '{"name": "get_time", "arguments": {"zone": "CET"}}]', "Sure.", [PARIS, CET]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]'
         '{"zone": "CET"}', None, [PARIS, CET]),
    ],
    "qwen3_xml": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None, [PARIS]),
        ("I will check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
         "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n"
         "</tool_call>", "I will check both.", [PARIS, CET]),
    ],
    "deepseek_v3": [
        (f'{B}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris", "days": 3}}\n```{CE}{E}',
         None, [PARIS]),
        (f'Checking.{B}{CB}function{SEP}get_weather\n```json\n{{"city": "Paris", "days": 3}}\n'
         f'```{CE}\n{CB}function{SEP}get_time\n```json\n{{"zone": "CET"}}\n```{CE}{E}',
         "Checking.", [PARIS, CET]),
        (f'{B}{CB}get_time{SEP}{{"zone": "CET"}}{CE}{E}', None, [CET]),  # V3.1's
    ],
    "json_list": [
        ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, '
         '{"name": "get_time", "parameters": {"zone": "CET"}}]', None, [PARIS, CET]),
    ],
}
# outputs that are no call: the text comes back as it is
MALFORMED = {
    "hermes": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
               '<tool_call>\n{"name": get_weather}\n</tool_call>',
               '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
               "<tool_call>\nnot json at all</tool_call> and more",
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'],  # cut short
    "llama3_json": ['{"city": "Paris"}', '{"name": "Bob"}',
                    '{"name": "get_weather", "parameters": [1]}', "I think { is a brace"],
    "mistral": ["[TOOL_CALLS]not a list", '[TOOL_CALLS][{"name": "get_weather", "arguments": 5}]',
                "[TOOL_CALLS]get weather[ARGS]{}"],
    "qwen3_xml": ["<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>",
                  "<tool_call>\n<func=get_weather>\n</func>\n</tool_call>"],
    "deepseek_v3": [f"{B}{CB}function{SEP}get_weather\n{{\"city\": 1}}{CE}{E}",
                    f"{B}oops{E}"],
    "json_list": ["[1, 2, 3]", '[{"name": "get_weather"}]', "The list [a, b]"],
}


def chunkings(text: str):
    """Whole, a character at a time, and in random pieces."""
    yield [text]
    yield list(text)
    rng = random.Random(len(text))
    for _ in range(3):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed(parser, pieces):
    """(content, [(name, arguments)], deltas) reassembled from a stream fed `pieces`."""
    stream = parser.stream()
    out = [d for p in pieces for d in stream.feed(p)] + stream.finish()
    calls, names = {}, {}
    for d in out:
        if isinstance(d, CallDelta):
            if d.name is not None:
                assert d.index not in names, "a call's name goes out once"
                names[d.index] = d.name
                calls[d.index] = d.arguments
            else:
                calls[d.index] += d.arguments
    content = "".join(d for d in out if isinstance(d, str))
    return content, [(names[k], calls[k]) for k in sorted(calls)], out


@pytest.mark.parametrize("family,case", [(f, c) for f, cs in CASES.items() for c in cs],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_each_family_reads_its_calls_whole_and_streamed(family, case):
    text, content, want = case
    parser = tool_parser(family, TOOLS)
    got_content, calls = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(n, a) for n, a in want]
    assert (got_content or None) == content
    assert len({c.id for c in calls}) == len(calls)
    if family == "mistral":  # Mistral's templates take 9 letters and digits
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    for pieces in chunkings(text):
        s_content, s_calls, deltas = streamed(parser, pieces)
        assert s_content == got_content and s_calls == [(c.name, c.arguments) for c in calls]
    # a character at a time, the arguments come in several deltas (they stream), but for a name
    # written after them: they wait for it
    _, _, deltas = streamed(parser, list(text))
    pieces = sum(1 for d in deltas if isinstance(d, CallDelta) and d.name is None)
    assert pieces == len(want) if '{"arguments"' in text else pieces > len(want)


@pytest.mark.parametrize("family,text", [(f, t) for f, ts in MALFORMED.items() for t in ts])
def test_malformed_calls_are_plain_text(family, text):
    """Whole: the text as it is. Streamed: the text as content too; a call whose name went out
    before the text broke (its arguments had begun) keeps what was sent, as it must."""
    parser = tool_parser(family, TOOLS)
    assert parser.parse(text) == (text, [])
    content, calls, _ = streamed(parser, list(text))
    assert content == text
    broke_late = {'{"city": "Paris"}\n<', '"Par', "Paris\n</tool_call>"}
    assert calls == [] or (any(b in text for b in broke_late) and len(calls) == 1), calls


def test_plain_answers_pass_through_every_parser():
    text = "The weather in Paris is mild: 18 degrees, {rain} [maybe].  "
    for family in CASES:
        assert tool_parser(family, TOOLS).parse(text) == (text, [])
        assert streamed(tool_parser(family, TOOLS), list(text))[:2] == (text, [])


def test_qwen3_xml_types_values_by_the_schema():
    parser = tool_parser("qwen3_xml", [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "code": {"type": "string"}, "n": {"type": "number"}, "flag": {"type": "boolean"},
            "items": {"type": "array"}}}}}])
    text = ("<tool_call>\n<function=f>\n<parameter=code>\n42\n</parameter>\n<parameter=n>\n1.5\n"
            "</parameter>\n<parameter=flag>\ntrue\n</parameter>\n<parameter=items>\n[1, \"a\"]\n"
            "</parameter>\n</function>\n</tool_call>")
    _, [call] = parser.parse(text)
    assert json.loads(call.arguments) == {"code": "42", "n": 1.5, "flag": True, "items": [1, "a"]}


@pytest.mark.parametrize("name,text,want", [
    ("deepseek_r1", "Let me think.\n</think>\n\nParis.", ("Let me think.\n", "Paris.")),
    ("deepseek_r1", "<think>Hmm</think>Paris.", ("Hmm", "Paris.")),
    ("deepseek_r1", "Thinking without an end", ("Thinking without an end", "")),
    ("qwen3", "<think>\nHmm.\n</think>\n\nParis.", ("\nHmm.\n", "Paris.")),
    ("qwen3", "Paris, no thinking.", (None, "Paris, no thinking.")),
    ("qwen3", "<think>cut short", ("cut short", "")),
])
def test_reasoning_parsers_whole_and_streamed(name, text, want):
    parser = reasoning_parser(name)
    assert parser.parse(text) == want
    for pieces in chunkings(text):
        s = parser.stream()
        pairs = [x for p in pieces for x in s.feed(p)] + s.finish()
        assert "".join(c for _, c in pairs) == want[1]
        assert "".join(r for r, _ in pairs) == (want[0] or "")


def test_thinking_stays_out_of_tool_parsing():
    """A call written inside the thinking is no call; the answer's is, streamed alike."""
    parser = OutputParser(tool_parser("hermes", TOOLS), reasoning_parser("qwen3"))
    text = ('<think>Maybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call>?</think>\n'
            'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
            "</tool_call>")
    m = parser.parse(text, "stop")
    assert m.reasoning_content.startswith("Maybe <tool_call>") and m.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [PARIS]
    assert m.finish_reason == "tool_calls" and m.openai()["tool_calls"][0]["type"] == "function"
    s = parser.stream()
    deltas = [s.feed(ch) for ch in text] + [s.finish()]
    assert "".join(d.reasoning_content for d in deltas) == m.reasoning_content
    assert "".join(d.content for d in deltas) == m.content and s.called
    assert "".join(c.arguments for d in deltas for c in d.tool_calls) == m.tool_calls[0].arguments


def render(family: str, messages, tools=TOOLS, add_generation_prompt=False) -> str:
    template = ChatTemplate((TEMPLATES / f"{family}.jinja").read_text(), "<s>", "</s>")
    return template.render(template_messages(messages), add_generation_prompt, tools=tools)


ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call0AbCd", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}},
        {"id": "call1AbCd", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call0AbCd", "content": "sunny, 18 C"},
    {"role": "tool", "tool_call_id": "call1AbCd", "content": "14:05"},
]


@pytest.mark.parametrize("family", [f for f in CASES if f != "json_list"])
def test_fixture_templates_render_each_familys_calls_and_results(family):
    """Each fixture template shows the tools, renders the assistant's calls in the family's format
    (its parser reads them back as the calls they were) and the tools' results."""
    text = render(family, ROUND_TRIP, add_generation_prompt=True)
    assert "get_weather" in text.split("Weather in Paris")[0] or family == "mistral"
    assert "The weather in a city." in text or family in ("llama3_json", "mistral")
    assert "sunny, 18 C" in text and "14:05" in text
    before = render(family, ROUND_TRIP[:2])
    answer = render(family, ROUND_TRIP[:3])[len(before):]
    _, calls = tool_parser(family, TOOLS).parse(answer.split("<|im_end|>")[0]
                                                .split("<|eot_id|>")[0].split("</s>")[0]
                                                .split("<｜end▁of▁sentence｜>")[0]
                                                .split("<|start_header_id|>assistant"
                                                       "<|end_header_id|>\n\n")[-1]
                                                .split("<|im_start|>assistant\n")[-1])
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [PARIS, CET]


@pytest.mark.parametrize("kw,field", [
    (dict(tools=[]), "tools"),
    (dict(tools=[{"type": "function"}]), "tools"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "extra": 1}}]), "tools"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="auto"), "tool_choice"),  # no parser on this server
    (dict(tools=TOOLS), "tool_choice"),  # (auto is the default with tools)
    (dict(tools=TOOLS, tool_choice="required", parallel_tool_calls="yes"), "parallel_tool_calls"),
    (dict(tool_parser="nope"), "tool_parser"),
    (dict(reasoning="nope"), "reasoning_parser"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "messages"),
    (dict(messages=[{"role": "user", "content": "hi", "audio": {}}]), "messages"),
    (dict(messages=[{"role": "tool", "content": "42"}]), "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "x", "type": "function",
                                                          "function": {"name": "f",
                                                                       "arguments": "{"}}]}]),
     "messages"),
    (dict(messages=[{"role": "user", "content": "hi", "tool_calls": []}]), "messages"),
])
def test_request_mistakes_name_their_field(kw, field):
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    with pytest.raises(UserError) as e:
        plan_chat(kw.pop("messages"), **kw)
    assert e.value.field == field, str(e.value)


def test_plans():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]},
            {"role": "user", "content": "hi"}]
    plain = plan_chat(msgs)
    assert plain.messages[0] == {"role": "system", "content": "ab"}
    assert plain.tools is None and plain.structured is None and plain.template_variables() == {}
    none = plan_chat(msgs, TOOLS, "none", tool_parser="hermes")
    assert none.structured is None and none.parser.tools is None and none.tools == TOOLS
    auto = plan_chat(msgs, TOOLS, tool_parser="hermes")
    assert auto.structured is None and auto.parser.tools.name == "hermes"
    named = plan_chat(msgs, TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert named.parser.tools.name == "json_list" and named.parser.tools.names == {"get_time"}
    assert "get_weather" not in named.structured["grammar"]
    required = plan_chat(msgs, TOOLS, "required", False, tool_parser="hermes")
    assert required.structured["grammar"].startswith("start: call\n")


def walk(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher for `grammar` takes `text` (byte tokens) and may stop there."""
    import llguidance

    from dcp_jax.structured import Grammars
    from dcp_jax.weights import ByteTokenizer

    tokenizer = ByteTokenizer()
    g = Grammars(tokenizer, 256, [])
    m = llguidance.LLMatcher(g.tokenizer, g.grammar(("grammar", grammar)))
    return m.consume_tokens(list(text.encode())) and not m.is_error() and m.is_accepting()


@pytest.mark.parametrize("family", list(CASES))
def test_required_grammar_takes_the_familys_calls_and_only_valid_ones(family):
    parser = tool_parser(family, TOOLS)
    functions = [t["function"] for t in TOOLS]
    grammar = tool_grammar(parser, functions, parallel=True)
    args = '{"city":"Paris","days":3}'
    one = {"hermes": f'<tool_call>\n{{"name":"get_weather","arguments":{args}}}\n</tool_call>',
           "llama3_json": f'{{"name":"get_weather","parameters":{args}}}',
           "mistral": f'[TOOL_CALLS][{{"name":"get_weather","arguments":{args}}}]',
           "qwen3_xml": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                        "</tool_call>",
           "deepseek_v3": f"{B}{CB}function{SEP}get_weather\n```json\n{args}\n```{CE}{E}",
           "json_list": f'[{{"name":"get_weather","parameters":{args}}}]'}[family]
    assert walk(grammar, one)
    assert [(c.name, json.loads(c.arguments)) for c in parser.parse(one)[1]] == [PARIS]
    assert not walk(grammar, one.replace("3", '"3"'))  # an integer's place
    assert not walk(grammar, one.replace("get_weather", "get_wether"))
    thinking = tool_grammar(parser, functions, False, reasoning_parser("deepseek_r1"))
    assert walk(thinking, "Let me see.</think>\n" + one)
