"""What a generation returns: plain Python values, and the stats that describe a run.

A leaf of the package: `LLM`, `DisaggregatedLLM` and the CLI build their results and reports from here.
"""

from __future__ import annotations

import dataclasses

from dcp_jax.errors import UserError


@dataclasses.dataclass
class Generation:
    """Result of `LLM.generate` / `Engine.generate`: plain Python values."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stats: dict
    text: list[str] | None = None
    finish_reasons: list[str] | None = None
    errors: list[str | None] | None = None
    # with top_logprobs=N: per request, per generated token, its N most likely (id, logprob) pairs
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    # with prompt_logprobs=N: per request, per prompt token, its log-probability given the tokens
    # before it (None for the first) and its N most likely (id, logprob) alternatives (None first)
    prompt_logprobs: list[list[float | None]] | None = None
    prompt_top_logprobs: list[list[list[tuple[int, float]] | None]] | None = None


@dataclasses.dataclass
class ChatGeneration:
    """Result of `LLM.chat`: each answer as an assistant message (`dcp_jax.agents.ParsedMessage`:
    content, reasoning_content, tool_calls as `ToolCall(id, name, arguments)` objects,
    finish_reason), conversation-major (conversation i's sample j is entry i·n + j), and the
    `Generation` underneath (tokens, logprobs, stats)."""

    messages: list
    generation: Generation

    @property
    def message(self):
        """The first answer."""
        return self.messages[0]

    @property
    def tool_calls(self) -> tuple:
        """The first answer's tool calls."""
        return self.messages[0].tool_calls


def request_stats(requests, first_token_s: dict, timing: dict) -> dict:
    """The stats every generation reports about its requests and the device's time: batch, prompt and
    generated tokens, TTFT (the slowest request's; each request's in `requests`), prefill and decode time,
    decode steps and speed. `first_token_s`: request id -> seconds from arrival to its first token;
    `timing`: this run's share of the engine's prefill_s, decode_s, decode_steps, decode_tokens."""
    decode_s = timing["decode_s"]
    # decode speed: the tokens the decode program made for requests, over its own time (prefill chunks
    # of other requests interleave with decoding; they are not counted against it)
    return dict(
        batch=len(requests), prompt_tokens=sum(r.num_prompt_tokens for r in requests),
        generated_tokens=sum(len(r.output_token_ids) for r in requests),
        ttft_s=max(first_token_s.values(), default=0.0), prefill_s=timing.get("prefill_s", 0.0),
        decode_s=decode_s, decode_steps=timing["decode_steps"],
        decode_tokens_per_s=timing["decode_tokens"] / decode_s if decode_s > 0 else 0.0,
        requests=[dict(ttft_s=first_token_s.get(r.request_id), prompt_tokens=r.num_prompt_tokens,
                       generated_tokens=len(r.output_token_ids), finish_reason=r.finish_reason,
                       preemptions=r.num_preemptions) for r in requests])


def generation(requests, stats: dict, detokenize=None) -> Generation:
    """The `Generation` of finished `requests`; UserError (the first one's message) if every one failed."""
    errors = [r.error for r in requests]
    if all(e is not None for e in errors):
        raise UserError(errors[0])
    out = Generation([list(r.output_token_ids) for r in requests], [list(r.output_logprobs) for r in requests],
                     stats, finish_reasons=[r.finish_reason for r in requests], errors=errors)
    if any(r.sampling.top_logprobs for r in requests):
        out.top_logprobs = [[list(t) for t in r.output_top_logprobs] for r in requests]
    if any(r.sampling.prompt_logprobs is not None for r in requests):
        scores = [r.prompt_scores() or ([], [], []) for r in requests]
        out.prompt_logprobs = [list(lps) for lps, _, _ in scores]
        out.prompt_top_logprobs = [list(tops) for _, _, tops in scores]
    # the request's own text where it has one (cut before a stop string, special tokens as it asked)
    if detokenize is not None:
        out.text = [r.decode(detokenize, r.output_token_ids) if r.text is None else r.text
                    for r in requests]
    return out
