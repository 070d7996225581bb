"""The request side of a chat with tools: OpenAI-shaped `tools`, `tool_choice`,
`parallel_tool_calls` and messages checked and turned into what the chat template receives (as
transformers hands `tools=` and messages to `apply_chat_template`: assistant `tool_calls` with their
arguments as objects, `role: "tool"` results with their `tool_call_id`), the grammar a required or
named choice runs under, and the `OutputParser` that reads the answer. `plan_chat` is the one way
in (the server's chat endpoint and `LLM.chat`); a mistake is a UserError naming its field."""

from __future__ import annotations

import dataclasses
import json

from dcp_jax.agents.calls import NAME
from dcp_jax.agents.grammar import tool_grammar
from dcp_jax.agents.json_list import JsonList
from dcp_jax.agents.output import OutputParser
from dcp_jax.agents.parsers import TOOL_PARSERS, check_tool_parser
from dcp_jax.agents.reasoning import reasoning_parser
from dcp_jax.errors import UserError

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclasses.dataclass(frozen=True)
class ChatPlan:
    """What a chat request runs as: the template's `messages` and `tools` (None: the template gets
    no tools), the `structured` output a required or named choice runs under (None: free), and the
    `parser` of its answer."""
    messages: list[dict]
    tools: list[dict] | None
    structured: dict | None
    parser: OutputParser

    def template_variables(self) -> dict:
        return {} if self.tools is None else {"tools": self.tools}


def plan_chat(messages, tools=None, tool_choice=None, parallel_tool_calls=None, *,
              tool_parser: str | None = None, reasoning: str | None = None) -> ChatPlan:
    """Check a chat request and plan it. `tool_parser`, `reasoning`: the parsers' names (None:
    none; `auto` needs a tool parser, required and named choices use the family's syntax, or
    without one a JSON list)."""
    check_tool_parser(tool_parser)
    thinking = reasoning_parser(reasoning)
    tools = check_tools(tools)
    choice = check_choice(tool_choice, tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise UserError("parallel_tool_calls must be true or false", field="parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    if choice == "auto" and tool_parser is None:
        raise UserError("tool_choice auto needs a tool-call parser, and this server has none: "
                        "start it with --tool-call-parser NAME (one of "
                        f"{', '.join(TOOL_PARSERS)}), or ask for tool_choice required or a "
                        "named function", field="tool_choice")
    parser, structured = None, None
    if choice != "none":
        offered = tools if choice in ("auto", "required") else [
            t for t in tools if t["function"]["name"] == choice]
        family = TOOL_PARSERS[tool_parser] if tool_parser else JsonList
        parser = family(offered)
        if choice != "auto":
            functions = [t["function"] for t in offered]
            structured = {"grammar": tool_grammar(parser, functions,
                                                  parallel and choice == "required", thinking)}
    return ChatPlan(template_messages(messages), tools, structured, OutputParser(parser, thinking))


def check_tools(tools) -> list[dict] | None:
    """OpenAI's tools (`[{"type": "function", "function": {name, description, parameters,
    strict}}]`), each checked, as given."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise UserError("tools must be a non-empty list of {type: function, function: {...}}",
                        field="tools")
    seen = set()
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {
                "type", "function"}:
            raise UserError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}",
                            field="tools")
        f = tool.get("function")
        if not isinstance(f, dict) or set(f) - FUNCTION_KEYS:
            raise UserError(f"{where}.function must be an object with keys among "
                            f"{', '.join(sorted(FUNCTION_KEYS))}", field="tools")
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in seen:
            raise UserError(f"{where}.function.name must be a new name of 1 to 64 letters, digits, "
                            f"_ . : or -, got {name!r}", field="tools")
        seen.add(name)
        if not isinstance(f.get("description", ""), str):
            raise UserError(f"{where}.function.description must be a string", field="tools")
        if not isinstance(f.get("parameters", {}), dict):
            raise UserError(f"{where}.function.parameters must be a JSON schema object",
                            field="tools")
        if not isinstance(f.get("strict", False), bool):
            raise UserError(f"{where}.function.strict must be true or false", field="tools")
    return tools


def check_choice(choice, tools: list[dict] | None) -> str:
    """"none", "auto", "required" or the named function's name."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or set(choice) != {"type", "function"} or (
                not isinstance(f, dict) or set(f) != {"name"} or not isinstance(f["name"], str)):
            raise UserError('tool_choice takes "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', field="tool_choice")
        name = f["name"]
        if name not in {t["function"]["name"] for t in tools or ()}:
            raise UserError(f"tool_choice names the function {name!r}, which tools does not "
                            "offer", field="tool_choice")
        return name
    if choice not in ("none", "auto", "required"):
        raise UserError(f'tool_choice takes "none", "auto", "required" or a named function, got '
                        f"{choice!r}", field="tool_choice")
    if choice != "none" and not tools:
        raise UserError(f"tool_choice {choice} needs tools", field="tool_choice")
    return choice


def template_messages(messages) -> list[dict]:
    """The messages as the chat template receives them: text content (text parts joined; None is
    ""), the developer role as system, assistant tool calls with their arguments as objects, a
    tool result's `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise UserError("messages must be a non-empty list", field="messages")
    return [template_message(m, f"messages[{k}]") for k, m in enumerate(messages)]


def template_message(m, where: str) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise UserError(f"{where} must be an object whose role is one of {', '.join(ROLES)}",
                        field="messages")
    if set(m) - MESSAGE_KEYS:
        raise UserError(f"{where} has keys this server does not know: "
                        f"{', '.join(sorted(set(m) - MESSAGE_KEYS))}", field="messages")
    role = "system" if m["role"] == "developer" else m["role"]
    out = {"role": role, "content": text_content(m.get("content"), where)}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise UserError(f"{where}.{key} must be a string", field="messages")
            out[key] = m[key]
    if role == "tool" and "tool_call_id" not in out:
        raise UserError(f"{where}: a tool message needs tool_call_id (the call it answers)",
                        field="messages")
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise UserError(f"{where}: only an assistant message has tool_calls", field="messages")
        out["tool_calls"] = [template_call(c, f"{where}.tool_calls[{j}]")
                             for j, c in enumerate(m["tool_calls"])]
    return out


def text_content(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise UserError(f"{where}.content must be a string or a list of text parts (only text content "
                    "parts are supported)", field="messages")


def template_call(call, where: str) -> dict:
    """An assistant's call as templates read it: {id, type, function: {name, arguments: object}}."""
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(
            f.get("arguments"), str) or not isinstance(call.get("id", ""), str):
        raise UserError(f"{where} must be {{id, type: function, function: {{name, arguments}}}} "
                        "with arguments a JSON string", field="messages")
    try:
        arguments = json.loads(f["arguments"])
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise UserError(f"{where}.function.arguments must be a JSON object's text",
                        field="messages")
    out = {"type": "function", "function": {"name": f["name"], "arguments": arguments}}
    return {"id": call["id"], **out} if call.get("id") is not None else out
