"""One generation request as the scheduler sees it: its tokens, its stop rules, its place in the pool.

Plain Python (no device arrays): the scheduler and its tests run without devices.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

from dcp_jax.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "abort", "error")


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed; holds no slot, no page
    PREFILLING = "prefilling"  # owns a slot and pages; its tokens go through the cache chunk by chunk
    DECODING = "decoding"  # every token but the last sampled one is in the cache
    FINISHED = "finished"  # finish_reason says why; slot and pages already returned


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt, how to sample it and when to stop, and what it produced so far.

    `max_tokens` None means "until the model length". Output token ids include a stop/EOS token that
    ended the request (as vLLM's do); `text` (when the scheduler has a detokenizer) ends before a stop
    string, as OpenAI's API returns it. `seed` is per request so a device sampler that derives its key
    from (seed, position) gives the same tokens again after a preemption recomputes the request.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    arrival_time: float | None = None

    # --- what it produced ---
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    # the error was the server's, not the request's (its prompt KV never arrived from a prefill
    # instance): the same request may succeed when sent again
    error_retryable: bool = False

    # --- owned by the scheduler ---
    state: RequestState = RequestState.WAITING
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)  # block-table row, in block order
    num_computed: int = 0  # tokens whose KV is in the cache (positions [0, num_computed))
    num_preemptions: int = 0
    # prefix caching: keys of the full blocks of prompt + output (kept across preemption: the tokens do
    # not change), and how many of `pages` are registered in the prefix table (or were taken from it)
    block_keys: list[bytes] = dataclasses.field(default_factory=list)
    num_registered: int = 0

    def __post_init__(self):
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    # --- sizes ---
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output: a recompute after preemption prefills all of them."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:min(stop, p)]
        return head + self.output_token_ids[max(start - p, 0):max(stop - p, 0)]

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def tokens_left(self, max_model_len: int) -> int:
        """Tokens it may still produce before a "length" stop (max_tokens or the model length)."""
        left = max_model_len - self.num_tokens
        if self.max_tokens is not None:
            left = min(left, self.max_tokens - len(self.output_token_ids))
        return left

    def peak_cache_tokens(self, max_model_len: int) -> int:
        """The most tokens it can ever hold in the cache: the last sampled token is never written."""
        total = max_model_len if self.max_tokens is None else self.num_prompt_tokens + self.max_tokens
        return min(total, max_model_len) - 1

    # --- producing tokens ---
    def finish(self, reason: str, error: str | None = None, detokenize: Callable | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        self.state, self.finish_reason, self.error = RequestState.FINISHED, reason, error
        if detokenize is not None and self.text is None:
            self.text = detokenize(self.output_token_ids)

    def append_token(self, token: int, logprob: float | None, *, eos_token_ids: Sequence[int] = (),
                     max_model_len: int, detokenize: Callable | None = None) -> bool:
        """Record one sampled token and apply the stop rules; True if the request is now finished.

        Order: EOS, stop token ids, stop strings ("stop"), then max_tokens / model length ("length"),
        so a stop that coincides with the last allowed token reports "stop".
        """
        token = int(token)
        self.output_token_ids.append(token)
        self.output_logprobs.append(float("nan") if logprob is None else float(logprob))
        if not self.ignore_eos and token in eos_token_ids:
            self.stop_reason = token
            self.finish("stop", detokenize=detokenize)
        elif token in self.stop_token_ids:
            self.stop_reason = token
            self.finish("stop", detokenize=detokenize)
        elif self.stop and detokenize is not None and self.check_stop_strings(detokenize):
            self.finish("stop")
        elif self.tokens_left(max_model_len) <= 0:
            self.finish("length", detokenize=detokenize)
        return self.is_finished

    def check_stop_strings(self, detokenize: Callable) -> bool:
        """Detokenize the output, cut the text before the earliest stop string; True if one occurs.

        The whole output is searched each time (a detokenizer may rewrite earlier characters as bytes
        complete), so a stop string spanning several tokens is found; O(output) per token.
        """
        text = detokenize(self.output_token_ids)
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if not hits:
            self.text = text
            return False
        i, s = min(hits)
        self.text, self.stop_reason = text[:i], s
        return True
