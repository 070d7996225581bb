"""Who proposes the drafts a verify step checks: n-gram prompt lookup (on the device, or a host
proposer) or a draft model (device).

    SpeculativeConfig(method="ngram" | "draft", num_tokens=k, draft=CausalLM | None)

Both feed the same verify program (`dcp_jax.serving.engine`), which checks each decoding sequence's
drafts in one forward of k + 1 tokens. A host proposer is any object with `propose(request, num) ->
list[int]` (at most `num` drafts; `ServingEngine.proposer`, an `NgramProposer` for method "ngram");
a draft model drafts on the device instead, inside the verify program.

- n-gram (`ngram_drafts` on the device; `NgramProposer` / `propose_ngram`, the same rule on the
  host): no model, no memory. Find the most recent earlier occurrence of the context's
  last n tokens (n from `max_n` down to `min_n`) and propose the k tokens that followed it. The
  continuation is read from the context extended by the tokens proposed so far, so a repeat shorter
  than k (a greedy cycle of period 3, say) still fills all k. Suits long-context work that quotes or
  edits its own context. Deterministic: its q is one-hot (see `dcp_jax.spec.verify`). The device
  version reads the token history the runner keeps per slot, so the verify loop proposes, verifies
  and proposes again with no host round trip; the host version serves a proposer handed in
  (`SpeculativeConfig.proposer`) and rows with a structured output (their drafts' token masks are
  made on the host).
- draft model: a smaller checkpoint with the target's vocabulary on the same mesh. Its KV pages are
  **sharded like the target's** and share the target's page ids and block table: one allocator,
  one prefix cache and one preemption rule cover both, a rejected draft is rolled back by the same
  global length, and the draft's KV per device shrinks with dcp like the target's (a replicated draft
  cache would cost every device the whole draft context, which at long context is what DCP exists
  to avoid). It drafts inside the verify program (k + 1 one-token steps: the last writes the KV of
  the k-th draft so the draft cache always holds every accepted position), so no host round trip
  separates drafting from verifying.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np

from dcp_jax.errors import UserError

METHODS = ("ngram", "draft")


@dataclasses.dataclass(frozen=True, eq=False)
class SpeculativeConfig:
    """method "ngram" or "draft"; num_tokens = k drafts per verify step; draft: the draft `CausalLM`
    (method "draft" only); min_n / max_n: the n-gram lengths tried (longest first); proposer: the
    host proposer of method "ngram" (any object with `propose(request, num) -> drafts`; default:
    none, the drafts are looked up on the device); auto_off: turn speculation off for a while when it
    measures slower than plain decoding (`dcp_jax.spec.policy.SpecSwitch`; never on several
    processes in lockstep, whose plans must not depend on a clock)."""

    method: str
    num_tokens: int = 4
    draft: object | None = None
    min_n: int = 1
    max_n: int = 4
    proposer: object | None = None
    auto_off: bool = True

    def __post_init__(self):
        if self.method not in METHODS:
            raise UserError(f"speculative must be one of {METHODS} (or None), got {self.method!r}")
        if not (isinstance(self.num_tokens, int) and not isinstance(self.num_tokens, bool) and self.num_tokens >= 1):
            raise UserError(f"num_speculative_tokens must be an integer >= 1, got {self.num_tokens!r}")
        if (self.method == "draft") != (self.draft is not None):
            raise UserError("speculative='draft' needs a draft model (draft_model=DIR) and only it takes one")
        if self.proposer is not None and self.method != "ngram":
            raise UserError("a host proposer serves speculative='ngram' only")
        if not 1 <= self.min_n <= self.max_n:
            raise UserError(f"n-gram lengths need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if not isinstance(self.auto_off, bool):
            raise UserError(f"auto_off must be True or False, got {self.auto_off!r}")

    @property
    def on_device_ngram(self) -> bool:
        """Whether the drafts are n-gram lookups made on the device (no host proposer handed in)."""
        return self.method == "ngram" and self.proposer is None

    def verify_steps(self, decode_steps: int) -> int:
        """Verify steps one program call runs: `decode_steps`, as plain decoding's loop, when the
        drafts are made on the device; 1 with a host proposer (its drafts need the host)."""
        return 1 if self.proposer is not None else decode_steps


class NgramProposer:
    """Prompt lookup over each request's prompt + output (kept as a growing NumPy array per
    request)."""

    def __init__(self, num_tokens: int, min_n: int = 1, max_n: int = 4):
        self.k, self.min_n, self.max_n = num_tokens, min_n, max_n
        self._history = weakref.WeakKeyDictionary()  # Request -> (buffer, length)

    def context(self, request) -> np.ndarray:
        """The request's tokens [0, num_tokens) as int32, appended to incrementally."""
        n = request.num_tokens
        buf, have = self._history.get(request, (np.zeros(0, np.int32), 0))
        if n < have:  # never happens (tokens are only appended); rebuild rather than trust it
            buf, have = np.zeros(0, np.int32), 0
        if n > len(buf):
            grown = np.zeros(max(n, 2 * len(buf), 64), np.int32)
            grown[:have] = buf[:have]
            buf = grown
        if n > have:
            buf[have:n] = request.token_ids(have, n)
        self._history[request] = (buf, n)
        return buf[:n]

    def propose(self, request, num: int | None = None) -> list[int]:
        """Up to `num` (default k) drafts following the request's context; [] when no n-gram
        recurs."""
        return propose_ngram(self.context(request), self.k if num is None else num, self.min_n, self.max_n)


def propose_ngram(tokens: np.ndarray, num: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """The `num` tokens after the most recent earlier occurrence of the last n tokens of `tokens`
    (the longest n in [min_n, max_n] that recurs), continuing through the proposal itself when the
    match is closer than `num` to the end. [] when none recurs."""
    length = len(tokens)
    if num <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # starts j < length - n with tokens[j:j+n] == the last n tokens
        hit = tokens[:length - n] == tokens[length - n]
        for i in range(1, n):
            hit &= tokens[i:length - n + i] == tokens[length - n + i]
        found = np.flatnonzero(hit)
        if found.size:
            src = int(found[-1]) + n  # first token after the match
            ext = list(tokens[src:src + num])  # tokens already in the context
            while len(ext) < num:  # the match runs into the end: copy on through the proposal
                ext.append(ext[len(ext) - (length - src)])
            return [int(t) for t in ext]
    return []


def ngram_drafts(history, length, num: int, min_n: int = 1, max_n: int = 4):
    """`propose_ngram` on the device, for every row at once: history int32 [S, L] (each row's tokens
    by position; only the first `length` [S] of a row are its context, what lies past them is never
    read), `num` drafts per row. Returns (drafts int32 [S, num], found bool [S]): the tokens after
    the most recent earlier occurrence of the row's last n tokens (the longest n in [min_n, max_n]
    that recurs), continuing through the proposal itself when the match is closer than `num` to the
    end; a row where none recurs has found False (its drafts are zeros, never used).

    Per n, one pass over [S, L]: `run` holds, for every end position e, whether the tokens ending at
    e match the context's last m + 1; the largest e below length - 1 is the most recent match."""
    import jax.numpy as jnp

    s, size = history.shape
    ends = jnp.arange(size, dtype=jnp.int32)[None]
    run = jnp.ones((s, size), bool)
    best = jnp.full((s,), -1, jnp.int32)  # the end of the chosen match
    for m in range(max_n):
        tail = jnp.take_along_axis(history, jnp.clip(length - 1 - m, 0, size - 1)[:, None], axis=1)
        back = jnp.pad(history, ((0, 0), (m, 0)))[:, :size]  # back[e] = history[e - m]
        run = run & (back == tail) & (ends >= m)
        if m + 1 >= min_n:  # a longer n found overrides a shorter one
            end = jnp.max(jnp.where(run & (ends < length[:, None] - 1), ends, -1), axis=1)
            best = jnp.where(end >= 0, end, best)
    src = best + 1  # the first token after the match
    period = jnp.maximum(length - src, 1)
    at = src[:, None] + jnp.arange(num, dtype=jnp.int32)[None] % period[:, None]
    drafts = jnp.take_along_axis(history, jnp.clip(at, 0, size - 1), axis=1)
    found = best >= 0
    return jnp.where(found[:, None], drafts, 0).astype(jnp.int32), found


def layer_skip_draft(model, mesh, num_layers: int, *, scan_layers: bool = True):
    """A draft model made of `model`'s first `num_layers` layers with its embeddings, final norm and
    head (self-speculation: the same vocabulary by construction, no second checkpoint to train).
    Returns a `CausalLM` on `mesh`; `LLM.save` writes it as a checkpoint like any other."""
    from dcp_jax.config import ModelConfig
    from dcp_jax.model import CausalLM
    from dcp_jax.weights import DictSource

    cfg = model.config
    if not (isinstance(num_layers, int) and 1 <= num_layers < cfg.num_layers):
        raise UserError(f"a layer-skip draft keeps 1..{cfg.num_layers - 1} of the {cfg.num_layers} layers, "
                        f"got {num_layers!r}")
    # saved as its config
    small = ModelConfig.from_dict(dict(cfg.hf_config, num_hidden_layers=num_layers))
    weights = model.hf_weights()
    dtype = model.embed_tokens.get_value().dtype
    return CausalLM(small, DictSource(weights, small, mesh, dtype), mesh, scan_layers=scan_layers)


def check_draft(model, draft) -> None:
    """Refuse a draft model (a `CausalLM`) whose tokens the target `model` cannot read (another
    vocabulary)."""
    if draft.config.vocab_size != model.config.vocab_size:
        raise UserError(f"the draft model's vocabulary ({draft.config.vocab_size} ids) differs from the "
                        f"target's ({model.config.vocab_size}): give a draft model with the same tokenizer")


def host_proposer(config: SpeculativeConfig | None):
    """The proposer of a speculative configuration whose drafts are made on the host, or None."""
    if config is None or config.method != "ngram":
        return None
    return config.proposer or NgramProposer(config.num_tokens, config.min_n, config.max_n)
