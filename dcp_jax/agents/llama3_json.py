"""llama3_json: Llama 3.1 / 3.2 / 3.3's JSON tool calls, the whole answer one or more objects
(`parameters` or `arguments`), after `<|python_tag|>` or at the very start, `;` between them:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", ...}

A plain answer that merely starts with `{` stays text: a call object has only the keys name,
parameters (or arguments) and type, and its arguments.
"""

from __future__ import annotations

from dcp_jax.agents.calls import (
    WS,
    Incomplete,
    PartialCall,
    ToolParser,
    call_object,
    json_call,
    lark_str,
    skip_ws,
)

TAG = "<|python_tag|>"


class Llama3Json(ToolParser):
    name = "llama3_json"
    markers = (TAG, "{")

    def find(self, text: str, at_start: bool) -> tuple[int | None, int]:
        """`<|python_tag|>` anywhere; a bare `{` only when it opens the answer."""
        rest = text.lstrip(WS)
        if at_start and rest.startswith("{"):
            return len(text) - len(rest), 0
        i = text.find(TAG)
        if i >= 0:
            return i, 0
        hold = max((k for k in range(1, len(TAG)) if text.endswith(TAG[:k])), default=0)
        if at_start and not rest:
            hold = len(text)
        return None, hold

    def scan(self, text: str, calls: list[PartialCall], final: bool) -> int:
        i = len(TAG) if text.startswith(TAG) else 0
        while True:
            calls.append(PartialCall())
            i = call_object(text, skip_ws(text, i), calls[-1], self.names, args_optional=False)
            j = skip_ws(text, i)
            if j == len(text) and not final:
                raise Incomplete  # a `;` and another call may follow
            if not text.startswith(";", j):
                return i
            i = j + 1

    def call_syntax(self, name: str, parameters: dict) -> str:
        return json_call(name, parameters, "parameters")

    def sequence(self, parallel: bool) -> str:
        return f'call ({lark_str("; ")} call)*' if parallel else "call"
