"""Sampling: the samplers and the per-row parameters they read.

Below the API (errors, the penalties, structured outputs and `sampling_params`, then jax). What a
request asks for and every range on it live in `dcp_jax.sampling_params` (`SamplingParams`,
`RULES`, `check_seed`: re-exported here); this module turns them into device rows and samples.

    filter_logits    the one top-k / top-p / min-p rule, per row
    bias_logits      logit_bias and allowed_token_ids, per row (before greedy and sampling alike)
    sample           one SamplingParams for a whole batch (the dense baseline)
    SamplingRows     per-row parameters [R] as device arrays (one program serves every mix), each
                     field filled from the request attribute its metadata names
    ban_stops        min_tokens: no stop id before a row's minimum (logits masked per row)
    sample_rows      per-row sampling with keys from (seed, position): the serving engine's sampler
    top_logprobs     each row's most likely tokens and their log-probabilities (when a row asks)
    (the penalties and bad words, and the token history they read: dcp_jax.penalties)
    score_tokens     the log-probability, rank and top alternatives of given tokens at every
                     position of a flat batch (prompt logprobs, echo), chunk by chunk

A new sampling parameter touches three places: its field in `SamplingParams` (with its row in
`RULES` when it is a number), the `SamplingRows` field it fills here (its metadata names the
parameter) and its test.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax.penalties import MAX_BAD_LEN, MAX_BAD_WORDS, penalize
# the request's description and its ranges (re-exported: callers import them from here too)
from dcp_jax.sampling_params import (  # noqa: F401
    INT32_MAX,
    MAX_BIAS,
    MAX_LISTED,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    RULES,
    SEED_LIMIT,
    Rule,
    SamplingParams,
    check,
    check_seed,
)
from dcp_jax.structured import mask_logits

MAX_BANNED = 16  # stop ids one row may hold back until its min_tokens (EOS ids + stop_token_ids)
SCORE_CHUNK = 64  # tokens whose full logits `score_tokens` holds at once (its temp: [64, V] float32 a few times)


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


def _row(source: str | None, dtype, neutral=0, shape: tuple = ()):
    """A `SamplingRows` field: per row the request attribute `source` names ("sampling.top_k": its
    parameter), `neutral` for an empty row; `shape`: the row's own axes (a field filled by hand)."""
    meta = dict(source=source, dtype=dtype, neutral=neutral, shape=shape)
    return dataclasses.field(metadata=meta)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters [R] (a registered dataclass: one program serves every mix). A
    field with a `source` is filled from that attribute of each request (`of`); the others (source
    None) by `of` itself."""

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
    # structured output (the step's token mask applies)
    constrained: jax.Array = _row(None, np.bool_, False)

    @classmethod
    def spec(cls, rows: int) -> "SamplingRows":
        return cls(**{f.name: jax.ShapeDtypeStruct((rows, *f.metadata["shape"]),
                                                   f.metadata["dtype"])
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
                values = [m["neutral"] if r is None else get(r) for r in rows]
                out[f.name] = np.asarray(values, m["dtype"])
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
