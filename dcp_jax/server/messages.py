"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the chat
path. A body becomes an OpenAI chat request (`anthropic.chat_request`), which the chat template
renders and the intake turns into a `Request` by the same rules as /v1/chat/completions (a field
the chat path refuses is refused here, named as Anthropic names it); the answer is a Message, or
Anthropic's event stream (message_start, content_block_start, content_block_delta...,
content_block_stop, message_delta, message_stop). Errors are Anthropic's shape (the app's error
handlers, `anthropic.speaks_anthropic`).
"""

from __future__ import annotations

import asyncio
import uuid

from dcp_jax.server import anthropic
from dcp_jax.server.base import GeneratingHandler
from dcp_jax.server.intake import check_supported
from dcp_jax.server.protocol import APIError, ChatBody
from dcp_jax.serving.request import Request

try:
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from pydantic import ValidationError
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None

# the chat request's fields that Anthropic names otherwise
RENAMED = {"prompt": "messages", "stop": "stop_sequences"}


def renamed(e: APIError) -> APIError:
    """The chat path's error, its field named as the Messages request names it."""
    if e.param not in RENAMED:
        return e
    return APIError(e.status, e.message, e.type, param=RENAMED[e.param], code=e.code)


class MessagesHandler(GeneratingHandler):
    """Anthropic's /v1/messages and /v1/messages/count_tokens."""

    async def prompt(self, http: HTTPRequest, model: type[anthropic.CountTokensBody]):
        """(the body, its chat request, the prompt's token ids): read, converted, checked as the
        chat path checks it, rendered and tokenized."""
        body = await self.intake.body(http, model)
        self.intake.check_model(body.model)
        template = self.client.chat_template
        if template is None:
            raise self.error(400, "this model has no chat template (its checkpoint carries none): "
                             "use /v1/completions", param="messages", code="no_chat_template")
        fields = anthropic.chat_request(body)
        try:
            chat = ChatBody.model_validate(fields)
        except ValidationError as e:  # (the conversion writes valid fields: a bug if it did not)
            raise RequestValidationError(e.errors()) from None
        messages = fields["messages"]
        try:
            check_supported(chat)  # tools, until the chat path takes them
            continuing = messages[-1]["role"] == "assistant"  # a prefill the model goes on from
            text = await self.intake.render(template, anthropic.template_messages(messages),
                                            not continuing, continue_final_message=continuing)
            return body, chat, await self.intake.encode(text, special=False)
        except APIError as e:
            raise renamed(e) from None

    async def count_tokens(self, http: HTTPRequest):
        """The prompt's tokens, as /v1/messages would count them."""
        _, _, prompt_ids = await self.prompt(http, anthropic.CountTokensBody)
        return {"input_tokens": len(prompt_ids)}

    async def create_message(self, http: HTTPRequest):
        """A Message, whole or as Anthropic's event stream."""
        body, chat, prompt_ids = await self.prompt(http, anthropic.MessagesBody)
        try:
            request, = self.intake.requests(chat, prompt_ids, None)
        except APIError as e:
            raise renamed(e) from None
        message_id = f"msg_{uuid.uuid4().hex}"
        sink, ok = self.submit(request), False
        try:
            first = await self.first_update(http, request, sink)
            if body.stream:
                ok = True  # the stream owns the request from here
                return StreamingResponse(self.events(request, sink, first, message_id),
                                         media_type="text/event-stream")
            ids, _, last = await self.generate(http, request, sink, first)
            ok = True
            use = anthropic.usage(request.num_prompt_tokens, last.num_cached_tokens, len(ids))
            return anthropic.message(message_id, self.model_name,
                                     self.final_text(request, last, ids),
                                     anthropic.stop_reason(last), use)
        finally:
            if not ok:
                self.client.cancel(request.request_id)

    async def events(self, request: Request, sink: asyncio.Queue, first, message_id: str):
        """The event stream: text deltas as tokens come (held back as the chat stream holds them:
        an incomplete character, a possible stop sequence's start), then the stop reason and the
        usage. A failure after the start is an error event; a client that goes away cancels the
        request."""
        n_prompt, text = request.num_prompt_tokens, self.text_streams([request])[0]
        ids, t_first, done, u = [], None, False, first
        try:
            for e in anthropic.stream_head(message_id, self.model_name,
                                           anthropic.usage(n_prompt, u.num_cached_tokens, 0)):
                yield e
            while True:
                if u.token_ids and t_first is None:
                    t_first = u.time
                ids += u.token_ids
                if delta := text.delta(ids, u.text, u.finished):
                    yield anthropic.text_delta(delta)
                if u.finished:
                    break
                u = await sink.get()
            if u.finish_reason not in ("stop", "length"):
                yield anthropic.error_event(u.error or f"the request ended with {u.finish_reason}")
                return
            use = anthropic.usage(n_prompt, u.num_cached_tokens, len(ids))
            for e in anthropic.stream_tail(anthropic.stop_reason(u), use):
                yield e
            self.observe(request, t_first, u.time, len(ids))
            done = True
        finally:
            if not done:
                self.client.cancel(request.request_id)
