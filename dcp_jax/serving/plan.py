"""One engine iteration as data: what it runs (`SchedulePlan` and its prefill chunks, made by
`Scheduler.schedule`) and what the device produced for it (`StepOutput`, made by
`ModelRunner.execute` and applied by `Scheduler.update` in one call).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dcp_jax.serving.request import Request


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Tokens [start, start + len(token_ids)) of `request` (prompt + output so far), to write into
    the cache through block-table row `slot`. When `is_last`, the device samples one token after the
    chunk's last row (the request's next token: `StepOutput.first`). When also `joins`, the request
    decodes in the decode loop that follows the ragged step: its decode_steps - 1 tokens after that
    one, from position `end` (their pages are reserved: `StepOutput.joined`)."""

    request: Request
    slot: int
    start: int
    token_ids: list[int]
    is_last: bool
    joins: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclasses.dataclass
class SchedulePlan:
    """What the device runs this iteration. Arrays are copies (safe to hand to the device).

    decode_* arrays are indexed by slot; unused slots have token 0, position 0, mask False and a
    block-table row of NULL_PAGE. Decode step k (0 <= k < decode_steps) of slot s writes the KV of
    position decode_positions[s] + k (its pages are reserved) and samples the token after it; the
    input of step 0 is decode_tokens[s], of step k > 0 the token sampled at step k - 1. The length
    (tokens in cache) seen by step k is decode_positions[s] + k + 1. Every slot runs all K steps;
    the host discards tokens sampled after a request stopped.

    decode_budget[s]: the most tokens slot s may produce this iteration (its pages are reserved for
    them). Without speculation it is K for every decoding slot; with it (`verify_steps` > 0: the
    iteration runs up to that many verify steps, in one program call), min(verify_steps · (k + 1),
    tokens it has left) per slot, and decode_steps is verify_steps · (k + 1), the output's columns:
    the verify steps write the KV of at most budget positions from decode_positions[s] on.

    Without speculation, the K - 1 decode steps after a ragged step also run the requests whose
    prompt ends in it (`PrefillChunk.joins`; only when some request decodes: no loop runs for those
    alone).
    """

    step: int
    prefills: list[PrefillChunk]
    decode_requests: list[Request]
    decode_slots: list[int]
    decode_steps: int  # K; 0 when nothing decodes
    decode_tokens: np.ndarray  # int32 [max_num_seqs]
    decode_positions: np.ndarray  # int32 [max_num_seqs]
    decode_mask: np.ndarray  # bool [max_num_seqs]
    block_table: np.ndarray  # int32 [max_num_seqs, max_blocks_per_seq]
    decode_budget: np.ndarray  # int32 [max_num_seqs]; 0 for slots that do not decode
    preempted: list[str]
    verify_steps: int = 0  # > 0: the decode rows speculate (up to this many verify steps)
    applied: bool = False  # its results were applied (`Scheduler.update`) or its requests failed

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.prefills)

    def decode_rows(self, advance: int = 0) -> list[tuple[int, Request, int]]:
        """(slot, request, position + `advance`) of each decoding slot: the decode loop's rows."""
        return [(slot, r, int(self.decode_positions[slot]) + advance)
                for r, slot in zip(self.decode_requests, self.decode_slots)]

    @property
    def joining(self) -> list[PrefillChunk]:
        """The chunks whose requests decode in the loop after the ragged step
        (`PrefillChunk.joins`)."""
        return [c for c in self.prefills if c.joins]


@dataclasses.dataclass(frozen=True)
class Sampled:
    """Tokens a program sampled, on the host, rows by slot: tokens int32 and logprobs float32 [S,
    n]; `tops`: the top logprobs (ids, logprobs) [S, n, 20] when a request of the step asked, else
    None; `counts` [S]: a verify step's tokens per slot (1 <= count <= its budget), else None (n
    each)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    tops: tuple | None = None
    counts: np.ndarray | None = None

    def then(self, more: "Sampled") -> "Sampled":
        """These columns followed by `more`'s (a ragged step's first token, then the decode
        loop's)."""
        cat = lambda a, b: np.concatenate([a, b], axis=1)  # noqa: E731
        tops = None if self.tops is None else tuple(cat(a, b) for a, b in zip(self.tops, more.tops))
        return Sampled(cat(self.tokens, more.tokens), cat(self.logprobs, more.logprobs), tops)

    def top(self, slot: int, i: int):
        """Column i's top logprobs of row `slot` (ids, logprobs), or None."""
        return None if self.tops is None else (self.tops[0][slot, i], self.tops[1][slot, i])


@dataclasses.dataclass
class StepOutput:
    """What the device produced for one plan, on the host (`ModelRunner.execute`), for
    `Scheduler.update`:

    first    the ragged step's sampled token after each row's last one, [S, 1] (a prefill chunk that
             `is_last`: its request's next token; a decode row: its first token of the iteration)
    decode   the plan's decode rows' tokens [S, K]: the ragged step's first then the loop's K - 1,
    the
             decode loop's K, or a verify step's k + 1 with `counts`
    joined   the loop's K - 1 tokens [S, K - 1] of the requests that joined it (`plan.joining`)
    prompt_scores  (request, start, logprobs, ranks, top ids, top logprobs) per row whose request
             scores its prompt (prompt logprobs)
    timing   the step's device counters (prefill_s, decode_s, decode_steps, ragged_steps,
             rows_computed, rows_useful; draft_fill_s: the part of decode_s that filled a draft
             model's cache after plain iterations)
    drafted / accepted_per_pos / verify_rows   the verify steps' drafts proposed, accepted by
             position, and the verify steps summed over the rows that took part in them
    """

    first: Sampled | None = None
    decode: Sampled | None = None
    joined: Sampled | None = None
    prompt_scores: list = dataclasses.field(default_factory=list)
    timing: dict = dataclasses.field(default_factory=dict)
    drafted: int = 0
    accepted_per_pos: np.ndarray | None = None
    verify_rows: int = 0

    def count(self, key: str, value) -> None:
        self.timing[key] = self.timing.get(key, 0) + value
