"""An OpenAI-compatible HTTP front end (FastAPI) over an `AsyncEngine`.

`create_app(...)` serves `POST /v1/completions`, `POST /v1/chat/completions` (streaming with SSE or
not), `GET /v1/models`, `GET /health` and `GET /metrics` (Prometheus text, one registry per app so
two apps in one process never share counters). Requests become `dcp_jax.serving.request.Request`s and
go through the scheduler like any other: validation that the scheduler owns (prompt longer than the
context, a pool too small, stop strings without a tokenizer) comes back from it as an "error" finish
and is answered 400 here. Every error is OpenAI's JSON shape, never a traceback.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
import uuid

from dcp_jax.errors import UserError
from dcp_jax.sampling import SamplingParams, check_seed
from dcp_jax.serving.async_engine import AsyncEngine, QueueFull
from dcp_jax.serving.metrics import Metrics
from dcp_jax.serving.protocol import (
    UNSUPPORTED,
    APIError,
    ChatBody,
    ChatTemplate,
    CompletionBody,
    TextStream,
    RequestBody,
    error_response,
)
from dcp_jax.serving.request import Request

try:
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import PlainTextResponse, StreamingResponse
    from prometheus_client import generate_latest
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError(f"the server needs the 'serve' extra: pip install 'dcp_jax[serve]' ({e})") from None

# --- the app --------------------------------------------------------------------------------------------
def create_app(engine: AsyncEngine, *, model_name: str, max_model_len: int, tokenizer=None,
               chat_template: ChatTemplate | None = None, tp: int = 1, dcp: int = 1) -> FastAPI:
    """The FastAPI app. The app's lifespan starts `engine`'s thread and shuts it down. `tokenizer`
    (a `tokenizers.Tokenizer`-like object, or None) encodes text prompts and decodes outputs."""
    from contextlib import asynccontextmanager

    metrics = Metrics(tp, dcp)
    created = int(time.time())
    ids = itertools.count()

    def on_step(plan, stats):
        metrics.update(stats)

    def on_finish(r: Request):
        metrics.finished.labels(r.finish_reason).inc()

    engine.on_step, engine.on_finish = on_step, on_finish
    metrics.update(engine.stats)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="dcp_jax", lifespan=lifespan)

    @app.middleware("http")
    async def count(request: HTTPRequest, call_next):
        response = await call_next(request)
        if request.url.path.startswith("/v1/") and request.method == "POST":
            metrics.requests.labels(str(response.status_code)).inc()
        return response

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return error_response(400, "the body is not valid JSON", code="invalid_json")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None  # the field; a union's member names follow it
        msg = first.get("msg", "invalid request")
        if first.get("type") == "missing":
            msg = f"missing required field {'.'.join(loc)!r}"
        elif param:
            msg = f"{param}: wrong type or value ({msg})"
        return error_response(400, msg, param=param, code="invalid_type" if first.get("type") != "missing"
                              else "missing_field")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                              else "server_error")

    @app.exception_handler(Exception)
    async def any_error(request, e: Exception):  # never a traceback in a response
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    # --- helpers ---------------------------------------------------------------------------------------
    def encode(text: str, special: bool = True) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: give the prompt as token ids", param="prompt")
        if not special:
            try:
                return list(tokenizer.encode(text, add_special_tokens=False).ids)
            except TypeError:  # a tokenizer without the switch
                pass
        return list(tokenizer.encode(text).ids)

    detokenize = None if tokenizer is None else (lambda t: tokenizer.decode(list(t)))

    def make_request(body: RequestBody, prompt_ids: list[int], default_max: int | None) -> Request:
        if body.model != model_name:
            raise APIError(400, f"the model {body.model!r} does not exist: this server serves {model_name!r}",
                           param="model", code="model_not_found")
        extra = body.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if name in extra and extra[name] is not None and extra[name] != neutral:
                raise APIError(400, f"{name} is not supported by this server", param=name,
                               code="unsupported_parameter")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(prompt_ids) >= max_model_len:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens but the model context is "
                           f"{max_model_len}: shorten it to at most {max_model_len - 1} tokens", param="prompt",
                           code="context_length_exceeded")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            max_tokens = default_max
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        if max_tokens is not None and max_tokens + len(prompt_ids) > max_model_len:
            raise APIError(400, f"max_tokens ({max_tokens}) + the prompt ({len(prompt_ids)} tokens) exceed the "
                           f"model context of {max_model_len} tokens: lower max_tokens", param="max_tokens")
        seed = body.seed if body.seed is not None else random.getrandbits(31)
        if (problem := check_seed(seed)) is not None:
            raise APIError(400, problem, param="seed")
        try:
            sampling = SamplingParams(float(body.temperature), int(body.top_k), float(body.top_p))
        except UserError as e:  # SamplingParams owns these ranges; its message starts with the field
            field = str(e).split()[0]
            raise APIError(400, str(e), param=field if field in ("temperature", "top_k", "top_p") else None) from None
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if stop and tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer", param="stop")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")
        return Request(f"{next(ids)}-{uuid.uuid4().hex[:12]}", prompt_ids, sampling=sampling, seed=seed,
                       max_tokens=max_tokens, ignore_eos=body.ignore_eos, stop=stop,
                       arrival_time=time.monotonic())

    def submit(request: Request) -> asyncio.Queue:
        try:
            return engine.submit(request)
        except QueueFull as e:
            raise APIError(503, str(e), "server_overloaded", code="queue_full") from None

    async def first_update(request: Request, sink: asyncio.Queue):
        """The first update; an error finish becomes a 400 (the scheduler refused the request) or a 503
        (the server failed it, e.g. its KV never arrived from a prefill instance: send it again)."""
        try:
            u = await sink.get()
        except asyncio.CancelledError:
            engine.cancel(request.request_id)
            raise
        if u.finished and u.finish_reason == "error":
            if u.retryable:
                raise APIError(503, u.error or "the request failed on the server", "server_error")
            raise APIError(400, u.error or "the request was refused")
        if u.finished and u.finish_reason == "abort":
            raise APIError(503, u.error or "the request was aborted", "server_error")
        return u

    def observe(request: Request, first_time: float | None, end: float, n: int, prompt: int):
        metrics.prompt_tokens.inc(prompt)
        metrics.generation_tokens.inc(n)
        if first_time is not None:
            metrics.ttft.observe(first_time - request.arrival_time)
            if n > 1:
                metrics.tpot.observe((end - first_time) / (n - 1))

    def usage(prompt: int, n: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}

    def finish_reason(u) -> str:
        return "length" if u.finish_reason == "length" else "stop"

    async def generate(request: Request, sink: asyncio.Queue, first):
        """All updates of a request to its end (non-streaming): (ids, logprobs, last update, first time)."""
        u, out_ids, out_lps, t_first = first, [], [], None
        try:
            while True:
                if u.token_ids and t_first is None:
                    t_first = u.time
                out_ids += u.token_ids
                out_lps += u.logprobs
                if u.finished:
                    break
                u = await sink.get()
        except asyncio.CancelledError:  # the client went away
            engine.cancel(request.request_id)
            raise
        if u.finish_reason not in ("stop", "length"):  # a server-side failure the client may retry: 503
            raise APIError(503 if u.retryable else 500, u.error or f"the request ended with {u.finish_reason}",
                           "server_error")
        observe(request, t_first, u.time, len(out_ids), request.num_prompt_tokens)
        return out_ids, out_lps, u, t_first

    def token_strings(ids: list[int]) -> list[str]:
        return [detokenize([t]) if detokenize else str(t) for t in ids]

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    # --- endpoints -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return error_response(503, f"the engine stopped: {engine.failure}", "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "dcp_jax", "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        metrics.update(engine.stats)
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def parse(http: HTTPRequest, model):
        raw = await http.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the body is not valid JSON", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            return model.model_validate(data)
        except ValidationError as e:  # the same shape as FastAPI's own validation errors
            raise RequestValidationError(e.errors()) from None

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body: CompletionBody = await parse(http, CompletionBody)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "a list of prompts must hold exactly one (batches: send one request each)",
                               param="prompt", code="unsupported_parameter")
            p = p[0]
        prompt_ids = encode(p) if isinstance(p, str) else list(p)
        if body.logprobs is not None and not 0 <= body.logprobs <= 1:
            # the engine samples on the device and returns the chosen token's logprob only
            raise APIError(400, f"logprobs must be 0 or 1 (the chosen token's logprob; top alternatives are not "
                           f"supported), got {body.logprobs}", param="logprobs", code="unsupported_parameter")
        request = make_request(body, prompt_ids, 16)
        sink = submit(request)
        first = await first_update(request, sink)
        rid = f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        want_lp = body.logprobs is not None

        def lp_block(ids, lps, offset0=0):
            if not want_lp:
                return None
            toks = token_strings(ids)
            offsets = list(itertools.accumulate([len(t) for t in toks[:-1]], initial=offset0)) if toks else []
            return {"tokens": toks, "token_logprobs": [float(x) for x in lps], "top_logprobs": None,
                    "text_offset": offsets}

        def chunk(delta, u, reason):
            return dict(base, choices=[{"index": 0, "text": delta, "logprobs": lp_block(u.token_ids, u.logprobs),
                                        "finish_reason": reason}])

        def choice(text, ids, lps):
            return {"index": 0, "text": text, "logprobs": lp_block(ids, lps)}

        return await respond(body, request, sink, first, base, base, chunk, choice)

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        body: ChatBody = await parse(http, ChatBody)
        if chat_template is None:
            raise APIError(400, "this model has no chat template (tokenizer_config.json has no chat_template): "
                           "use /v1/completions", param="messages", code="no_chat_template")
        messages = []
        for m in body.messages:
            content = m.content
            if isinstance(content, list):
                if any(part.get("type") != "text" for part in content):
                    raise APIError(400, "only text content parts are supported", param="messages")
                content = "".join(str(part.get("text", "")) for part in content)
            messages.append({"role": m.role, "content": content or ""})
        prompt_ids = encode(chat_template.render(messages), special=False)
        request = make_request(body, prompt_ids, None)
        sink = submit(request)
        first = await first_update(request, sink)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}

        def lp_block(ids, lps):
            if not body.logprobs:
                return None
            return {"content": [{"token": t, "logprob": float(x), "bytes": list(t.encode()), "top_logprobs": []}
                                for t, x in zip(token_strings(ids), lps)]}

        cbase = dict(base, object="chat.completion.chunk")
        started = []

        def chunk(delta, u, reason):
            d = {} if reason is not None and not delta else {"content": delta}
            if not started:  # the first chunk names the role, as OpenAI's do
                started.append(True)
                d = {"role": "assistant", "content": delta}
            return dict(cbase, choices=[{"index": 0, "delta": d, "logprobs": lp_block(u.token_ids, u.logprobs),
                                         "finish_reason": reason}])

        def choice(text, ids, lps):
            return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp_block(ids, lps)}

        return await respond(body, request, sink, first, base, cbase, chunk, choice)

    async def respond(body, request: Request, sink: asyncio.Queue, first, base: dict, chunk_base: dict,
                      make_chunk, make_choice):
        """The tail both endpoints share: a server-sent-event stream of `make_chunk` chunks, or the
        whole response (one `make_choice` choice with its finish reason, and usage)."""
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return StreamingResponse(stream_with(request, sink, first, make_chunk, include_usage, chunk_base),
                                     media_type="text/event-stream")
        out_ids, out_lps, last, _ = await generate(request, sink, first)
        text = (last.text if last.text is not None else detokenize(out_ids)) if detokenize else ""
        return dict(base, choices=[dict(make_choice(text, out_ids, out_lps), finish_reason=finish_reason(last))],
                    usage=usage(request.num_prompt_tokens, len(out_ids)))

    async def stream_with(request: Request, sink: asyncio.Queue, first, make_chunk, include_usage: bool, base):
        """SSE: one chunk per update (tokens as they come), the finish, usage if asked, then [DONE]. A
        client that disconnects cancels the request, which frees its pages at once."""
        text = TextStream(detokenize, request.stop)
        u, ids_so_far, t_first, done = first, [], None, False
        try:
            while True:
                if u.token_ids and t_first is None:
                    t_first = u.time
                ids_so_far += u.token_ids
                delta = text.delta(ids_so_far, u.text, u.finished)
                if u.finished:
                    if u.finish_reason not in ("stop", "length"):
                        yield sse({"error": {"message": u.error or f"the request ended with {u.finish_reason}",
                                             "type": "server_error", "param": None, "code": None}})
                        break
                    yield sse(make_chunk(delta, u, finish_reason(u)))
                    observe(request, t_first, u.time, len(ids_so_far), request.num_prompt_tokens)
                    if include_usage:
                        yield sse(dict(base, choices=[], usage=usage(request.num_prompt_tokens, len(ids_so_far))))
                    break
                yield sse(make_chunk(delta, u, None))
                u = await sink.get()
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                engine.cancel(request.request_id)

    return app

