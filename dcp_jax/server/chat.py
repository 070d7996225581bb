"""`POST /v1/chat/completions`: messages rendered by the model's chat template, then n samples,
whole or streamed, with logprobs in chat's shape (content[].token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

import time
import uuid

from dcp_jax.server.base import GeneratingHandler
from dcp_jax.server.protocol import ChatBody, TokenBytes, chat_messages, vllm_prompt_logprobs

try:
    from fastapi import Request as HTTPRequest
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None


class ChatOutput:
    """The chunks and choices of one chat request (a choice's first chunk names the role)."""

    def __init__(self, handler: "ChatHandler", body: ChatBody):
        self.handler, self.body = handler, body
        self.base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                     "created": int(time.time()), "model": handler.model_name}
        self.chunk_base = dict(self.base, object="chat.completion.chunk")
        self.started: set[int] = set()

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
        d = {} if reason is not None and not delta else {"content": delta}
        if j not in self.started:  # a choice's first chunk names the role, as OpenAI's do
            self.started.add(j)
            d = {"role": "assistant", "content": delta}
        block = self.lp_block(u.token_ids, u.logprobs, u.top_logprobs)
        return dict(self.chunk_base, choices=[{"index": j, "delta": d, "finish_reason": reason,
                                               "logprobs": block}])

    def choice(self, j, text, ids, lps) -> dict:
        return {"index": j, "message": {"role": "assistant", "content": text},
                "logprobs": self.lp_block(ids, *lps)}


class ChatHandler(GeneratingHandler):
    """OpenAI's /v1/chat/completions (with vLLM's extensions)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        tokenizer = self.client.tokenizer
        self.token_bytes = None if tokenizer is None else TokenBytes(tokenizer)

    async def create_chat_completion(self, http: HTTPRequest):
        body: ChatBody = await self.intake.body(http, ChatBody)
        self.intake.check_model(body.model)
        template = self.client.chat_template
        if template is None:
            raise self.error(400, "this model has no chat template (its checkpoint carries none): "
                             "use /v1/completions", param="messages",
                             code="no_chat_template")
        text = await self.intake.render(template, chat_messages(body.messages))
        prompt_ids = await self.intake.encode(text, special=False)
        if body.top_logprobs and not body.logprobs:
            raise self.error(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        requests = self.intake.requests(body, prompt_ids, None,
                                        ("top_logprobs", body.top_logprobs or 0))
        out = await self.respond(http, body, requests, ChatOutput(self, body))
        if body.prompt_logprobs is not None:  # (never with stream: the intake refuses it)
            out["prompt_logprobs"] = vllm_prompt_logprobs(requests[0], body.prompt_logprobs,
                                                          self.token_strings)
        return out
