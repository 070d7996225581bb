"""What the step programs run on, by name: `StepInputs` (rows of T tokens: the decode loop, the verify
step) and `RaggedInputs` (one flat batch of many rows' tokens: the ragged step), with `build`, which
lays a plan's rows out on the host. Plain dataclasses registered as pytrees; shapes only depend on the
`ServingConfig`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dcp_jax.sampling import SamplingRows
from pallas_kernels.attention import ragged


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What a step program runs on, by name: R rows (sequences) of T tokens.

    tokens, positions int32 [R, T]; valid bool [R, T] (padding and idle slots False: nothing written);
    kv_len int32 [R] (tokens in cache once the row is written); block_table int32 [R, blocks];
    sampling: per-row SamplingRows [R]; token_mask int32 [R, T, ⌈V/32⌉]: the tokens a constrained row
    may emit at each position (structured outputs; bit v of a row's words = token v allowed).
    """

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    kv_len: jax.Array
    block_table: jax.Array
    sampling: SamplingRows
    token_mask: jax.Array

    @classmethod
    def spec(cls, rows: int, tokens: int, blocks: int, words: int) -> "StepInputs":
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return cls(i32(rows, tokens), i32(rows, tokens), jax.ShapeDtypeStruct((rows, tokens), jnp.bool_), i32(rows),
                   i32(rows, blocks), SamplingRows.spec(rows), i32(rows, tokens, words))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyInputs(StepInputs):
    """The verify loop's inputs: the StepInputs of its first verify step [S, k+1] (column 0 each
    slot's last token, not yet in the cache; columns 1..k the drafts of the rows whose drafts are
    `given`), and per slot: budget int32 [S], the most tokens the slot may emit in this call (its
    pages are reserved for them); given bool [S], whether the slot's drafts of the first step come
    from the host (a host proposer, or a structured output's row: its token mask covers them) rather
    than from the device's proposer. valid[:, 0] says the slot decodes."""

    budget: jax.Array
    given: jax.Array

    @classmethod
    def spec(cls, rows: int, tokens: int, blocks: int, words: int) -> VerifyInputs:
        base = StepInputs.spec(rows, tokens, blocks, words)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(StepInputs)},
                   budget=jax.ShapeDtypeStruct((rows,), jnp.int32),
                   given=jax.ShapeDtypeStruct((rows,), jnp.bool_))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RaggedInputs(StepInputs):
    """One ragged step: the tokens of many rows (decode rows and prefill chunks) end to end, by name.

    The StepInputs of one flat row: tokens, positions int32 [1, N]; valid bool [1, N] (padding past the
    last row False: nothing written); per slot (rows are slots: row s reads and writes block-table row
    s): kv_len int32 [S] (tokens in cache once the row is written; 0 for a slot with nothing this step),
    block_table int32 [S, blocks], sampling SamplingRows [S]; and logits_at int32 [S]: the flat index of
    each row's last token, whose logits are sampled; tiles: how the tokens are cut per row
    (pallas_kernels.attention.ragged); next_token int32 [N]: for the prompt tokens of a request that
    scores its prompt (prompt logprobs), the prompt token after each, else -1.
    """

    logits_at: jax.Array
    tiles: ragged.RaggedTiles
    next_token: jax.Array

    @classmethod
    def spec(cls, n: int, rows: int, blocks: int, tile: int, words: int) -> "RaggedInputs":
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return cls(i32(1, n), i32(1, n), jax.ShapeDtypeStruct((1, n), jnp.bool_), i32(rows), i32(rows, blocks),
                   SamplingRows.spec(rows), i32(rows, 1, words), i32(rows),
                   ragged.RaggedTiles.spec(n, ragged.group_shapes(n, rows, tile)), i32(n))

    @classmethod
    def build(cls, rows, n: int, slots: int, block_table, tile: int, token_mask, eos_token_ids=()) -> "RaggedInputs":
        """Host arrays for `rows`: (slot, request, first position, token ids) each, laid end to end and
        padded to `n` tokens; the row of a slot samples the token after its last one (under
        `token_mask` [S, 1, W] when it is constrained)."""
        tokens, positions, valid = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool)
        kv_len, logits_at = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
        next_token = np.full(n, -1, np.int32)
        by_slot, starts, lens, slot_ids, firsts, at = [None] * slots, [], [], [], [], 0
        for slot, request, start, ids in rows:
            m = len(ids)
            tokens[at:at + m], positions[at:at + m], valid[at:at + m] = ids, np.arange(start, start + m), True
            kv_len[slot], logits_at[slot], by_slot[slot] = start + m, at + m - 1, request
            if request.scores_prompt and start + 1 < request.num_prompt_tokens:
                after = request.prompt_token_ids[start + 1:start + m + 1]
                next_token[at:at + len(after)] = after
            starts.append(at), lens.append(m), slot_ids.append(slot), firsts.append(start)
            at += m
        tiles = ragged.plan(starts, lens, slot_ids, n, ragged.group_shapes(n, slots, tile), positions=firsts)
        return cls(tokens[None], positions[None], valid[None], kv_len, np.asarray(block_table, np.int32),
                   SamplingRows.of(by_slot, eos_token_ids), token_mask, logits_at, tiles, next_token)
