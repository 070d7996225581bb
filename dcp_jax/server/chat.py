"""`POST /v1/chat/completions`: messages rendered by the model's chat template (with the request's
tools), then n samples, whole or streamed, with logprobs in chat's shape (content[].token, logprob,
bytes, top_logprobs). Tools, the tool choice and the answer's tool calls and thinking go through
`dcp_jax.agents` (`plan_chat`, then each choice's `OutputParser`), as `LLM.chat` does."""

from __future__ import annotations

import time
import uuid

from dcp_jax.agents.output import OutputParser, finish_reason
from dcp_jax.server.base import ChatPathHandler
from dcp_jax.server.protocol import (
    ChatBody,
    TokenBytes,
    message_dicts,
    vllm_prompt_logprobs,
)

try:
    from fastapi import Request as HTTPRequest
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None


class ChatOutput:
    """The chunks and choices of one chat request (a choice's first chunk names the role), each
    choice's text read by `parser` (tool calls, thinking)."""

    def __init__(self, handler: ChatHandler, body: ChatBody, parser: OutputParser):
        self.handler, self.body, self.parser = handler, body, parser
        self.base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                     "created": int(time.time()), "model": handler.model_name}
        self.chunk_base = dict(self.base, object="chat.completion.chunk")
        self.started: set[int] = set()
        self.streams: dict = {}  # choice -> its OutputStream
        self.reasons: dict[int, str] = {}  # choice -> its finish reason (whole answers)

    def alternatives(self, alts) -> list[dict]:
        token_bytes = self.handler.token_bytes
        return [{"token": s, "logprob": x, "bytes": token_bytes(i, s)}
                for (i, x), s in zip(alts, self.handler.token_strings([i for i, _ in alts]))]

    def lp_block(self, ids, lps, tops):
        if not self.body.logprobs:
            return None
        tops = tops or [[]] * len(ids)
        token_bytes = self.handler.token_bytes
        strings = self.handler.token_strings(ids)
        return {"content": [{"token": t, "logprob": float(x), "bytes": token_bytes(i, t),
                             "top_logprobs": self.alternatives(alts)}
                            for i, t, x, alts in zip(ids, strings, lps, tops)]}

    def chunk(self, j, delta, u, reason) -> dict:
        stream = self.streams.setdefault(j, self.parser.stream())
        m = stream.feed(delta, final=reason is not None)
        d = {} if reason is not None and not m.content else {"content": m.content}
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            d["tool_calls"] = [c.openai() for c in m.tool_calls]
            if not m.content:
                d.pop("content", None)
        if j not in self.started:  # a choice's first chunk names the role, as OpenAI's do
            self.started.add(j)
            d = {"role": "assistant", "content": m.content if m.content or not m.tool_calls
                 else None, **{k: v for k, v in d.items() if k != "content"}}
        block = self.lp_block(u.token_ids, u.logprobs, u.top_logprobs)
        reason = finish_reason(reason, stream.called)
        return dict(self.chunk_base, choices=[{"index": j, "delta": d, "finish_reason": reason,
                                               "logprobs": block}])

    def choice(self, j, text, ids, lps, reason=None) -> dict:
        message = self.parser.parse(text, reason)
        return {"index": j, "message": message.openai(), "logprobs": self.lp_block(ids, *lps),
                "finish_reason": message.finish_reason}


class ChatHandler(ChatPathHandler):
    """OpenAI's /v1/chat/completions (with vLLM's extensions). `tool_parser`, `reasoning_parser`:
    the server's parsers by name (`dcp_jax.agents`), or None."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        tokenizer = self.client.tokenizer
        self.token_bytes = None if tokenizer is None else TokenBytes(tokenizer)

    async def create_chat_completion(self, http: HTTPRequest):
        body: ChatBody = await self.intake.body(http, ChatBody)
        self.intake.check_model(body.model)
        template = self.chat_template()
        plan = self.plan(message_dicts(body.messages), body.tools, body.tool_choice,
                         body.parallel_tool_calls)
        text = await self.intake.render(template, plan.messages, **plan.template_variables())
        prompt_ids = await self.intake.encode(text, special=False)
        if body.top_logprobs and not body.logprobs:
            raise self.error(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        constrained = None if plan.structured is None else (plan.structured, "tool_choice")
        requests = self.intake.requests(body, prompt_ids, None,
                                        ("top_logprobs", body.top_logprobs or 0),
                                        structured=constrained)
        out = await self.respond(http, body, requests, ChatOutput(self, body, plan.parser))
        if body.prompt_logprobs is not None:  # (never with stream: the intake refuses it)
            out["prompt_logprobs"] = vllm_prompt_logprobs(requests[0], body.prompt_logprobs,
                                                          self.token_strings)
        return out
