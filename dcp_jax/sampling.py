"""Sampling: what a request asks for (`SamplingParams`), its range checks, and the samplers.

A leaf of the package (errors only, then jax): the API, `LLM.generate`, the scheduler's requests and the
device programs all take their sampling rules from here, so each range is checked in one place.

    SamplingParams   temperature (0 = greedy), top-k (0 = off), top-p (1 = off), min-p (0 = off),
                     logit_bias, allowed_token_ids, top_logprobs (0..20 alternatives reported per
                     token); checked on creation
    check_seed       a request's seed: an integer in [0, 2**32) (it becomes a uint32 on the device)
    filter_logits    the one top-k / top-p / min-p rule, per row
    bias_logits      logit_bias and allowed_token_ids, per row (before greedy and sampling alike)
    sample           one SamplingParams for a whole batch (the dense baseline)
    SamplingRows     per-row parameters [R] as device arrays (one program serves every mix)
    ban_stops        min_tokens: no stop id before a row's minimum (logits masked per row)
    sample_rows      per-row sampling with keys from (seed, position): the serving engine's sampler
    top_logprobs     each row's most likely tokens and their log-probabilities (when a row asks)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax.errors import UserError

INT32_MAX = 2**31 - 1  # top_k becomes an int32 on the device
SEED_LIMIT = 2**32  # a seed becomes a uint32 on the device
MAX_BANNED = 16  # stop ids one row may hold back until its min_tokens (EOS ids + stop_token_ids)
MAX_TOP_LOGPROBS = 20  # alternatives a token may report (OpenAI's and vLLM's limit)
MAX_LISTED = 300  # token ids one row may list in logit_bias and allowed_token_ids together (fixed shape)
MAX_BIAS = 100.0  # |logit_bias| (OpenAI's range)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; top_logprobs: how many of the most likely
    tokens (and their log-probabilities under the model) each generated token reports, 0..20; min_p
    (0 = off): after temperature, top-k and top-p, drop tokens less likely than min_p times the most
    likely one; logit_bias {token id: bias in [-100, 100]} added to the logits, and allowed_token_ids
    (None = all) the only ids that may be emitted, both before greedy and sampled choices alike (the
    reported logprobs stay the model's own). Token ids are checked against the vocabulary where the
    request meets a model (`Request.problem`). Every other value is checked here, where a request
    enters, so nothing out of range reaches a device array."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    top_logprobs: int = 0
    min_p: float = 0.0
    logit_bias: tuple = ()  # ((token id, bias), ...); a dict is accepted and sorted
    allowed_token_ids: tuple | None = None

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
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))

    @property
    def listed_ids(self) -> tuple[int, ...]:
        """Every token id logit_bias or allowed_token_ids names (their vocabulary check)."""
        return tuple(sorted({k for k, _ in self.logit_bias} | set(self.allowed_token_ids or ())))


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

    @classmethod
    def spec(cls, rows: int) -> "SamplingRows":
        f32, i32 = jnp.float32, jnp.int32
        return cls(*(jax.ShapeDtypeStruct((rows,), dt) for dt in (f32, i32, f32, jnp.uint32, i32)),
                   jax.ShapeDtypeStruct((rows, MAX_BANNED), i32), jax.ShapeDtypeStruct((rows,), i32),
                   jax.ShapeDtypeStruct((rows,), f32), jax.ShapeDtypeStruct((rows, MAX_LISTED), i32),
                   jax.ShapeDtypeStruct((rows, MAX_LISTED), f32), jax.ShapeDtypeStruct((rows,), jnp.bool_))

    @classmethod
    def of(cls, rows, eos_token_ids=()) -> "SamplingRows":
        """Host arrays for `rows`: requests (`.sampling`, `.seed`, `.min_tokens`, `.banned_ids(eos)`) or
        None (greedy, never read). The values were range-checked when the requests entered."""
        ban = np.full((len(rows), MAX_BANNED), -1, np.int32)
        until = np.zeros(len(rows), np.int32)
        listed, bias = np.full((len(rows), MAX_LISTED), -1, np.int32), np.zeros((len(rows), MAX_LISTED), np.float32)
        only = np.zeros(len(rows), bool)
        for i, r in enumerate(rows):
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
                   listed=listed, bias=bias, only_listed=only)


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


def sample_rows(logits, params: SamplingRows, positions):
    """logits [R, V] float32 -> (tokens [R] int32, log-probability of each under the model [R], and
    `top_logprobs`' (ids, log-probabilities) [R, MAX_TOP_LOGPROBS]).

    Each row samples with its own parameters and a key from (seed, position of the new token): the same
    row at the same position draws the same token, whatever else shares the batch.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)  # under the model's raw logits
    x = bias_logits(ban_stops(logits, params, positions), params)
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
