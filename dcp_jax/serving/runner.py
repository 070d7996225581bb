"""The model runner: the paged, sequence-sharded KV pool and the fixed-shape step programs over it.

    pools (per layer stack): [L, N·pages, K, page, D] (kv heads over "tp", each context rank its own pages),
                       with a draft model's pools beside them: one pytree `Caches(target, draft)`
    ragged program:    one step of N flat tokens (one of `config.step_sizes`): every row's tokens
                       (decode rows and prompt chunks of many requests, end to end) written through
                       its own block-table row and attended in tiles of that row
                       (pallas_kernels.attention.ragged); the token after each row's last sampled
                                                                                         [jit, donated]
    decode program:    every slot [S] for up to K steps in one while_loop: forward one token, write,
                       sample, record                                                    [jit, donated]
    verify program:    (speculative decoding, instead of decode) every slot's last token + k drafts
                       [S, k+1] in one forward, written; the accepted drafts + one target token come
                       back [S, k+1] with a count per slot; a draft model drafts inside it [jit, donated]

    history:           each slot's tokens by position [S, max_model_len] int32 (replicated), written by
                       every program for the rows whose sampling reads earlier tokens (penalties, bad
                       words) and by `fill_history` for the tokens a request brings into its slot
                       already computed (prefix hits, a resumed request); donated like the pools

Shapes depend only on the `ServingConfig` (slots, blocks per sequence, step sizes, K): requests come
and go with no recompilation. Sampling is per row (`dcp_jax.sampling.sample_rows`) with a key derived
from (seed, position), so a request recomputed after preemption samples the same tokens again. Nothing
outside this module touches the pools: disaggregation writes through `write_pool_shards`.

A program that fails after its pools were donated leaves them deleted: `pools_lost` says so, and
`reset_pools` makes a zeroed pool again (the KV it held is gone; the engine fails or recomputes the
requests that used it).
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
from dcp_jax.errors import UserError
from dcp_jax.layers import AttentionContext
from dcp_jax.layout import PagedLayout
from dcp_jax.model import CausalLM
from dcp_jax.penalties import write_history
from dcp_jax.sampling import MAX_TOP_LOGPROBS, bias_logits, sample_rows, score_tokens
from dcp_jax.serving.config import ServingConfig, padded_size
from dcp_jax.serving.host_copy import HostCopier
from dcp_jax.serving.inputs import RaggedInputs, StepInputs
from dcp_jax.spec import verify as spec_verify
from dcp_jax.spec.proposers import SpeculativeConfig
from pallas_kernels.attention import kv_quant as kvq
from pallas_kernels.attention.configs import pow2


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


class ModelRunner:
    """A `CausalLM` (and an optional draft model) on a ("tp","dcp") mesh with one paged KV pool and the
    compiled programs that run over it."""

    def __init__(self, model: CausalLM, mesh: Mesh, config: ServingConfig, *, interleave: int = 1,
                 impl: str | None = None, combine: str = "auto", speculative: SpeculativeConfig | None = None):
        self.model, self.mesh, self.config = model, mesh, config
        self.impl, self.combine = impl, combine
        self.graphdef, params = nnx.split(model)
        self.dtype = model.embed_tokens.get_value().dtype
        self.layout = PagedLayout(mesh_lib.axis_size(mesh, model.context_axes), interleave, config.page_size)
        self.max_blocks_per_seq = self.layout.blocks_for(config.max_model_len)
        self.speculative = speculative
        self.draft = speculative.draft if speculative is not None else None
        pool_sharding = mesh_lib.named(mesh, mesh_lib.kv_pool_spec(model.head_axes, model.context_axes, stacked=True))
        draft_params = draft_sharding = None
        if self.draft is not None:
            self.draft_graphdef, draft_params = nnx.split(self.draft)
            self.draft_layout = draft_layout(self.layout, mesh_lib.axis_size(mesh, self.draft.context_axes))
            draft_sharding = mesh_lib.named(
                mesh, mesh_lib.kv_pool_spec(self.draft.head_axes, self.draft.context_axes, stacked=True))
        self.weights = Weights(params, draft_params)
        self.pool_sharding = pool_sharding
        self.shardings = Caches(pool_sharding, draft_sharding)
        self.replicated = mesh_lib.named(mesh, mesh_lib.spec())
        self.compiled: dict = {}  # (program, shape) -> executable: a test counts these
        self.compile_s = 0.0  # seconds spent compiling them
        self.caches: Caches | None = None
        self.history: jax.Array | None = None  # [S, max_model_len] int32: each slot's tokens by position
        self.history_owner: list = [None] * config.max_num_seqs  # the request whose tokens each row holds
        self.mask_words = (model.config.vocab_size + 31) // 32  # a token mask row: ⌈V/32⌉ int32 words
        self.open_masks: dict = {}  # tokens per row -> an all-allowed token mask kept on the device
        self.before_pool_write = None  # called before a transfer writes the pools (the host tier's copies)
        self.copier = HostCopier(self)  # the host tier's copy programs (dcp_jax.serving.host_copy)

    # --- the pool --------------------------------------------------------------------------------
    def pool_shapes(self) -> Caches:
        """Per layer stack, the global shapes of its pools: [layers, N·pages, K, page, D] ((k, v), or
        MLA's latent); the draft model's on the same pages (one block table), its own layers, kv heads
        and head dim: a draft page holds the draft's share of the same tokens as the target's page."""
        n = self.layout.num_shards * self.config.num_pages
        m, d = self.model, self.draft
        width = kvq.width(m.config.head_dim, self.config.kv_quant)  # (8-bit rows carry their scale)
        target = m.stacked_shapes((n, m.kv_heads, self.config.page_size, width))
        draft = None if d is None else d.stacked_shapes((n, d.kv_heads, self.draft_layout.page_size, d.config.head_dim))
        return Caches(target, draft)

    def pool_spec(self) -> Caches:
        """Abstract values of the pools (with their shardings): nothing allocated."""
        shapes = self.pool_shapes()

        def spec(shapes, sharding, dtype):
            return None if shapes is None else tuple(
                tuple(jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in layer) for layer in shapes)

        target_dtype = kvq.storage_dtype(self.config.kv_quant, self.dtype)
        return Caches(spec(shapes.target, self.shardings.target, target_dtype),
                      spec(shapes.draft, self.shardings.draft, self.dtype))

    def history_spec(self) -> jax.ShapeDtypeStruct:
        """The abstract token history [S, max_model_len] int32, replicated."""
        return jax.ShapeDtypeStruct((self.config.max_num_seqs, self.config.max_model_len), jnp.int32,
                                    sharding=self.replicated)

    def allocate(self) -> Caches:
        """The zeroed pools, sharded from the start (never whole on one device), and the token history."""
        if self.caches is None:
            self.caches = mesh_lib.zeros(self.pool_spec())
        if self.history is None:
            self.history = mesh_lib.zeros(self.history_spec())
            self.history_owner = [None] * self.config.max_num_seqs
        return self.caches

    @property
    def pools(self) -> tuple:
        """The target's pools (allocated on first use)."""
        return self.allocate().target

    def pools_lost(self) -> bool:
        """Whether a failed program left the pools (or a shard of them) donated and deleted."""
        return self.caches is not None and any(
            x.is_deleted() or any(sh.data.is_deleted() for sh in x.addressable_shards)
            for x in jax.tree.leaves((self.caches, self.history)))

    def reset_pools(self) -> None:
        """Drop the pools (their KV is lost) and the token history; the next use allocates zeroed ones."""
        self.caches = self.history = None

    def open_mask(self, tokens: int) -> jax.Array:
        """The all-allowed token mask [S, tokens, W] on the device (made once: a step without a
        constrained row sends no mask)."""
        if tokens not in self.open_masks:
            shape = (self.config.max_num_seqs, tokens, self.mask_words)
            self.open_masks[tokens] = jax.device_put(np.full(shape, -1, np.int32), self.replicated)
        return self.open_masks[tokens]

    def fill_history(self, slot: int, request, count: int) -> None:
        """Write the first `count` tokens of `request` into history row `slot` (the tokens it brings into
        the slot already in the cache: a prefix hit, a resumed or transferred request), unless the row
        already holds them, and make it the row's owner. A request's tokens never change, so a row its
        own request left holds them still."""
        self.allocate()
        if self.history_owner[slot] is request:
            return
        if count:
            n = min(pow2(count, 16), self.config.max_model_len)
            key = ("history", n)
            if key not in self.compiled:
                t = time.perf_counter()
                length = self.config.max_model_len
                fill = lambda h, row, ids, m: h.at[row, jnp.where(jnp.arange(n) < m, jnp.arange(n), length)].set(  # noqa: E731
                    ids, mode="drop")
                i32 = jax.ShapeDtypeStruct((), jnp.int32)
                self.compiled[key] = jax.jit(fill, donate_argnums=(0,), out_shardings=self.replicated).lower(
                    self.history_spec(), i32, jax.ShapeDtypeStruct((n,), jnp.int32), i32).compile()
                self.compile_s += time.perf_counter() - t
            ids = np.zeros(n, np.int32)
            ids[:count] = request.token_ids(0, count)
            self.history = self.compiled[key](self.history, np.int32(slot), ids, np.int32(count))
        self.history_owner[slot] = request

    def write_pool_shards(self, write) -> None:
        """Per-device writes into the target's pools (prefill/decode disaggregation): `write(device,
        shards)`, for each of this process's devices, gets that device's shards of every pool array, in
        `jax.tree.leaves` order, donates them, and returns the new ones; the pools are reassembled from
        the shards without a copy. If `write`
        fails part way after donating shards, the pools are left deleted: `pools_lost` says so and the
        engine rebuilds them (`ServingEngine.recover_pools`), so no later step runs on dead buffers."""
        if self.before_pool_write is not None:
            self.before_pool_write()
        caches = self.allocate()
        leaves, tree = jax.tree.flatten(caches.target)
        shards = [{sh.device: sh.data for sh in leaf.addressable_shards} for leaf in leaves]
        devices = self.mesh.local_devices  # (this process's own)
        for dev in devices:
            out = write(dev, tuple(sh[dev] for sh in shards))
            for sh, new in zip(shards, out):
                sh[dev] = new
        target = jax.tree.unflatten(tree, [
            jax.make_array_from_single_device_arrays(leaf.shape, self.pool_sharding, [sh[d] for d in devices])
            for leaf, sh in zip(leaves, shards)])
        self.caches = Caches(target, caches.draft)

    def kv_bytes(self) -> dict:
        """KV bytes one device holds (its shards of the pool) and the pool's logical bytes (the target's;
        a draft model's pool adds draft_kv_bytes_per_device)."""
        caches = self.allocate()
        out = mesh_lib.kv_bytes(caches.target, self.model.kv_replication)
        if self.draft is not None:
            out["draft_kv_bytes_per_device"] = mesh_lib.kv_bytes(caches.draft,
                                                                 self.draft.kv_replication)["kv_bytes_per_device"]
        return out

    # --- programs --------------------------------------------------------------------------------
    def context(self, block_table, layout: PagedLayout | None = None) -> AttentionContext:
        """The target's pools' context, or with `layout` the draft model's (kept in the model dtype)."""
        return AttentionContext(self.mesh, layout or self.layout, self.impl, self.combine, block_table=block_table,
                                max_seq_len=self.config.max_model_len,
                                kv_quant=self.config.kv_quant if layout is None else None)

    def ragged_step(self, weights: Weights, caches: Caches, history, step: RaggedInputs):
        """One ragged step: every row's tokens written and attended in one forward over the flat batch,
        the token after each row's last one sampled. Returns (caches, history, tokens [S], logprobs [S],
        top logprobs: (ids, log-probabilities) [S, 20], and the prompt scores of `step.next_token`
        (`sampling.score_tokens`: logprobs [N], ranks [N], top ids and logprobs [N, 20]))."""
        flat = (step.tokens, step.positions, step.valid, step.kv_len)
        draft_pools = caches.draft
        if self.draft is not None:  # the draft model's cache takes the same tokens
            draft = nnx.merge(self.draft_graphdef, weights.draft)
            ctx = dataclasses.replace(self.context(step.block_table, self.draft_layout), ragged=step.tiles)
            _, draft_pools = draft(*flat, draft_pools, ctx, logits_at=step.logits_at)
        model = nnx.merge(self.graphdef, weights.target)
        ctx = dataclasses.replace(self.context(step.block_table), ragged=step.tiles)
        logits, pools, hidden = model(*flat, caches.target, ctx, logits_at=step.logits_at, hidden=True)
        scores = score_tokens(model.head_logits, hidden[0], step.next_token)
        history = write_history(history, step.sampling, step.tiles.token_row, step.positions[0], step.tokens[0],
                                step.valid[0])
        # the new token lands at kv_len
        tok, lp, top = sample_rows(logits, step.sampling, step.kv_len, history, step.token_mask)
        return Caches(pools, draft_pools), history, tok, lp, top, scores

    def verify(self, weights: Weights, caches: Caches, history, step: StepInputs):
        """One speculative step. step [S, k+1]: column 0 the last token (position p, not yet in cache),
        columns 1..k the drafts (n-gram; ignored with a draft model, which drafts them here); valid[:, i]
        for i >= 1 says draft i exists; kv_len = p + 1 + drafts. Writes the KV of every valid column,
        accepts (dcp_jax.spec.verify) and returns (caches, history, tokens [S, k+1], counts [S], logprobs
        [S, k+1], top logprobs [S, k+1, 20])."""
        tokens, draft_probs, draft_pools = step.tokens, None, caches.draft
        if self.draft is not None:
            drafts, draft_probs, draft_pools = self.draft_tokens(weights.draft, caches.draft, step)
            tokens = jnp.concatenate([step.tokens[:, :1], drafts], axis=1)
        model = nnx.merge(self.graphdef, weights.target)
        logits, pools = model(tokens, step.positions, step.valid, step.kv_len, caches.target,
                              self.context(step.block_table))
        s, t = tokens.shape
        history = write_history(history, step.sampling, jnp.broadcast_to(jnp.arange(s)[:, None], (s, t)),
                                step.positions, tokens, step.valid)
        out, counts, lps, top = spec_verify.accept(logits.astype(jnp.float32), tokens[:, 1:], step.valid[:, 1:],
                                                   step.sampling, step.positions[:, 0] + 1, history, step.token_mask,
                                                   draft_probs)
        return Caches(pools, draft_pools), history, out, counts, lps, top

    def draft_tokens(self, draft_params, draft_pools, step: StepInputs):
        """The draft model's k drafts per row [S, k] and their distributions [S, k, V]: one-token steps
        from the last token at p; step i writes position p + i (while i <= the row's drafts, so the k-th
        draft's KV is written too: the draft cache then holds every position the target accepts)."""
        draft = nnx.merge(self.draft_graphdef, draft_params)
        ctx = self.context(step.block_table, self.draft_layout)
        s, t = step.tokens.shape
        v = self.draft.config.vocab_size
        active, n_drafts, p0, sp = step.valid[:, 0], jnp.sum(step.valid[:, 1:], axis=1), step.positions[:, 0], step.sampling

        def propose(logits, pos):  # [S, V] -> (tokens [S], q [S, V]); greedy rows: argmax, q unused
            logits = bias_logits(logits, sp)  # drafts the target may accept: its logit_bias / allowed ids
            greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

            def sampled():
                q = spec_verify.target_probs(logits[:, None], sp.temperature, sp.top_k, sp.top_p, sp.min_p)[:, 0]
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

    def decode(self, weights: Weights, caches: Caches, history, step: StepInputs, num_steps):
        model, pools = nnx.merge(self.graphdef, weights.target), caches.target
        s, k_max = step.tokens.shape[0], self.config.decode_steps
        ctx = self.context(step.block_table)
        active = step.valid[:, 0]

        def body(state):
            k, pools, history, cur, pos, out, out_lp, out_top = state
            kv_len = jnp.where(active, pos + 1, 0)
            logits, pools = model(cur[:, None], pos[:, None], active[:, None], kv_len, pools, ctx)
            history = write_history(history, step.sampling, jnp.arange(s), pos, cur, active)
            tok, lp, top = sample_rows(logits[:, 0], step.sampling, pos + 1, history, step.token_mask)
            out = jax.lax.dynamic_update_index_in_dim(out, tok, k, axis=1)
            out_lp = jax.lax.dynamic_update_index_in_dim(out_lp, lp, k, axis=1)
            out_top = jax.tree.map(lambda acc, x: jax.lax.dynamic_update_index_in_dim(acc, x, k, axis=1), out_top, top)
            return k + 1, pools, history, tok, pos + 1, out, out_lp, out_top

        n_top = (s, k_max, MAX_TOP_LOGPROBS)
        state = (jnp.int32(0), pools, history, step.tokens[:, 0], step.positions[:, 0],
                 jnp.zeros((s, k_max), jnp.int32), jnp.zeros((s, k_max), jnp.float32),
                 (jnp.zeros(n_top, jnp.int32), jnp.zeros(n_top, jnp.float32)))
        _, pools, history, _, _, out, out_lp, out_top = jax.lax.while_loop(lambda st: st[0] < num_steps, body, state)
        return Caches(pools, caches.draft), history, out, out_lp, out_top

    def program(self, name: str, fn, *args, outputs: int = 2):
        """`fn` (weights, caches, history, ...) -> (caches, history, `outputs` more) jitted with the pools
        and the history donated and compiled for `args` (abstract), once per shape."""
        key = (name,) + tuple(np.shape(a) for a in jax.tree.leaves(args[2:]))
        if key not in self.compiled:
            t = time.perf_counter()
            jitted = jax.jit(fn, donate_argnames=("caches", "history"),
                             out_shardings=(self.shardings,) + (self.replicated,) * (outputs + 1))
            self.compiled[key] = jitted.lower(*args).compile()
            self.compile_s += time.perf_counter() - t
        return self.compiled[key]

    def ragged_program(self, n: int):
        """The compiled ragged step of `n` tokens (one of `config.step_sizes`) over every slot:
        (weights, caches, history, RaggedInputs) -> (caches, history, tokens [S], logprobs [S], top logprobs,
        prompt scores)."""
        s, nb = self.config.max_num_seqs, self.max_blocks_per_seq
        return self.program("ragged", self.ragged_step, self.weights, self.pool_spec(), self.history_spec(),
                            RaggedInputs.spec(n, s, nb, self.config.ragged_tile, self.mask_words), outputs=4)

    def step_size(self, tokens: int) -> int:
        """The smallest step size that holds `tokens` tokens."""
        return padded_size(self.config.step_sizes, tokens)

    def decode_program(self):
        """The compiled decode loop over every slot: (weights, caches, history, StepInputs [S, 1] (the
        tokens and positions to start from, valid = the slot decodes), num_steps) -> (caches, history,
        tokens [S, K], logprobs [S, K], top logprobs [S, K, 20]); runs num_steps <= K steps."""
        if self.speculative is not None:
            raise RuntimeError("a speculative engine decodes with verify_program()")
        s, nb = self.config.max_num_seqs, self.max_blocks_per_seq
        return self.program("decode", self.decode, self.weights, self.pool_spec(), self.history_spec(),
                            StepInputs.spec(s, 1, nb, self.mask_words), jax.ShapeDtypeStruct((), jnp.int32), outputs=3)

    def verify_program(self):
        """The compiled speculative step over every slot: (weights, caches, history, StepInputs [S, k+1])
        -> (caches, history, tokens [S, k+1], counts [S], logprobs [S, k+1], top logprobs) (see `verify`)."""
        s, nb = self.config.max_num_seqs, self.max_blocks_per_seq
        t = self.speculative.num_tokens + 1
        return self.program("verify", self.verify, self.weights, self.pool_spec(), self.history_spec(),
                            StepInputs.spec(s, t, nb, self.mask_words), outputs=4)

    def step_program(self):
        """The program a decode iteration runs: the verify step with speculation, else the decode loop."""
        return self.decode_program() if self.speculative is None else self.verify_program()

    def compile_all(self, step_sizes=None, decode: bool = True) -> None:
        """Compile the decode (or verify) program (unless not `decode`: a prefill-only role) and the
        ragged step of each of `step_sizes` (default: every size, what a server does before it serves,
        and then, with a host tier, its copies of up to a sequence's blocks), and allocate the pools."""
        if decode:
            self.step_program()
        for n in self.config.step_sizes if step_sizes is None else step_sizes:
            self.ragged_program(n)
        if self.config.host_blocks and step_sizes is None:
            self.copier.compile_all(self.max_blocks_per_seq)
        self.allocate()


def draft_layout(layout: PagedLayout, draft_shards: int) -> PagedLayout:
    """The draft model's pages over the target's blocks (`PagedLayout.same_blocks`), or a UserError."""
    try:
        return layout.same_blocks(draft_shards)
    except ValueError as e:
        raise UserError(f"the draft model cannot share the target's KV pages: {e}; choose a page size that "
                        "is a multiple of the tp size, or a draft of the target's attention kind (MLA or not)") from None


def page_bytes_per_device(model: CausalLM, mesh: Mesh, page_size: int, dtype, kv_quant: str | None = None) -> int:
    """Bytes one page (one block-table entry) costs each device, over all layers and (k, v); 8-bit
    pages (`kv_quant`) count their scales."""
    n_ctx = mesh_lib.axis_size(mesh, model.context_axes)
    sharding = mesh_lib.named(mesh, mesh_lib.kv_pool_spec(model.head_axes, model.context_axes))
    one = (n_ctx, model.kv_heads, page_size, kvq.width(model.config.head_dim, kv_quant))
    per_layer = math.prod(sharding.shard_shape(one)) * (1 if model.config.mla else 2)
    return per_layer * model.config.num_layers * np.dtype(kvq.storage_dtype(kv_quant, dtype)).itemsize


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
