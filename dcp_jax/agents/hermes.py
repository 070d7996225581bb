"""hermes: Hermes 2/3, Qwen2.5 and Qwen3 (their templates' default), each call a JSON object in
tags, one after another:

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"zone": "CET"}}
    </tool_call>
"""

from __future__ import annotations

from dcp_jax.agents.calls import (
    PartialCall,
    ToolParser,
    call_object,
    closing,
    json_call,
    lark_str,
    skip_ws,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolParser):
    name = "hermes"
    markers = (OPEN,)

    def scan(self, text: str, calls: list[PartialCall], final: bool) -> int:
        calls.append(PartialCall())
        i = call_object(text, skip_ws(text, len(OPEN)), calls[-1], self.names)
        return closing(text, i, CLOSE, final)

    def call_syntax(self, name: str, parameters: dict) -> str:
        call = json_call(name, parameters)
        return f"{lark_str(OPEN + chr(10))} {call} {lark_str(chr(10) + CLOSE)}"
