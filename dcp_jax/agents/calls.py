"""The tool-call parsing machinery every model family shares: `ToolCall`, the stream's `CallDelta`,
the JSON-prefix scanner, and `ToolParser`, whose one driver (`ToolStream`) serves both the
streaming and the whole-text parse.

A family (one small module each: hermes.py, llama3_json.py, ...) says three things:

    markers     the strings that open a call section (`<tool_call>`, `[TOOL_CALLS]`, ...)
    scan(text, calls, final) -> end
                read one section (text starts at its marker), appending a `PartialCall` per call
                and filling it as far as the text goes; return where the section ends, raise
                `Incomplete` where the text runs out inside it (`final`: the output has ended) and
                `Malformed` where it is no call of the family
    grammar(...)  the family's call syntax around each function's JSON schema (agents/grammar.py)

`ToolStream.feed(delta)` keeps the text it has not settled: plain text goes out as content (less a
tail that may begin a marker), a section is scanned again as it grows and each call's name goes out
once (when complete) and its arguments as deltas (the part of their JSON text not sent yet).
`ToolParser.parse(text)` runs the same driver over the whole text at once, so a streamed output
reassembles to the same calls. A section that is not a call (malformed, truncated, a function the
request did not offer) is plain text: whole, it never becomes a call; streamed, only a call whose
name already went out when the text broke keeps what was sent (a stream cannot take it back), and
the section's text follows as content.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from dcp_jax.structured import COMPACT

WS = " \t\r\n"
NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")  # a function name (OpenAI's, with . and : as vLLM's)
STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
STRING_TAIL = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*'
                         r'(?:\\(?:u[0-9a-fA-F]{0,3})?)?\Z')
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
NUMBER_TAIL = re.compile(r"-?(?:0|[1-9][0-9]*)?(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?\Z")


class Incomplete(Exception):
    """The text ended inside a call section that could still be one."""


class Malformed(Exception):
    """The text is not a call section of the family."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: `arguments` is a JSON object's text (OpenAI's `function.arguments`)."""
    id: str
    name: str
    arguments: str

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class PartialCall:
    """What a scan has read of one call: its name once complete (None before), its arguments' JSON
    text so far (each scan's a prefix of the next's)."""
    name: str | None = None
    arguments: str = ""

    def set(self, name: str | None = None, arguments: str | None = None) -> None:
        """Record the complete name, and the arguments' text so far."""
        if name is not None:
            self.name = name
        if arguments is not None:
            self.arguments = arguments

    def extend(self, arguments: str) -> None:
        self.arguments += arguments


@dataclasses.dataclass(frozen=True)
class CallDelta:
    """One piece of a streamed call: the first carries `id` and `name`, the rest `arguments`."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def openai(self) -> dict:
        if self.name is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


# --- scanning helpers (raise Incomplete / Malformed) ---------------------------------------------
def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WS:
        i += 1
    return i


def literal(s: str, i: int, lit: str) -> int:
    """The index after `lit` at i."""
    if s.startswith(lit, i):
        return i + len(lit)
    if lit.startswith(s[i:]):
        raise Incomplete
    raise Malformed


def closing(s: str, i: int, lit: str, final: bool) -> int:
    """The index after the closing marker `lit` at i (after whitespace); at the output's end a
    missing or cut closing marker is forgiven (the call itself is complete)."""
    i = skip_ws(s, i)
    if s.startswith(lit, i):
        return i + len(lit)
    if lit.startswith(s[i:]):
        if final:
            return len(s)
        raise Incomplete
    raise Malformed


def until(s: str, i: int, end: str, pattern: re.Pattern = NAME) -> tuple[str, int]:
    """The text from i up to `end` (which must match `pattern`) and the index after `end`."""
    j = s.find(end, i)
    if j < 0:
        tail = s[i:]
        cut = max((k for k in range(len(end)) if tail.endswith(end[:k])), default=0)
        head = tail[:len(tail) - cut]
        if head and not pattern.fullmatch(head):
            raise Malformed
        raise Incomplete
    if not pattern.fullmatch(s[i:j]):
        raise Malformed
    return s[i:j], j + len(end)


def string_end(s: str, i: int) -> int:
    if i >= len(s):
        raise Incomplete
    m = STRING.match(s, i)
    if m:
        return m.end()
    if STRING_TAIL.match(s, i):
        raise Incomplete
    raise Malformed


def scalar_end(s: str, i: int) -> int:
    """The end of a number or literal at i (never at the text's end: a number could go on)."""
    m = NUMBER.match(s, i)
    if m and m.end() < len(s):
        return m.end()
    if m or NUMBER_TAIL.match(s, i):
        raise Incomplete
    for word in ("true", "false", "null"):
        if s.startswith(word, i):
            return i + len(word)
        if word.startswith(s[i:]):
            raise Incomplete
    raise Malformed


def value_end(s: str, i: int) -> int:
    """The index after the JSON value that starts at s[i] (no whitespace before it)."""
    stack: list[str] = []
    expect = "value"
    while True:
        i = skip_ws(s, i)
        if i >= len(s):
            raise Incomplete
        c = s[i]
        if expect in ("value", "value]") and not (expect == "value]" and c == "]"):
            if c in "{[":
                stack.append(c)
                expect = "key}" if c == "{" else "value]"
                i += 1
                continue
            i = string_end(s, i) if c == '"' else scalar_end(s, i)
        elif expect in ("key", "key}") and c == '"':
            i, expect = string_end(s, i), ":"
            continue
        elif expect == ":" and c == ":":
            i, expect = i + 1, "value"
            continue
        elif expect == "," and c == ",":
            i, expect = i + 1, "key" if stack[-1] == "{" else "value"
            continue
        elif c == {"{": "}", "[": "]"}.get(stack[-1] if stack else "") and expect in (
                ",", "key}", "value]"):
            stack.pop()
            i += 1
        else:
            raise Malformed
        if not stack:
            return i
        expect = ","


def object_text(s: str, i: int, call: PartialCall | None = None) -> int:
    """Read a JSON object at s[i] into `call.arguments` (its text so far); the index after it."""
    if i >= len(s):
        raise Incomplete
    if s[i] != "{":
        raise Malformed
    try:
        end = value_end(s, i)
    except Incomplete:
        if call is not None:
            call.set(arguments=s[i:])
        raise
    if call is not None:
        call.set(arguments=s[i:end])
    return end


def call_list(s: str, i: int, calls: list[PartialCall], names, **kw) -> int:
    """Read a JSON list of call objects (`call_object`, its keywords `kw`) whose items begin at
    s[i] (after the `[`), one PartialCall each into `calls`. The index after the `]`."""
    i = skip_ws(s, i)
    while True:
        calls.append(PartialCall())
        i = skip_ws(s, call_object(s, i, calls[-1], names, **kw))
        if s.startswith("]", i):
            return i + 1
        i = skip_ws(s, literal(s, i, ","))


def call_object(s: str, i: int, call: PartialCall, names, args_keys=("arguments", "parameters"),
                args_optional: bool = True) -> int:
    """Read `{"name": "f", "arguments": {...}}` (keys in any order; "type" and "id" allowed) at
    s[i] into `call`; the name is given out once the arguments' object begins (or the object
    closes). `names`: the
    functions the request offers (None: any). The index after the object."""
    i = literal(s, i, "{")
    name, has_args, first = None, False, True
    while True:
        i = skip_ws(s, i)
        if s.startswith("}", i):
            if name is None or not (has_args or args_optional):
                raise Malformed
            if not has_args:
                call.set(arguments="{}")
            call.set(name)
            return i + 1
        if not first:
            i = skip_ws(s, literal(s, i, ","))
        key_end = string_end(s, i)
        key = json.loads(s[i:key_end])
        i = skip_ws(s, literal(s, skip_ws(s, key_end), ":"))
        if key in ("name", "type", "id"):
            end = string_end(s, i)
            value = json.loads(s[i:end])
            if key == "name":
                if name is not None or not NAME.fullmatch(value) or (names is not None
                                                                     and value not in names):
                    raise Malformed
                name = value
            i = end
        elif key in args_keys and not has_args:
            has_args = True
            if not s.startswith("{", i):  # (the text ends there, or it is no object)
                raise Incomplete if i >= len(s) else Malformed
            if name is not None:
                call.set(name)
            i = object_text(s, i, call)
        else:
            raise Malformed
        first = False


# --- grammar pieces (Lark, as llguidance reads it) -----------------------------------------------
def lark_str(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def lark_json(schema) -> str:
    """A value valid under the JSON schema `schema` (llguidance's `%json`), without whitespace
    between its tokens (a weak model cannot pad forever) unless the schema's "x-guidance" asks."""
    if isinstance(schema, dict):
        schema = {"x-guidance": COMPACT, **schema}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def json_call(name: str, parameters: dict, args_key: str = "arguments") -> str:
    """`{"name": name, args_key: <parameters>}`, the name first (llguidance keeps the schema's
    property order: a stream gives the name out before the arguments)."""
    return lark_json({"type": "object", "properties": {"name": {"const": name},
                                                       args_key: parameters},
                      "required": ["name", args_key], "additionalProperties": False})


# --- the family interface and its one driver -----------------------------------------------------
class ToolParser:
    """A model family's tool-call format (subclasses set `name`, `markers`, `scan`, `grammar`).
    Made per request: `tools` (OpenAI's tool dicts) name the functions a call may use (None: any)
    and give the parameters' schemas a family may need (qwen3's XML values)."""

    name = ""
    markers: tuple[str, ...] = ()

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or ()}
        self.names = set(self.tools) if tools else None

    # --- what a family defines ---
    def scan(self, text: str, calls: list[PartialCall], final: bool) -> int:
        raise NotImplementedError

    def find(self, text: str, at_start: bool) -> tuple[int | None, int]:
        """Where the first call section opens in `text` (None: nowhere yet) and, when nowhere, how
        long a tail to hold back (it may begin a marker). `at_start`: no content went out yet."""
        found = [(text.find(m), m) for m in self.markers if m in text]
        if found:
            return min(found)[0], 0
        hold = max((k for m in self.markers for k in range(1, len(m)) if text.endswith(m[:k])),
                   default=0)
        return None, hold

    def call_syntax(self, name: str, parameters: dict) -> str:
        """The Lark expression of one call of `name` (its arguments valid under `parameters`)."""
        raise NotImplementedError

    def sequence(self, parallel: bool) -> str:
        """The Lark expression of the calls of one output over the rule `call`."""
        return 'call ("\\n" call)*' if parallel else "call"

    def new_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    # --- the two ways in ---
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output."""
        content, calls = [], {}
        for delta in self.stream().whole(text):
            if isinstance(delta, str):
                content.append(delta)
            elif delta.name is not None:
                calls[delta.index] = [delta.id, delta.name, delta.arguments]
            else:
                calls[delta.index][2] += delta.arguments
        return "".join(content), [ToolCall(*calls[k]) for k in sorted(calls)]

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """The driver: text deltas in, content strings and `CallDelta`s out (see the module's doc)."""

    def __init__(self, parser: ToolParser):
        self.parser, self.buf = parser, ""
        self.in_section, self.after_section, self.at_start = False, False, True
        self.calls = 0  # calls begun before the open section
        self.sent: list[list] = []  # the open section's calls: [id, arguments sent]
        self.gap = ""  # the whitespace before the open section (content if it is no call)

    def feed(self, delta: str) -> list:
        self.buf += delta
        return self.run(final=False)

    def finish(self) -> list:
        return self.run(final=True)

    def whole(self, text: str) -> list:
        """A whole output at once (nothing goes out before all of it is read)."""
        self.buf += text
        return self.run(final=True)

    def text_out(self, n: int, out: list, hold_ws: bool) -> None:
        """Give out buf[:n] as content: less its leading whitespace right after a section, less
        its trailing whitespace (held: it may come right before a section) when `hold_ws`."""
        start = 0
        if self.after_section:
            start = n - len(self.buf[:n].lstrip(WS))
        stop = start + len(self.buf[start:n].rstrip(WS)) if hold_ws else n
        if stop > start:
            out.append(self.buf[start:stop])
            self.after_section, self.at_start = False, False
            self.buf = self.buf[stop:]
        elif not hold_ws:
            self.buf = self.buf[n:]

    def run(self, final: bool) -> list:
        out: list = []
        while True:
            if not self.in_section:
                i, hold = self.parser.find(self.buf, self.at_start)
                if i is None:
                    self.text_out(len(self.buf) - (0 if final else hold), out, hold_ws=not final)
                    return out
                self.text_out(i, out, hold_ws=True)
                rest = self.buf.lstrip(WS)
                self.gap, self.buf = self.buf[:len(self.buf) - len(rest)], rest
                self.in_section, self.sent = True, []
            calls: list[PartialCall] | None = []
            try:
                end = self.parser.scan(self.buf, calls, final)
            except Incomplete:
                end = None
                if final:
                    calls = None
            except Malformed:
                calls = None
            if calls is None:
                self.not_a_section(out)
                continue
            self.diff(calls, out)
            if end is None:
                return out
            self.buf = self.buf[end:]
            self.close_section(True)

    def not_a_section(self, out: list) -> None:
        """The open section is no call: its text is content (all of it when a call's name went
        out already; else its marker, and the text after it is read again)."""
        if self.sent:
            out.append(self.buf)
            self.buf = ""
        else:
            marker = next((m for m in self.parser.markers if self.buf.startswith(m)),
                          self.buf[:1])
            out.append(self.gap + marker)
            self.buf, self.at_start = self.buf[len(marker):], False
        self.close_section(False)

    def close_section(self, ok: bool) -> None:
        self.calls += len(self.sent)
        self.in_section, self.sent, self.after_section, self.gap = False, [], ok, ""

    def diff(self, calls: list[PartialCall], out: list) -> None:
        for k, call in enumerate(calls):
            if call.name is None:
                return  # calls go out in order
            if k == len(self.sent):
                self.sent.append([self.parser.new_id(), 0])
                out.append(CallDelta(self.calls + k, self.sent[k][0], call.name))
                self.at_start = False
            new = call.arguments[self.sent[k][1]:]
            if new:
                out.append(CallDelta(self.calls + k, arguments=new))
                self.sent[k][1] = len(call.arguments)
