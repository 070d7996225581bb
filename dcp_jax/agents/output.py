"""A chat answer's text into an assistant message: the thinking out first (a reasoning parser), then
the tool calls out of what is left (a tool-call parser), whole (`OutputParser.parse`) or streamed
(`OutputParser.stream`: text deltas in, `MessageDelta`s out). The server's chat endpoints and
`LLM.chat` both read answers through it."""

from __future__ import annotations

import dataclasses

from dcp_jax.agents.calls import CallDelta, ToolCall, ToolParser
from dcp_jax.agents.reasoning import ReasoningParser


@dataclasses.dataclass(frozen=True)
class ParsedMessage:
    """An assistant message: `content` (None when the answer is only tool calls), its thinking
    (`reasoning_content`, None without), its `tool_calls`, and the finish reason ("tool_calls" when
    it called tools and stopped by itself)."""
    content: str | None
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None

    def openai(self) -> dict:
        """OpenAI's message dict."""
        out = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.openai() for c in self.tool_calls]
        return out


@dataclasses.dataclass(frozen=True)
class MessageDelta:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: tuple[CallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's: "tool_calls" for an answer that called tools and ended by itself."""
    return "tool_calls" if called and reason == "stop" else reason


class OutputParser:
    """The parsers of one request (either may be None: its part of the text is left as it is)."""

    def __init__(self, tools: ToolParser | None = None, reasoning: ReasoningParser | None = None):
        self.tools, self.reasoning = tools, reasoning

    def parse(self, text: str, reason: str | None = None) -> ParsedMessage:
        thinking, content = (None, text) if self.reasoning is None else self.reasoning.parse(text)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.parse(content)
        if calls and not content:
            content = None
        return ParsedMessage(content, thinking, tuple(calls), finish_reason(reason, bool(calls)))

    def stream(self) -> OutputStream:
        return OutputStream(self)


class OutputStream:
    """One streamed answer: `feed(delta)` and at the end `finish()` (or `feed(delta, final=True)`),
    each a `MessageDelta`;
    `called` whether any tool call went out (the last chunk's finish reason)."""

    def __init__(self, parser: OutputParser):
        self.thinking = None if parser.reasoning is None else parser.reasoning.stream()
        self.calls = None if parser.tools is None else parser.tools.stream()
        self.called = False

    def feed(self, delta: str, final: bool = False) -> MessageDelta:
        """What `delta` adds (with `final`, the output ends there: whatever was held back)."""
        if self.thinking is None:
            pairs = [("", delta)]
        else:
            pairs = self.thinking.feed(delta) if delta else []
            if final:
                pairs += self.thinking.finish()
        reasoning = "".join(r for r, _ in pairs)
        content = "".join(c for _, c in pairs)
        if self.calls is None:
            return MessageDelta(content, reasoning)
        pieces = self.calls.feed(content) if content else []
        if final:
            pieces += self.calls.finish()
        calls = tuple(p for p in pieces if isinstance(p, CallDelta))
        self.called = self.called or bool(calls)
        return MessageDelta("".join(p for p in pieces if isinstance(p, str)), reasoning, calls)

    def finish(self) -> MessageDelta:
        return self.feed("", final=True)
