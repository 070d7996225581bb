"""The tool-call parsers by name (`--tool-call-parser NAME`, `LLM.chat(tool_parser=...)`)."""

from __future__ import annotations

from dcp_jax.agents.calls import ToolParser
from dcp_jax.agents.deepseek_v3 import DeepSeekV3
from dcp_jax.agents.hermes import Hermes
from dcp_jax.agents.json_list import JsonList
from dcp_jax.agents.llama3_json import Llama3Json
from dcp_jax.agents.mistral import Mistral
from dcp_jax.agents.qwen3_xml import Qwen3Xml
from dcp_jax.errors import UserError

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (Hermes, Llama3Json, Mistral, Qwen3Xml, DeepSeekV3, JsonList)}


def check_tool_parser(name: str | None) -> None:
    """UserError naming the parsers when `name` is none of them."""
    if name is not None and name not in TOOL_PARSERS:
        raise UserError(f"unknown tool-call parser {name!r}: use one of "
                        f"{', '.join(TOOL_PARSERS)}", field="tool_parser")


def tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """The parser `name` for one request offering `tools`."""
    check_tool_parser(name)
    return TOOL_PARSERS[name](tools)
