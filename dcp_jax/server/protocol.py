"""The OpenAI wire protocol of the server: request bodies (strict pydantic models), the error shape,
the parameters refused by name, chat templates rendered as transformers renders them, and text
deltas for streaming. No engine here: `dcp_jax.server` joins these to an engine client.
"""

from __future__ import annotations

import json
import re
from typing import Any

try:
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError(f"the server needs the 'serve' extra: pip install 'dcp_jax[serve]' ({e})") from None

# Parameters of OpenAI's API, and vLLM's extensions, that this server does not implement: a request
# that sets one to anything but its neutral value is refused (400, by name) rather than silently
# answered differently. (vLLM's stop_token_ids, min_tokens, min_p, logit_bias, allowed_token_ids,
# the presence, frequency and repetition penalties, bad_words, prompt_logprobs,
# include_stop_str_in_output, skip_special_tokens, ignore_eos and the structured outputs
# (response_format, structured_outputs, guided_*) are implemented: fields of RequestBody;
# completions' echo too: only chat's is refused here; chat's tools, tool_choice and
# parallel_tool_calls are fields of ChatBody, read by dcp_jax.agents. The older functions and
# function_call are refused: send tools.)
UNSUPPORTED = {"best_of": 1, "echo": False, "suffix": None, "functions": None,
               "function_call": None, "prediction": None, "audio": None,
               "modalities": None,
               # vLLM's sampling and structured-output extensions
               "length_penalty": 1, "use_beam_search": False, "logits_processors": None,
               "truncate_prompt_tokens": None, "guided_decoding_backend": None, "guided_whitespace_pattern": None,
               "spaces_between_special_tokens": True, "priority": 0}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def authorized(header: str | None, api_key: str | None, x_api_key: str | None = None) -> bool:
    """Whether an Authorization header carries `Bearer <api_key>`, or an x-api-key header (what
    Anthropic's clients send) `<api_key>` (always, without a key); constant time."""
    import hmac

    def same(given: str | None, want: str) -> bool:
        return hmac.compare_digest((given or "").encode(), want.encode())

    return api_key is None or (same(header, f"Bearer {api_key}") | same(x_api_key, api_key))


def unauthorized():
    return error_response(401, "a valid API key is needed: send Authorization: Bearer <key>", code="invalid_api_key")


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers={"Retry-After": "1"} if status == 503 else None)


def validation_error(errors: list[dict]) -> APIError:
    """The 400 of a body pydantic refused (FastAPI's RequestValidationError.errors()), naming the
    field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, "the body is not valid JSON", code="invalid_json")
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None  # the field; a union's member names follow it
    msg = first.get("msg", "invalid request")
    if first.get("type") == "missing":
        msg = f"missing required field {'.'.join(loc)!r}"
    elif param:
        msg = f"{param}: wrong type or value ({msg})"
    return APIError(400, msg, param=param, code="invalid_type" if first.get("type") != "missing"
                    else "missing_field")


def vllm_prompt_logprobs(request, n: int | None, token_strings):
    """vLLM's prompt_logprobs of a request whose prefill is done: per prompt token (None for the
    first), a dict from token id to {logprob, rank, decoded_token} for the token itself and its n
    most likely alternatives (ranks 1..n); None when not asked. `token_strings(ids)`: each id's
    text."""
    scores = request.prompt_scores() if n is not None else None
    if scores is None:
        return None
    out = [None]
    for tok, lp, rank, alts in zip(request.prompt_token_ids[1:], *(x[1:] for x in scores)):
        entry = {str(i): {"logprob": x, "rank": k + 1, "decoded_token": s}
                 for k, ((i, x), s) in enumerate(zip(alts[:n], token_strings([i for i, _ in alts[:n]])))}
        entry.setdefault(str(tok), {"logprob": lp, "rank": rank, "decoded_token": token_strings([tok])[0]})
        out.append(entry)
    return out


# --- request bodies (strict: a wrong type is a 400, not a silent coercion) ------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    include_usage: bool = False  # strict: "yes" is a 400, not true


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    n: int = 1
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's extensions
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    # OpenAI's: token id (a string key) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # structured outputs: OpenAI's response_format ({"type": "json_object"} or {"type":
    # "json_schema", "json_schema": {"schema": ...}}), vLLM's structured_outputs ({"json" | "regex"
    # | "choice" | "grammar" | "json_object": ...}) and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class CompletionBody(RequestBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the prompt before the completion (and its tokens' logprobs with logprobs)


class ChatMessage(BaseModel):
    """One message (its other keys are refused by name: `dcp_jax.agents.template_messages`)."""
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's
    reasoning_content: str | None = None  # an assistant's thinking, for templates that show it


class ChatBody(RequestBody):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    # tools (dcp_jax.agents checks them: the function names, the choice against them)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered by the chat template
    first."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered with the messages
    # default: True for a prompt, False for messages (as vLLM)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    """vLLM's /detokenize."""
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """The messages as OpenAI-shaped dicts (what `dcp_jax.agents.plan_chat` takes)."""
    return [m.model_dump(exclude_none=True) for m in messages]


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The template's view of the messages (`dcp_jax.agents.template_messages`: text content,
    tool calls and results)."""
    from dcp_jax.agents.messages import template_messages

    return template_messages(message_dicts(messages))


# --- text deltas ----------------------------------------------------------------------------------
class TextStream:
    """Turns cumulative token ids into text deltas whose concatenation is the final text: it holds
    back an incomplete UTF-8 character and any tail that could begin a stop string (the scheduler
    cuts the final text before a stop string, so what was sent must never include part of one)."""

    def __init__(self, detokenize, stop: tuple[str, ...]):
        self.detokenize, self.stop, self.sent = detokenize, stop, ""

    def delta(self, ids: list[int], final_text: str | None = None, finished: bool = False) -> str:
        if self.detokenize is None:
            return ""
        text = final_text if finished and final_text is not None else self.detokenize(ids)
        if not finished:
            text = text.rstrip("\ufffd")
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        # a detokenizer rewrote earlier text: send only what extends
        if not text.startswith(self.sent):
            return ""
        out, self.sent = text[len(self.sent):], text
        return out


# --- a token's bytes ------------------------------------------------------------------------------
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character that stands for each
    byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """The bytes one token stands for (OpenAI's `logprobs.content[].bytes`): its own bytes, also for
    a token holding part of a UTF-8 character, where its decoded text would be U+FFFD."""

    BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer):
        self.tokenizer, self.alphabet = tokenizer, None
        spec = tokenizer.to_str() if hasattr(tokenizer, "to_str") else ""
        self.bytes_vocab = spec == "bytes"  # dcp_jax's ByteTokenizer: the id is the byte
        if not self.bytes_vocab:
            try:
                decoder = json.dumps(json.loads(spec).get("decoder"))
            except (ValueError, AttributeError):
                decoder = ""
            if '"ByteLevel"' in decoder:
                self.alphabet = byte_level_alphabet()

    def __call__(self, token_id: int, text: str) -> list[int]:
        if self.bytes_vocab:
            return [token_id] if 0 <= token_id < 256 else []
        piece = self.tokenizer.id_to_token(token_id) if hasattr(self.tokenizer, "id_to_token") else None
        if piece is not None and self.alphabet is not None and all(c in self.alphabet for c in piece):
            return [self.alphabet[c] for c in piece]
        if piece is not None and (m := self.BYTE_FALLBACK.fullmatch(piece)):
            return [int(m.group(1), 16)]
        return list(text.encode("utf-8"))
