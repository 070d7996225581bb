"""What every route handler shares (vLLM's `OpenAIServing` shape): the engine client, the intake,
the metrics, the error helpers, and for the generating endpoints the run of a request's samples to
a whole response or a server-sent-event stream. A client that goes away cancels its samples (their
pages are freed at once); an error finish becomes a 400 (refused) or a 503 (the server failed it:
send it again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

from dcp_jax.agents.messages import ChatPlan, plan_chat
from dcp_jax.agents.parsers import check_tool_parser
from dcp_jax.agents.reasoning import check_reasoning_parser
from dcp_jax.server.client import EngineClient, EngineOverloaded
from dcp_jax.server.intake import Intake
from dcp_jax.server.metrics import Metrics
from dcp_jax.server.protocol import APIError, TextStream
from dcp_jax.serving.request import Request

try:
    from fastapi import Request as HTTPRequest
    from fastapi.responses import StreamingResponse
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def usage(prompt: int, n: int, cached: int = 0) -> dict:
    """OpenAI's usage: `cached` of the `prompt` tokens came from the prefix cache (device or host
    tier: `Request.num_cached_tokens`)."""
    return {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(u) -> str:
    return "length" if u.finish_reason == "length" else "stop"


class Handler:
    """A family of routes over one served model. `client`: the engine, as `EngineClient` says."""

    def __init__(self, client: EngineClient, intake: Intake, metrics: Metrics, model_name: str):
        self.client, self.intake, self.metrics = client, intake, metrics
        self.model_name = model_name
        tokenizer = client.tokenizer

        def detokenize(ids, skip_special_tokens=True):
            return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

        self.detokenize = None if tokenizer is None else detokenize

    @staticmethod
    def error(status: int, message: str, param: str | None = None, code: str | None = None,
              type_: str | None = None) -> APIError:
        """The APIError to raise (OpenAI's error shape): 4xx are the client's, 5xx the server's."""
        kind = type_ or ("invalid_request_error" if status < 500 else "server_error")
        return APIError(status, message, kind, param=param, code=code)

    def check_model(self, name: str | None) -> None:
        if name is not None:
            self.intake.check_model(name)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.detokenize([t]) if self.detokenize else str(t) for t in ids]


class GeneratingHandler(Handler):
    """The shared tail of /v1/completions and /v1/chat/completions. An endpoint gives `respond` an
    output (`base`, `chunk_base`, `chunk(j, delta, update, reason)`, `choice(j, text, ids, lps,
    reason)`) that shapes its chunks and choices (a choice may give its own finish_reason)."""

    def submit(self, request: Request) -> asyncio.Queue:
        try:
            return self.client.submit(request)
        except EngineOverloaded as e:
            raise self.error(503, str(e), type_="server_overloaded", code="queue_full") from None

    @staticmethod
    async def disconnected(http: HTTPRequest) -> None:
        """Returns when the client goes away (its body was read already: the next message is
        that)."""
        while (await http.receive())["type"] != "http.disconnect":
            pass

    async def next_update(self, http: HTTPRequest, request: Request, sink: asyncio.Queue):
        """The request's next update; a client that goes away meanwhile cancels it and ends the
        handler."""
        get = asyncio.ensure_future(sink.get())
        gone = asyncio.ensure_future(self.disconnected(http))
        try:
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get in done:
                return get.result()
            raise asyncio.CancelledError("the client went away")
        except asyncio.CancelledError:
            self.client.cancel(request.request_id)
            raise
        finally:
            get.cancel()
            gone.cancel()

    async def first_update(self, http: HTTPRequest, request: Request, sink: asyncio.Queue):
        """The first update; an error finish becomes a 400 (the scheduler refused the request) or a
        503 (the server failed it, e.g. its KV never arrived from a prefill instance: send it
        again)."""
        u = await self.next_update(http, request, sink)
        if u.finished and u.finish_reason == "error":
            if u.retryable:
                raise self.error(503, u.error or "the request failed on the server")
            raise self.error(400, u.error or "the request was refused")
        if u.finished and u.finish_reason == "abort":
            raise self.error(503, u.error or "the request was aborted")
        return u

    def observe(self, request: Request, first_time: float | None, end: float, n: int) -> None:
        self.metrics.observe(request.arrival_time, first_time, end, n, request.num_prompt_tokens)

    async def generate(self, http: HTTPRequest, request: Request, sink: asyncio.Queue, first):
        """All updates of a request to its end (non-streaming): (ids, (logprobs, top logprobs) per
        token, last update). A client that disconnects meanwhile cancels the request."""
        u, out_ids, out_lps, t_first = first, [], ([], []), None
        while True:
            if u.token_ids and t_first is None:
                t_first = u.time
            out_ids += u.token_ids
            out_lps[0].extend(u.logprobs)
            out_lps[1].extend(u.top_logprobs)
            if u.finished:
                break
            u = await self.next_update(http, request, sink)
        if u.finish_reason not in ("stop", "length"):  # a server-side failure: 503 if retryable
            raise self.error(503 if u.retryable else 500,
                             u.error or f"the request ended with {u.finish_reason}")
        self.observe(request, t_first, u.time, len(out_ids))
        return out_ids, out_lps, u

    async def respond(self, http: HTTPRequest, body, requests: list[Request], out,
                      keep_output: bool = True):
        """The request's n samples (choice j = sample j), submitted together, then a server-sent-
        event stream of `out.chunk(j, ...)` chunks, or the whole response (each `out.choice(j, ...)`
        with its finish reason, and usage over all). An error (or a client that goes away) before
        the end cancels every sample. Without `keep_output` the tokens generated are left out (echo
        with max_tokens 0)."""
        sinks, firsts, ok = [], [], False
        try:
            sinks += [self.submit(r) for r in requests]
            for r, sink in zip(requests, sinks):
                firsts.append(await self.first_update(http, r, sink))
            if body.stream:
                options = body.stream_options
                include_usage = options is not None and options.include_usage
                ok = True  # the stream owns the samples from here
                events = self.stream(requests, sinks, firsts, out, include_usage, keep_output)
                return StreamingResponse(events, media_type="text/event-stream")
            choices, n_out, cached = [], 0, []
            for j, (r, sink, first) in enumerate(zip(requests, sinks, firsts)):
                out_ids, out_lps, last = await self.generate(http, r, sink, first)
                cached.append(last.num_cached_tokens)
                text = self.final_text(r, last, out_ids)
                if not keep_output:
                    out_ids, out_lps, text = [], ([], []), ""
                reason = finish_reason(last)
                choice = out.choice(j, text, out_ids, out_lps, reason)
                choices.append(dict(choice, finish_reason=choice.get("finish_reason", reason)))
                n_out += len(out_ids)
            ok = True
            n_prompt = requests[0].num_prompt_tokens
            return dict(out.base, choices=choices, usage=usage(n_prompt, n_out, cached[0]))
        finally:
            if not ok:
                for r in requests:
                    self.client.cancel(r.request_id)

    def final_text(self, request: Request, last, ids: list[int]) -> str:
        """A finished sample's text: the engine's (cut before a stop string), else its ids
        decoded."""
        if not self.detokenize:
            return ""
        return last.text if last.text is not None else request.decode(self.detokenize, ids)

    @staticmethod
    async def merge(sinks: list[asyncio.Queue], firsts: list, merged: asyncio.Queue) -> list:
        """Every sample's updates into one queue, as (sample, update); returns the pumps to
        cancel."""
        async def pump(j, sink):  # sample j's updates after its first
            while True:
                u = await sink.get()
                await merged.put((j, u))
                if u.finished:
                    return

        for j, first in enumerate(firsts):
            merged.put_nowait((j, first))
        return [asyncio.ensure_future(pump(j, s))
                for j, (s, f) in enumerate(zip(sinks, firsts)) if not f.finished]

    def text_streams(self, requests: list[Request]) -> list[TextStream]:
        decode = self.detokenize
        return [TextStream(None if decode is None else (lambda ids, r=r: r.decode(decode, ids)),
                           r.stop) for r in requests]

    async def stream(self, requests: list[Request], sinks: list[asyncio.Queue], firsts: list, out,
                     include_usage: bool, keep_output: bool = True):
        """SSE: one chunk per update of any sample (tokens as they come), each sample's finish,
        usage if asked, then [DONE]. A client that disconnects cancels every sample (which frees
        their pages)."""
        merged: asyncio.Queue = asyncio.Queue()
        pumps = await self.merge(sinks, firsts, merged)
        texts = self.text_streams(requests)
        ids_so_far, t_first = [[] for _ in requests], [None] * len(requests)
        left, done, cached = len(requests), False, [0] * len(requests)
        try:
            while left:
                j, u = await merged.get()
                cached[j] = u.num_cached_tokens
                if not keep_output:
                    u = dataclasses.replace(u, token_ids=[], logprobs=[], top_logprobs=[],
                                            text="")
                if u.token_ids and t_first[j] is None:
                    t_first[j] = u.time
                ids_so_far[j] += u.token_ids
                delta = texts[j].delta(ids_so_far[j], u.text, u.finished)
                if not u.finished:
                    yield sse(out.chunk(j, delta, u, None))
                    continue
                if u.finish_reason not in ("stop", "length"):
                    message = u.error or f"the request ended with {u.finish_reason}"
                    yield sse({"error": {"message": message, "type": "server_error", "param": None,
                                         "code": None}})
                    break
                yield sse(out.chunk(j, delta, u, finish_reason(u)))
                self.observe(requests[j], t_first[j], u.time, len(ids_so_far[j]))
                left -= 1
            if not left and include_usage:
                n_out = sum(map(len, ids_so_far))
                yield sse(dict(out.chunk_base, choices=[],
                               usage=usage(requests[0].num_prompt_tokens, n_out, cached[0])))
            yield "data: [DONE]\n\n"
            done = not left
        finally:
            for p in pumps:
                p.cancel()
            if not done:
                for r in requests:
                    self.client.cancel(r.request_id)


class ChatPathHandler(GeneratingHandler):
    """A generating endpoint whose requests are chats planned by the agents path (`plan_chat`):
    chat completions and Anthropic's Messages. `tool_parser`, `reasoning_parser`: the server's
    parsers by name (`dcp_jax.agents`), or None."""

    def __init__(self, *args, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, **kw):
        super().__init__(*args, **kw)
        check_tool_parser(tool_parser)
        check_reasoning_parser(reasoning_parser)
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser

    def chat_template(self):
        """The model's chat template; a 400 naming `messages` when its checkpoint carries none."""
        template = self.client.chat_template
        if template is None:
            raise self.error(400, "this model has no chat template (its checkpoint carries none): "
                             "use /v1/completions", param="messages", code="no_chat_template")
        return template

    def plan(self, messages, tools, tool_choice, parallel_tool_calls) -> ChatPlan:
        """`plan_chat` with the server's parsers."""
        return plan_chat(messages, tools, tool_choice, parallel_tool_calls,
                         tool_parser=self.tool_parser, reasoning=self.reasoning_parser)
