"""`SamplingParams`: one request's description (vLLM's), and `RULES`: the range of each of its
numeric parameters, written once.

A leaf below `sampling` (errors, then the penalties' and structured outputs' limits): the API,
`LLM.generate`, the CLI, the server, the scheduler's requests and the device rows take their
parameters from here.

    Rule / RULES     a numeric parameter's type, bounds, what its neutral value means and its CLI
                     help; `SamplingParams` checks against them, `Request.problem` and the CLI's
                     flags (`dcp_jax.cli.add_sampling_args`) too
    SamplingParams   max_tokens, min_tokens, n, seed, stop, stop_token_ids, ignore_eos, temperature,
                     top-k, top-p, min-p, logit_bias, allowed_token_ids, top_logprobs, penalties,
                     bad words, prompt_logprobs, structured, ...; checked on creation
    check_seed       a request's seed: an integer in [0, 2**32) (it becomes a uint32 on the device)

A new sampling parameter touches three places: its field here (with its row in `RULES` when it is
a number: the CLI flag and the range check come from that row), the `sampling.SamplingRows` field
it fills (its metadata names the parameter) and its test.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from dcp_jax.errors import UserError
from dcp_jax.penalties import MAX_BAD_LEN, MAX_BAD_WORDS, MAX_PENALTY
from dcp_jax.structured import KINDS, structured_spec

INT32_MAX = 2**31 - 1  # top_k becomes an int32 on the device
SEED_LIMIT = 2**32  # a seed becomes a uint32 on the device
MAX_TOP_LOGPROBS = 20  # alternatives a token may report (OpenAI's and vLLM's limit)
# token ids one row may list in logit_bias and allowed_token_ids together (a fixed shape)
MAX_LISTED = 300
MAX_BIAS = 100.0  # |logit_bias| (OpenAI's range)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 512  # stop strings per request, characters per stop string


@dataclasses.dataclass(frozen=True)
class Rule:
    """A numeric parameter's range: `kind` int or float (a float must be finite); `low` / `high`
    bounds (None = unbounded), excluded where `low_open` / `high_open`; `optional`: None is allowed
    too; `note`: what a neutral value means ("0 = off"); `help`: the CLI flag's help; `high_text`:
    how the upper bound is written ("2**32")."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    note: str = ""
    help: str = ""
    high_text: str | None = None

    def describe(self, optional: bool | None = None) -> str:
        """What a valid value is, as a message says it: "an integer in [0, 20]", "in (0, 1]", ..."""
        what = "an integer" if self.kind is int else "a finite number"
        num = (lambda x: str(int(x))) if self.kind is int else (lambda x: f"{x:g}")  # noqa: E731
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            span = f"in {left}{num(self.low)}, {self.high_text or num(self.high)}{right}"
            text = f"{what} {span}" if self.kind is int else span
        elif self.low is not None:
            text = f"{what} {'>' if self.low_open else '>='} {num(self.low)}"
        else:
            text = what
        text += f" ({self.note})" if self.note else ""
        return text + (" or None" if (self.optional if optional is None else optional) else "")

    def ok(self, value, optional: bool | None = None) -> bool:
        if value is None:
            return self.optional if optional is None else optional
        kinds = (int, np.integer) if self.kind is int else (int, float, np.number)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return False
        if self.kind is float and not math.isfinite(value):
            return False
        lo = self.low is None or (value > self.low if self.low_open else value >= self.low)
        hi = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return lo and hi

    def problem(self, name: str, value, optional: bool | None = None) -> str | None:
        """Why `value` cannot be `name` (one line naming it), or None."""
        if self.ok(value, optional):
            return None
        return f"{name} must be {self.describe(optional)}, got {value!r}"


# name -> its range: the one place each numeric sampling parameter's rule is written
RULES: dict[str, Rule] = {
    "max_tokens": Rule(int, 1, optional=True,
                       help="tokens to generate at most (None: up to the model length)"),
    "min_tokens": Rule(int, 0, help="no end-of-sequence (or stop) token before this many tokens"),
    "n": Rule(int, 1, help="samples per prompt (sample j draws with seed + j; they share the "
                           "prompt's prefill)"),
    "seed": Rule(int, 0, SEED_LIMIT, high_open=True, high_text="2**32", optional=True,
                 help="the sampling seed (None: a random one)"),
    "temperature": Rule(float, 0, help="0 = greedy"),
    "top_k": Rule(int, 0, INT32_MAX, note="0 = off",
                  help="keep the k most likely tokens (0 = off)"),
    "top_p": Rule(float, 0, 1, low_open=True,
                  help="keep the most likely tokens whose mass reaches p (1 = off)"),
    "min_p": Rule(float, 0, 1,
                  help="drop tokens less likely than this times the most likely one (0 = off)"),
    "top_logprobs": Rule(int, 0, MAX_TOP_LOGPROBS,
                         help="report each token's N most likely alternatives and their "
                              "log-probabilities"),
    "prompt_logprobs": Rule(int, 0, MAX_TOP_LOGPROBS, optional=True,
                            help="report each prompt token's log-probability and its N most "
                                 "likely alternatives"),
    "presence_penalty": Rule(float, -MAX_PENALTY, MAX_PENALTY,
                             help="subtracted from a token's logit once it occurs in the output"),
    "frequency_penalty": Rule(float, -MAX_PENALTY, MAX_PENALTY,
                              help="subtracted from a token's logit per occurrence in the output"),
    "repetition_penalty": Rule(float, 0, low_open=True, note="1 = off",
                               help="divides the positive logits (multiplies the negative) of "
                                    "tokens in the prompt or output"),
}


def check(name: str, value) -> None:
    """UserError(field=name) when `value` breaks `name`'s rule in `RULES`."""
    if (problem := RULES[name].problem(name, value)) is not None:
        raise UserError(problem, field=name)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's description, as vLLM's `SamplingParams` (`LLM.generate(prompts, params)`; the
    CLI, the server and the disaggregated pair build requests from one too: `dcp_jax.serving.
    request.make_requests`). Every value is checked on creation (numbers against `RULES`; the
    UserError's `field` names the parameter), so nothing out of range reaches a device array; token
    ids are checked against the vocabulary where the request meets a model (`Request.problem`).

    max_tokens (None: until the model length; vLLM's default 16), min_tokens (no stop before it),
    n samples per prompt (sample j draws with seed + j; seed None: a random one), stop strings (cut
    from the text unless include_stop_str_in_output; they need a tokenizer), stop_token_ids,
    ignore_eos, skip_special_tokens (of the text).

    temperature 0 = greedy; top_k 0 = off; top_p 1 = off; top_logprobs: how many of the most
    likely tokens (and their log-probabilities under the model) each generated token reports,
    0..20; min_p (0 = off): after temperature, top-k and top-p, drop tokens less likely than min_p
    times the most likely one; logit_bias {token id: bias in [-100, 100]} added to the logits, and
    allowed_token_ids (None = all) the only ids that may be emitted, both before greedy and sampled
    choices alike (the reported logprobs stay the model's own).

    Penalties as vLLM defines them: repetition_penalty (1 = off, > 0) divides the positive logits
    and multiplies the negative ones of every token in the prompt or the output so far;
    frequency_penalty (0 = off, in [-2, 2]) is subtracted once per occurrence of a token in the
    output, presence_penalty (likewise) once for any occurrence. bad_words: words never generated,
    as text (made token sequences by the tokenizer where the request is built:
    `penalties.bad_words_ids`) or as token id lists; bad_words_ids: the token sequences the device
    bans (the last token of each is banned where the output ends with the ones before it).
    prompt_logprobs (None = off, else 0..20 alternatives): each prompt token's log-probability
    given the tokens before it, its rank and the most likely alternatives (vLLM's; what `echo`
    with logprobs reports). structured: what the output must match (`dcp_jax.structured`: a dict
    such as {"json": schema}, kept as a (kind, text) pair; the grammar is compiled where the
    request meets a tokenizer).

    The first seven fields keep their positions (older callers pass them positionally)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    top_logprobs: int = 0
    min_p: float = 0.0
    logit_bias: tuple = ()  # ((token id, bias), ...); a dict is accepted and sorted
    allowed_token_ids: tuple | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bad_words_ids: tuple = ()  # ((token id, ...), ...)
    prompt_logprobs: int | None = None
    structured: tuple | dict | None = None
    # --- the request's own (the scheduler's `Request` fields, per sample) ---
    max_tokens: int | None = 16
    min_tokens: int = 0
    n: int = 1
    seed: int | None = 0
    stop: tuple = ()  # strings
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    bad_words: tuple = ()  # words as text or token id lists (`bad_words_ids` once resolved)

    def __post_init__(self):
        for name, rule in RULES.items():
            check(name, value := getattr(self, name))
            if value is not None:  # (numpy scalars and ints for floats made plain)
                object.__setattr__(self, name, rule.kind(value))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise UserError(f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                            f"({self.max_tokens})", field="min_tokens")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise UserError(f"{name} must be True or False, got {getattr(self, name)!r}",
                                field=name)
        self._check_ids()
        self._check_words()
        self._check_stops()
        spec = self.structured
        if isinstance(spec, dict):
            spec = structured_spec(spec)
        elif spec is not None:  # a (kind, text) pair (a list once it went through JSON)
            if (not isinstance(spec, (tuple, list)) or len(spec) != 2 or spec[0] not in KINDS
                    or not isinstance(spec[1], str)):
                raise UserError(f"structured must be a dict with one of {', '.join(KINDS)}",
                                field="structured")
            spec = tuple(spec)
        object.__setattr__(self, "structured", spec)

    def _check_ids(self):
        """logit_bias and allowed_token_ids: token ids (and biases in range), sorted."""
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = tuple(sorted((_token_id(k), float(b)) for k, b in items))
        except (TypeError, ValueError):
            raise UserError("logit_bias must map token ids to numbers in [-100, 100]",
                            field="logit_bias") from None
        if (any(not -MAX_BIAS <= b <= MAX_BIAS for _, b in pairs)
                or len({k for k, _ in pairs}) != len(pairs)):
            raise UserError("logit_bias must map distinct token ids to numbers in [-100, 100]",
                            field="logit_bias")
        object.__setattr__(self, "logit_bias", pairs)
        allowed = self.allowed_token_ids
        if allowed is not None:
            try:
                allowed = tuple(sorted({_token_id(a) for a in allowed}))
            except (TypeError, ValueError):
                raise UserError("allowed_token_ids must be a list of token ids",
                                field="allowed_token_ids") from None
            if not allowed:
                raise UserError("allowed_token_ids must name at least one token id",
                                field="allowed_token_ids")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if len(self.listed_ids) > MAX_LISTED:
            raise UserError(f"logit_bias and allowed_token_ids list {len(self.listed_ids)} token "
                            f"ids together; at most {MAX_LISTED} are supported",
                            field="logit_bias")

    def _check_words(self):
        """bad_words (text or id lists, as given) and bad_words_ids (distinct token sequences)."""
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        try:
            words = tuple(w if isinstance(w, str) else tuple(map(_token_id, w)) for w in words)
        except (TypeError, ValueError):
            raise UserError("bad_words must be a list of words (text or token id sequences)",
                            field="bad_words") from None
        if any(isinstance(w, str) and not w.strip() for w in words):
            raise UserError("bad_words must be a list of non-empty strings", field="bad_words")
        object.__setattr__(self, "bad_words", words)
        try:
            ids = tuple(dict.fromkeys(tuple(_token_id(t) for t in w) for w in self.bad_words_ids))
        except (TypeError, ValueError):
            raise UserError("bad_words must be a list of words (token id sequences)",
                            field="bad_words") from None
        if any(not 0 < len(w) <= MAX_BAD_LEN for w in ids) or len(ids) > MAX_BAD_WORDS:
            raise UserError(f"bad_words takes at most {MAX_BAD_WORDS} token sequences (a word "
                            "counts once or twice: with and without a leading space) of 1 to "
                            f"{MAX_BAD_LEN} tokens each", field="bad_words")
        object.__setattr__(self, "bad_words_ids", ids)

    def _check_stops(self):
        """stop (strings, bounded) and stop_token_ids (token ids)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if (len(stop) > MAX_STOP_STRINGS
                or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
            raise UserError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                            f"{MAX_STOP_CHARS} characters each", field="stop")
        object.__setattr__(self, "stop", stop)
        try:
            ids = tuple(_token_id(t) for t in self.stop_token_ids or ())
        except (TypeError, ValueError):
            raise UserError("stop_token_ids must be a list of token ids",
                            field="stop_token_ids") from None
        object.__setattr__(self, "stop_token_ids", ids)

    @classmethod
    def of(cls, params: "SamplingParams | None" = None, /, **kw) -> "SamplingParams":
        """`params`, or one made from keywords: SamplingParams' fields, and `max_new_tokens` for
        max_tokens (the older keyword form of `LLM.generate`; a None keyword keeps the default but
        for max_tokens and seed). Giving both is a UserError."""
        if params is not None and kw:
            raise UserError(f"give a SamplingParams or keywords ({', '.join(sorted(kw))}), "
                            "not both")
        if params is not None:
            if not isinstance(params, cls):
                raise UserError(f"sampling_params must be a SamplingParams, got "
                                f"{type(params).__name__}")
            return params
        if "max_new_tokens" in kw:
            if "max_tokens" in kw:
                raise UserError("give max_tokens or max_new_tokens, not both", field="max_tokens")
            kw["max_tokens"] = kw.pop("max_new_tokens")
        if bad := sorted(set(kw) - {f.name for f in dataclasses.fields(cls)}):
            raise TypeError(f"SamplingParams has no parameter {', '.join(bad)}")
        return cls(**{k: v for k, v in kw.items() if v is not None or k in ("max_tokens", "seed")})

    @classmethod
    def fields_of(cls, source) -> dict:
        """The values `source` (a mapping, or an object: an HTTP body, parsed flags) gives under
        SamplingParams' field names, None ones left out: a field added here reaches every source
        that names it the same."""
        if isinstance(source, Mapping):
            return {f.name: source[f.name] for f in dataclasses.fields(cls)
                    if source.get(f.name) is not None}
        return {f.name: v for f in dataclasses.fields(cls)
                if (v := getattr(source, f.name, None)) is not None}

    @classmethod
    def from_fields(cls, source, /, **overrides) -> "SamplingParams":
        """One made from `fields_of(source)`, then `overrides` (the values a source names
        otherwise: an HTTP body's max_completion_tokens, its response_format, ...)."""
        return cls(**{**cls.fields_of(source), **overrides})

    @property
    def listed_ids(self) -> tuple[int, ...]:
        """Every token id logit_bias or allowed_token_ids names (one table on the device)."""
        return tuple(sorted({k for k, _ in self.logit_bias} | set(self.allowed_token_ids or ())))

    @property
    def named_ids(self) -> tuple[int, ...]:
        """Every token id the parameters name (their vocabulary check)."""
        return tuple(sorted(set(self.listed_ids) | {t for w in self.bad_words_ids for t in w}))

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens (penalties, bad words): the device
        keeps them for it (`write_history`)."""
        return self.penalized or bool(self.bad_words_ids)


def _token_id(x) -> int:
    """A token id from an int or its decimal string (JSON object keys are strings); ValueError
    else."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer, str)):
        raise ValueError(x)
    value = int(x)
    if value < 0 or (isinstance(x, str) and x.strip() != str(value)):
        raise ValueError(x)
    return value


def check_seed(seed) -> str | None:
    """Why `seed` cannot be a request's seed (one line), or None (a request's seed is never
    None)."""
    return RULES["seed"].problem("seed", seed, optional=False)
