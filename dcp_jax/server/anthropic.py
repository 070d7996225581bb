"""Anthropic's Messages API as wire format: its request bodies, its error shape, the conversion of a
request into the OpenAI chat request the rest of the server serves, and its response and stream
events. No engine here: `dcp_jax.server.messages` joins these to the chat path.

A Messages request becomes an OpenAI chat request (`chat_request`): the system prompt a system
message; text blocks a message's text (a message's blocks joined by newlines); an assistant's
`thinking` blocks its `reasoning_content` (for templates that show it) and its `tool_use` blocks its
`tool_calls` (OpenAI's shape: id, type "function", function name, arguments as JSON text); each
`tool_result` block a `role: "tool"` message (`tool_call_id`, its text; with `is_error` the message
carries `is_error: true` for templates that show it); a final assistant message a prefill the model
goes on from. `tools` and `tool_choice` become OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls` in one function (`openai_tools`): auto, any (chat's required), a named tool
and none, `disable_parallel_tool_use` as `parallel_tool_calls: false`. The chat path plans them
(`dcp_jax.agents.plan_chat`: the server's tool-call parser, the grammar of any / a named tool) and
reads the answer with the same `OutputParser`; here its `ParsedMessage` (or, streamed, its
`MessageDelta`s) becomes content blocks: a `thinking` block (when the request enabled thinking), a
`text` block, a `tool_use` block per call (`toolu_` ids, the arguments' object as `input`, streamed
as `input_json_delta`s), and `stop_reason: "tool_use"` when the answer called tools and ended by
itself. `cache_control` marks are accepted and need nothing: the prefix cache keeps every full
block of every prompt.

Thinking (`thinking: {"type": "enabled", "budget_tokens": N}` or `{"type": "adaptive"}`) needs the
server's reasoning parser (`--reasoning-parser`; without one it is a 400 naming `thinking`). With a
reasoning parser the thinking is always taken out of the answer (as chat's reasoning_content);
it is a `thinking` block when the request enabled thinking, and left out otherwise (the output
tokens still count it). `budget_tokens` is checked (an integer below `max_tokens`) but not
enforced: the model ends its thinking by itself, within `max_tokens`. The blocks carry an empty
`signature` (nothing here signs them); thinking blocks sent back are taken as they come.

Usage is Anthropic's: `input_tokens` are the prompt tokens computed for this request,
`cache_read_input_tokens` those the prefix cache served (their sum is the prompt),
`cache_creation_input_tokens` 0 (nothing is written to a cache at a price).
"""

from __future__ import annotations

import json
import re
from typing import Any

from dcp_jax.agents.output import MessageDelta, ParsedMessage
from dcp_jax.agents.reasoning import REASONING_PARSERS
from dcp_jax.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, Rule
from dcp_jax.server.protocol import APIError

try:
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Anthropic's error type of each status (others: invalid_request_error below 500, api_error above)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}
TEMPERATURE = Rule(float, 0, 1)  # Anthropic's range (OpenAI's has no upper bound here)
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # and "tool": a named one
THINKING_KEYS = {"disabled": {"type"}, "adaptive": {"type", "display"},
                 "enabled": {"type", "budget_tokens", "display"}}  # each type's keys


def speaks_anthropic(path: str) -> bool:
    """Whether a route answers in Anthropic's shapes (its errors included)."""
    return path.rstrip("/") in PATHS


def error_response(status: int, message: str, param: str | None = None):
    """Anthropic's error shape; the message names the field it concerns."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    if param and param not in message:
        message = f"{param}: {message}"
    return JSONResponse(error_body(kind, message), status_code=status,
                        headers={"Retry-After": "1"} if status in (503, 529) else None)


def error_event(message: str) -> str:
    """A stream's error event (the request failed on the server after the stream began)."""
    return f"event: error\ndata: {json.dumps(error_body('api_error', message))}\n\n"


def error_body(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


def bad(path: str, problem: str) -> APIError:
    """The 400 of one field (`path`: its place in the body, e.g. messages.2.content.0.type)."""
    return APIError(400, f"{path}: {problem}", param=path)


# --- request bodies (strict: a wrong type is a 400; an unknown field too) -------------------------
class CountTokensBody(BaseModel):
    """`POST /v1/messages/count_tokens`: what the prompt is made of."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # (a mark on the prompt's end: every block is)


class MessagesBody(CountTokensBody):
    """`POST /v1/messages`."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


# --- a request as OpenAI's chat request -----------------------------------------------------------
def chat_request(body: CountTokensBody, reasoning: bool = False) -> dict:
    """The OpenAI chat request (a `ChatBody`'s fields) that asks what `body` asks; APIError (400)
    names the first bad field by its place in the body. When its last message is the assistant's,
    the model goes on from it (`ChatTemplate.render`'s continue_final_message). `reasoning`: the
    server has a reasoning parser (what thinking needs)."""
    check_thinking(body.thinking, reasoning, getattr(body, "max_tokens", None))
    check_cache_control(body.cache_control, "cache_control")
    out = {"model": body.model, "messages": chat_messages(body.system, body.messages)}
    out.update(openai_tools(body.tools, body.tool_choice))
    if isinstance(body, MessagesBody):
        out.update(sampling_fields(body))
    return out


def sampling_fields(body: MessagesBody) -> dict:
    """max_tokens, the sampling parameters and stop strings under OpenAI's names (their ranges are
    `SamplingParams`'; Anthropic's narrower temperature and its stop_sequences checked here)."""
    if body.temperature is not None and (
            problem := TEMPERATURE.problem("temperature", body.temperature)) is not None:
        raise APIError(400, problem, param="temperature")
    stops = body.stop_sequences or []
    if len(stops) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise bad("stop_sequences", f"at most {MAX_STOP_STRINGS} non-empty strings of at most "
                  f"{MAX_STOP_CHARS} characters each")
    if body.metadata is not None and (set(body.metadata) - {"user_id"} or not isinstance(
            body.metadata.get("user_id"), str | None)):
        raise bad("metadata", "takes only user_id (a string)")
    given = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    return dict({k: v for k, v in given.items() if v is not None}, max_tokens=body.max_tokens,
                stop=stops, stream=body.stream)


def check_thinking(thinking: dict | None, reasoning: bool, max_tokens: int | None) -> None:
    """Anthropic's thinking: disabled, adaptive, or enabled with budget_tokens (an integer below
    max_tokens: checked, not enforced); adaptive and enabled need the server's reasoning parser."""
    if thinking is None:
        return
    kind = thinking.get("type")
    if kind not in THINKING_KEYS:
        raise bad("thinking.type", 'must be "enabled" (with budget_tokens), "adaptive" or '
                  f'"disabled", got {kind!r}'[:300])
    if set(thinking) - THINKING_KEYS[kind]:
        raise bad("thinking", f"type {kind} takes {', '.join(sorted(THINKING_KEYS[kind]))}")
    if thinking.get("display", "summarized") not in ("summarized", None):
        raise bad("thinking.display", 'only "summarized" is supported (this server shows the '
                  "thinking as it is, or not at all)")
    budget = thinking.get("budget_tokens") if kind == "enabled" else 1
    if type(budget) is not int or budget < 1 or (max_tokens is not None and budget >= max_tokens):
        raise bad("thinking.budget_tokens", "must be an integer in [1, max_tokens) (thinking "
                  f"counts toward max_tokens), got {budget!r}"[:300])
    if kind != "disabled" and not reasoning:
        raise bad("thinking", "thinking needs a reasoning parser, and this server has none: "
                  f"start it with --reasoning-parser NAME (one of {', '.join(REASONING_PARSERS)}),"
                  ' or leave thinking out (or send {"type": "disabled"})')


def thinking_shown(thinking: dict | None) -> bool:
    """Whether a (checked) thinking config asks for thinking blocks."""
    return thinking is not None and thinking.get("type") != "disabled"


def chat_messages(system, messages: list[dict]) -> list[dict]:
    """The OpenAI chat messages of a system prompt and Anthropic's messages."""
    out = []
    if system is not None:
        text = system if isinstance(system, str) else blocks_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or set(m) - {"role", "content"}:
            raise bad(where, "a message has a role and content, nothing else")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f"must be user or assistant, got {role!r} (a system prompt "
                      "is the top-level system field)")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            convert = assistant_message if role == "assistant" else user_messages
            out += convert(content, f"{where}.content")
        else:
            raise bad(f"{where}.content", "must be a string or a list of content blocks")
    last = out[-1]
    if last["role"] == "assistant" and "tool_calls" in last:
        raise bad(f"messages.{len(messages) - 1}", "a final assistant message with tool_use "
                  "blocks needs their tool_result in a user message after it")
    if last["role"] == "assistant" and not last["content"].strip():
        out.pop()  # an empty prefill: the model starts its turn as without one
    if not out or out[-1]["role"] == "system":
        raise bad("messages", "needs a user message")
    return out


def check_block(block, where: str, kinds: tuple[str, ...]) -> str:
    """The block's type, after its shape: a dict whose type is one of `kinds`, whose cache_control
    (if any) is Anthropic's ephemeral mark."""
    if not isinstance(block, dict):
        raise bad(where, "a content block must be an object")
    kind = block.get("type")
    if kind not in kinds:
        raise bad(f"{where}.type", f"must be {' or '.join(kinds)} here, got {kind!r} (this server "
                  "takes text, thinking, tool_use and tool_result blocks)")
    check_cache_control(block.get("cache_control"), f"{where}.cache_control")
    return kind


def check_cache_control(mark, where: str) -> None:
    """Anthropic's cache mark, {"type": "ephemeral"} with an optional ttl: taken, and nothing to
    do (the prefix cache keeps every full block of every prompt)."""
    if mark is not None and (not isinstance(mark, dict) or mark.get("type") != "ephemeral"
                             or set(mark) - {"type", "ttl"}
                             or mark.get("ttl", "5m") not in ("5m", "1h")):
        raise bad(where, "must be {\"type\": \"ephemeral\"} (with ttl \"5m\" or \"1h\")")


def text_of(block: dict, where: str) -> str:
    if set(block) - {"type", "text", "cache_control", "citations"} or not isinstance(
            block.get("text"), str):
        raise bad(where, "a text block has type, text (a string) and cache_control")
    if block.get("citations"):
        raise bad(f"{where}.citations", "citations are not supported by this server")
    return block["text"]


def blocks_text(blocks, where: str) -> str:
    """The text of a list of text blocks, joined by newlines."""
    if not isinstance(blocks, list):
        raise bad(where, "must be a string or a list of text blocks")
    parts = []
    for j, block in enumerate(blocks):
        check_block(block, f"{where}.{j}", ("text",))
        parts.append(text_of(block, f"{where}.{j}"))
    return "\n".join(parts)


def user_messages(blocks: list, where: str) -> list[dict]:
    """A user message's blocks in order: each tool_result a tool message, each run of text blocks
    a user message."""
    out, text = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        if check_block(block, at, ("text", "tool_result")) == "text":
            text.append(text_of(block, at))
            continue
        if text:
            out.append({"role": "user", "content": "\n".join(text)})
            text = []
        out.append(tool_message(block, at))
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def tool_message(block: dict, where: str) -> dict:
    if set(block) - {"type", "tool_use_id", "content", "is_error", "cache_control"}:
        raise bad(where, "a tool_result block has type, tool_use_id, content, is_error and "
                  "cache_control")
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str) or not call_id:
        raise bad(f"{where}.tool_use_id", "must be the id of the tool_use block it answers")
    text = content if isinstance(content, str) else blocks_text(content, f"{where}.content")
    error = block.get("is_error", False)
    if not isinstance(error, bool):
        raise bad(f"{where}.is_error", "must be true or false")
    return {"role": "tool", "tool_call_id": call_id, "content": text} | (
        {"is_error": True} if error else {})


def assistant_message(blocks: list, where: str) -> list[dict]:
    """An assistant message's text blocks as its content, its thinking blocks as its
    reasoning_content, its tool_use blocks as its tool_calls."""
    text, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        kind = check_block(block, at, ("text", "thinking", "tool_use"))
        if kind == "text":
            text.append(text_of(block, at))
        elif kind == "thinking":
            thinking.append(thinking_of(block, at))
        else:
            calls.append(tool_call(block, at))
    out = {"role": "assistant", "content": "\n".join(text)}
    if thinking:
        out["reasoning_content"] = "\n".join(thinking)
    return [out | ({"tool_calls": calls} if calls else {})]


def thinking_of(block: dict, where: str) -> str:
    """A thinking block's text (its signature, whatever it is, is not checked: none is made
    here)."""
    if set(block) - {"type", "thinking", "signature"} or not isinstance(
            block.get("thinking"), str) or not isinstance(block.get("signature", ""), str):
        raise bad(where, "a thinking block has type, thinking (a string) and signature")
    return block["thinking"]


def tool_call(block: dict, where: str) -> dict:
    if set(block) - {"type", "id", "name", "input", "cache_control"}:
        raise bad(where, "a tool_use block has type, id, name, input and cache_control")
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise bad(f"{where}.{key}", "must be a non-empty string")
    if not isinstance(block.get("input"), dict):
        raise bad(f"{where}.input", "must be an object (the tool's arguments)")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}


def openai_tools(tools: list[dict] | None, tool_choice: dict | None) -> dict:
    """Anthropic's `tools` (name, description, input_schema) and `tool_choice` ({"type": auto |
    any | tool | none}, disable_parallel_tool_use) as OpenAI's chat fields: `tools` ([{"type":
    "function", "function": {name, description, parameters}}]), `tool_choice` ("auto",
    "required", {"type": "function", "function": {"name"}} or "none") and `parallel_tool_calls`;
    only the fields given (none for no tools and no choice, or choice none). APIError (400) names
    a malformed one."""
    out: dict = {}
    names = []
    for i, tool in enumerate(tools or ()):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise bad(where, "a tool must be an object")
        if tool.get("type", "custom") != "custom":
            raise bad(f"{where}.type", f"only custom tools (name, description, input_schema) are "
                      f"supported, got {tool.get('type')!r}")
        if set(tool) - {"type", "name", "description", "input_schema", "cache_control"}:
            raise bad(where, "a tool has name, description, input_schema and cache_control")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name) or name in names:
            raise bad(f"{where}.name", "must be a unique name of 1 to 64 letters, digits, _ or -")
        if not isinstance(tool.get("description", ""), str):
            raise bad(f"{where}.description", "must be a string")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise bad(f"{where}.input_schema", "must be a JSON schema of type object")
        names.append(name)
        function = {"name": name, "parameters": schema} | (
            {"description": tool["description"]} if "description" in tool else {})
        out.setdefault("tools", []).append({"type": "function", "function": function})
    if tool_choice is not None:
        out.update(openai_tool_choice(tool_choice, names))
    return out


def openai_tool_choice(choice: dict, names: list[str]) -> dict:
    kind = choice.get("type")
    keys = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if kind not in (*TOOL_CHOICES, "tool") or set(choice) - keys:
        raise bad("tool_choice", f"must be {{\"type\": \"auto\" | \"any\" | \"none\"}} or "
                  f"{{\"type\": \"tool\", \"name\": ...}} (with disable_parallel_tool_use), got "
                  f"{choice!r}"[:300])
    if kind == "none":  # the neutral choice: the model answers in text
        if "disable_parallel_tool_use" in choice:
            raise bad("tool_choice.disable_parallel_tool_use", "does not go with type none")
        return {"tool_choice": "none"} if names else {}
    if not names:
        raise bad("tool_choice", f"type {kind} needs tools")
    if kind == "tool" and choice.get("name") not in names:
        raise bad("tool_choice.name", f"must name one of the tools {names}"[:300])
    out = {"tool_choice": TOOL_CHOICES.get(kind) or {"type": "function",
                                                     "function": {"name": choice["name"]}}}
    serial = choice.get("disable_parallel_tool_use")
    if serial is not None:
        if not isinstance(serial, bool):
            raise bad("tool_choice.disable_parallel_tool_use", "must be true or false")
        out["parallel_tool_calls"] = not serial
    return out


# --- the prompt ---------------------------------------------------------------------------------
def plannable(messages: list[dict]) -> list[dict]:
    """The chat messages as `plan_chat` takes them (OpenAI's keys: a tool result's is_error mark
    left out; `marked` puts it back)."""
    return [{k: v for k, v in m.items() if k != "is_error"} for m in messages]


def marked(template_messages: list[dict], messages: list[dict]) -> list[dict]:
    """The template's messages (one per chat message) with the tool results' is_error marks."""
    return [dict(t, is_error=True) if m.get("is_error") else t
            for t, m in zip(template_messages, messages, strict=True)]


# --- the response ---------------------------------------------------------------------------------
def stop_reason(last, called: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished request's last update; `called`: the answer
    called tools (tool_use when it ended by itself, as chat's finish reason tool_calls)."""
    if last.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(last.stop_reason, str):
        return "stop_sequence", last.stop_reason
    return "end_turn", None


def usage(prompt: int, cached: int, output: int) -> dict:
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic's (toolu_...)."""
    return "toolu_" + call_id.removeprefix("call_")


def text_block(text: str = "") -> dict:
    return {"type": "text", "text": text}


def thinking_block(thinking: str = "") -> dict:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call_id: str, name: str, arguments: dict) -> dict:
    return {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": arguments}


def content(parsed: ParsedMessage, thinking: bool) -> list[dict]:
    """A whole answer's content blocks: its thinking (when `thinking` asks for it), its text, a
    tool_use block per call; an answer with none of them is one empty text block."""
    blocks = [thinking_block(parsed.reasoning_content)] if (
        thinking and parsed.reasoning_content) else []
    if parsed.content:
        blocks.append(text_block(parsed.content))
    blocks += [tool_use_block(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    return blocks or [text_block()]


def message(message_id: str, model: str, blocks: list[dict], reason: tuple, use: dict) -> dict:
    """A Message (the whole response, or with no blocks the head message_start carries)."""
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason[0], "stop_sequence": reason[1],
            "usage": use}


def event(name: str, data: dict) -> str:
    """One server-sent event of a Messages stream (`data` typed by its name)."""
    return f"event: {name}\ndata: {json.dumps(dict(type=name, **data))}\n\n"


def stream_head(message_id: str, model: str, use: dict) -> list[str]:
    """A stream's first event: the message (no content, no stop reason yet)."""
    return [event("message_start", {"message": message(message_id, model, [], (None, None),
                                                        use)})]


def stream_tail(reason: tuple, use: dict) -> list[str]:
    """A stream's last events (after its blocks): the stop reason and the whole usage, the end."""
    return [event("message_delta", {"delta": {"stop_reason": reason[0],
                                              "stop_sequence": reason[1]}, "usage": use}),
            event("message_stop", {})]


class BlockStream:
    """A streamed answer's content blocks: the chat path's `MessageDelta`s in (`feed`, then
    `finish`), Anthropic's content_block_start / _delta / _stop events out. A block opens with its
    first piece and closes when a piece of another block comes, or at the end: thinking deltas
    (when `thinking` asks for them), text deltas, and per call a tool_use block (its id and name)
    whose arguments' JSON text comes as input_json_delta pieces. An answer with none is one empty
    text block, as the whole message (`content`)."""

    def __init__(self, thinking: bool):
        self.thinking, self.index, self.kind = thinking, -1, None

    def feed(self, m: MessageDelta) -> list[str]:
        out = []
        if self.thinking and m.reasoning_content:
            out += self.piece("thinking", {"type": "thinking_delta",
                                           "thinking": m.reasoning_content})
        # a delta's text comes after the arguments of a call already open (a call section ends
        # before text follows it) and before the calls it names
        first = next((k for k, c in enumerate(m.tool_calls) if c.name is not None),
                     len(m.tool_calls))
        out += self.calls(m.tool_calls[:first])
        if m.content:
            out += self.piece("text", {"type": "text_delta", "text": m.content})
        return out + self.calls(m.tool_calls[first:])

    def finish(self) -> list[str]:
        return (self.open(text_block()) if self.index < 0 else []) + self.close()

    def calls(self, deltas) -> list[str]:
        out = []
        for c in deltas:
            if c.name is not None:
                out += self.open(tool_use_block(c.id, c.name, {}))
            if c.arguments:
                out.append(self.delta({"type": "input_json_delta", "partial_json": c.arguments}))
        return out

    def piece(self, kind: str, delta: dict) -> list[str]:
        """A thinking or text delta, in a block of its kind (opened if another is open)."""
        start = [] if self.kind == kind else self.open(
            thinking_block() if kind == "thinking" else text_block())
        return start + [self.delta(delta)]

    def open(self, block: dict) -> list[str]:
        out = self.close()
        self.index, self.kind = self.index + 1, block["type"]
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"index": self.index})]

    def delta(self, delta: dict) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})
