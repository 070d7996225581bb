"""vLLM's `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` (what lm-eval's remote
tokenizer reads)."""

from __future__ import annotations

import asyncio

from dcp_jax.agents.messages import check_tools
from dcp_jax.server.base import Handler
from dcp_jax.server.protocol import DetokenizeBody, TokenizeBody, chat_messages

try:
    from fastapi import Request as HTTPRequest
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None


class TokenizeHandler(Handler):
    """The tokenizer's routes: text or chat messages to ids, ids to text, the special tokens."""

    @property
    def vocab_size(self) -> int:
        tokenizer = self.client.tokenizer
        return self.client.vocab_size or (
            tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else 2**31)

    async def tokenize(self, http: HTTPRequest):
        """The ids (and, asked, the token strings) of a prompt or of chat messages as templated."""
        body: TokenizeBody = await self.intake.body(http, TokenizeBody)
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise self.error(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            template = self.client.chat_template
            if template is None:
                raise self.error(400, "this model has no chat template: tokenize a prompt instead",
                                 param="messages", code="no_chat_template")
            tools = {} if body.tools is None else {"tools": check_tools(body.tools)}
            text = await self.intake.render(template, chat_messages(body.messages),
                                            body.add_generation_prompt, **tools)
            ids = await self.intake.encode(text, special=bool(body.add_special_tokens))
        else:
            special = body.add_special_tokens is not False
            ids = await self.intake.encode(body.prompt, special=special)
        strings = self.token_strings(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.client.max_model_len, "tokens": ids,
                "token_strs": strings}

    async def tokenizer_info(self):
        """The special tokens (as text), the chat template and the context length."""
        if self.detokenize is None:
            raise self.error(400, "this model has no tokenizer", code="no_tokenizer")

        def text(ids):
            return self.detokenize(ids[:1], skip_special_tokens=False) if ids else None

        template = self.client.chat_template
        return {"tokenizer_class": type(self.client.tokenizer).__name__,
                "model_max_length": self.client.max_model_len,
                "eos_token": text(list(self.client.eos_token_ids)),
                "bos_token": template.bos_token or None if template else None, "pad_token": None,
                "chat_template": template.source if template else None}

    async def detokenize_ids(self, http: HTTPRequest):
        """The text of token ids."""
        body: DetokenizeBody = await self.intake.body(http, DetokenizeBody)
        self.check_model(body.model)
        if self.detokenize is None:
            raise self.error(400, "this model has no tokenizer: there is no text for its ids",
                             param="tokens")
        vocab_size = self.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab_size]:
            raise self.error(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                             param="tokens")
        return {"prompt": await asyncio.to_thread(self.detokenize, body.tokens)}
