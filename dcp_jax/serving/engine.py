"""The device side of continuous batching: a paged, sequence-sharded KV pool and two fixed-shape programs.

    pool (per layer stack): [L, N·pages, K, page, D] (kv heads over "tp", each context rank its own pages)
    prefill program:   one request's chunk [1, C] -> write its KV through its block-table row, sample
                       the token after its last row                                      [jit, donated]
    decode program:    every slot [S] for up to K steps in one while_loop: forward one token, write,
                       sample, record                                                    [jit, donated]
    verify program:    (speculative decoding, instead of decode) every slot's last token + k drafts
                       [S, k+1] in one forward, written; the accepted drafts + one target token come
                       back [S, k+1] with a count per slot; a draft model drafts inside it [jit, donated]

The host (`dcp_jax.serving.scheduler`) decides what runs: it admits requests while pages and slots
are free, cuts prompts into chunks under a token budget, reserves the pages of K decode steps
before the decode program runs, and preempts the newest request when pages run out. Shapes depend
only on the configuration (slots, blocks per sequence, chunk length, K): requests come and go with
no recompilation. Sampling is per row (temperature, top-k, top-p, seed) with a key derived from
(seed, position), so a request recomputed after preemption samples the same tokens again.

Speculative decoding (`dcp_jax.spec`) rolls a rejected draft back by the sequence's length alone: the
host advances a request by the tokens it accepted, and every rank-local length and mask is recomputed
on the device from that global length (`PagedLayout`), so the rejected drafts' KV lies past the length,
is never attended to, and is overwritten when the sequence gets there.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dcp_jax import mesh as mesh_lib
from dcp_jax.engine import filter_logits, host, kv_bytes
from dcp_jax.errors import UserError
from dcp_jax.layers import AttentionContext
from dcp_jax.layout import PagedLayout
from dcp_jax.model import CausalLM
from dcp_jax.serving.request import Request
from dcp_jax.serving.scheduler import SchedulePlan, Scheduler, SchedulerConfig
from dcp_jax.spec import verify as spec_verify
from dcp_jax.spec.proposers import NgramProposer, SpeculativeConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters [R] (a registered dataclass: one program serves every mix)."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = off
    top_p: jax.Array  # float32; 1 = off
    seed: jax.Array  # uint32

    @classmethod
    def spec(cls, rows: int) -> "SamplingRows":
        return cls(*(jax.ShapeDtypeStruct((rows,), dt) for dt in (jnp.float32, jnp.int32, jnp.float32, jnp.uint32)))

    @classmethod
    def of(cls, requests: list[Request | None]) -> "SamplingRows":
        """Host arrays for `requests` (None rows: greedy, never read)."""
        temp = [r.sampling.temperature if r else 0.0 for r in requests]
        return cls(temperature=np.asarray(temp, np.float32),
                   top_k=np.asarray([r.sampling.top_k if r else 0 for r in requests], np.int32),
                   top_p=np.asarray([r.sampling.top_p if r else 1.0 for r in requests], np.float32),
                   seed=np.asarray([r.seed if r else 0 for r in requests], np.uint32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What a step program runs on, by name: R rows (sequences) of T tokens.

    tokens, positions int32 [R, T]; valid bool [R, T] (padding and idle slots False: nothing written);
    kv_len int32 [R] (tokens in cache once the row is written); block_table int32 [R, blocks];
    sampling: per-row SamplingRows [R].
    """

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    kv_len: jax.Array
    block_table: jax.Array
    sampling: SamplingRows

    @classmethod
    def spec(cls, rows: int, tokens: int, blocks: int) -> "StepInputs":
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        return cls(i32(rows, tokens), i32(rows, tokens), jax.ShapeDtypeStruct((rows, tokens), jnp.bool_), i32(rows),
                   i32(rows, blocks), SamplingRows.spec(rows))


def sample_rows(logits, params: SamplingRows, positions):
    """logits [R, V] float32 -> (tokens [R] int32, log-probability of each under the model [R]).

    Each row samples with its own parameters and a key from (seed, position of the new token): the same
    row at the same position draws the same token, whatever else shares the batch.
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        x = filter_logits(logits / jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None],
                          params.top_k, params.top_p)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(params.seed, positions)
        drawn = jax.vmap(jax.random.categorical)(keys, x)
        return jnp.where(params.temperature > 0, drawn, greedy).astype(jnp.int32)

    # an all-greedy batch skips the sorts and the draw
    tokens = jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda: greedy)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def parse_bytes(text) -> int:
    """'512MiB', '2GB', '1.5GiB' or a plain number of bytes -> int (at least one byte)."""
    problem = f"memory size {text!r} is not a positive size: write e.g. 512MiB, 2GB or 1073741824"
    if isinstance(text, (int, np.integer)) and not isinstance(text, bool):
        if text < 1:
            raise UserError(problem)
        return int(text)
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in units or not (math.isfinite(value) and value * units[unit] >= 1):
        raise UserError(problem)
    return int(value * units[unit])


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """Shapes that fix the compiled programs: pages per context rank, page size, slots, blocks per
    sequence, the prefill chunk and the decode steps per program call; and the scheduler's prefill token
    budget per iteration (`max_num_batched_tokens`, default one chunk: prefill and decode interleave
    finely; larger prefills more requests before the next decode steps)."""

    num_pages: int
    page_size: int
    max_num_seqs: int
    max_model_len: int
    prefill_chunk: int
    decode_steps: int
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = False


class ServingEngine:
    """A `CausalLM` on a ("tp","dcp") mesh serving requests from a paged, sequence-sharded KV pool."""

    def __init__(self, model: CausalLM, mesh: Mesh, config: PoolConfig, *, interleave: int = 1,
                 impl: str | None = None, combine: str = "auto", detokenize=None,
                 speculative: SpeculativeConfig | None = None):
        self.model, self.mesh, self.config = model, mesh, config
        self.impl, self.combine = impl, combine
        self.graphdef, self.params = nnx.split(model)
        self.dtype = model.embed_tokens.get_value().dtype
        n_ctx = mesh_lib.axis_size(mesh, model.context_axes)
        self.layout = PagedLayout(n_ctx, interleave, config.page_size)
        self.speculative = speculative
        self.proposer = (NgramProposer(speculative.num_tokens, speculative.min_n, speculative.max_n)
                         if speculative is not None and speculative.method == "ngram" else None)
        self.draft = speculative.draft if speculative is not None else None
        if self.draft is not None:
            self.draft_graphdef, self.draft_params = nnx.split(self.draft)
            self.draft_layout = draft_layout(self.layout, mesh_lib.axis_size(mesh, self.draft.context_axes))
            self.draft_pool_sharding = mesh_lib.named(
                mesh, mesh_lib.kv_pool_spec(self.draft.head_axes, self.draft.context_axes, stacked=True))
        self.draft_pools = None
        # verify steps (row by row): drafts proposed, drafts accepted, steps; the tokens they made
        self.spec_counts = dict(spec_drafted_tokens=0, spec_accepted_tokens=0, spec_verify_steps=0)
        self.scheduler_config = SchedulerConfig(
            layout=self.layout, num_pages=config.num_pages, max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens or config.prefill_chunk,
            decode_steps=config.decode_steps, eos_token_ids=tuple(model.config.eos_token_ids),
            vocab_size=model.config.vocab_size, enable_prefix_caching=config.enable_prefix_caching,
            num_speculative_tokens=0 if speculative is None else speculative.num_tokens)
        self.scheduler = Scheduler(self.scheduler_config, detokenize=detokenize)
        self.replicated = mesh_lib.named(mesh, mesh_lib.spec())
        self.pool_sharding = mesh_lib.named(
            mesh, mesh_lib.kv_pool_spec(model.head_axes, model.context_axes, stacked=True))
        self.compiled: dict = {}  # (program, shape) -> executable: a test counts these
        self.pools = None
        # time in the device programs (results on the host) and the tokens they produced for requests
        self.timing = dict(prefill_s=0.0, prefill_tokens=0, decode_s=0.0, decode_tokens=0, decode_steps=0)

    # --- the pool --------------------------------------------------------------------------------
    def pool_shapes(self, num_pages: int | None = None) -> tuple:
        """Per layer stack, the global shapes of its pools: [layers, N·pages, K, page, D] ((k, v), or
        MLA's latent)."""
        n = self.layout.num_shards * (num_pages or self.config.num_pages)
        return self.model.stacked_shapes((n, self.model.kv_heads, self.config.page_size, self.model.config.head_dim))

    def draft_pool_shapes(self) -> tuple:
        """The draft model's pools: the same pages (N·pages of them, one block table), its own layers,
        kv heads and head dim; a page holds the draft's share of the same tokens as the target's page."""
        n = self.layout.num_shards * self.config.num_pages
        d = self.draft
        return d.stacked_shapes((n, d.kv_heads, self.draft_layout.page_size, d.config.head_dim))

    def allocate(self):
        """The zeroed pool (and the draft model's), sharded from the start (never whole on one device).
        Returns the target's pool."""
        if self.pools is None:
            make = lambda shapes, sharding: jax.jit(  # noqa: E731
                lambda: tuple(tuple(jnp.zeros(s, self.dtype) for s in layer) for layer in shapes),
                out_shardings=sharding)()
            self.pools = make(self.pool_shapes(), self.pool_sharding)
            if self.draft is not None:
                self.draft_pools = make(self.draft_pool_shapes(), self.draft_pool_sharding)
        return self.pools

    def caches(self):
        """What the programs take and donate: the pool, or (pool, draft pool) with a draft model."""
        self.allocate()
        return self.pools if self.draft is None else (self.pools, self.draft_pools)

    def set_caches(self, caches) -> None:
        if self.draft is None:
            self.pools = caches
        else:
            self.pools, self.draft_pools = caches

    def all_params(self):
        """The programs' weights: the target's, or (target's, draft's)."""
        return self.params if self.draft is None else (self.params, self.draft_params)

    def release_pool(self) -> None:
        """Give the pool's memory back (the programs stay compiled); `allocate` makes a zeroed one again.
        Only between runs: no request may hold pages."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("release_pool with requests in flight")
        self.scheduler.drop_cached_blocks()  # their KV goes with the pool
        self.pools = self.draft_pools = None

    def pool_spec(self):
        """Abstract values of `caches()`."""
        def spec(shapes, sharding):
            return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, self.dtype, sharding=sharding), shapes,
                                is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], int))
        target = spec(self.pool_shapes(), self.pool_sharding)
        return target if self.draft is None else (target, spec(self.draft_pool_shapes(), self.draft_pool_sharding))

    # --- programs --------------------------------------------------------------------------------
    def context(self, block_table) -> AttentionContext:
        return AttentionContext(self.mesh, self.layout, self.impl, self.combine, block_table=block_table,
                                max_seq_len=self.config.max_model_len)

    def draft_context(self, block_table) -> AttentionContext:
        return AttentionContext(self.mesh, self.draft_layout, self.impl, self.combine, block_table=block_table,
                                max_seq_len=self.config.max_model_len)

    def _prefill(self, params, pools, step: "StepInputs", last):
        if self.draft is not None:  # the draft model's cache takes the same chunk
            (params, draft_params), (pools, draft_pools) = params, pools
            draft = nnx.merge(self.draft_graphdef, draft_params)
            _, draft_pools = draft(step.tokens, step.positions, step.valid, step.kv_len, draft_pools,
                                   self.draft_context(step.block_table), logits_at=last)
        model = nnx.merge(self.graphdef, params)
        logits, pools = model(step.tokens, step.positions, step.valid, step.kv_len, pools,
                              self.context(step.block_table), logits_at=last)
        tok, lp = sample_rows(logits, step.sampling, step.kv_len)  # the new token's position is kv_len
        return (pools if self.draft is None else (pools, draft_pools)), tok, lp

    def _verify(self, params, pools, step: "StepInputs"):
        """One speculative step. step [S, k+1]: column 0 the last token (position p, not yet in cache),
        columns 1..k the drafts (n-gram; ignored with a draft model, which drafts them here); valid[:, i]
        for i >= 1 says draft i exists; kv_len = p + 1 + drafts. Writes the KV of every valid column,
        accepts (dcp_jax.spec.verify) and returns (pools, tokens [S, k+1], counts [S], logprobs [S, k+1])."""
        ctx = self.context(step.block_table)
        tokens, draft_probs = step.tokens, None
        if self.draft is not None:
            (params, draft_params), (pools, draft_pools) = params, pools
            drafts, draft_probs, draft_pools = self._draft(draft_params, draft_pools, step)
            tokens = jnp.concatenate([step.tokens[:, :1], drafts], axis=1)
        model = nnx.merge(self.graphdef, params)
        logits, pools = model(tokens, step.positions, step.valid, step.kv_len, pools, ctx)
        out, counts, lps = spec_verify.accept(logits.astype(jnp.float32), tokens[:, 1:], step.valid[:, 1:],
                                              step.sampling, step.positions[:, 0] + 1, draft_probs)
        if self.draft is not None:
            pools = (pools, draft_pools)
        return pools, out, counts, lps

    def _draft(self, draft_params, draft_pools, step: "StepInputs"):
        """The draft model's k drafts per row [S, k] and their distributions [S, k, V]: one-token steps
        from the last token at p; step i writes position p + i (while i <= the row's drafts, so the k-th
        draft's KV is written too: the draft cache then holds every position the target accepts)."""
        draft = nnx.merge(self.draft_graphdef, draft_params)
        ctx = self.draft_context(step.block_table)
        s, t = step.tokens.shape
        v = self.draft.config.vocab_size
        active, n_drafts, p0, sp = step.valid[:, 0], jnp.sum(step.valid[:, 1:], axis=1), step.positions[:, 0], step.sampling

        def propose(logits, pos):  # [S, V] -> (tokens [S], q [S, V]); greedy rows: argmax, q unused
            greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

            def sampled():
                q = spec_verify.target_probs(logits[:, None], sp.temperature, sp.top_k, sp.top_p)[:, 0]
                keys = spec_verify.row_keys(sp.seed, pos[:, None], spec_verify.DRAFT)[:, 0]
                drawn = jax.vmap(jax.random.categorical)(keys, jnp.log(q)).astype(jnp.int32)
                return jnp.where(sp.temperature > 0, drawn, greedy), q

            return jax.lax.cond(jnp.any(sp.temperature > 0), sampled,
                                lambda: (greedy, jnp.zeros((s, v), jnp.float32)))

        def body(i, carry):
            pools, cur, drafts, qs = carry
            pos = p0 + i
            ok = active & (i <= n_drafts)
            logits, pools = draft(cur[:, None], pos[:, None], ok[:, None], jnp.where(ok, pos + 1, 0), pools, ctx)
            d, q = propose(logits[:, 0].astype(jnp.float32), pos + 1)
            drafts = jax.lax.dynamic_update_index_in_dim(drafts, d, i, axis=1)
            qs = jax.lax.dynamic_update_index_in_dim(qs, q, i, axis=1)
            return pools, d, drafts, qs

        init = (draft_pools, step.tokens[:, 0], jnp.zeros((s, t), jnp.int32), jnp.zeros((s, t, v), jnp.float32))
        draft_pools, _, drafts, qs = jax.lax.fori_loop(0, jnp.max(jnp.where(active, n_drafts, -1)) + 1, body, init)
        return drafts[:, :-1], qs[:, :-1], draft_pools

    def _decode(self, params, pools, step: "StepInputs", num_steps):
        model = nnx.merge(self.graphdef, params)
        s, k_max = step.tokens.shape[0], self.config.decode_steps
        ctx = self.context(step.block_table)
        active = step.valid[:, 0]

        def body(state):
            k, pools, cur, pos, out, out_lp = state
            kv_len = jnp.where(active, pos + 1, 0)
            logits, pools = model(cur[:, None], pos[:, None], active[:, None], kv_len, pools, ctx)
            tok, lp = sample_rows(logits[:, 0], step.sampling, pos + 1)
            out = jax.lax.dynamic_update_index_in_dim(out, tok, k, axis=1)
            out_lp = jax.lax.dynamic_update_index_in_dim(out_lp, lp, k, axis=1)
            return k + 1, pools, tok, pos + 1, out, out_lp

        state = (jnp.int32(0), pools, step.tokens[:, 0], step.positions[:, 0], jnp.zeros((s, k_max), jnp.int32),
                 jnp.zeros((s, k_max), jnp.float32))
        _, pools, _, _, out, out_lp = jax.lax.while_loop(lambda st: st[0] < num_steps, body, state)
        return pools, out, out_lp

    def _program(self, name: str, fn, *args, outputs: int = 2):
        key = (name,) + tuple(np.shape(a) for a in jax.tree.leaves(args[2:]))
        if key not in self.compiled:
            pools = self.pool_sharding if self.draft is None else (self.pool_sharding, self.draft_pool_sharding)
            shardings = (pools,) + (self.replicated,) * outputs
            jitted = jax.jit(fn, donate_argnames=("pools",), out_shardings=shardings)
            self.compiled[key] = jitted.lower(*args).compile()
        return self.compiled[key]

    def prefill_program(self, chunk: int):
        """The compiled prefill of one request's chunk of `chunk` tokens: (params, pools,
        StepInputs [1, C], last row [1]) -> (pools, token [1], logprob [1])."""
        nb = self.scheduler_config.max_blocks_per_seq
        return self._program("prefill", self._prefill, self.all_params(), self.pool_spec(),
                             StepInputs.spec(1, chunk, nb), jax.ShapeDtypeStruct((1,), jnp.int32))

    def decode_program(self):
        """The compiled decode loop over every slot: (params, pools, StepInputs [S, 1] (the tokens and
        positions to start from, valid = the slot decodes), num_steps) -> (pools, tokens [S, K],
        logprobs [S, K]); runs num_steps <= K steps."""
        if self.speculative is not None:
            raise RuntimeError("a speculative engine decodes with verify_program()")
        s, nb = self.config.max_num_seqs, self.scheduler_config.max_blocks_per_seq
        return self._program("decode", self._decode, self.params, self.pool_spec(), StepInputs.spec(s, 1, nb),
                             jax.ShapeDtypeStruct((), jnp.int32))

    def verify_program(self):
        """The compiled speculative step over every slot: (params, caches, StepInputs [S, k+1]) ->
        (caches, tokens [S, k+1], counts [S], logprobs [S, k+1]) (see `_verify`)."""
        s, nb = self.config.max_num_seqs, self.scheduler_config.max_blocks_per_seq
        t = self.speculative.num_tokens + 1
        return self._program("verify", self._verify, self.all_params(), self.pool_spec(), StepInputs.spec(s, t, nb),
                             outputs=3)

    def step_program(self):
        """The program a decode iteration runs: the verify step with speculation, else the decode loop."""
        return self.decode_program() if self.speculative is None else self.verify_program()

    # --- one iteration -----------------------------------------------------------------------------
    def step(self, on_prefill=None) -> SchedulePlan:
        """Schedule, run the plan's prefill chunks and decode steps, and apply the results."""
        sched = self.scheduler
        plan = sched.schedule()
        pools = self.caches()
        if plan.prefills:
            t0 = time.perf_counter()
            sampled, logprobs = [], []
            for chunk in plan.prefills:
                tok = lp = None
                row = plan.block_table[chunk.slot][None]
                for start in range(chunk.start, chunk.end, self.config.prefill_chunk):
                    ids = chunk.request.token_ids(start, min(start + self.config.prefill_chunk, chunk.end))
                    c = self.config.prefill_chunk  # one compiled shape: a shorter piece is padded
                    tokens = np.zeros((1, c), np.int32)
                    tokens[0, :len(ids)] = ids
                    positions = np.arange(start, start + c, dtype=np.int32)[None]
                    valid = np.arange(c)[None] < len(ids)
                    inputs = StepInputs(tokens, positions, valid, np.asarray([start + len(ids)], np.int32), row,
                                        SamplingRows.of([chunk.request]))
                    pools, tok, lp = self.prefill_program(c)(self.all_params(), pools, inputs,
                                                             np.asarray([len(ids) - 1], np.int32))
                    if on_prefill is not None:
                        on_prefill(len(ids))
                if chunk.is_last:
                    tok, lp = int(host(tok)[0]), float(host(lp)[0])
                sampled.append(tok if chunk.is_last else None)
                logprobs.append(lp if chunk.is_last else None)
            self.set_caches(pools)
            jax.block_until_ready(pools)
            self.timing["prefill_s"] += time.perf_counter() - t0
            self.timing["prefill_tokens"] += plan.num_prefill_tokens
            sched.update_prefill(plan, sampled, logprobs)
        if plan.decode_slots:
            self.decode_iteration(plan, pools)
        return plan

    def decode_iteration(self, plan: SchedulePlan, caches) -> None:
        """Run and apply a plan's decode iteration: up to K steps of the decode loop, or, with
        speculation, one verify step of each slot's last token and its drafts (from the host proposer,
        or drafted on the device by the draft model)."""
        t0 = time.perf_counter()
        before = sum(len(r.output_token_ids) for r in plan.decode_requests)
        s = self.config.max_num_seqs
        width = 1 if self.speculative is None else self.speculative.num_tokens + 1
        tokens, valid = np.zeros((s, width), np.int32), np.zeros((s, width), bool)
        tokens[:, 0], valid[:, 0] = plan.decode_tokens, plan.decode_mask
        rows = [None] * s
        for r, slot in zip(plan.decode_requests, plan.decode_slots):
            rows[slot] = r
            most = int(plan.decode_budget[slot]) - 1  # a verify step emits at most drafts + 1 tokens
            if self.proposer is not None:
                drafts = self.proposer.propose(r, most)
                tokens[slot, 1:1 + len(drafts)] = drafts
                valid[slot, 1:1 + len(drafts)] = True
            elif self.draft is not None:
                valid[slot, 1:1 + most] = True
        positions = plan.decode_positions[:, None] + np.arange(width, dtype=np.int32)[None]
        kv_len = np.where(plan.decode_mask, plan.decode_positions + valid.sum(axis=1), 0).astype(np.int32)
        inputs = StepInputs(tokens, positions, valid, kv_len, plan.block_table, SamplingRows.of(rows))
        if self.speculative is None:
            caches, out, out_lp = self.decode_program()(self.params, caches, inputs, np.int32(plan.decode_steps))
            counts, steps = None, plan.decode_steps
        else:
            caches, out, counts, out_lp = self.verify_program()(self.all_params(), caches, inputs)
            counts, steps = host(counts), 1
            self.spec_counts["spec_drafted_tokens"] += int(valid[plan.decode_slots, 1:].sum())
            self.spec_counts["spec_accepted_tokens"] += int((counts[plan.decode_slots] - 1).sum())
            self.spec_counts["spec_verify_steps"] += len(plan.decode_slots)
        self.set_caches(caches)
        k = plan.decode_steps
        out, out_lp = host(out)[:, :k], host(out_lp)[:, :k]
        self.timing["decode_s"] += time.perf_counter() - t0
        self.timing["decode_steps"] += steps
        self.scheduler.update_decode(plan, out, out_lp, counts)
        self.timing["decode_tokens"] += sum(len(r.output_token_ids) for r in plan.decode_requests) - before

    def stats(self) -> dict:
        """The scheduler's stats, plus speculation's when it is on: drafted and accepted tokens, verify
        steps (one per sequence per step) and the mean acceptance length (tokens a sequence gains per
        step: 1 + accepted / steps)."""
        out = self.scheduler.stats()
        if self.speculative is not None:
            c = self.spec_counts
            steps = c["spec_verify_steps"]
            out.update(c, speculative=self.speculative.method, num_speculative_tokens=self.speculative.num_tokens,
                       spec_acceptance_rate=c["spec_accepted_tokens"] / max(c["spec_drafted_tokens"], 1),
                       mean_acceptance_length=1 + c["spec_accepted_tokens"] / steps if steps else 0.0)
        return out

    def kv_bytes(self) -> dict:
        """KV bytes one device holds (its shards of the pool) and the pool's logical bytes (the target's;
        a draft model's pool adds draft_kv_bytes_per_device)."""
        out = kv_bytes(self.allocate(), self.model.kv_replication)
        if self.draft is not None:
            out["draft_kv_bytes_per_device"] = kv_bytes(self.draft_pools, self.draft.kv_replication)["kv_bytes_per_device"]
        return out


def draft_layout(layout: PagedLayout, draft_shards: int) -> PagedLayout:
    """The draft model's pages over the target's blocks (`PagedLayout.same_blocks`), or a UserError."""
    try:
        return layout.same_blocks(draft_shards)
    except ValueError as e:
        raise UserError(f"the draft model cannot share the target's KV pages: {e}; choose a page size that "
                        "is a multiple of the tp size, or a draft of the target's attention kind (MLA or not)") from None


def page_bytes_per_device(model: CausalLM, mesh: Mesh, page_size: int, dtype) -> int:
    """Bytes one page (one block-table entry) costs each device, over all layers and (k, v)."""
    n_ctx = mesh_lib.axis_size(mesh, model.context_axes)
    sharding = mesh_lib.named(mesh, mesh_lib.kv_pool_spec(model.head_axes, model.context_axes))
    one = (n_ctx, model.kv_heads, page_size, model.config.head_dim)
    per_layer = math.prod(sharding.shard_shape(one)) * (1 if model.config.mla else 2)
    return per_layer * model.config.num_layers * np.dtype(dtype).itemsize


def gpu_budget(mesh: Mesh, utilization: float) -> int:
    """Like vLLM's --gpu-memory-utilization: the fraction `utilization` of each device's memory, less
    what is already in use (weights), on the tightest device."""
    budgets = []
    for d in mesh.devices.flat:
        if d.platform != "gpu":
            raise UserError("--gpu-memory-utilization needs a GPU; on CPU give --kv-cache-memory SIZE "
                            "(bytes per device, e.g. 512MiB)")
        stats = d.memory_stats() or {}
        budgets.append(int(utilization * stats.get("bytes_limit", 0)) - int(stats.get("bytes_in_use", 0)))
    return min(budgets)


def run_requests(engine: ServingEngine, requests: list[Request], arrivals=None, on_step=None,
                 on_prefill=None) -> dict:
    """Serve `requests` to completion through `engine` (continuous batching). `arrivals` (seconds after
    the start, one per request; default all at once) lets requests join mid-flight. Each request's
    output is on the request; returns the wall time, each request's time to first token
    (`first_token_s`, by id) and the scheduler's stats (pages, capacity, preemptions)."""
    sched = engine.scheduler
    order = sorted(range(len(requests)), key=lambda i: 0.0 if arrivals is None else arrivals[i])
    pending = [requests[i] for i in order]
    due = [0.0 if arrivals is None else float(arrivals[i]) for i in order]
    first_token: dict[str, float] = {}
    t0 = time.perf_counter()
    while pending or sched.has_unfinished():
        now = time.perf_counter() - t0
        while pending and due[0] <= now:
            r = pending.pop(0)
            due.pop(0)
            r.arrival_time = t0 + now
            sched.add_request(r)
        if not sched.has_unfinished():
            sched.pop_finished()
            if pending:
                time.sleep(max(0.0, min(due[0] - now, 0.05)))
            continue
        plan = engine.step(on_prefill=on_prefill)
        t = time.perf_counter()
        for c in plan.prefills:  # a request's first token comes from its last prefill chunk
            r = c.request
            if c.is_last and r.output_token_ids and r.request_id not in first_token:
                first_token[r.request_id] = t - r.arrival_time
        if on_step is not None:
            on_step(plan)
        sched.pop_finished()
    return dict(wall_s=time.perf_counter() - t0, first_token_s=first_token, **engine.stats())
