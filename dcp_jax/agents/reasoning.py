"""Reasoning parsers: a thinking model's `<think>` block moved out of the answer (OpenAI-style
`reasoning_content`), whole or streamed, by one machine (`ReasoningStream`; `parse` runs it over
the whole text).

    deepseek_r1  DeepSeek-R1 (and Qwen3 thinking-2507, QwQ): the template opens `<think>` in the
                 prompt, so the output is thinking up to `</think>` (a leading `<think>` is
                 dropped); no `</think>`: all of it is thinking (cut short)
    qwen3        Qwen3: thinking only when the output opens with `<think>`, up to `</think>`;
                 otherwise (thinking switched off) all of it is the answer

Whitespace between `</think>` and the answer is dropped. The answer alone goes on to tool-call
parsing; a grammar (structured outputs, a required tool call) lets the thinking come first
(`REASONING_PARSERS[name].grammar_prefix`).
"""

from __future__ import annotations

from dcp_jax.errors import UserError

WS = " \t\r\n"
START, END = "<think>", "</think>"


class ReasoningParser:
    """One family's rule (`opens`: thinking starts without a `<think>` in the output)."""

    name, opens = "", False

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output."""
        s = self.stream()
        pieces = [*s.feed(text), *s.finish()]
        reasoning = "".join(r for r, _ in pieces)
        return (reasoning if s.thought else None), "".join(c for _, c in pieces)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.opens)

    def grammar_prefix(self) -> tuple[str, str]:
        """A Lark expression for the thinking a grammar lets through before what it constrains,
        and the rule it uses (any text up to `</think>`: llguidance's `stop`)."""
        rule = f'thinking[stop="{END}"]: /(?s:.*)/'
        think = 'thinking /[ \\t\\r\\n]*/'
        if self.opens:
            return f'"{START}"? {think}', rule
        return f'("{START}" {think})?', rule


class DeepSeekR1(ReasoningParser):
    name, opens = "deepseek_r1", True


class Qwen3(ReasoningParser):
    name, opens = "qwen3", False


REASONING_PARSERS = {p.name: p for p in (DeepSeekR1, Qwen3)}


def check_reasoning_parser(name: str | None) -> None:
    """UserError naming the parsers when `name` is none of them."""
    if name is not None and name not in REASONING_PARSERS:
        raise UserError(f"unknown reasoning parser {name!r}: use one of "
                        f"{', '.join(REASONING_PARSERS)}", field="reasoning_parser")


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser `name` (None for None)."""
    check_reasoning_parser(name)
    return None if name is None else REASONING_PARSERS[name]()


class ReasoningStream:
    """Text deltas in, (reasoning, content) pairs out."""

    def __init__(self, opens: bool):
        self.state = "start"  # start -> thinking -> after (whitespace dropped) -> content
        self.opens, self.buf, self.thought = opens, "", False

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self.buf += delta
        return self.run(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self.run(final=True)

    def run(self, final: bool) -> list[tuple[str, str]]:
        out = []
        if self.state == "start":
            rest = self.buf.lstrip(WS)
            if rest.startswith(START):
                self.state, self.buf, self.thought = "thinking", rest[len(START):], True
            elif START.startswith(rest) and not final:
                return out
            elif self.opens:
                self.state, self.thought = "thinking", True
            else:
                self.state = "content"
        if self.state == "thinking":
            i = self.buf.find(END)
            if i < 0:
                hold = 0 if final else max((k for k in range(1, len(END))
                                            if self.buf.endswith(END[:k])), default=0)
                out.append((self.buf[:len(self.buf) - hold], ""))
                self.buf = self.buf[len(self.buf) - hold:]
                return out
            out.append((self.buf[:i], ""))
            self.state, self.buf = "after", self.buf[i + len(END):]
        if self.state == "after":
            self.buf = self.buf.lstrip(WS)
            if not self.buf:
                return out
            self.state = "content"
        out.append(("", self.buf))
        self.buf = ""
        return out
