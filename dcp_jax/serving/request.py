"""One generation request as the scheduler sees it: its tokens, its stop rules, its place in the pool.

Plain Python (no device arrays): the scheduler and its tests run without devices.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Callable, Sequence

from dcp_jax.errors import UserError
from dcp_jax.sampling import MAX_BANNED
from dcp_jax.sampling_params import RULES, SEED_LIMIT, SamplingParams

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
    # vLLM's extensions: no stop (EOS, stop ids, stop strings) before min_tokens outputs (the device
    # holds the stop ids back); keep the stop string in `text`; keep special tokens in `text`
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # one of n samples of a prompt: the first sample, whose prefill the others wait for (with prefix
    # caching they then share its prompt's full blocks by reference count instead of prefilling them)
    follows: Request | None = None

    # --- what it produced ---
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    # per output token, its sampling.top_logprobs most likely (id, logprob) pairs (empty when not asked)
    output_top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    # with sampling.prompt_logprobs: per prompt token (None for the first, which nothing precedes), its
    # log-probability given the tokens before it, its rank, and the sampling.prompt_logprobs most likely
    # (id, logprob) pairs there; a sample that follows another reads that one's (`prompt_scores`)
    prompt_logprobs: list[float | None] = dataclasses.field(default_factory=list)
    prompt_ranks: list[int | None] = dataclasses.field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = dataclasses.field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    # the error was the server's, not the request's (its prompt KV never arrived from a prefill
    # instance): the same request may succeed when sent again
    error_retryable: bool = False

    # --- owned by the engine: structured outputs' matcher (dcp_jax.structured) and the output tokens
    # it has consumed ---
    matcher: object = None
    matched: int = 0

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
    # prompt tokens whose KV the prefix cache held (device or host tier) when it was first admitted
    # (None until then; a recompute after preemption does not change it): the KV manager's, read as
    # OpenAI's usage.prompt_tokens_details.cached_tokens
    num_cached_tokens: int | None = None

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

    @classmethod
    def samples(cls, request_id: str, prompt_token_ids, n: int, *, seed: int, **kw) -> list[Request]:
        """n samples of one prompt (ids `request_id`, or `request_id`.j when n > 1): sample j draws with
        seed + j and follows sample 0, whose prefill the others wait for and then share (the scheduler)."""
        out: list[Request] = []
        for j in range(n):
            out.append(cls(request_id if n == 1 else f"{request_id}.{j}", prompt_token_ids,
                           seed=(seed + j) % SEED_LIMIT, follows=out[0] if out else None, **kw))
        return out

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill scores its prompt (prompt_logprobs asked, not a follower): every prompt
        token is then computed, none taken from the prefix cache."""
        return self.sampling.prompt_logprobs is not None and self.follows is None

    def prompt_scores(self) -> tuple[list, list, list] | None:
        """(logprobs, ranks, top logprobs) of its prompt tokens (its first sample's for a follower), or
        None when not asked."""
        if self.sampling.prompt_logprobs is None:
            return None
        src = self.follows or self
        return src.prompt_logprobs, src.prompt_ranks, src.prompt_top_logprobs

    def record_prompt_scores(self, start: int, logprobs, ranks, top_ids, top_lps) -> None:
        """Scores computed at positions start, start + 1, ... (of the next token at each): those of prompt
        tokens are kept (a recompute writes the same values again)."""
        n, k = self.num_prompt_tokens, self.sampling.prompt_logprobs
        if not self.prompt_logprobs:
            self.prompt_logprobs, self.prompt_ranks, self.prompt_top_logprobs = [None] * n, [None] * n, [None] * n
        for i in range(len(logprobs)):
            t = start + i + 1  # the token scored
            if t >= n:
                break
            self.prompt_logprobs[t], self.prompt_ranks[t] = float(logprobs[i]), int(ranks[i])
            self.prompt_top_logprobs[t] = [(int(a), float(b)) for a, b in zip(top_ids[i][:k], top_lps[i][:k])]

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
    def banned_ids(self, eos_token_ids: Sequence[int] = ()) -> list[int]:
        """The ids it may not emit before min_tokens: EOS (unless ignore_eos) and its stop ids."""
        return sorted(set(() if self.ignore_eos else eos_token_ids) | set(self.stop_token_ids))

    def decode(self, detokenize: Callable, ids: Sequence[int]) -> str:
        """`ids` as text, with its special tokens when the request keeps them."""
        return detokenize(ids) if self.skip_special_tokens else detokenize(ids, skip_special_tokens=False)

    def finish(self, reason: str, error: str | None = None, detokenize: Callable | None = None) -> None:
        assert reason in FINISH_REASONS, reason
        self.state, self.finish_reason, self.error = RequestState.FINISHED, reason, error
        if detokenize is not None and self.text is None:
            self.text = self.decode(detokenize, self.output_token_ids)

    def append_token(self, token: int, logprob: float | None, *, top=None, eos_token_ids: Sequence[int] = (),
                     max_model_len: int, detokenize: Callable | None = None) -> bool:
        """Record one sampled token and apply the stop rules; True if the request is now finished.

        Order: EOS, stop token ids, stop strings ("stop"), then max_tokens / model length ("length"),
        so a stop that coincides with the last allowed token reports "stop".
        """
        token = int(token)
        self.output_token_ids.append(token)
        self.output_logprobs.append(float("nan") if logprob is None else float(logprob))
        if self.sampling.top_logprobs:  # `top`: (ids, logprobs) most likely first, or None if not computed
            n = self.sampling.top_logprobs
            self.output_top_logprobs.append([] if top is None else
                                            [(int(i), float(x)) for i, x in zip(top[0][:n], top[1][:n])])
        stops = len(self.output_token_ids) > self.min_tokens  # none apply before min_tokens (vLLM's rule)
        if stops and not self.ignore_eos and token in eos_token_ids:
            self.stop_reason = token
            self.finish("stop", detokenize=detokenize)
        elif stops and token in self.stop_token_ids:
            self.stop_reason = token
            self.finish("stop", detokenize=detokenize)
        elif stops and self.stop and detokenize is not None and self.check_stop_strings(detokenize):
            self.finish("stop")
        elif self.tokens_left(max_model_len) <= 0:
            self.finish("length", detokenize=detokenize)
        return self.is_finished

    def check_stop_strings(self, detokenize: Callable) -> bool:
        """Whether a stop string ends the output; if so, cut `text` before it (after it with
        include_stop_str_in_output).

        Only a trailing window of tokens is detokenized per new token (enough for the longest stop
        string: each character takes at most 4 byte-level tokens), so the cost per token does not grow
        with the output; on a hit the whole output is detokenized once to place the cut.
        """
        longest = max(map(len, self.stop))
        tail = self.decode(detokenize, self.output_token_ids[-(4 * longest + 8):])
        if not any(s in tail for s in self.stop):
            return False
        text = self.decode(detokenize, self.output_token_ids)
        start = max(0, len(text) - len(tail) - longest)  # earlier text held no stop string
        hits = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
        if not hits:  # the window's text differs from the whole text's tail (a rewritten prefix): go on
            return False
        i, s = min(hits)
        self.text, self.stop_reason = text[:i + len(s) if self.include_stop_str_in_output else i], s
        return True

    # --- where it enters ---
    def problem(self, cfg, usable_pages: int, can_detokenize: bool) -> str | None:
        """Why this request can never run on a scheduler with `cfg` (a SchedulerConfig) and a pool of
        `usable_pages` (one line, with the fix), or None. Every value that becomes a device array is
        checked here or in `SamplingParams` (by the same `RULES` for the request's own numbers: a
        `Request` may be built without one)."""
        n, vocab = self.num_prompt_tokens, cfg.vocab_size
        if n == 0:
            return "the prompt is empty: give at least one token"
        for what, ids in (("token id", self.prompt_token_ids), ("stop token id", self.stop_token_ids),
                          ("logit_bias / allowed_token_ids / bad_words id", self.sampling.named_ids)):
            bad = [t for t in ids if vocab is not None and not 0 <= t < vocab]
            if bad:
                return f"{what} {bad[0]} is outside the vocabulary [0, {vocab}): check the tokenizer"
        if n >= cfg.max_model_len:
            return (f"the prompt has {n} tokens but the model context (max_model_len) is {cfg.max_model_len}: "
                    f"shorten the prompt to at most {cfg.max_model_len - 1} tokens or raise max_model_len")
        for name, optional in (("seed", False), ("max_tokens", None), ("min_tokens", None)):
            if (problem := RULES[name].problem(name, getattr(self, name), optional)) is not None:
                return problem
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            return f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})"
        if self.min_tokens and len(self.banned_ids(cfg.eos_token_ids)) > MAX_BANNED:
            return f"min_tokens holds back at most {MAX_BANNED} stop token ids (EOS included): give fewer stop_token_ids"
        if (self.stop or not self.skip_special_tokens) and not can_detokenize:
            return "stop strings need a tokenizer to detokenize the output: give stop_token_ids instead"
        peak = self.peak_cache_tokens(cfg.max_model_len)
        need, lay = cfg.layout.blocks_for(peak), cfg.layout
        if need > usable_pages:
            wanted = "up to max_model_len" if self.max_tokens is None else self.max_tokens
            return (f"prompt ({n} tokens) + max_tokens ({wanted}) needs {need} KV pages of "
                    f"{lay.tokens_per_block} tokens but the whole pool has {usable_pages}: lower max_tokens, "
                    "shorten the prompt or give the KV cache more pages")
        return None


def make_requests(request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                  encode: Callable | None = None,
                  arrival_time: float | None = None) -> list[Request]:
    """The `params.n` requests (samples) of one prompt: ids `request_id` (`request_id`.j when
    n > 1), sample j seeded seed + j (a random seed when params.seed is None) and following sample
    0, whose prefill the others share. The one place a `SamplingParams` becomes `Request`s:
    `LLM.generate`, the CLI, the disaggregated pair and the server build theirs here.
    `encode(text) -> ids` (no special tokens) makes bad words given as text token sequences
    (UserError without it). The prompt's length and ids are checked where it meets a model
    (`Request.problem`)."""
    if params.bad_words:
        words = params.bad_words_ids + resolve_bad_words(params.bad_words, encode)
        params = dataclasses.replace(params, bad_words=(), bad_words_ids=words)
    seed = random.getrandbits(31) if params.seed is None else params.seed
    return Request.samples(request_id, prompt_token_ids, params.n, seed=seed, sampling=params,
                           max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                           ignore_eos=params.ignore_eos, stop=params.stop,
                           stop_token_ids=params.stop_token_ids,
                           include_stop_str_in_output=params.include_stop_str_in_output,
                           skip_special_tokens=params.skip_special_tokens,
                           arrival_time=arrival_time)


def resolve_bad_words(words, encode: Callable | None) -> tuple[tuple[int, ...], ...]:
    """Bad words as token sequences: text through `encode` (vLLM's rule,
    `penalties.bad_words_ids`), token id lists as they are."""
    from dcp_jax.penalties import bad_words_ids

    words = (words,) if isinstance(words, str) else tuple(words)
    texts = [w for w in words if isinstance(w, str)]
    if texts and encode is None:
        raise UserError("bad_words as text needs a tokenizer: give them as token id lists",
                        field="bad_words")
    ids = tuple(tuple(w) for w in words if not isinstance(w, str))
    return (bad_words_ids(encode, texts) if texts else ()) + ids
