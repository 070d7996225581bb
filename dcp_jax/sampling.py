"""Sampling: what a request asks for (`SamplingParams`), its range checks, and the samplers.

A leaf of the package (errors only, then jax): the API, `LLM.generate`, the scheduler's requests and the
device programs all take their sampling rules from here, so each range is checked in one place.

    SamplingParams   temperature (0 = greedy), top-k (0 = off), top-p (1 = off), min-p (0 = off),
                     logit_bias, allowed_token_ids, top_logprobs (0..20 alternatives reported per
                     token), presence / frequency / repetition penalties, bad words (as token id
                     sequences: `penalties.bad_words_ids` makes them from strings), prompt_logprobs;
                     checked on creation
    check_seed       a request's seed: an integer in [0, 2**32) (it becomes a uint32 on the device)
    filter_logits    the one top-k / top-p / min-p rule, per row
    bias_logits      logit_bias and allowed_token_ids, per row (before greedy and sampling alike)
    sample           one SamplingParams for a whole batch (the dense baseline)
    SamplingRows     per-row parameters [R] as device arrays (one program serves every mix)
    ban_stops        min_tokens: no stop id before a row's minimum (logits masked per row)
    sample_rows      per-row sampling with keys from (seed, position): the serving engine's sampler
    top_logprobs     each row's most likely tokens and their log-probabilities (when a row asks)
    (the penalties and bad words, and the token history they read: dcp_jax.penalties)
    score_tokens     the log-probability, rank and top alternatives of given tokens at every position of a
                     flat batch (prompt logprobs, echo), chunk by chunk
"""

from __future__ import annotations

import dataclasses
import math

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
SCORE_CHUNK = 64  # tokens whose full logits `score_tokens` holds at once (its temp: [64, V] float32 a few times)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; top_logprobs: how many of the most likely
    tokens (and their log-probabilities under the model) each generated token reports, 0..20; min_p
    (0 = off): after temperature, top-k and top-p, drop tokens less likely than min_p times the most
    likely one; logit_bias {token id: bias in [-100, 100]} added to the logits, and allowed_token_ids
    (None = all) the only ids that may be emitted, both before greedy and sampled choices alike (the
    reported logprobs stay the model's own). Token ids are checked against the vocabulary where the
    request meets a model (`Request.problem`). Every other value is checked here, where a request
    enters, so nothing out of range reaches a device array.

    Penalties as vLLM defines them: repetition_penalty (1 = off, > 0) divides the positive logits and
    multiplies the negative ones of every token in the prompt or the output so far; frequency_penalty
    (0 = off, in [-2, 2]) is subtracted once per occurrence of a token in the output, presence_penalty
    (likewise) once for any occurrence. bad_words_ids: token sequences never completed in the output
    (the last token of each is banned where the output ends with the ones before it). prompt_logprobs
    (None = off, else 0..20 alternatives): each prompt token's log-probability given the tokens before
    it, its rank and the most likely alternatives (vLLM's; what `echo` with logprobs reports).
    structured: what the output must match (`dcp_jax.structured`: a dict such as {"json": schema}, kept
    as a (kind, text) pair; the grammar is compiled where the request meets a tokenizer)."""

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

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float, np.number)) or not (math.isfinite(t) and t >= 0):
            raise UserError(f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= INT32_MAX:
            raise UserError(f"top_k must be an integer in [0, {INT32_MAX}] (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float, np.number)) or not 0 < p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {p!r}")
        n = self.top_logprobs
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_TOP_LOGPROBS:
            raise UserError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}")
        object.__setattr__(self, "top_logprobs", int(n))
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float, np.number)) or not 0 <= m <= 1:
            raise UserError(f"min_p must be in [0, 1], got {m!r}")
        object.__setattr__(self, "min_p", float(m))
        bias = self.logit_bias
        items = bias.items() if isinstance(bias, dict) else bias
        try:
            pairs = tuple(sorted((_token_id(k), float(b)) for k, b in items))
        except (TypeError, ValueError):
            raise UserError("logit_bias must map token ids to numbers in [-100, 100]") from None
        if any(not -MAX_BIAS <= b <= MAX_BIAS for _, b in pairs) or len({k for k, _ in pairs}) != len(pairs):
            raise UserError("logit_bias must map distinct token ids to numbers in [-100, 100]")
        object.__setattr__(self, "logit_bias", pairs)
        allowed = self.allowed_token_ids
        if allowed is not None:
            try:
                allowed = tuple(sorted({_token_id(a) for a in allowed}))
            except (TypeError, ValueError):
                raise UserError("allowed_token_ids must be a list of token ids") from None
            if not allowed:
                raise UserError("allowed_token_ids must name at least one token id")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if len(self.listed_ids) > MAX_LISTED:
            raise UserError(f"logit_bias and allowed_token_ids list {len(self.listed_ids)} token ids together; "
                            f"at most {MAX_LISTED} are supported")
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float, np.number)) or not -MAX_PENALTY <= x <= MAX_PENALTY:
                raise UserError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {x!r}")
            object.__setattr__(self, name, float(x))
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float, np.number)) or not (math.isfinite(r) and r > 0):
            raise UserError(f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
        object.__setattr__(self, "repetition_penalty", float(r))
        try:
            words = tuple(dict.fromkeys(tuple(_token_id(t) for t in w) for w in self.bad_words_ids))
        except (TypeError, ValueError):
            raise UserError("bad_words must be a list of words (token id sequences)") from None
        if any(not 0 < len(w) <= MAX_BAD_LEN for w in words) or len(words) > MAX_BAD_WORDS:
            raise UserError(f"bad_words takes at most {MAX_BAD_WORDS} token sequences (a word counts once or twice: "
                            f"with and without a leading space) of 1 to {MAX_BAD_LEN} tokens each")
        object.__setattr__(self, "bad_words_ids", words)
        spec = self.structured
        if isinstance(spec, dict):
            spec = structured_spec(spec)
        elif spec is not None:  # a (kind, text) pair (a list once it went through JSON)
            if not isinstance(spec, (tuple, list)) or len(spec) != 2 or spec[0] not in KINDS or not isinstance(spec[1], str):
                raise UserError(f"structured must be a dict with one of {', '.join(KINDS)}")
            spec = tuple(spec)
        object.__setattr__(self, "structured", spec)
        n = self.prompt_logprobs
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_TOP_LOGPROBS:
                raise UserError(f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {n!r}")
            object.__setattr__(self, "prompt_logprobs", int(n))
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))

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
    """Why `seed` cannot be a request's seed (one line), or None."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT:
        return f"seed must be an integer in [0, 2**32), got {seed!r}"
    return None


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters [R] (a registered dataclass: one program serves every mix)."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = off
    top_p: jax.Array  # float32; 1 = off
    seed: jax.Array  # uint32
    ban_until: jax.Array  # int32: a new token at a position below it is never one of ban_ids (min_tokens)
    ban_ids: jax.Array  # int32 [R, MAX_BANNED]; -1 = none
    num_top: jax.Array  # int32: top_logprobs (0: the row reports none)
    min_p: jax.Array  # float32; 0 = off
    listed: jax.Array  # int32 [R, MAX_LISTED]: ids logit_bias or allowed_token_ids names; -1 = none
    bias: jax.Array  # float32 [R, MAX_LISTED]: their logit_bias (0 for an allowed id without one)
    only_listed: jax.Array  # bool: allowed_token_ids given (only listed ids may be emitted)
    presence: jax.Array  # float32; 0 = off
    frequency: jax.Array  # float32; 0 = off
    repetition: jax.Array  # float32; 1 = off
    prompt_len: jax.Array  # int32: positions below it are the prompt's (penalties, bad words)
    bad_words: jax.Array  # int32 [R, MAX_BAD_WORDS, MAX_BAD_LEN], each word right-aligned; -1 = none
    constrained: jax.Array  # bool: structured output (the step's token mask applies)

    @classmethod
    def spec(cls, rows: int) -> "SamplingRows":
        f32, i32 = jnp.float32, jnp.int32
        return cls(*(jax.ShapeDtypeStruct((rows,), dt) for dt in (f32, i32, f32, jnp.uint32, i32)),
                   jax.ShapeDtypeStruct((rows, MAX_BANNED), i32), jax.ShapeDtypeStruct((rows,), i32),
                   jax.ShapeDtypeStruct((rows,), f32), jax.ShapeDtypeStruct((rows, MAX_LISTED), i32),
                   jax.ShapeDtypeStruct((rows, MAX_LISTED), f32), jax.ShapeDtypeStruct((rows,), jnp.bool_),
                   *(jax.ShapeDtypeStruct((rows,), dt) for dt in (f32, f32, f32, i32)),
                   jax.ShapeDtypeStruct((rows, MAX_BAD_WORDS, MAX_BAD_LEN), i32),
                   jax.ShapeDtypeStruct((rows,), jnp.bool_))

    @classmethod
    def of(cls, rows, eos_token_ids=()) -> "SamplingRows":
        """Host arrays for `rows`: requests (`.sampling`, `.seed`, `.min_tokens`, `.banned_ids(eos)`) or
        None (greedy, never read). The values were range-checked when the requests entered."""
        ban = np.full((len(rows), MAX_BANNED), -1, np.int32)
        until = np.zeros(len(rows), np.int32)
        listed, bias = np.full((len(rows), MAX_LISTED), -1, np.int32), np.zeros((len(rows), MAX_LISTED), np.float32)
        only = np.zeros(len(rows), bool)
        bad = np.full((len(rows), MAX_BAD_WORDS, MAX_BAD_LEN), -1, np.int32)
        for i, r in enumerate(rows):
            for j, word in enumerate(r.sampling.bad_words_ids if r is not None else ()):
                bad[i, j, MAX_BAD_LEN - len(word):] = word
            if r is not None and (r.sampling.logit_bias or r.sampling.allowed_token_ids is not None):
                ids, biases = r.sampling.listed_ids, dict(r.sampling.logit_bias)
                listed[i, :len(ids)] = ids
                bias[i, :len(ids)] = [biases.get(t, 0.0) for t in ids]
                only[i] = r.sampling.allowed_token_ids is not None
            if r is not None and r.min_tokens:
                ids = r.banned_ids(eos_token_ids)
                ban[i, :len(ids)] = ids
                until[i] = r.num_prompt_tokens + r.min_tokens
        return cls(temperature=np.asarray([r.sampling.temperature if r else 0.0 for r in rows], np.float32),
                   top_k=np.asarray([r.sampling.top_k if r else 0 for r in rows], np.int32),
                   top_p=np.asarray([r.sampling.top_p if r else 1.0 for r in rows], np.float32),
                   seed=np.asarray([r.seed if r else 0 for r in rows], np.uint32), ban_until=until, ban_ids=ban,
                   num_top=np.asarray([r.sampling.top_logprobs if r else 0 for r in rows], np.int32),
                   min_p=np.asarray([r.sampling.min_p if r else 0.0 for r in rows], np.float32),
                   listed=listed, bias=bias, only_listed=only,
                   presence=np.asarray([r.sampling.presence_penalty if r else 0.0 for r in rows], np.float32),
                   frequency=np.asarray([r.sampling.frequency_penalty if r else 0.0 for r in rows], np.float32),
                   repetition=np.asarray([r.sampling.repetition_penalty if r else 1.0 for r in rows], np.float32),
                   prompt_len=np.asarray([r.num_prompt_tokens if r else 0 for r in rows], np.int32), bad_words=bad,
                   constrained=np.asarray([r is not None and r.sampling.structured is not None for r in rows]))

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
