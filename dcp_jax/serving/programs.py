"""The step programs' bodies and the one cache of compiled programs.

    ProgramCache   every compiled program of one runner (step programs, the history fill, the host
                   tier's copies, a disaggregated pair's gathers and writes), keyed (kind, *sizes),
                   compiled once, with the time spent compiling: `ModelRunner.programs`
    StepPrograms   what the runner's device programs compute, as pure functions of (weights, caches,
                   history, inputs) -> (caches, history, outputs...); no device state lives here

    ragged:   one step of N flat tokens (one of `config.step_sizes`): every row's tokens (decode
              rows and prompt chunks of many requests, end to end) written through its own
              block-table row and attended in tiles of that row (pallas_kernels.attention.ragged);
              the token after each row's last one sampled                        [jit, donated]
    decode:   every slot [S] for up to K steps in one while_loop: forward one token, write,
              sample, record                                                     [jit, donated]
    verify:   (speculative decoding, instead of decode) a while_loop of up to M verify steps:
              each slot's drafts proposed on the device (n-gram lookup over the token history, or
              the draft model's k steps), then its last token + k drafts [S, k+1] in one forward,
              written and accepted; the accepted drafts + one target token of every step come back
              end to end [S, M·(k+1)] with a count per slot; no host round trip between
              steps                                                              [jit, donated]

Shapes depend only on the `ServingConfig` (slots, blocks per sequence, step sizes, K): requests come
and go with no recompilation. Sampling is per row (`dcp_jax.sampling.sample_rows`) with a key
derived from (seed, position), so a request recomputed after preemption samples the same tokens
again.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dcp_jax import mesh as mesh_lib
from dcp_jax.errors import UserError
from dcp_jax.layers import AttentionContext
from dcp_jax.layout import PagedLayout
from dcp_jax.model import CausalLM
from dcp_jax.penalties import write_history
from dcp_jax.sampling import MAX_TOP_LOGPROBS, bias_logits, sample_rows, score_tokens
from dcp_jax.serving.config import ServingConfig
from dcp_jax.serving.inputs import RaggedInputs, StepInputs, VerifyInputs
from dcp_jax.spec import verify as spec_verify
from dcp_jax.spec.proposers import SpeculativeConfig, ngram_drafts
from pallas_kernels.attention import kv_quant as kvq


class ProgramCache:
    """Compiled programs keyed (kind, *sizes): `get(key, build)` compiles with `build()` the first
    time a key is asked for and counts the seconds. Safe to fill from several threads (compiles of
    different keys run at once; XLA's compiler releases the GIL)."""

    def __init__(self):
        self._programs: dict[tuple, object] = {}
        self._lock = threading.Lock()
        self.compile_s = 0.0  # seconds spent compiling (summed over threads)

    def get(self, key: tuple, build: Callable[[], object]):
        program = self._programs.get(key)
        if program is None:
            t = time.perf_counter()
            program = build()
            with self._lock:
                self.compile_s += time.perf_counter() - t
                program = self._programs.setdefault(key, program)
        return program

    def kind(self, kind: str) -> dict:
        """The programs compiled of one kind, by the rest of their key."""
        return {k[1:]: p for k, p in list(self._programs.items()) if k[0] == kind}

    def __contains__(self, key) -> bool:
        return key in self._programs

    def __getitem__(self, key):
        return self._programs[key]

    def __iter__(self):
        return iter(list(self._programs))

    def __len__(self) -> int:
        return len(self._programs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Caches:
    """What every step program takes and donates: the target's pools and the draft model's (None
    without one: an empty subtree, so one program signature serves both)."""

    target: tuple
    draft: tuple | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """The programs' weights: the target's and the draft model's (None without one)."""

    target: object
    draft: object = None


class StepPrograms:
    """A `CausalLM` (and an optional draft model) on a ("tp","dcp") mesh: the abstract pools, the
    step programs' bodies, and their compiled forms in `cache`."""

    def __init__(self, model: CausalLM, mesh: Mesh, config: ServingConfig, layout: PagedLayout, *,
                 impl: str | None = None, combine: str = "auto",
                 speculative: SpeculativeConfig | None = None):
        self.model, self.mesh, self.config, self.layout = model, mesh, config, layout
        self.impl, self.combine, self.speculative = impl, combine, speculative
        self.graphdef, params = nnx.split(model)
        self.dtype = model.embed_tokens.get_value().dtype
        self.max_blocks_per_seq = layout.blocks_for(config.max_model_len)
        self.draft = speculative.draft if speculative is not None else None
        # n-gram drafts made on the device read every row's token history: every program keeps it
        self.keep_history = speculative is not None and speculative.on_device_ngram
        # verify steps per verify-loop call, and its output's columns (each step emits <= k + 1)
        self.verify_steps = 0 if speculative is None else speculative.verify_steps(
            config.decode_steps)
        self.verify_width = 0 if speculative is None else self.verify_steps * (
            speculative.num_tokens + 1)
        kv_spec = mesh_lib.kv_pool_spec(model.head_axes, model.context_axes, stacked=True)
        self.pool_sharding = mesh_lib.named(mesh, kv_spec)
        draft_params = draft_sharding = None
        if self.draft is not None:
            self.draft_graphdef, draft_params = nnx.split(self.draft)
            d_axes = self.draft.context_axes
            self.draft_layout = draft_layout(layout, mesh_lib.axis_size(mesh, d_axes))
            draft_spec = mesh_lib.kv_pool_spec(self.draft.head_axes, d_axes, stacked=True)
            draft_sharding = mesh_lib.named(mesh, draft_spec)
        self.weights = Weights(params, draft_params)
        self.shardings = Caches(self.pool_sharding, draft_sharding)
        self.replicated = mesh_lib.named(mesh, mesh_lib.spec())
        # a token mask row: ⌈V/32⌉ int32 words
        self.mask_words = (model.config.vocab_size + 31) // 32
        self.cache = ProgramCache()

    # --- abstract values -------------------------------------------------------------------------
    def pool_shapes(self) -> Caches:
        """Per layer stack, the global shapes of its pools: [layers, N·pages, K, page, D] ((k, v),
        or MLA's latent); the draft model's on the same pages (one block table), its own layers, kv
        heads and head dim: a draft page holds the draft's share of the same tokens as the target's
        page."""
        n = self.layout.num_shards * self.config.num_pages
        m, d = self.model, self.draft
        width = kvq.width(m.config.head_dim, self.config.kv_quant)  # (8-bit rows carry their scale)
        target = m.stacked_shapes((n, m.kv_heads, self.config.page_size, width))
        draft = None if d is None else d.stacked_shapes(
            (n, d.kv_heads, self.draft_layout.page_size, d.config.head_dim))
        return Caches(target, draft)

    def pool_spec(self) -> Caches:
        """Abstract values of the pools (with their shardings): nothing allocated."""
        shapes = self.pool_shapes()

        def spec(shapes, sharding, dtype):
            if shapes is None:
                return None
            return tuple(tuple(jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in layer)
                         for layer in shapes)

        target_dtype = kvq.storage_dtype(self.config.kv_quant, self.dtype)
        return Caches(spec(shapes.target, self.shardings.target, target_dtype),
                      spec(shapes.draft, self.shardings.draft, self.dtype))

    def history_spec(self) -> jax.ShapeDtypeStruct:
        """The abstract token history [S, max_model_len] int32, replicated."""
        shape = (self.config.max_num_seqs, self.config.max_model_len)
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.replicated)

    def context(self, block_table, layout: PagedLayout | None = None) -> AttentionContext:
        """The target's pools' context, or with `layout` the draft model's (kept in the model
        dtype)."""
        return AttentionContext(self.mesh, layout or self.layout, self.impl, self.combine,
                                block_table=block_table, max_seq_len=self.config.max_model_len,
                                kv_quant=self.config.kv_quant if layout is None else None)

    # --- compiled programs ------------------------------------------------------------------------
    def compiled(self, name: str, fn, *args, outputs: int = 2):
        """`fn` (weights, caches, history, ...) -> (caches, history, `outputs` more) jitted with the
        pools and the history donated and compiled for `args` (abstract), once per shape."""
        key = (name,) + tuple(np.shape(a) for a in jax.tree.leaves(args[2:]))

        def build():
            jitted = jax.jit(fn, donate_argnames=("caches", "history"),
                             out_shardings=(self.shardings,) + (self.replicated,) * (outputs + 1))
            return jitted.lower(*args).compile()

        return self.cache.get(key, build)

    def ragged_program(self, n: int):
        """The compiled ragged step of `n` tokens (one of `config.step_sizes`) over every slot:
        (weights, caches, history, RaggedInputs) -> (caches, history, tokens [S], logprobs [S], top
        logprobs, prompt scores)."""
        s, nb = self.config.max_num_seqs, self.max_blocks_per_seq
        inputs = RaggedInputs.spec(n, s, nb, self.config.ragged_tile, self.mask_words)
        return self.compiled("ragged", self.ragged_step, self.weights, self.pool_spec(),
                             self.history_spec(), inputs, outputs=4)

    def decode_program(self):
        """The compiled decode loop over every slot: (weights, caches, history, StepInputs [S, 1]
        (the tokens and positions to start from, valid = the slot decodes), num_steps) -> (caches,
        history, tokens [S, K], logprobs [S, K], top logprobs [S, K, 20]); runs num_steps <= K
        steps (also a speculative engine's plain iterations, while speculation is off)."""
        s, nb = self.config.max_num_seqs, self.max_blocks_per_seq
        return self.compiled("decode", self.decode, self.weights, self.pool_spec(),
                             self.history_spec(), StepInputs.spec(s, 1, nb, self.mask_words),
                             jax.ShapeDtypeStruct((), jnp.int32), outputs=3)

    def verify_program(self):
        """The compiled verify loop over every slot: (weights, caches, history, VerifyInputs
        [S, k+1], num_steps) -> (caches, history, tokens [S, W], counts [S], logprobs [S, W], top
        logprobs [S, W, 20], (drafted [S], accepted by draft position [k], verify steps [S])), W =
        `verify_width` (see `verify_loop`)."""
        s, nb = self.config.max_num_seqs, self.max_blocks_per_seq
        t = self.speculative.num_tokens + 1
        return self.compiled("verify", self.verify_loop, self.weights, self.pool_spec(),
                             self.history_spec(), VerifyInputs.spec(s, t, nb, self.mask_words),
                             jax.ShapeDtypeStruct((), jnp.int32), outputs=5)

    def draft_fill_program(self, n: int):
        """The compiled fill of a draft model's cache, `n` tokens per slot: (weights, caches,
        history, StepInputs [S, n] (its sampling and mask unused)) -> (caches, history)."""
        s, nb = self.config.max_num_seqs, self.max_blocks_per_seq
        return self.compiled("draft_fill", self.draft_fill, self.weights, self.pool_spec(),
                             self.history_spec(), StepInputs.spec(s, n, nb, 1), outputs=0)

    def step_program(self):
        """The program a decode iteration runs: the verify step with speculation, else the decode
        loop."""
        return self.decode_program() if self.speculative is None else self.verify_program()

    def history_program(self, n: int):
        """(history, row, ids [n], count) -> history with row's first `count` positions set to `ids`
        (donated): the tokens a request brings into its slot already computed."""
        length = self.config.max_model_len

        def fill(h, row, ids, m):
            at = jnp.where(jnp.arange(n) < m, jnp.arange(n), length)
            return h.at[row, at].set(ids, mode="drop")

        def build():
            i32 = jax.ShapeDtypeStruct((), jnp.int32)
            jitted = jax.jit(fill, donate_argnums=(0,), out_shardings=self.replicated)
            return jitted.lower(self.history_spec(), i32, jax.ShapeDtypeStruct((n,), jnp.int32),
                                i32).compile()

        return self.cache.get(("history", n), build)

    # --- the programs' bodies ---------------------------------------------------------------------
    def ragged_step(self, weights: Weights, caches: Caches, history, step: RaggedInputs):
        """One ragged step: every row's tokens written and attended in one forward over the flat
        batch, the token after each row's last one sampled. Returns (caches, history, tokens [S],
        logprobs [S], top logprobs: (ids, log-probabilities) [S, 20], and the prompt scores of
        `step.next_token` (`sampling.score_tokens`: logprobs [N], ranks [N], top ids and logprobs
        [N, 20]))."""
        flat = (step.tokens, step.positions, step.valid, step.kv_len)
        draft_pools = caches.draft
        if self.draft is not None:  # the draft model's cache takes the same tokens
            draft = nnx.merge(self.draft_graphdef, weights.draft)
            ctx = self.context(step.block_table, self.draft_layout)
            ctx = dataclasses.replace(ctx, ragged=step.tiles)
            _, draft_pools = draft(*flat, draft_pools, ctx, logits_at=step.logits_at)
        model = nnx.merge(self.graphdef, weights.target)
        ctx = dataclasses.replace(self.context(step.block_table), ragged=step.tiles)
        logits, pools, hidden = model(*flat, caches.target, ctx, logits_at=step.logits_at,
                                      hidden=True)
        scores = score_tokens(model.head_logits, hidden[0], step.next_token)
        history = write_history(history, step.sampling, step.tiles.token_row, step.positions[0],
                                step.tokens[0], step.valid[0], self.keep_history)
        # the new token lands at kv_len
        tok, lp, top = sample_rows(logits, step.sampling, step.kv_len, history, step.token_mask)
        return Caches(pools, draft_pools), history, tok, lp, top, scores

    def verify_loop(self, weights: Weights, caches: Caches, history, step: VerifyInputs,
                    num_steps):
        """Up to `num_steps` verify steps in one while_loop, each proposing on the device: a slot
        takes part while it has budget left (`step.budget`: the tokens its reserved pages hold) and
        drafts at most that budget less one, so it never writes past its pages. A slot whose drafts
        are `given` (host proposals; structured outputs) takes the first step only, with them.
        Returns (caches, history, tokens [S, W] (each step's accepted drafts and extra token, end to
        end), counts [S], logprobs [S, W], top logprobs [S, W, 20], (drafted [S], accepted by draft
        position [k], verify steps [S])). Draws depend on (seed, position) only, so the tokens are
        those of the same steps run one call each."""
        s, t = step.tokens.shape
        k, width, rows = t - 1, self.verify_width, jnp.arange(s)
        cols, col_t = jnp.arange(k, dtype=jnp.int32)[None], jnp.arange(t, dtype=jnp.int32)[None]

        def active(i, emitted):
            return step.valid[:, 0] & (step.budget > emitted) & (~step.given | (i == 0))

        def body(state):
            i, caches, history, cur, pos, emitted, out, counts_of = state
            on = active(i, emitted)
            drafts, room, history = self.propose(history, cur, pos, on)
            given = step.given & (i == 0)
            drafts = jnp.where(given[:, None], step.tokens[:, 1:], drafts)
            room = jnp.where(given, jnp.sum(step.valid[:, 1:], axis=1), room)
            n = jnp.where(on, jnp.minimum(room, jnp.clip(step.budget - emitted - 1, 0, k)), 0)
            valid = jnp.concatenate([on[:, None], cols < n[:, None]], axis=1)
            sub = StepInputs(jnp.concatenate([cur[:, None], drafts], axis=1), pos[:, None] + col_t,
                             valid, jnp.where(on, pos + 1 + n, 0), step.block_table,
                             step.sampling, step.token_mask)
            caches, history, toks, counts, lps, top = self.verify(weights, caches, history, sub)
            counts = jnp.where(on, counts, 0)
            at = jnp.where(col_t < counts[:, None], emitted[:, None] + col_t, width)  # end to end
            out = jax.tree.map(lambda acc, x: acc.at[rows[:, None], at].set(x, mode="drop"), out,
                               (toks, lps, top))
            cur = jnp.where(on, toks[rows, jnp.maximum(counts - 1, 0)], cur)
            drafted, accepted, steps = counts_of
            counts_of = (drafted + n, accepted + jnp.sum(cols < counts[:, None] - 1, axis=0),
                         steps + on)
            return i + 1, caches, history, cur, pos + counts, emitted + counts, out, counts_of

        n_top = (s, width, MAX_TOP_LOGPROBS)
        out = (jnp.zeros((s, width), jnp.int32), jnp.zeros((s, width), jnp.float32),
               (jnp.zeros(n_top, jnp.int32), jnp.zeros(n_top, jnp.float32)))
        zeros = jnp.zeros(s, jnp.int32)
        state = (jnp.int32(0), caches, history, step.tokens[:, 0], step.positions[:, 0], zeros,
                 out, (zeros, jnp.zeros(k, jnp.int32), zeros))
        state = jax.lax.while_loop(
            lambda st: (st[0] < num_steps) & jnp.any(active(st[0], st[5])), body, state)
        _, caches, history, _, _, emitted, (tokens, lps, top), counts_of = state
        return caches, history, tokens, emitted, lps, top, counts_of

    def propose(self, history, cur, pos, on):
        """One verify step's device drafts: (drafts [S, k], how many each row may use [S],
        history). n-gram lookup writes each row's last token `cur` at `pos` into the history first
        and looks its context up there; a draft model drafts inside `verify` (room for k); a host
        proposer's drafts are given (none here)."""
        s, k = cur.shape[0], self.speculative.num_tokens
        none = jnp.zeros((s, k), jnp.int32)
        if self.draft is not None:
            return none, jnp.full((s,), k, jnp.int32), history
        if not self.keep_history:
            return none, jnp.zeros((s,), jnp.int32), history
        history = history.at[jnp.arange(s), jnp.where(on, pos, history.shape[1])].set(
            cur, mode="drop")
        sp = self.speculative
        drafts, found = ngram_drafts(history, pos + 1, k, sp.min_n, sp.max_n)
        return drafts, jnp.where(found, k, 0), history

    def verify(self, weights: Weights, caches: Caches, history, step: StepInputs):
        """One speculative step. step [S, k+1]: column 0 the last token (position p, not yet in
        cache), columns 1..k the drafts (n-gram; ignored with a draft model, which drafts them
        here); valid[:, i] for i >= 1 says draft i exists; kv_len = p + 1 + drafts. Writes the KV of
        every valid column, accepts (dcp_jax.spec.verify) and returns (caches, history, tokens [S,
        k+1], counts [S], logprobs [S, k+1], top logprobs [S, k+1, 20])."""
        tokens, draft_probs, draft_pools = step.tokens, None, caches.draft
        if self.draft is not None:
            drafts, draft_probs, draft_pools = self.draft_tokens(weights.draft, caches.draft, step)
            tokens = jnp.concatenate([step.tokens[:, :1], drafts], axis=1)
        model = nnx.merge(self.graphdef, weights.target)
        logits, pools = model(tokens, step.positions, step.valid, step.kv_len, caches.target,
                              self.context(step.block_table))
        s, t = tokens.shape
        rows = jnp.broadcast_to(jnp.arange(s)[:, None], (s, t))
        history = write_history(history, step.sampling, rows, step.positions, tokens, step.valid,
                                self.keep_history)
        out, counts, lps, top = spec_verify.accept(
            logits.astype(jnp.float32), tokens[:, 1:], step.valid[:, 1:], step.sampling,
            step.positions[:, 0] + 1, history, step.token_mask, draft_probs)
        return Caches(pools, draft_pools), history, out, counts, lps, top

    def draft_tokens(self, draft_params, draft_pools, step: StepInputs):
        """The draft model's k drafts per row [S, k] and their distributions [S, k, V]: one-token
        steps from the last token at p; step i writes position p + i (while i <= the row's drafts,
        so the k-th draft's KV is written too: the draft cache then holds every position the target
        accepts)."""
        draft = nnx.merge(self.draft_graphdef, draft_params)
        ctx = self.context(step.block_table, self.draft_layout)
        s, t = step.tokens.shape
        active, n_drafts = step.valid[:, 0], jnp.sum(step.valid[:, 1:], axis=1)
        v = self.draft.config.vocab_size
        p0, propose = step.positions[:, 0], draft_proposer(step.sampling, s, v)

        def body(i, carry):
            pools, cur, drafts, qs = carry
            pos = p0 + i
            ok = active & (i <= n_drafts)
            kv_len = jnp.where(ok, pos + 1, 0)
            logits, pools = draft(cur[:, None], pos[:, None], ok[:, None], kv_len, pools, ctx)
            d, q = propose(logits[:, 0].astype(jnp.float32), pos + 1)
            drafts = jax.lax.dynamic_update_index_in_dim(drafts, d, i, axis=1)
            qs = jax.lax.dynamic_update_index_in_dim(qs, q, i, axis=1)
            return pools, d, drafts, qs

        init = (draft_pools, step.tokens[:, 0], jnp.zeros((s, t), jnp.int32),
                jnp.zeros((s, t, v), jnp.float32))
        steps = jnp.max(jnp.where(active, n_drafts, -1)) + 1
        draft_pools, _, drafts, qs = jax.lax.fori_loop(0, steps, body, init)
        return drafts[:, :-1], qs[:, :-1], draft_pools

    def decode(self, weights: Weights, caches: Caches, history, step: StepInputs, num_steps):
        """Plain decoding: `num_steps` one-token steps of every active slot. A draft model's cache
        is left as it is: the positions these steps write are filled into it (`draft_fill`, one
        forward of many tokens) before speculation resumes, which costs far less than a draft
        step per token here."""
        model, pools = nnx.merge(self.graphdef, weights.target), caches.target
        s, k_max = step.tokens.shape[0], self.config.decode_steps
        ctx = self.context(step.block_table)
        active = step.valid[:, 0]

        def put(acc, x, k):
            return jax.lax.dynamic_update_index_in_dim(acc, x, k, axis=1)

        def body(state):
            k, pools, history, cur, pos, out, out_lp, out_top = state
            kv_len = jnp.where(active, pos + 1, 0)
            logits, pools = model(cur[:, None], pos[:, None], active[:, None], kv_len, pools, ctx)
            history = write_history(history, step.sampling, jnp.arange(s), pos, cur, active,
                                    self.keep_history)
            tok, lp, top = sample_rows(logits[:, 0], step.sampling, pos + 1, history,
                                       step.token_mask)
            out_top = jax.tree.map(lambda acc, x: put(acc, x, k), out_top, top)
            out, out_lp = put(out, tok, k), put(out_lp, lp, k)
            return k + 1, pools, history, tok, pos + 1, out, out_lp, out_top

        n_top = (s, k_max, MAX_TOP_LOGPROBS)
        state = (jnp.int32(0), pools, history, step.tokens[:, 0], step.positions[:, 0],
                 jnp.zeros((s, k_max), jnp.int32), jnp.zeros((s, k_max), jnp.float32),
                 (jnp.zeros(n_top, jnp.int32), jnp.zeros(n_top, jnp.float32)))
        _, pools, history, _, _, out, out_lp, out_top = jax.lax.while_loop(
            lambda st: st[0] < num_steps, body, state)
        return Caches(pools, caches.draft), history, out, out_lp, out_top

    def draft_fill(self, weights: Weights, caches: Caches, history, step: StepInputs):
        """The draft model's forward over each slot's valid tokens [S, n] (their KV written into its
        cache; the head is unused, so XLA drops it): the positions plain iterations left out."""
        draft = nnx.merge(self.draft_graphdef, weights.draft)
        ctx = self.context(step.block_table, self.draft_layout)
        _, pools = draft(step.tokens, step.positions, step.valid, step.kv_len, caches.draft, ctx)
        return Caches(caches.target, pools), history


def draft_proposer(sp, s: int, v: int):
    """The draft model's choice at one step: (logits [S, V], position [S]) -> (tokens [S], q [S,
    V]); greedy rows take the argmax (q unused), sampled rows draw from the target's own filters."""

    def propose(logits, pos):
        # drafts the target may accept: its logit_bias / allowed ids
        logits = bias_logits(logits, sp)
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

        def sampled():
            q = spec_verify.target_probs(logits[:, None], sp.temperature, sp.top_k, sp.top_p,
                                         sp.min_p)[:, 0]
            keys = spec_verify.row_keys(sp.seed, pos[:, None], spec_verify.DRAFT)[:, 0]
            drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32)
            return jnp.where(sp.temperature > 0, drawn, greedy), q

        return jax.lax.cond(jnp.any(sp.temperature > 0), sampled,
                            lambda: (greedy, jnp.zeros((s, v), jnp.float32)))

    return propose


def draft_layout(layout: PagedLayout, draft_shards: int) -> PagedLayout:
    """The draft model's pages over the target's blocks (`PagedLayout.same_blocks`), or a
    UserError."""
    try:
        return layout.same_blocks(draft_shards)
    except ValueError as e:
        raise UserError(f"the draft model cannot share the target's KV pages: {e}; choose a page "
                        "size that is a multiple of the tp size, or a draft of the target's "
                        "attention kind (MLA or not)") from None
