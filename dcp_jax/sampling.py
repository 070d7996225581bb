"""Sampling: what a request asks for (`SamplingParams`), its range rules, and the samplers.

A leaf of the package (errors only, then jax): the API, `LLM.generate`, the CLI, the scheduler's requests
and the device programs all take their sampling rules from here, so each range is written once.

    SamplingParams   one request description, as vLLM's: how many tokens (max_tokens, min_tokens), when to
                     stop (stop, stop_token_ids, ignore_eos), how many samples (n, seed) and how to sample
                     them: temperature (0 = greedy), top-k (0 = off), top-p (1 = off), min-p (0 = off),
                     logit_bias, allowed_token_ids, top_logprobs (0..20 alternatives reported per token),
                     presence / frequency / repetition penalties, bad words (text, or token id sequences),
                     prompt_logprobs, structured; checked on creation
    RULES            the numeric parameters' ranges, one row each (type, bounds, what the neutral value
                     means, the CLI's help): `SamplingParams` checks against them, `Request.problem` and
                     the CLI's flags (`dcp_jax.cli.add_sampling_args`) too
    check_seed       a request's seed: an integer in [0, 2**32) (it becomes a uint32 on the device)
    filter_logits    the one top-k / top-p / min-p rule, per row
    bias_logits      logit_bias and allowed_token_ids, per row (before greedy and sampling alike)
    sample           one SamplingParams for a whole batch (the dense baseline)
    SamplingRows     per-row parameters [R] as device arrays (one program serves every mix), each
                     field filled from the request attribute its metadata names
    ban_stops        min_tokens: no stop id before a row's minimum (logits masked per row)
    sample_rows      per-row sampling with keys from (seed, position): the serving engine's sampler
    top_logprobs     each row's most likely tokens and their log-probabilities (when a row asks)
    (the penalties and bad words, and the token history they read: dcp_jax.penalties)
    score_tokens     the log-probability, rank and top alternatives of given tokens at every position of a
                     flat batch (prompt logprobs, echo), chunk by chunk

A new sampling parameter touches three places: its field in `SamplingParams` (with its row in `RULES`
when it is a number: the CLI flag and the range check come from that row), the `SamplingRows` field it
fills (its metadata names the parameter) and its test.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax.errors import UserError
from dcp_jax.penalties import MAX_BAD_LEN, MAX_BAD_WORDS, MAX_PENALTY, penalize
from dcp_jax.structured import KINDS, mask_logits, structured_spec

INT32_MAX = 2**31 - 1  # top_k becomes an int32 on the device
SEED_LIMIT = 2**32  # a seed becomes a uint32 on the device
MAX_BANNED = 16  # stop ids one row may hold back until its min_tokens (EOS ids + stop_token_ids)
MAX_TOP_LOGPROBS = 20  # alternatives a token may report (OpenAI's and vLLM's limit)
MAX_LISTED = 300  # token ids one row may list in logit_bias and allowed_token_ids together (fixed shape)
MAX_BIAS = 100.0  # |logit_bias| (OpenAI's range)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 512  # stop strings per request, characters per stop string
SCORE_CHUNK = 64  # tokens whose full logits `score_tokens` holds at once (its temp: [64, V] float32 a few times)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A numeric parameter's range: `kind` int or float (a float must be finite); `low` / `high` bounds
    (None = unbounded), excluded where `low_open` / `high_open`; `optional`: None is allowed too;
    `note`: what a neutral value means ("0 = off"); `help`: the CLI flag's help; `high_text`: how the
    upper bound is written ("2**32")."""

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
        if self.low is not None and self.high is not None:
            hi = self.high_text or f"{self.high:g}"
            span = f"in {'(' if self.low_open else '['}{self.low:g}, {hi}{')' if self.high_open else ']'}"
            text = f"{what} {span}" if self.kind is int else span
        elif self.low is not None:
            text = f"{what} {'>' if self.low_open else '>='} {self.low:g}"
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
        return None if self.ok(value, optional) else f"{name} must be {self.describe(optional)}, got {value!r}"


# name -> its range: the one place each numeric sampling parameter's rule is written
RULES: dict[str, Rule] = {
    "max_tokens": Rule(int, 1, optional=True, help="tokens to generate at most (None: up to the model length)"),
    "min_tokens": Rule(int, 0, help="no end-of-sequence (or stop) token before this many tokens"),
    "n": Rule(int, 1, help="samples per prompt (sample j draws with seed + j; they share the prompt's prefill)"),
    "seed": Rule(int, 0, SEED_LIMIT, high_open=True, high_text="2**32", optional=True,
                 help="the sampling seed (None: a random one)"),
    "temperature": Rule(float, 0, help="0 = greedy"),
    "top_k": Rule(int, 0, INT32_MAX, note="0 = off", help="keep the k most likely tokens (0 = off)"),
    "top_p": Rule(float, 0, 1, low_open=True, help="keep the most likely tokens whose mass reaches p (1 = off)"),
    "min_p": Rule(float, 0, 1, help="drop tokens less likely than this times the most likely one (0 = off)"),
    "top_logprobs": Rule(int, 0, MAX_TOP_LOGPROBS,
                         help="report each token's N most likely alternatives and their log-probabilities"),
    "prompt_logprobs": Rule(int, 0, MAX_TOP_LOGPROBS, optional=True,
                            help="report each prompt token's log-probability and its N most likely alternatives"),
    "presence_penalty": Rule(float, -MAX_PENALTY, MAX_PENALTY,
                             help="subtracted from a token's logit once it occurs in the output"),
    "frequency_penalty": Rule(float, -MAX_PENALTY, MAX_PENALTY,
                              help="subtracted from a token's logit per occurrence in the output"),
    "repetition_penalty": Rule(float, 0, low_open=True, note="1 = off",
                               help="divides the positive logits (multiplies the negative) of tokens in the "
                                    "prompt or output"),
}


def check(name: str, value) -> None:
    """UserError(field=name) when `value` breaks `name`'s rule in `RULES`."""
    if (problem := RULES[name].problem(name, value)) is not None:
        raise UserError(problem, field=name)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's description, as vLLM's `SamplingParams` (`LLM.generate(prompts, params)`; the CLI,
    the server and the disaggregated pair build requests from one too: `dcp_jax.serving.request.
    make_requests`). Every value is checked on creation (numbers against `RULES`; UserError's `field`
    names the parameter), so nothing out of range reaches a device array; token ids are checked against
    the vocabulary where the request meets a model (`Request.problem`).

    max_tokens (None: until the model length; vLLM's default 16), min_tokens (no stop before it), n
    samples per prompt (sample j draws with seed + j; seed None: a random one), stop strings (cut from
    the text unless include_stop_str_in_output; they need a tokenizer), stop_token_ids, ignore_eos,
    skip_special_tokens (of the text).

    temperature 0 = greedy; top_k 0 = off; top_p 1 = off; top_logprobs: how many of the most likely
    tokens (and their log-probabilities under the model) each generated token reports, 0..20; min_p
    (0 = off): after temperature, top-k and top-p, drop tokens less likely than min_p times the most
    likely one; logit_bias {token id: bias in [-100, 100]} added to the logits, and allowed_token_ids
    (None = all) the only ids that may be emitted, both before greedy and sampled choices alike (the
    reported logprobs stay the model's own).

    Penalties as vLLM defines them: repetition_penalty (1 = off, > 0) divides the positive logits and
    multiplies the negative ones of every token in the prompt or the output so far; frequency_penalty
    (0 = off, in [-2, 2]) is subtracted once per occurrence of a token in the output, presence_penalty
    (likewise) once for any occurrence. bad_words: words never generated, as text (made token sequences
    by the tokenizer where the request is built: `penalties.bad_words_ids`) or as token id lists;
    bad_words_ids: the token sequences the device bans (the last token of each is banned where the
    output ends with the ones before it). prompt_logprobs (None = off, else 0..20 alternatives): each
    prompt token's log-probability given the tokens before it, its rank and the most likely
    alternatives (vLLM's; what `echo` with logprobs reports). structured: what the output must match
    (`dcp_jax.structured`: a dict such as {"json": schema}, kept as a (kind, text) pair; the grammar is
    compiled where the request meets a tokenizer).

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
        for name in RULES:
            check(name, getattr(self, name))
        for name, kind in (("temperature", float), ("top_k", int), ("top_p", float), ("top_logprobs", int),
                           ("min_p", float), ("presence_penalty", float), ("frequency_penalty", float),
                           ("repetition_penalty", float), ("min_tokens", int), ("n", int)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        for name in ("max_tokens", "seed", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise UserError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({self.max_tokens})",
                            field="min_tokens")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise UserError(f"{name} must be True or False, got {getattr(self, name)!r}", field=name)
        self._check_ids()
        self._check_words()
        self._check_stops()
        spec = self.structured
        if isinstance(spec, dict):
            spec = structured_spec(spec)
        elif spec is not None:  # a (kind, text) pair (a list once it went through JSON)
            if not isinstance(spec, (tuple, list)) or len(spec) != 2 or spec[0] not in KINDS or not isinstance(spec[1], str):
                raise UserError(f"structured must be a dict with one of {', '.join(KINDS)}", field="structured")
            spec = tuple(spec)
        object.__setattr__(self, "structured", spec)

    def _check_ids(self):
        """logit_bias and allowed_token_ids: token ids (and biases in range), sorted."""
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = tuple(sorted((_token_id(k), float(b)) for k, b in items))
        except (TypeError, ValueError):
            raise UserError("logit_bias must map token ids to numbers in [-100, 100]", field="logit_bias") from None
        if any(not -MAX_BIAS <= b <= MAX_BIAS for _, b in pairs) or len({k for k, _ in pairs}) != len(pairs):
            raise UserError("logit_bias must map distinct token ids to numbers in [-100, 100]", field="logit_bias")
        object.__setattr__(self, "logit_bias", pairs)
        allowed = self.allowed_token_ids
        if allowed is not None:
            try:
                allowed = tuple(sorted({_token_id(a) for a in allowed}))
            except (TypeError, ValueError):
                raise UserError("allowed_token_ids must be a list of token ids", field="allowed_token_ids") from None
            if not allowed:
                raise UserError("allowed_token_ids must name at least one token id", field="allowed_token_ids")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if len(self.listed_ids) > MAX_LISTED:
            raise UserError(f"logit_bias and allowed_token_ids list {len(self.listed_ids)} token ids together; "
                            f"at most {MAX_LISTED} are supported", field="logit_bias")

    def _check_words(self):
        """bad_words (text or id lists, as given) and bad_words_ids (distinct token sequences)."""
        words = self.bad_words
        words = (words,) if isinstance(words, str) else words
        try:
            words = tuple(w if isinstance(w, str) else tuple(_token_id(t) for t in w) for w in words)
        except (TypeError, ValueError):
            raise UserError("bad_words must be a list of words (text or token id sequences)", field="bad_words") from None
        if any(isinstance(w, str) and not w.strip() for w in words):
            raise UserError("bad_words must be a list of non-empty strings", field="bad_words")
        object.__setattr__(self, "bad_words", words)
        try:
            ids = tuple(dict.fromkeys(tuple(_token_id(t) for t in w) for w in self.bad_words_ids))
        except (TypeError, ValueError):
            raise UserError("bad_words must be a list of words (token id sequences)", field="bad_words") from None
        if any(not 0 < len(w) <= MAX_BAD_LEN for w in ids) or len(ids) > MAX_BAD_WORDS:
            raise UserError(f"bad_words takes at most {MAX_BAD_WORDS} token sequences (a word counts once or twice: "
                            f"with and without a leading space) of 1 to {MAX_BAD_LEN} tokens each", field="bad_words")
        object.__setattr__(self, "bad_words_ids", ids)

    def _check_stops(self):
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if (len(stop) > MAX_STOP_STRINGS
                or any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
            raise UserError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings of at most "
                            f"{MAX_STOP_CHARS} characters each", field="stop")
        object.__setattr__(self, "stop", stop)
        try:
            ids = tuple(_token_id(t) for t in self.stop_token_ids or ())
        except (TypeError, ValueError):
            raise UserError("stop_token_ids must be a list of token ids", field="stop_token_ids") from None
        object.__setattr__(self, "stop_token_ids", ids)

    @classmethod
    def of(cls, params: "SamplingParams | None" = None, /, **kw) -> "SamplingParams":
        """`params`, or one made from keywords: SamplingParams' fields, and `max_new_tokens` for max_tokens
        (the older keyword form of `LLM.generate`). Giving both is a UserError."""
        if params is not None and kw:
            raise UserError(f"give a SamplingParams or keywords ({', '.join(sorted(kw))}), not both")
        if params is not None:
            if not isinstance(params, cls):
                raise UserError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
            return params
        if "max_new_tokens" in kw:
            if "max_tokens" in kw:
                raise UserError("give max_tokens or max_new_tokens, not both", field="max_tokens")
            kw["max_tokens"] = kw.pop("max_new_tokens")
        names = {f.name for f in dataclasses.fields(cls)}
        if bad := sorted(set(kw) - names):
            raise TypeError(f"SamplingParams has no parameter {', '.join(bad)}")
        return cls(**{k: v for k, v in kw.items() if v is not None or k in ("max_tokens", "seed")})

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
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens (penalties, bad words): the device keeps
        them for it (`write_history`)."""
        return self.penalized or bool(self.bad_words_ids)


def _token_id(x) -> int:
    """A token id from an int or its decimal string (JSON object keys are strings); ValueError else."""
    if isinstance(x, bool) or not isinstance(x, (int, np.integer, str)):
        raise ValueError(x)
    value = int(x)
    if value < 0 or (isinstance(x, str) and x.strip() != str(value)):
        raise ValueError(x)
    return value


def check_seed(seed) -> str | None:
    """Why `seed` cannot be a request's seed (one line), or None (a request's seed is never None)."""
    return RULES["seed"].problem("seed", seed, optional=False)


def filter_logits(x, top_k, top_p, min_p=None):
    """x [R, V] (logits already divided by the temperature) with every entry outside each row's top-k
    (top_k [R] int, 0 = off), outside its top-p nucleus (top_p [R], 1 = off: the smallest set of the
    most likely tokens whose mass reaches top_p) and, with min_p [R] (0 = off), less likely than min_p
    times the most likely token of what is left, set to -inf. The one top-k/top-p/min-p rule of both
    engines."""
    v = x.shape[-1]
    desc = -jnp.sort(-x, axis=-1)  # one sort: masking below the k-th value keeps the order
    kth = jnp.take_along_axis(desc, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=-1)
    x = jnp.where((top_k[:, None] > 0) & (x < kth), -jnp.inf, x)
    desc = jnp.where((top_k[:, None] > 0) & (desc < kth), -jnp.inf, desc)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    cutoff = jnp.min(jnp.where(before < top_p[:, None], desc, jnp.inf), axis=-1)
    x = jnp.where(x < cutoff[:, None], -jnp.inf, x)
    if min_p is not None:  # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p)
        x = jnp.where((min_p[:, None] > 0) & (x < desc[:, :1] + jnp.log(jnp.maximum(min_p, 1e-30))[:, None]),
                      -jnp.inf, x)
    return x


def bias_logits(logits, params: "SamplingRows"):
    """logits [R, ..., V] with each row's logit_bias added and, for a row with allowed_token_ids, every
    other id at -inf (`params.listed` [R, MAX_LISTED] ids, -1 = none, `params.bias` their biases,
    `params.only_listed` [R]). A batch in which no row lists an id is returned as it is."""
    r, v = logits.shape[0], logits.shape[-1]

    def apply():
        rows = jnp.broadcast_to(jnp.arange(r)[:, None], params.listed.shape)
        ids, named = jnp.maximum(params.listed, 0), params.listed >= 0
        bias = jnp.zeros((r, v), jnp.float32).at[rows, ids].add(jnp.where(named, params.bias, 0.0))
        allowed = jnp.zeros((r, v), bool).at[rows, ids].max(named) | ~params.only_listed[:, None]
        adj = jnp.where(allowed, bias, -jnp.inf).reshape((r,) + (1,) * (logits.ndim - 2) + (v,))
        return (logits + adj).astype(logits.dtype)

    return jax.lax.cond(jnp.any(params.listed >= 0), apply, lambda: logits)


def sample(logits, key, params: SamplingParams):
    """logits [B, V] float32 -> (tokens [B] int32, log-probability of each token under the model [B])."""
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    if params.temperature == 0:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        b = logits.shape[0]
        x = filter_logits(logits / params.temperature, jnp.full((b,), params.top_k, jnp.int32),
                          jnp.full((b,), params.top_p, jnp.float32))
        tokens = jax.random.categorical(key, x, axis=-1)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def _row(source: str, dtype, neutral=0, shape: tuple = ()):
    """A `SamplingRows` field: per row the request attribute `source` names ("sampling.top_k": its
    parameter), `neutral` for an empty row; `shape`: the row's own axes (a field filled by hand)."""
    return dataclasses.field(metadata=dict(source=source, dtype=dtype, neutral=neutral, shape=shape))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters [R] (a registered dataclass: one program serves every mix). A field
    with a `source` is filled from that attribute of each request (`of`); the others (source None)
    by `of` itself."""

    temperature: jax.Array = _row("sampling.temperature", np.float32)  # 0 = greedy
    top_k: jax.Array = _row("sampling.top_k", np.int32)  # 0 = off
    top_p: jax.Array = _row("sampling.top_p", np.float32, 1.0)  # 1 = off
    seed: jax.Array = _row("seed", np.uint32)
    # a new token at a position below it is never one of ban_ids (min_tokens); ban_ids -1 = none
    ban_until: jax.Array = _row(None, np.int32)
    ban_ids: jax.Array = _row(None, np.int32, -1, (MAX_BANNED,))
    num_top: jax.Array = _row("sampling.top_logprobs", np.int32)  # 0: the row reports none
    min_p: jax.Array = _row("sampling.min_p", np.float32)  # 0 = off
    # ids logit_bias or allowed_token_ids names (-1 = none), their logit_bias (0 for an allowed id
    # without one), and whether allowed_token_ids was given (only listed ids may be emitted)
    listed: jax.Array = _row(None, np.int32, -1, (MAX_LISTED,))
    bias: jax.Array = _row(None, np.float32, 0.0, (MAX_LISTED,))
    only_listed: jax.Array = _row(None, np.bool_, False)
    presence: jax.Array = _row("sampling.presence_penalty", np.float32)  # 0 = off
    frequency: jax.Array = _row("sampling.frequency_penalty", np.float32)  # 0 = off
    repetition: jax.Array = _row("sampling.repetition_penalty", np.float32, 1.0)  # 1 = off
    prompt_len: jax.Array = _row("num_prompt_tokens", np.int32)  # positions below it: the prompt's
    # each banned word right-aligned; -1 = none
    bad_words: jax.Array = _row(None, np.int32, -1, (MAX_BAD_WORDS, MAX_BAD_LEN))
    constrained: jax.Array = _row(None, np.bool_, False)  # structured output (the step's token mask applies)

    @classmethod
    def spec(cls, rows: int) -> "SamplingRows":
        return cls(**{f.name: jax.ShapeDtypeStruct((rows, *f.metadata["shape"]), f.metadata["dtype"])
                      for f in dataclasses.fields(cls)})

    @classmethod
    def of(cls, rows, eos_token_ids=()) -> "SamplingRows":
        """Host arrays for `rows`: requests (`.sampling`, `.seed`, `.min_tokens`, `.banned_ids(eos)`) or
        None (greedy, never read). The values were range-checked when the requests entered."""
        out = {}
        for f in dataclasses.fields(cls):
            m = f.metadata
            if m["source"] is None:
                out[f.name] = np.full((len(rows), *m["shape"]), m["neutral"], m["dtype"])
            else:
                get = operator.attrgetter(m["source"])
                out[f.name] = np.asarray([m["neutral"] if r is None else get(r) for r in rows], m["dtype"])
        for i, r in enumerate(rows):
            if r is None:
                continue
            for j, word in enumerate(r.sampling.bad_words_ids):
                out["bad_words"][i, j, MAX_BAD_LEN - len(word):] = word
            if r.sampling.logit_bias or r.sampling.allowed_token_ids is not None:
                ids, biases = r.sampling.listed_ids, dict(r.sampling.logit_bias)
                out["listed"][i, :len(ids)] = ids
                out["bias"][i, :len(ids)] = [biases.get(t, 0.0) for t in ids]
                out["only_listed"][i] = r.sampling.allowed_token_ids is not None
            if r.min_tokens:
                ids = r.banned_ids(eos_token_ids)
                out["ban_ids"][i, :len(ids)] = ids
                out["ban_until"][i] = r.num_prompt_tokens + r.min_tokens
            out["constrained"][i] = r.sampling.structured is not None
        return cls(**out)

    def needs_history(self):
        """[R] bool: the rows whose sampling reads their earlier tokens (`SamplingParams.needs_history`)."""
        return self.penalized() | jnp.any(self.bad_words >= 0, axis=(1, 2))

    def penalized(self):
        """[R] bool: the rows with a penalty on."""
        return (self.presence != 0) | (self.frequency != 0) | (self.repetition != 1)


def ban_stops(logits, params: SamplingRows, positions):
    """logits [R, ..., V] with each row's ban_ids at -inf where the new token's position (positions
    [R, ...]) is below its ban_until: a request emits no stop id before its min_tokens."""
    r, v = logits.shape[0], logits.shape[-1]

    def masked():
        rows = jnp.broadcast_to(jnp.arange(r)[:, None], params.ban_ids.shape)
        hit = jnp.zeros((r, v), bool).at[rows, jnp.maximum(params.ban_ids, 0)].max(params.ban_ids >= 0)
        early = positions < params.ban_until.reshape((r,) + (1,) * (positions.ndim - 1))
        hit = hit.reshape((r,) + (1,) * (logits.ndim - 2) + (v,))
        return jnp.where(early[..., None] & hit, -jnp.inf, logits)

    return jax.lax.cond(jnp.any(params.ban_until > 0), masked, lambda: logits)


def top_logprobs(logprobs, params: SamplingRows):
    """(ids int32 [R, ..., MAX_TOP_LOGPROBS], log-probabilities [R, ..., MAX_TOP_LOGPROBS]) of the most
    likely tokens of `logprobs` [R, ..., V], most likely first (the host keeps each row's first
    top_logprobs). A batch in which no row asks skips the top-k and returns zeros."""
    shape = logprobs.shape[:-1] + (MAX_TOP_LOGPROBS,)
    k = min(MAX_TOP_LOGPROBS, logprobs.shape[-1])

    def top():
        lps, ids = jax.lax.top_k(logprobs, k)
        pad = [(0, 0)] * (logprobs.ndim - 1) + [(0, MAX_TOP_LOGPROBS - k)]  # (a vocabulary under 20 ids)
        return jnp.pad(ids.astype(jnp.int32), pad, constant_values=-1), jnp.pad(lps, pad, constant_values=-jnp.inf)

    return jax.lax.cond(jnp.any(params.num_top > 0), top,
                        lambda: (jnp.zeros(shape, jnp.int32), jnp.zeros(shape, logprobs.dtype)))


def score_tokens(head_logits, hidden, targets):
    """Scores of `targets` [N] int32 (each position's next token; -1 = not asked) under the logits of
    `hidden` [N, E] (`head_logits`: [C, E] -> [C, V] float32): (log-probability [N] float32, rank [N]
    int32 (1 = the most likely), and the MAX_TOP_LOGPROBS most likely (ids [N, 20], log-probabilities
    [N, 20])). The logits are made SCORE_CHUNK positions at a time (one [chunk, V] block live), and not
    at all (a `lax.cond`) when no position is asked."""
    n = targets.shape[0]
    c = min(SCORE_CHUNK, n)
    m = -(-n // c)
    h = jnp.pad(hidden, ((0, m * c - n), (0, 0))).reshape(m, c, hidden.shape[-1])
    t = jnp.pad(targets, (0, m * c - n), constant_values=-1).reshape(m, c)

    def chunk(args):
        x, tg = args
        lsm = jax.nn.log_softmax(head_logits(x), axis=-1)
        lp = jnp.take_along_axis(lsm, jnp.maximum(tg, 0)[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(lsm > lp[:, None], axis=-1, dtype=jnp.int32)
        k = min(MAX_TOP_LOGPROBS, lsm.shape[-1])
        top_lp, top_id = jax.lax.top_k(lsm, k)
        pad = ((0, 0), (0, MAX_TOP_LOGPROBS - k))
        return lp, rank, jnp.pad(top_id.astype(jnp.int32), pad, constant_values=-1), jnp.pad(top_lp, pad)

    def run():
        out = jax.lax.map(chunk, (h, t))
        return tuple(x.reshape((m * c,) + x.shape[2:])[:n] for x in out)

    def skip():
        return (jnp.zeros(n, jnp.float32), jnp.zeros(n, jnp.int32), jnp.zeros((n, MAX_TOP_LOGPROBS), jnp.int32),
                jnp.zeros((n, MAX_TOP_LOGPROBS), jnp.float32))

    return jax.lax.cond(jnp.any(targets >= 0), run, skip)


def sample_rows(logits, params: SamplingRows, positions, history, mask):
    """logits [R, V] float32 -> (tokens [R] int32, log-probability of each under the model [R], and
    `top_logprobs`' (ids, log-probabilities) [R, MAX_TOP_LOGPROBS]). history [R, L]: each row's
    tokens by position, the new token's context history[r, :positions[r]] (read by penalties and bad
    words only); mask [R, 1, ⌈V/32⌉] int32: the constrained rows' allowed tokens (structured outputs).

    Each row samples with its own parameters and a key from (seed, position of the new token): the same
    row at the same position draws the same token, whatever else shares the batch.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # under the model's raw logits
    x = bias_logits(ban_stops(logits, params, positions), params)
    x = mask_logits(x[:, None], params.constrained, mask)
    x = penalize(x, params, history, positions[:, None])[:, 0]
    greedy = jnp.argmax(x, axis=-1).astype(jnp.int32)

    def draw():
        x_t = filter_logits(x / jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None],
                            params.top_k, params.top_p, params.min_p)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(params.seed, positions)
        drawn = jax.vmap(jax.random.categorical)(keys, x_t)
        return jnp.where(params.temperature > 0, drawn, greedy).astype(jnp.int32)

    # an all-greedy batch skips the sorts and the draw
    tokens = jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda: greedy)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0], top_logprobs(logprobs, params)
