"""An OpenAI-compatible HTTP front end (FastAPI) over an `AsyncEngine`.

`create_app(...)` serves `POST /v1/completions`, `POST /v1/chat/completions` (streaming with SSE or
not), `GET /v1/models`, vLLM's `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` (what
lm-eval's remote tokenizer reads), `GET /health` and `GET /metrics` (Prometheus text, one registry per
app so two apps in one process never share counters). Requests become `dcp_jax.serving.request.Request`s and
go through the scheduler like any other: validation that the scheduler owns (prompt longer than the
context, a pool too small, stop strings without a tokenizer) comes back from it as an "error" finish
and is answered 400 here. Every error is OpenAI's JSON shape, never a traceback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import time
import uuid

from dcp_jax.serving.async_engine import AsyncEngine, QueueFull
from dcp_jax.serving.intake import DEFAULT_MAX_REQUEST_BYTES, Intake
from dcp_jax.serving.metrics import Metrics
from dcp_jax.serving.protocol import (APIError, ChatBody, ChatTemplate, CompletionBody, DetokenizeBody, TextStream,
                                      TokenBytes, TokenizeBody, authorized, chat_messages, error_response,
                                      unauthorized, validation_response, vllm_prompt_logprobs)
from dcp_jax.serving.request import Request

try:
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import PlainTextResponse, StreamingResponse
    from prometheus_client import generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError(f"the server needs the 'serve' extra: pip install 'dcp_jax[serve]' ({e})") from None

# --- the app --------------------------------------------------------------------------------------------
def create_app(engine: AsyncEngine, *, model_name: str, max_model_len: int, tokenizer=None,
               chat_template: ChatTemplate | None = None, tp: int = 1, dcp: int = 1, api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app. The app's lifespan starts `engine`'s thread and shuts it down. `tokenizer`
    (a `tokenizers.Tokenizer`-like object, or None) encodes text prompts and decodes outputs. With
    `api_key`, every /v1 route answers 401 unless the request carries `Authorization: Bearer <key>`."""
    from contextlib import asynccontextmanager

    metrics = Metrics(tp, dcp)
    created = int(time.time())
    intake = Intake(model_name=model_name, max_model_len=max_model_len, tokenizer=tokenizer,
                    max_request_bytes=max_request_bytes)

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
        guarded = request.url.path.startswith("/v1") or request.url.path in ("/tokenize", "/detokenize",
                                                                               "/tokenizer_info")
        if guarded and not authorized(request.headers.get("authorization"), api_key):
            metrics.requests.labels("401").inc()
            return unauthorized()
        response = await call_next(request)
        if request.url.path.startswith("/v1/") and request.method == "POST":
            metrics.requests.labels(str(response.status_code)).inc()
        return response

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        return validation_response(e.errors())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                              else "server_error")

    @app.exception_handler(Exception)
    async def any_error(request, e: Exception):  # never a traceback in a response
        return error_response(500, f"internal error: {type(e).__name__}", "server_error")

    # --- helpers ---------------------------------------------------------------------------------------
    detokenize = None if tokenizer is None else (
        lambda ids, skip_special_tokens=True: tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
    token_bytes = None if tokenizer is None else TokenBytes(tokenizer)
    vocab_size = engine.engine.scheduler.config.vocab_size or (
        tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else 2**31)

    def submit(request: Request) -> asyncio.Queue:
        try:
            return engine.submit(request)
        except QueueFull as e:
            raise APIError(503, str(e), "server_overloaded", code="queue_full") from None

    async def disconnected(http: HTTPRequest) -> None:
        """Returns when the client goes away (its body was read already: the next message is that)."""
        while (await http.receive())["type"] != "http.disconnect":
            pass

    async def next_update(http: HTTPRequest, request: Request, sink: asyncio.Queue):
        """The request's next update; a client that goes away meanwhile cancels it (its pages are freed
        at once) and ends the handler."""
        get, gone = asyncio.ensure_future(sink.get()), asyncio.ensure_future(disconnected(http))
        try:
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                return get.result()
            raise asyncio.CancelledError("the client went away")
        except asyncio.CancelledError:
            engine.cancel(request.request_id)
            raise
        finally:
            get.cancel()
            gone.cancel()

    async def first_update(http: HTTPRequest, request: Request, sink: asyncio.Queue):
        """The first update; an error finish becomes a 400 (the scheduler refused the request) or a 503
        (the server failed it, e.g. its KV never arrived from a prefill instance: send it again)."""
        u = await next_update(http, request, sink)
        if u.finished and u.finish_reason == "error":
            if u.retryable:
                raise APIError(503, u.error or "the request failed on the server", "server_error")
            raise APIError(400, u.error or "the request was refused")
        if u.finished and u.finish_reason == "abort":
            raise APIError(503, u.error or "the request was aborted", "server_error")
        return u

    def observe(request: Request, first_time: float | None, end: float, n: int, prompt: int):
        metrics.observe(request.arrival_time, first_time, end, n, prompt)

    def usage(prompt: int, n: int) -> dict:
        return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}

    def finish_reason(u) -> str:
        return "length" if u.finish_reason == "length" else "stop"

    async def generate(http: HTTPRequest, request: Request, sink: asyncio.Queue, first):
        """All updates of a request to its end (non-streaming): (ids, logprobs and top logprobs per token,
        last update, first time). A client that disconnects meanwhile cancels the request."""
        u, out_ids, out_lps, t_first = first, [], ([], []), None
        while True:
            if u.token_ids and t_first is None:
                t_first = u.time
            out_ids += u.token_ids
            out_lps[0].extend(u.logprobs)
            out_lps[1].extend(u.top_logprobs)
            if u.finished:
                break
            u = await next_update(http, request, sink)
        if u.finish_reason not in ("stop", "length"):  # a server-side failure the client may retry: 503
            raise APIError(503 if u.retryable else 500, u.error or f"the request ended with {u.finish_reason}",
                           "server_error")
        observe(request, t_first, u.time, len(out_ids), request.num_prompt_tokens)
        return out_ids, out_lps, u, t_first

    def token_strings(ids: list[int]) -> list[str]:
        return [detokenize([t]) if detokenize else str(t) for t in ids]

    def prompt_logprobs(request: Request, n: int | None):
        return vllm_prompt_logprobs(request, n, token_strings)

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    # --- endpoints -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return error_response(503, f"the engine stopped: {engine.failure}", "server_error")
        return {"status": "ok"}

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "dcp_jax",
            "max_model_len": max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        intake.check_model(model_id)
        return card

    @app.get("/metrics")
    async def prometheus():
        metrics.update(engine.stats)
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        """vLLM's: the ids (and, asked, the token strings) of a prompt or of chat messages as templated."""
        body: TokenizeBody = await intake.body(http, TokenizeBody)
        if body.model is not None:
            intake.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            if chat_template is None:
                raise APIError(400, "this model has no chat template: tokenize a prompt instead", param="messages",
                               code="no_chat_template")
            text = await intake.render(chat_template, chat_messages(body.messages), body.add_generation_prompt)
            ids = await intake.encode(text, special=bool(body.add_special_tokens))
        else:
            ids = await intake.encode(body.prompt, special=body.add_special_tokens is not False)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                "token_strs": token_strings(ids) if body.return_token_strs else None}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: the special tokens (as text), the chat template and the context length."""
        if detokenize is None:
            raise APIError(400, "this model has no tokenizer", code="no_tokenizer")

        def text(ids):
            return detokenize(ids[:1], skip_special_tokens=False) if ids else None

        eos = text(list(engine.engine.scheduler.config.eos_token_ids))
        return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": max_model_len, "eos_token": eos,
                "bos_token": chat_template.bos_token or None if chat_template else None, "pad_token": None,
                "chat_template": chat_template.source if chat_template else None}

    @app.post("/detokenize")
    async def detokenize_ids(http: HTTPRequest):
        """vLLM's: the text of token ids."""
        body: DetokenizeBody = await intake.body(http, DetokenizeBody)
        if body.model is not None:
            intake.check_model(body.model)
        if detokenize is None:
            raise APIError(400, "this model has no tokenizer: there is no text for its ids", param="tokens")
        if bad := [t for t in body.tokens if not 0 <= t < vocab_size]:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", param="tokens")
        return {"prompt": await asyncio.to_thread(detokenize, body.tokens)}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body: CompletionBody = await intake.body(http, CompletionBody)
        intake.check_model(body.model)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "a list of prompts must hold exactly one (batches: send one request each)",
                               param="prompt", code="unsupported_parameter")
            p = p[0]
        prompt_ids = await intake.encode(p) if isinstance(p, str) else list(p)
        want_lp = body.logprobs is not None
        requests = intake.requests(body, prompt_ids, 16, ("logprobs", body.logprobs or 0),
                                   echo_logprobs=body.logprobs if body.echo and want_lp else None)
        rid = f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}
        offset = [0] * len(requests)  # text_offset runs on across chunks
        echoed: set[int] = set()  # choices whose prompt went out (echo: before their first tokens)
        if body.echo:
            prompt_text = (p if isinstance(p, str) else detokenize(prompt_ids) if detokenize else "")

        def alternatives(alts):
            return {s: x for s, (_, x) in zip(token_strings([i for i, _ in alts]), alts)}

        def lp_block(j, ids, lps, tops, head=None):
            if not want_lp:
                return None
            toks, lps = token_strings(ids), [float(x) for x in lps]
            top = [alternatives(alts) for alts in tops] if body.logprobs else None
            if head is not None:  # echo: the prompt's tokens first (the first has no logprob)
                p_lps, _, p_tops = head
                toks, lps = token_strings(prompt_ids) + toks, p_lps + lps
                if top is not None:
                    top = [None if alts is None else alternatives(alts) for alts in p_tops] + top
            offsets = list(itertools.accumulate([len(t) for t in toks], initial=offset[j]))
            offset[j] = offsets.pop()
            return {"tokens": toks, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}

        def head(j):
            """echo: the prompt text and its scores, once per choice (its first chunk)."""
            if not body.echo or j in echoed:
                return "", None
            echoed.add(j)
            return prompt_text, requests[0].prompt_scores() or ([None] * len(prompt_ids), None,
                                                                 [None] * len(prompt_ids))

        def chunk(j, delta, u, reason):
            text, scores = head(j)
            return dict(base, choices=[{"index": j, "text": text + delta, "finish_reason": reason,
                                        "logprobs": lp_block(j, u.token_ids, u.logprobs, u.top_logprobs, scores)}])

        def choice(j, text, ids, lps):
            echo_text, scores = head(j)
            return {"index": j, "text": echo_text + text, "logprobs": lp_block(j, ids, *lps, head=scores),
                    "prompt_logprobs": prompt_logprobs(requests[0], body.prompt_logprobs)}

        # echo with max_tokens 0 scores the prompt alone: the one token generated is left out
        return await respond(http, body, requests, base, base, chunk, choice,
                             keep_output=not (body.echo and body.max_tokens == 0))

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        body: ChatBody = await intake.body(http, ChatBody)
        intake.check_model(body.model)
        if chat_template is None:
            raise APIError(400, "this model has no chat template (tokenizer_config.json has no chat_template): "
                           "use /v1/completions", param="messages", code="no_chat_template")
        prompt_ids = await intake.encode(await intake.render(chat_template, chat_messages(body.messages)),
                                         special=False)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        requests = intake.requests(body, prompt_ids, None, ("top_logprobs", body.top_logprobs or 0))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name}

        def alternatives(alts):
            return [{"token": s, "logprob": x, "bytes": token_bytes(i, s)}
                    for (i, x), s in zip(alts, token_strings([i for i, _ in alts]))]

        def lp_block(ids, lps, tops):
            if not body.logprobs:
                return None
            tops = tops or [[]] * len(ids)
            return {"content": [{"token": t, "logprob": float(x), "bytes": token_bytes(i, t),
                                 "top_logprobs": alternatives(alts)}
                                for i, t, x, alts in zip(ids, token_strings(ids), lps, tops)]}

        cbase = dict(base, object="chat.completion.chunk")
        started = set()

        def chunk(j, delta, u, reason):
            d = {} if reason is not None and not delta else {"content": delta}
            if j not in started:  # a choice's first chunk names the role, as OpenAI's do
                started.add(j)
                d = {"role": "assistant", "content": delta}
            return dict(cbase, choices=[{"index": j, "delta": d, "finish_reason": reason,
                                         "logprobs": lp_block(u.token_ids, u.logprobs, u.top_logprobs)}])

        def choice(j, text, ids, lps):
            return {"index": j, "message": {"role": "assistant", "content": text}, "logprobs": lp_block(ids, *lps)}

        out = await respond(http, body, requests, base, cbase, chunk, choice)
        if body.prompt_logprobs is not None:  # (never with stream: the intake refuses it)
            out["prompt_logprobs"] = prompt_logprobs(requests[0], body.prompt_logprobs)
        return out

    async def respond(http: HTTPRequest, body, requests: list[Request], base: dict, chunk_base: dict, make_chunk,
                      make_choice, keep_output: bool = True):
        """The tail both endpoints share, for the request's n samples (choice j = sample j): submitted
        together, then a server-sent-event stream of `make_chunk(j, ...)` chunks, or the whole response
        (each `make_choice(j, ...)` with its finish reason, and usage over all). An error (or a client
        that goes away) before the end cancels every sample. Without `keep_output` the tokens generated
        are left out (echo with max_tokens 0)."""
        sinks, firsts, ok = [], [], False
        try:
            sinks += [submit(r) for r in requests]
            for r, sink in zip(requests, sinks):
                firsts.append(await first_update(http, r, sink))
            if body.stream:
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                ok = True  # the stream owns the samples from here
                return StreamingResponse(stream_with(requests, sinks, firsts, make_chunk, include_usage, chunk_base,
                                                     keep_output), media_type="text/event-stream")
            choices, n_out = [], 0
            for j, (r, sink, first) in enumerate(zip(requests, sinks, firsts)):
                out_ids, out_lps, last, _ = await generate(http, r, sink, first)
                text = (last.text if last.text is not None else r.decode(detokenize, out_ids)) if detokenize else ""
                if not keep_output:
                    out_ids, out_lps, text = [], ([], []), ""
                choices.append(dict(make_choice(j, text, out_ids, out_lps), finish_reason=finish_reason(last)))
                n_out += len(out_ids)
            ok = True
            return dict(base, choices=choices, usage=usage(requests[0].num_prompt_tokens, n_out))
        finally:
            if not ok:
                for r in requests:
                    engine.cancel(r.request_id)

    async def stream_with(requests: list[Request], sinks: list[asyncio.Queue], firsts: list, make_chunk,
                          include_usage: bool, base, keep_output: bool = True):
        """SSE: one chunk per update of any sample (tokens as they come), each sample's finish, usage if
        asked, then [DONE]. A client that disconnects cancels every sample, which frees their pages."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(j, sink):  # sample j's updates after its first, into the merged queue
            while True:
                u = await sink.get()
                await merged.put((j, u))
                if u.finished:
                    return

        for j, first in enumerate(firsts):
            merged.put_nowait((j, first))
        pumps = [asyncio.ensure_future(pump(j, s)) for j, (s, f) in enumerate(zip(sinks, firsts)) if not f.finished]
        texts = [TextStream(None if detokenize is None else (lambda ids, r=r: r.decode(detokenize, ids)), r.stop)
                 for r in requests]
        ids_so_far, t_first = [[] for _ in requests], [None] * len(requests)
        left, done = len(requests), False
        try:
            while left:
                j, u = await merged.get()
                r = requests[j]
                if not keep_output:
                    u = dataclasses.replace(u, token_ids=[], logprobs=[], top_logprobs=[], text="")
                if u.token_ids and t_first[j] is None:
                    t_first[j] = u.time
                ids_so_far[j] += u.token_ids
                delta = texts[j].delta(ids_so_far[j], u.text, u.finished)
                if not u.finished:
                    yield sse(make_chunk(j, delta, u, None))
                    continue
                if u.finish_reason not in ("stop", "length"):
                    yield sse({"error": {"message": u.error or f"the request ended with {u.finish_reason}",
                                         "type": "server_error", "param": None, "code": None}})
                    break
                yield sse(make_chunk(j, delta, u, finish_reason(u)))
                observe(r, t_first[j], u.time, len(ids_so_far[j]), r.num_prompt_tokens)
                left -= 1
            if not left and include_usage:
                yield sse(dict(base, choices=[], usage=usage(requests[0].num_prompt_tokens,
                                                             sum(map(len, ids_so_far)))))
            yield "data: [DONE]\n\n"
            done = not left
        finally:
            for p in pumps:
                p.cancel()
            if not done:
                for r in requests:
                    engine.cancel(r.request_id)

    return app

