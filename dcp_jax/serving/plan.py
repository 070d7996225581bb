"""What one engine iteration runs: the scheduler's plan (`SchedulePlan`) and its prefill chunks.

Plain data made by `dcp_jax.serving.scheduler.Scheduler.schedule` and applied by its `update_*`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dcp_jax.serving.request import Request


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Tokens [start, start + len(token_ids)) of `request` (prompt + output so far), to write into the
    cache through block-table row `slot`. When `is_last`, the device samples one token after the chunk's
    last row (the request's next token) and hands it to `update_prefill`. When also `joins`, the request
    decodes in the decode loop that follows the ragged step: its decode_steps - 1 tokens after that one,
    from position `end` (their pages are reserved), handed to `Scheduler.update_joined`."""

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
    position decode_positions[s] + k (its pages are reserved) and samples the token after it; the input
    of step 0 is decode_tokens[s], of step k > 0 the token sampled at step k - 1. The length (tokens in
    cache) seen by step k is decode_positions[s] + k + 1. Every slot runs all K steps; the host
    discards tokens sampled after a request stopped.

    decode_budget[s]: the most tokens slot s may produce this iteration (its pages are reserved for
    them). Without speculation it is K for every decoding slot; with it, min(k + 1, tokens it has left)
    per slot: a verify step writes the KV of at most budget positions from decode_positions[s] on.

    Without speculation, the K - 1 decode steps after a ragged step also run the requests whose prompt
    ends in it (`PrefillChunk.joins`; only when some request decodes: no loop runs for those alone).
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
    prefill_applied: bool = False
    decode_applied: bool = False
    joined_applied: bool = False

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.prefills)

    def decode_rows(self, advance: int = 0) -> list[tuple[int, Request, int]]:
        """(slot, request, position + `advance`) of each decoding slot: the decode loop's rows."""
        return [(slot, r, int(self.decode_positions[slot]) + advance)
                for r, slot in zip(self.decode_requests, self.decode_slots)]

    @property
    def joining(self) -> list[PrefillChunk]:
        """The chunks whose requests decode in the loop after the ragged step (`PrefillChunk.joins`)."""
        return [c for c in self.prefills if c.joins]

    @property
    def applied(self) -> bool:
        return ((self.prefill_applied or not self.prefills) and (self.decode_applied or not self.decode_slots)
                and (self.joined_applied or not self.joining))
