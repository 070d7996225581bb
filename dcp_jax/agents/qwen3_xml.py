"""qwen3_xml: Qwen3-Coder's (and Qwen3.5's) XML calls, each parameter's value as plain text typed
by the function's schema (a string stays text; numbers, booleans, objects and arrays are JSON):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

The arguments go out as JSON (`{"city": "Paris", "days": 3}`), a parameter at a time.
"""

from __future__ import annotations

import json
import re

from dcp_jax.agents.calls import (
    Incomplete,
    Malformed,
    PartialCall,
    ToolParser,
    closing,
    lark_json,
    lark_str,
    literal,
    skip_ws,
    until,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION = "<function=", "</function>"
PARAMETER, END_PARAMETER = "<parameter=", "</parameter>"
JSON_START = re.compile(r"[-0-9\[{]|true\b|false\b|null\b")


def typed(value: str, schema: dict):
    """A parameter's text as the JSON value its schema asks for (the text itself when it is no
    such value)."""
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    if "string" in kinds or (not kinds and not JSON_START.match(value)):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class Qwen3Xml(ToolParser):
    name = "qwen3_xml"
    markers = (OPEN,)

    def scan(self, text: str, calls: list[PartialCall], final: bool) -> int:
        call = PartialCall()
        calls.append(call)
        i = literal(text, skip_ws(text, len(OPEN)), FUNCTION)
        name, i = until(text, i, ">")
        if self.names is not None and name not in self.names:
            raise Malformed
        call.set(name, "{")
        schema = (self.tools.get(name) or {}).get("parameters") or {}
        props, seen = schema.get("properties") or {}, set()
        while True:
            i = skip_ws(text, i)
            if text.startswith(END_FUNCTION, i):
                call.extend("}")
                return closing(text, i + len(END_FUNCTION), CLOSE, final)
            if text[i:] and END_FUNCTION.startswith(text[i:]):
                raise Incomplete
            i = literal(text, i, PARAMETER)
            key, i = until(text, i, ">")
            end = text.find(END_PARAMETER, i)
            if end < 0:
                raise Incomplete
            if key in seen:
                raise Malformed
            seen.add(key)
            value = typed(text[i:end].removeprefix("\n").removesuffix("\n"),
                          props.get(key) if isinstance(props.get(key), dict) else {})
            comma = ", " if len(seen) > 1 else ""
            call.extend(f"{comma}{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
            i = end + len(END_PARAMETER)

    def call_syntax(self, name: str, parameters: dict) -> str:
        props = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        parts = []
        for key, schema in props.items():
            value = self.value_syntax(schema if isinstance(schema, dict) else {})
            part = f'{lark_str(f"{PARAMETER}{key}>\n")} {value} {lark_str(f"{END_PARAMETER}\n")}'
            parts.append(part if key in required else f"({part})?")
        body = " ".join(parts)
        head = lark_str(f"{OPEN}\n{FUNCTION}{name}>\n")
        return f'{head} {body} {lark_str(f"{END_FUNCTION}\n{CLOSE}")}'

    @staticmethod
    def value_syntax(schema: dict) -> str:
        """A parameter's text and its newline: free text (no `<`) for a string, JSON for the
        rest."""
        kinds = schema.get("type")
        if kinds == "string" and not any(k in schema for k in ("enum", "const", "pattern")):
            return "/[^<]*/"
        return f'{lark_json(schema)} "\\n"'
