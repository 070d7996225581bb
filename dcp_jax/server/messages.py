"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the chat
path. A body becomes an OpenAI chat request (`anthropic.chat_request`), planned as chat plans one
(`dcp_jax.agents.plan_chat` with the server's tool-call and reasoning parsers: the tools the
template renders, the grammar of tool_choice any or a named tool), rendered by the chat template
and turned into a `Request` by the intake's rules for /v1/chat/completions (a field the chat path
refuses is refused here, named as Anthropic names it). The answer goes through the plan's
`OutputParser` (thinking, text, tool calls) into a Message's content blocks, or Anthropic's event
stream (message_start; per block content_block_start, content_block_delta..., content_block_stop;
message_delta, message_stop). Errors are Anthropic's shape (the app's error handlers,
`anthropic.speaks_anthropic`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from dcp_jax.agents.messages import ChatPlan
from dcp_jax.agents.output import OutputParser
from dcp_jax.server import anthropic
from dcp_jax.server.base import ChatPathHandler, finish_reason
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


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A Messages request read and planned: its `body`, the chat request it is (`chat`), the
    chat path's `plan` of it, the prompt's token `ids`."""
    body: anthropic.CountTokensBody
    chat: ChatBody
    plan: ChatPlan
    ids: list[int]


class MessagesHandler(ChatPathHandler):
    """Anthropic's /v1/messages and /v1/messages/count_tokens. `tool_parser`, `reasoning_parser`:
    the server's parsers by name (`dcp_jax.agents`, the chat endpoint's), or None."""

    async def prompt(self, http: HTTPRequest, model: type[anthropic.CountTokensBody]) -> Prompt:
        """The body read, converted, planned and checked as the chat path checks it, rendered (with
        its tools) and tokenized."""
        body = await self.intake.body(http, model)
        self.intake.check_model(body.model)
        template = self.chat_template()
        fields = anthropic.chat_request(body, reasoning=self.reasoning_parser is not None)
        try:
            chat = ChatBody.model_validate(fields)
        except ValidationError as e:  # (the conversion writes valid fields: a bug if it did not)
            raise RequestValidationError(e.errors()) from None
        messages = fields["messages"]
        plan = self.plan(anthropic.plannable(messages), chat.tools, chat.tool_choice,
                         chat.parallel_tool_calls)
        try:
            continuing = messages[-1]["role"] == "assistant"  # a prefill the model goes on from
            text = await self.intake.render(template, anthropic.marked(plan.messages, messages),
                                            not continuing, continue_final_message=continuing,
                                            **plan.template_variables())
            return Prompt(body, chat, plan, await self.intake.encode(text, special=False))
        except APIError as e:
            raise renamed(e) from None

    async def count_tokens(self, http: HTTPRequest):
        """The prompt's tokens (its tools as the template renders them), as /v1/messages would
        count them."""
        return {"input_tokens": len((await self.prompt(http, anthropic.CountTokensBody)).ids)}

    async def create_message(self, http: HTTPRequest):
        """A Message, whole or as Anthropic's event stream."""
        p = await self.prompt(http, anthropic.MessagesBody)
        structured = None if p.plan.structured is None else (p.plan.structured, "tool_choice")
        try:
            request, = self.intake.requests(p.chat, p.ids, None, structured=structured)
        except APIError as e:
            raise renamed(e) from None
        message_id, thinking = f"msg_{uuid.uuid4().hex}", anthropic.thinking_shown(p.body.thinking)
        sink, ok = self.submit(request), False
        try:
            first = await self.first_update(http, request, sink)
            if p.body.stream:
                ok = True  # the stream owns the request from here
                events = self.events(request, sink, first, message_id, p.plan.parser, thinking)
                return StreamingResponse(events, media_type="text/event-stream")
            ids, _, last = await self.generate(http, request, sink, first)
            ok = True
            answer = p.plan.parser.parse(self.final_text(request, last, ids), finish_reason(last))
            use = anthropic.usage(request.num_prompt_tokens, last.num_cached_tokens, len(ids))
            return anthropic.message(message_id, self.model_name,
                                     anthropic.content(answer, thinking),
                                     anthropic.stop_reason(last, bool(answer.tool_calls)), use)
        finally:
            if not ok:
                self.client.cancel(request.request_id)

    async def events(self, request: Request, sink: asyncio.Queue, first, message_id: str,
                     parser: OutputParser, thinking: bool):
        """The event stream: the answer's blocks as its tokens come (its text held back as the
        chat stream holds it: an incomplete character, a possible stop sequence's start; then read
        by `parser`'s stream, as chat's), then the stop reason and the usage. A failure after the
        start is an error event; a client that goes away cancels the request."""
        n_prompt, text = request.num_prompt_tokens, self.text_streams([request])[0]
        answer, blocks = parser.stream(), anthropic.BlockStream(thinking)
        ids, t_first, done, u = [], None, False, first
        try:
            for e in anthropic.stream_head(message_id, self.model_name,
                                           anthropic.usage(n_prompt, u.num_cached_tokens, 0)):
                yield e
            while True:
                if u.token_ids and t_first is None:
                    t_first = u.time
                ids += u.token_ids
                delta = text.delta(ids, u.text, u.finished)
                if delta or u.finished:
                    for e in blocks.feed(answer.feed(delta, final=u.finished)):
                        yield e
                if u.finished:
                    break
                u = await sink.get()
            if u.finish_reason not in ("stop", "length"):
                yield anthropic.error_event(u.error or f"the request ended with {u.finish_reason}")
                return
            use = anthropic.usage(n_prompt, u.num_cached_tokens, len(ids))
            reason = anthropic.stop_reason(u, answer.called)
            for e in blocks.finish() + anthropic.stream_tail(reason, use):
                yield e
            self.observe(request, t_first, u.time, len(ids))
            done = True
        finally:
            if not done:
                self.client.cancel(request.request_id)
