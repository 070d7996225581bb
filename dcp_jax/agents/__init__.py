"""Agents as clients: tool calls and reasoning, one path shared by the HTTP server (chat
completions; the Messages API reuses it for tool_use blocks) and `LLM.chat`. No HTTP here.

The request side (`messages.py`):

    plan = plan_chat(messages, tools, tool_choice, parallel_tool_calls,
                     tool_parser="hermes", reasoning="qwen3")
    plan.messages, plan.template_variables()   what the chat template renders (tools=...)
    plan.structured                            {"grammar": lark} for a required / named choice
                                               (SamplingParams' structured), else None
    plan.parser                                the OutputParser of the answer

The answer side (`output.py`), whole or streamed:

    plan.parser.parse(text, finish_reason) -> ParsedMessage(content, reasoning_content,
                                                            tool_calls, finish_reason)
    s = plan.parser.stream(); s.feed(delta) / s.finish() -> MessageDelta(content,
                                                            reasoning_content, tool_calls)

Underneath, usable alone:

    tool_parser(name, tools).parse(text) -> (content, [ToolCall(id, name, arguments_json)])
    tool_parser(name, tools).stream(): feed(delta) / finish() -> [str (content) | CallDelta
                                       (a call's id and name once, then its arguments' deltas)]
    reasoning_parser(name).parse(text) -> (reasoning | None, content); .stream() likewise
    tool_grammar(parser, functions, parallel, reasoning) -> the llguidance (Lark) grammar

Tool-call parsers (`TOOL_PARSERS`, one module each, `calls.ToolParser`'s interface): hermes,
llama3_json, mistral, qwen3_xml, deepseek_v3, json_list. Reasoning parsers: deepseek_r1, qwen3.
"""

from dcp_jax.agents.calls import CallDelta, ToolCall, ToolParser
from dcp_jax.agents.grammar import tool_grammar
from dcp_jax.agents.messages import ChatPlan, plan_chat, template_messages
from dcp_jax.agents.output import MessageDelta, OutputParser, ParsedMessage
from dcp_jax.agents.parsers import TOOL_PARSERS, tool_parser
from dcp_jax.agents.reasoning import REASONING_PARSERS, reasoning_parser

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "CallDelta",
    "ChatPlan",
    "MessageDelta",
    "OutputParser",
    "ParsedMessage",
    "ToolCall",
    "ToolParser",
    "plan_chat",
    "reasoning_parser",
    "template_messages",
    "tool_grammar",
    "tool_parser",
]
