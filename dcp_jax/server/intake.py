"""Where an HTTP request becomes a `Request`: every check a request meets before the engine sees it.

The event loop only waits: the body is read under a size limit (`max_request_bytes`, 413 past
it), JSON is parsed, tokenized and chat templates rendered on worker threads, and a text prompt
whose characters could not fit the context even at the tokenizer's longest token is refused before
it is tokenized at all. Malformed-but-valid JSON (a lone UTF-16 surrogate, nesting too deep to
parse) is a 400, as is every value out of range (`SamplingParams`, `check_seed` and
`Request.problem` own those; the 400's `param` is the field a UserError names) and every parameter
this server does not implement (refused by name, never silently ignored).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import time
import uuid

from dcp_jax.errors import UserError
from dcp_jax.penalties import bad_words_ids
from dcp_jax.sampling import MAX_TOP_LOGPROBS, SamplingParams, check_seed
from dcp_jax.server.protocol import UNSUPPORTED, APIError, RequestBody
from dcp_jax.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from dcp_jax.serving.request import Request, make_requests

try:
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
MAX_N = 16  # samples one request may ask for (`n`)


def check_strings(data) -> None:
    """APIError when a string anywhere in the parsed body is not valid Unicode (a lone surrogate
    such as "\\ud800" is valid JSON but encodes to no UTF-8). Iterative: nesting depth costs no
    recursion."""
    todo = [data]
    while todo:
        x = todo.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "the body holds a string with a lone UTF-16 surrogate "
                               "(e.g. \\ud800): send valid Unicode",
                               code="invalid_unicode") from None
        elif isinstance(x, dict):
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object (on a worker thread: a large body never holds the event loop)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the body's JSON is nested too deeply to parse",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    check_strings(data)
    return data


class Intake:
    """Turns request bodies into `Request`s for one served model."""

    def __init__(self, *, model_name: str, max_model_len: int, tokenizer=None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES):
        self.model_name, self.max_model_len, self.tokenizer = model_name, max_model_len, tokenizer
        self.max_request_bytes = max_request_bytes
        self.ids = itertools.count()
        # the most characters one token can stand for: a text prompt longer than this many per token
        # of the context cannot fit, whatever it tokenizes to
        has_vocab = tokenizer is not None and hasattr(tokenizer, "get_vocab")
        vocab = tokenizer.get_vocab() if has_vocab else None
        self.max_token_chars = max((len(t) for t in vocab), default=1) if vocab else 4

    # --- the body ---
    async def body(self, http, model: type[RequestBody]) -> RequestBody:
        """Read (bounded), parse (off the loop) and validate the body as `model`."""
        length = http.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_request_bytes:
            raise self.too_large()
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > self.max_request_bytes:
                raise self.too_large()
            chunks.append(chunk)
        data = await asyncio.to_thread(parse_json, b"".join(chunks))
        try:
            return await asyncio.to_thread(model.model_validate, data)
        except ValidationError as e:  # the same shape as FastAPI's own validation errors
            raise RequestValidationError(e.errors()) from None

    def too_large(self) -> APIError:
        return APIError(413, "the body is larger than this server's limit of "
                        f"{self.max_request_bytes:,} bytes (--max-request-bytes)",
                        code="request_too_large")

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            shown = name if len(name) <= 64 else name[:61] + "..."
            raise APIError(404, f"the model {shown!r} does not exist: this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    # --- the prompt ---
    def check_chars(self, text: str | int, param: str = "prompt") -> None:
        """Refuse text (or so many characters) that cannot fit the context even if every token
        were the longest one."""
        n = text if isinstance(text, int) else len(text)
        if n > self.max_token_chars * (self.max_model_len - 1):
            raise APIError(400, f"the prompt has {n:,} characters, more than "
                           f"{self.max_model_len - 1:,} tokens of this tokenizer can hold (the "
                           f"model context is {self.max_model_len}): shorten it", param=param,
                           code="context_length_exceeded")

    async def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`, tokenized on a worker thread after the character bound."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: give the prompt as token ids",
                           param="prompt")
        self.check_chars(text)
        return await asyncio.to_thread(self.tokenize, text, special)

    def tokenize(self, text: str, special: bool) -> list[int]:
        if not special:
            try:
                return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
            except TypeError:  # a tokenizer without the switch
                pass
        return list(self.tokenizer.encode(text).ids)

    async def render(self, template, messages: list[dict], add_generation_prompt: bool = True,
                     **options) -> str:
        """The chat template rendered on a worker thread (after a bound on the characters of the
        messages and the other `options`: `ChatTemplate.render`'s keywords and the template's
        variables, such as tools)."""
        self.check_chars(len(json.dumps([messages, options], ensure_ascii=False)),
                         param="messages")
        return await asyncio.to_thread(template.render, messages, add_generation_prompt,
                                       **options)

    # --- the request ---
    def requests(self, body: RequestBody, prompt_ids: list[int], default_max: int | None,
                 top_logprobs: tuple[str, int] = ("logprobs", 0),
                 echo_logprobs: int | None = None,
                 structured: tuple[dict, str] | None = None) -> list[Request]:
        """The `n` requests (samples) of a validated body: sample j has seed + j and follows
        sample 0 (whose prefill the others share); APIError (400) names the first bad field.
        `top_logprobs`: (the field that asked, how many alternatives each token reports);
        `echo_logprobs`: completions' echo with logprobs N (the prompt's tokens are scored with N
        alternatives; max_tokens 0 allowed: one token is generated, which the endpoint leaves
        out); `structured`: (spec, field) the endpoint constrains the output with (a required
        tool call), refused beside the body's own structured output."""
        if not 1 <= body.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {body.n}", param="n")
        check_supported(body)
        max_tokens = self.check_lengths(body, prompt_ids, default_max)
        seed = body.seed if body.seed is not None else random.getrandbits(31)
        if (problem := check_seed(seed)) is not None:
            raise APIError(400, problem, param="seed")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs is not supported with stream: true",
                           param="prompt_logprobs")
        sampling = self.sampling(body, top_logprobs, echo_logprobs, structured,
                                 max_tokens=max_tokens, seed=seed)
        stop = self.stop_strings(body)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        # (the one place a SamplingParams becomes Requests, as for LLM.generate and the CLI)
        return make_requests(f"{next(self.ids)}-{uuid.uuid4().hex[:12]}", prompt_ids,
                             dataclasses.replace(sampling, stop=stop),
                             arrival_time=time.monotonic())

    def check_lengths(self, body: RequestBody, prompt_ids: list[int], default_max: int | None):
        """The prompt, max_tokens and min_tokens against the context: the max_tokens to use."""
        cap, n_prompt = self.max_model_len, len(prompt_ids)
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if n_prompt >= cap:
            raise APIError(400, f"the prompt has {n_prompt} tokens but the model context is {cap}: "
                           f"shorten it to at most {cap - 1} tokens", param="prompt",
                           code="context_length_exceeded")
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
        if max_tokens is None:
            max_tokens = default_max
        if max_tokens == 0 and getattr(body, "echo", False):
            max_tokens = 1  # scoring the prompt alone (the endpoint drops the one token generated)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        if max_tokens is not None and max_tokens + n_prompt > cap:
            raise APIError(400, f"max_tokens ({max_tokens}) + the prompt ({n_prompt} tokens) "
                           f"exceed the model context of {cap} tokens: lower max_tokens",
                           param="max_tokens")
        if body.min_tokens < 0 or (max_tokens is not None and body.min_tokens > max_tokens):
            raise APIError(400, f"min_tokens must be in [0, max_tokens], got {body.min_tokens}",
                           param="min_tokens")
        return max_tokens

    def sampling(self, body: RequestBody, top_logprobs: tuple[str, int],
                 echo_logprobs: int | None, endpoint: tuple[dict, str] | None = None,
                 **given) -> SamplingParams:
        """The body's SamplingParams (which owns the ranges), read by field name
        (`SamplingParams.from_fields`), with `given` (the max_tokens and seed intake settled) and
        what the body names otherwise; its UserError is a 400 naming the field."""
        scored = [k for k in (body.prompt_logprobs, echo_logprobs) if k is not None]
        structured, structured_field = structured_of(body)
        if endpoint is not None and structured is not None:
            raise APIError(400, f"{endpoint[1]} constrains the answer already: drop "
                           f"{structured_field}", param=structured_field)
        if endpoint is not None:
            structured, structured_field = endpoint
        if body.bad_words and self.tokenizer is None:
            raise APIError(400, "bad_words need a tokenizer", param="bad_words")
        try:
            words = (bad_words_ids(lambda text: self.tokenize(text, False), body.bad_words)
                     if body.bad_words else ())
            return SamplingParams.from_fields(
                body, **given, top_logprobs=top_logprobs[1], logit_bias=body.logit_bias or (),
                bad_words=(), bad_words_ids=words, stop=(),
                stop_token_ids=tuple(body.stop_token_ids or ()),
                prompt_logprobs=max(scored) if scored else None, structured=structured)
        except UserError as e:  # the error names its field
            raise sampling_error(e, top_logprobs, structured_field) from None

    def stop_strings(self, body: RequestBody) -> tuple[str, ...]:
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if len(stop) > MAX_STOP_STRINGS or any(not 0 < len(s) <= MAX_STOP_CHARS for s in stop):
            raise APIError(400, f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at "
                           f"most {MAX_STOP_CHARS} characters each", param="stop")
        if stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer", param="stop")
        return stop


def check_supported(body: RequestBody) -> None:
    """Refuse, by name, a parameter this server does not implement set to anything but neutral."""
    extra = body.model_extra or {}
    for name, neutral in UNSUPPORTED.items():
        if name in extra and extra[name] is not None and extra[name] != neutral:
            raise APIError(400, f"{name} is not supported by this server", param=name,
                           code="unsupported_parameter")


# SamplingParams' arguments named as the request's fields (the rest have the same names)
SAMPLING_FIELDS = {"bad_words_ids": "bad_words"}
KNOWN_FIELDS = ("temperature", "top_k", "top_p", "top_logprobs", "min_p", "logit_bias",
                "allowed_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "bad_words", "prompt_logprobs", "structured")


def sampling_field(e: UserError) -> str | None:
    """The SamplingParams argument a UserError concerns: its `field`; failing that (an error raised
    without one, e.g. by a check not yet given its field) the message's first word when that names
    an argument."""
    if e.field is not None:
        return SAMPLING_FIELDS.get(e.field, e.field)
    words = str(e).split()
    return words[0] if words and words[0] in KNOWN_FIELDS else None


def sampling_error(e: UserError, top_logprobs: tuple[str, int],
                   structured_field: str | None) -> APIError:
    """The 400 of a value SamplingParams refused, its `param` the request field it concerns:
    top_logprobs is the field that asked for them (completions' logprobs), structured the field that
    gave the structured output."""
    field, n_top = top_logprobs
    name = sampling_field(e)
    if name == "top_logprobs":
        return APIError(400, f"{field} must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                        f"got {n_top!r}", param=field)
    return APIError(400, str(e), param=structured_field if name == "structured" else name)


def structured_of(body: RequestBody) -> tuple[dict | None, str | None]:
    """The body's structured output as `LLM.generate`'s `structured=` dict, and the field that gave
    it: response_format (OpenAI's), structured_outputs (vLLM's) or a guided_* field (vLLM's older
    names); at most one of them. APIError (400) names a malformed one."""
    given = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            schema = (rf.get("json_schema") or {}).get("schema")
            if schema is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema",
                               param="response_format")
            given.append(("response_format", {"json": schema}))
        elif kind != "text":
            raise APIError(400, "response_format type must be text, json_object or json_schema, "
                           f"got {kind!r}", param="response_format")
    if body.structured_outputs is not None:
        given.append(("structured_outputs", dict(body.structured_outputs)))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}")
        if value is not None:
            given.append((f"guided_{kind}", {kind: value}))
    if len(given) > 1:
        names = " and ".join(f for f, _ in given)
        raise APIError(400, f"give one structured output, not {names}", param=given[1][0])
    return (given[0][1], given[0][0]) if given else (None, None)
