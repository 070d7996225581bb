"""json_list: the calls as one JSON list, the whole answer (vLLM's format for a required or named
tool choice on a server with no --tool-call-parser):

    [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", ...}]
"""

from __future__ import annotations

from dcp_jax.agents.calls import (
    WS,
    PartialCall,
    ToolParser,
    call_list,
    json_call,
    lark_str,
)


class JsonList(ToolParser):
    name = "json_list"
    markers = ("[",)

    def find(self, text: str, at_start: bool) -> tuple[int | None, int]:
        """Only a `[` that opens the answer."""
        rest = text.lstrip(WS)
        if at_start and rest.startswith("["):
            return len(text) - len(rest), 0
        return None, 0

    def scan(self, text: str, calls: list[PartialCall], final: bool) -> int:
        return call_list(text, 1, calls, self.names, args_optional=False)

    def call_syntax(self, name: str, parameters: dict) -> str:
        return json_call(name, parameters, "parameters")

    def sequence(self, parallel: bool) -> str:
        more = f' ({lark_str(", ")} call)*' if parallel else ""
        return f'{lark_str("[")} call{more} {lark_str("]")}'
