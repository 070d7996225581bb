"""Acceptance of drafted tokens against the target's distributions (on device, inside the verify program).

One verify step gives each sequence the target's logits at k + 1 positions: after its last accepted token
and after each of k drafts d_1..d_k. The step's output is d_1..d_n (the accepted prefix) and one more
token from the target, so every step yields between 1 and k + 1 tokens:

    greedy rows:    d_i is accepted iff it equals the target's argmax after d_1..d_{i-1}; the extra
                    token is the target's argmax where the first draft failed (or after the last).
    sampled rows:   standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): d_i, drawn
                    from the proposer's q_i, is accepted with probability min(1, p_i(d_i) / q_i(d_i));
                    at the first rejection the extra token is drawn from the residual
                    norm(max(0, p_i - q_i)); after k acceptances it is drawn from p_{k+1}. Each emitted
                    token is then distributed exactly as the target's p (after temperature, top-k, top-p).

A deterministic proposer (n-gram lookup) proposes with q = one-hot(d): accept with probability p(d), and
the residual is p with d removed. A draft that does not exist (the proposer found fewer than k, or the
sequence may produce fewer tokens) is never accepted and leaves p unchanged at its index.

Random draws use keys from (seed, position of the token drawn, purpose), so a row's draws do not depend
on what shares its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.penalties import penalize
from dcp_jax.sampling import ban_stops, bias_logits, filter_logits, top_logprobs
from dcp_jax.structured import mask_logits

# purposes folded into a row's (seed, position) key
ACCEPT, RESIDUAL, DRAFT = 1, 2, 3


def row_keys(seed, positions, purpose: int):
    """Keys [R, T] from seeds [R] and positions [R, T] for one `purpose`."""
    base = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), purpose))(seed)
    return jax.vmap(lambda k, ps: jax.vmap(lambda p: jax.random.fold_in(k, p))(ps))(base, positions)


def target_probs(logits, temperature, top_k, top_p, min_p=None):
    """logits [R, T, V] -> the sampling distribution of each position [R, T, V] float32 (temperature,
    top-k, top-p and min-p of its row applied; rows with temperature 0 get the temperature-1 softmax,
    unused)."""
    r, t, v = logits.shape
    temp = jnp.where(temperature > 0, temperature, 1.0)
    x = filter_logits((logits / temp[:, None, None]).reshape(r * t, v),
                      jnp.repeat(top_k, t), jnp.repeat(top_p, t), None if min_p is None else jnp.repeat(min_p, t))
    return jax.nn.softmax(x, axis=-1).reshape(r, t, v)


def residual(p, q):
    """norm(max(0, p - q)) over the last axis; p where nothing is left (p == q: rejection impossible)."""
    r = jnp.maximum(p - q, 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    return jnp.where(total > 0, r / jnp.where(total > 0, total, 1.0), p)


def accept(logits, drafts, draft_valid, sampling, positions, history, token_mask, draft_probs=None):
    """Accept drafts against the target.

    logits [R, k+1, V] float32: the target's logits after the last accepted token and after each draft;
    drafts int32 [R, k]; draft_valid bool [R, k] (False: no draft there, never accepted);
    sampling: `SamplingRows` [R]; positions int32 [R]: position of the first token this step emits;
    draft_probs [R, k, V] float32: the proposer's distributions q_i (None: a deterministic proposer,
    q_i = one-hot(d_i)); history [R, L]: each row's tokens by position, the drafts included (the
    penalties and bad words of position i read the drafts before it); token_mask [R, k+1, ⌈V/32⌉]: the
    tokens a constrained row may emit at each position (a draft the grammar refuses is rejected).
    Returns (tokens int32 [R, k+1]: d_1..d_n, then the extra token, then zeros; counts int32 [R] = n + 1;
    logprobs float32 [R, k+1]: each emitted token's log-probability under the target's raw logits; and
    `top_logprobs`' (ids, log-probabilities) [R, k+1, MAX_TOP_LOGPROBS] at each of those positions).
    """
    r, t, v = logits.shape
    k = t - 1
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    idx = jnp.arange(t, dtype=jnp.int32)
    pos = positions[:, None] + idx[None]  # where each emitted token lands
    # min_tokens (no stop id before it), logit_bias, allowed_token_ids, penalties and bad words (the
    # drafts before a position count as its output); the logprobs stay raw
    logits = mask_logits(bias_logits(ban_stops(logits, sampling, pos), sampling), sampling.constrained, token_mask)
    logits = penalize(logits, sampling, history, pos)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [R, k+1]
    sampled = sampling.temperature > 0

    def draw():
        p = target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)  # [R, k+1, V]
        q = (jax.nn.one_hot(drafts, v, dtype=jnp.float32) if draft_probs is None else draft_probs)
        q = jnp.where(draft_valid[..., None], q, 0.0)  # no draft: nothing to subtract, never accepted
        p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
        q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        u = jax.vmap(jax.vmap(jax.random.uniform))(row_keys(sampling.seed, pos[:, :k], ACCEPT))
        ok = draft_valid & (u * q_d < p_d)  # u < p/q without dividing (q_d > 0 for a drafted token)
        n = _accepted(jnp.where(sampled[:, None], ok, draft_valid & (drafts == greedy[:, :k])))
        # the extra token: from the residual at a rejected draft, from p after the last draft
        q_pad = jnp.concatenate([q, jnp.zeros((r, 1, v), q.dtype)], axis=1)
        at = lambda x: jnp.take_along_axis(x, n[:, None, None], axis=1)[:, 0]  # noqa: E731
        dist = residual(at(p), at(q_pad))
        keys = jnp.take_along_axis(row_keys(sampling.seed, pos, RESIDUAL), n[:, None], axis=1)[:, 0]
        extra = jax.vmap(jax.random.categorical)(keys, jnp.log(dist))
        extra = jnp.where(sampled, extra, jnp.take_along_axis(greedy, n[:, None], axis=1)[:, 0])
        return n, extra.astype(jnp.int32)

    def greedy_only():
        n = _accepted(draft_valid & (drafts == greedy[:, :k]))
        return n, jnp.take_along_axis(greedy, n[:, None], axis=1)[:, 0]

    # an all-greedy batch skips the sorts and the draws
    n, extra = jax.lax.cond(jnp.any(sampled), draw, greedy_only)
    drafts_pad = jnp.concatenate([drafts, jnp.zeros((r, 1), drafts.dtype)], axis=1)
    tokens = jnp.where(idx[None] < n[:, None], drafts_pad, jnp.where(idx[None] == n[:, None], extra[:, None], 0))
    logprobs = jnp.take_along_axis(logprobs_all, tokens[..., None], axis=-1)[..., 0]
    return tokens.astype(jnp.int32), n + 1, logprobs, top_logprobs(logprobs_all, sampling)


def _accepted(ok):
    """ok bool [R, k] -> the length of each row's leading run of True [R] int32."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
