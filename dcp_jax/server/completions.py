"""`POST /v1/completions`: a prompt (text, token ids, or a list of one of them) to n samples,
whole or streamed, with logprobs (completions' shape: tokens, token_logprobs, top_logprobs,
text_offset), echo (the prompt first, scored) and vLLM's prompt_logprobs."""

from __future__ import annotations

import itertools
import time
import uuid

from dcp_jax.server.base import GeneratingHandler
from dcp_jax.server.protocol import CompletionBody, vllm_prompt_logprobs
from dcp_jax.serving.request import Request

try:
    from fastapi import Request as HTTPRequest
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None


class CompletionOutput:
    """The chunks and choices of one completion request (its logprob blocks' text offsets run on
    across chunks; echo puts the prompt and its scores in each choice's first chunk)."""

    def __init__(self, handler: GeneratingHandler, body: CompletionBody, requests: list[Request],
                 prompt_ids: list[int], prompt_text: str):
        self.handler, self.body, self.requests = handler, body, requests
        self.prompt_ids, self.prompt_text = prompt_ids, prompt_text
        self.base = self.chunk_base = {"id": f"cmpl-{uuid.uuid4().hex}",
                                       "object": "text_completion", "created": int(time.time()),
                                       "model": handler.model_name}
        self.offset = [0] * len(requests)  # text_offset runs on across chunks
        self.echoed: set[int] = set()  # choices whose prompt went out (echo: before their tokens)

    def alternatives(self, alts) -> dict:
        return {s: x for s, (_, x) in zip(self.handler.token_strings([i for i, _ in alts]), alts)}

    def lp_block(self, j, ids, lps, tops, head=None):
        if self.body.logprobs is None:
            return None
        token_strings = self.handler.token_strings
        toks, lps = token_strings(ids), [float(x) for x in lps]
        top = [self.alternatives(alts) for alts in tops] if self.body.logprobs else None
        if head is not None:  # echo: the prompt's tokens first (the first has no logprob)
            p_lps, _, p_tops = head
            toks, lps = token_strings(self.prompt_ids) + toks, p_lps + lps
            if top is not None:
                top = [None if alts is None else self.alternatives(alts) for alts in p_tops] + top
        offsets = list(itertools.accumulate([len(t) for t in toks], initial=self.offset[j]))
        self.offset[j] = offsets.pop()
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}

    def head(self, j):
        """echo: the prompt text and its scores, once per choice (its first chunk)."""
        if not self.body.echo or j in self.echoed:
            return "", None
        self.echoed.add(j)
        n = len(self.prompt_ids)
        return self.prompt_text, self.requests[0].prompt_scores() or ([None] * n, None, [None] * n)

    def chunk(self, j, delta, u, reason) -> dict:
        text, scores = self.head(j)
        block = self.lp_block(j, u.token_ids, u.logprobs, u.top_logprobs, scores)
        return dict(self.base, choices=[{"index": j, "text": text + delta, "finish_reason": reason,
                                         "logprobs": block}])

    def choice(self, j, text, ids, lps, reason=None) -> dict:
        echo_text, scores = self.head(j)
        prompt_lps = vllm_prompt_logprobs(self.requests[0], self.body.prompt_logprobs,
                                          self.handler.token_strings)
        return {"index": j, "text": echo_text + text,
                "logprobs": self.lp_block(j, ids, *lps, head=scores), "prompt_logprobs": prompt_lps}


class CompletionsHandler(GeneratingHandler):
    """OpenAI's /v1/completions (with vLLM's extensions)."""

    async def create_completion(self, http: HTTPRequest):
        body: CompletionBody = await self.intake.body(http, CompletionBody)
        self.intake.check_model(body.model)
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise self.error(400, "a list of prompts must hold exactly one (batches: send one "
                                 "request each)", param="prompt", code="unsupported_parameter")
            p = p[0]
        prompt_ids = await self.intake.encode(p) if isinstance(p, str) else list(p)
        want_lp = body.logprobs is not None
        echo_lps = body.logprobs if body.echo and want_lp else None
        requests = self.intake.requests(body, prompt_ids, 16, ("logprobs", body.logprobs or 0),
                                        echo_logprobs=echo_lps)
        prompt_text = ""
        if body.echo:
            prompt_text = (p if isinstance(p, str) else self.detokenize(prompt_ids)
                           if self.detokenize else "")
        out = CompletionOutput(self, body, requests, prompt_ids, prompt_text)
        # echo with max_tokens 0 scores the prompt alone: the one token generated is left out
        keep = not (body.echo and body.max_tokens == 0)
        return await self.respond(http, body, requests, out, keep_output=keep)
