"""Penalties and bad words: the rules that read a request's earlier tokens, per row on the device.

A leaf below `sampling` (errors, then jax; the per-row parameters come in as `sampling.SamplingRows`,
read by field):

    bad_words_ids    vLLM's bad words (strings) as token id sequences
    write_history    the tokens of the rows that need them into the per-slot token history the
                     programs keep on the device ([slots, max_model_len] int32, by position)
    history_counts   per row, output counts and prompt occurrences of every token, read from that history
    penalize         presence / frequency / repetition penalties and bad words, per row, from it
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dcp_jax.errors import UserError

MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_BAD_WORDS, MAX_BAD_LEN = 32, 8  # token sequences one row may ban, tokens per sequence (fixed shape)


def bad_words_ids(encode, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad words as token sequences: each word encoded (no special tokens) as it is (its leading
    spaces stripped) and with one leading space, the second kept when it starts with another token and
    is as long (a word alone and a word after a space are different tokens to byte-level BPE).
    `encode(text) -> ids`."""
    out: list[tuple[int, ...]] = []
    if isinstance(words, str):
        words = [words]
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise UserError("bad_words must be a list of non-empty strings")
        bare = tuple(encode(word.lstrip()))
        out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(w for w in out if w)


def write_history(history, params, rows, positions, tokens, ok, every_row: bool = False):
    """history int32 [S, L] (each slot's tokens by position) with `tokens` written at (`rows`,
    `positions`) where `ok` and the row needs its history (penalties, bad words; `params`:
    `SamplingRows`; with `every_row`, every row: the device n-gram proposer reads them all); all
    four of one shape. A batch in which no row needs it is returned as it is."""
    need = params.needs_history()
    if every_row:
        need = jnp.ones_like(need)

    def write():
        keep = ok & need[rows]
        return history.at[rows, jnp.where(keep, positions, history.shape[1])].set(tokens, mode="drop")

    return jax.lax.cond(jnp.any(need), write, lambda: history)


HISTORY_CHUNK = 2048  # history positions one step of the count loop reads


def history_counts(history, prompt_len, upto, vocab: int):
    """Per row, each token's count in the output before position `upto` (positions from `prompt_len`
    on) and whether it occurs in the prompt before it: (counts [R, V] int32, in_prompt [R, V] bool).
    The history [R, L] is read HISTORY_CHUNK positions at a time up to the longest `upto` of the batch,
    so the cost follows the context the rows have, not max_model_len, and no [R, L]-sized index array
    is made."""
    r, length = history.shape
    chunk = min(HISTORY_CHUNK, length)
    rows = jnp.broadcast_to(jnp.arange(r)[:, None], (r, chunk))

    def body(i, carry):
        counts, in_prompt = carry
        start = jnp.minimum(i * chunk, length - chunk)  # the last chunk may overlap the one before it
        pos = start + jnp.arange(chunk, dtype=jnp.int32)
        ids = jnp.clip(jax.lax.dynamic_slice_in_dim(history, start, chunk, axis=1), 0, vocab - 1)
        fresh = (pos >= i * chunk)[None] & (pos[None] < upto[:, None])  # (not counted by an earlier chunk)
        prompt = fresh & (pos[None] < prompt_len[:, None])
        counts = counts.at[rows, ids].add((fresh & ~prompt).astype(jnp.int32))
        return counts, in_prompt.at[rows, ids].max(prompt)

    steps = (jnp.max(upto) + chunk - 1) // chunk
    return jax.lax.fori_loop(0, steps, body, (jnp.zeros((r, vocab), jnp.int32), jnp.zeros((r, vocab), bool)))


def penalize(logits, params, history, positions):
    """logits [R, T, V] with each row's penalties and bad words applied, the token at (r, t) following
    the context history[r, :positions[r, t]] (prompt below params.prompt_len, output from it on; for
    t > 0 the positions follow each other, a verify step's: the tokens between are drafts, output).

    Penalties (vLLM's): where a token occurs in the context, a positive logit is divided by the row's
    repetition penalty and a negative one multiplied; then frequency x (its count in the output) and
    presence x (whether it occurs in the output) are subtracted. Bad words: a word's last token is
    banned where the output ends with the word's other tokens. Each part is skipped (a `lax.cond`) when no
    row of the batch uses it."""
    r, t, v = logits.shape
    length = history.shape[1]
    col = lambda x: x[:, None]  # noqa: E731

    def penalties():
        counts, in_prompt = history_counts(history, params.prompt_len, positions[:, 0], v)
        out = []
        for j in range(t):  # column j: the drafts before it added to column 0's counts, one at a time
            if j:
                at = positions[:, 0] + j - 1
                tok = jnp.clip(jnp.take_along_axis(history, jnp.clip(at, 0, length - 1)[:, None], axis=1)[:, 0], 0, v - 1)
                counts = counts.at[jnp.arange(r), tok].add((at < positions[:, j]).astype(jnp.int32))
            x = logits[:, j]
            rep = jnp.where(in_prompt | (counts > 0), col(params.repetition), 1.0)
            x = jnp.where(x > 0, x / rep, x * rep)
            out.append(x - col(params.frequency) * counts - col(params.presence) * (counts > 0))
        return jnp.stack(out, axis=1).astype(logits.dtype)

    def bad_words():
        m = MAX_BAD_LEN - 1
        at = positions[..., None] + jnp.arange(-m, 0, dtype=jnp.int32)  # [R, T, m]: the context's last m
        ctx = jnp.take_along_axis(history, jnp.clip(at, 0, length - 1).reshape(r, -1), axis=1).reshape(at.shape)
        ctx = jnp.where(at >= params.prompt_len[:, None, None], ctx, -2)  # the output's tokens only (vLLM's)
        words = params.bad_words  # [R, W, MAX_BAD_LEN]
        prefix, last = words[..., :m], words[..., m]
        match = jnp.all((prefix[:, None] < 0) | (prefix[:, None] == ctx[:, :, None]), axis=-1)  # [R, T, W]
        hit = match & (last[:, None] >= 0)
        rows = jnp.broadcast_to(jnp.arange(r)[:, None, None], hit.shape)
        cols = jnp.broadcast_to(jnp.arange(t)[None, :, None], hit.shape)
        ids = jnp.broadcast_to(jnp.maximum(last, 0)[:, None], hit.shape)
        banned = jnp.zeros((r, t, v), bool).at[rows, cols, ids].max(hit)
        return jnp.where(banned, -jnp.inf, x)

    x = jax.lax.cond(jnp.any(params.penalized()), penalties, lambda: logits)
    return jax.lax.cond(jnp.any(params.bad_words >= 0), bad_words, lambda: x)
