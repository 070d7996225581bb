"""The model runner: the one owner of device state, and what runs a plan on the device.

    ModelRunner.execute(plan) -> StepOutput
        one iteration's programs: one ragged step (every decoding slot's first token and the prompt
        chunks in one flat batch), then the decode loop for the other K - 1 (the prompts that ended
        in the step decoding too); with nothing to prefill, the decode loop alone; a speculative
        plan's decode rows run the verify loop instead (after the ragged step's prefills, when it
        has any); the host tier's pending copies first

    pools (per layer stack): [L, N·pages, K, page, D] (kv heads over "tp", each context rank its
        own pages), with a draft model's pools beside them: one pytree `Caches(target, draft)`.
        The ragged step and the verify loop write both; the plain decode loop (a speculative
        engine's iterations with speculation off) the target's only, and the positions it wrote
        are filled into the draft's (`draft_fills`: one forward of up to 256 tokens per slot)
        before the slot's next verify step
    history: each slot's tokens by position [S, max_model_len] int32 (replicated), written by every
        program for the rows whose sampling reads earlier tokens (penalties, bad words) and by
        `fill_history` for the tokens a request brings into its slot already computed (prefix
        hits, a resumed request); donated like the pools

Nothing outside this class assigns the pools or the history: the host tier's copies run here (their
queue is the KV manager's, handed in as `host_copies`), and disaggregation writes through
`write_pool_shards`. The programs (`dcp_jax.serving.programs`) are pure functions compiled once per
shape into one `ProgramCache` (`programs.cache`). Collaborators are handed in at construction: the
structured outputs (token masks of constrained rows) and the host tier's copy queue.

A program that fails after its pools were donated leaves them deleted: `pools_lost` says so, and
`reset_pools` makes a zeroed pool again (the KV it held is gone; the engine fails or recomputes the
requests that used it).
"""

from __future__ import annotations

import math
import time
from functools import partial

import jax
import numpy as np
from jax.sharding import Mesh

from dcp_jax import mesh as mesh_lib
from dcp_jax.errors import UserError
from dcp_jax.layout import PagedLayout
from dcp_jax.mesh import host
from dcp_jax.model import CausalLM
from dcp_jax.sampling import SamplingRows
from dcp_jax.serving.config import ServingConfig, padded_size
from dcp_jax.serving.host_copy import HostCopier
from dcp_jax.serving.inputs import RaggedInputs, StepInputs, VerifyInputs
from dcp_jax.serving.plan import Sampled, SchedulePlan, StepOutput
from dcp_jax.serving.programs import Caches, StepPrograms
from dcp_jax.spec.proposers import SpeculativeConfig, host_proposer
from pallas_kernels.attention import kv_quant as kvq

# tokens per slot of one draft-cache fill (`ModelRunner.draft_fills`): the sizes compiled
FILL_SIZES = (16, 64, 256)


class ModelRunner:
    """A `CausalLM` (and an optional draft model) on a ("tp","dcp") mesh with one paged KV pool, the
    token history, and the compiled programs that run over them."""

    def __init__(self, model: CausalLM, mesh: Mesh, config: ServingConfig, layout: PagedLayout, *,
                 impl: str | None = None, combine: str = "auto",
                 speculative: SpeculativeConfig | None = None, structured=None, host_copies=None):
        self.programs = StepPrograms(model, mesh, config, layout, impl=impl, combine=combine,
                                     speculative=speculative)
        self.model, self.mesh, self.config, self.layout = model, mesh, config, layout
        self.speculative, self.draft = speculative, self.programs.draft
        self.eos_token_ids = tuple(model.config.eos_token_ids)
        # StructuredOutputs (dcp_jax.structured): constrained rows' masks
        self.structured = structured
        # drafts made on the host: a proposer handed in, or n-gram lookup for the rows with a
        # structured output (their drafts' masks are made here); None with a draft model
        self.proposer = host_proposer(speculative)
        self.host_copies = host_copies  # () -> (offloads, restores): the KV manager's copy queue
        self.copier = HostCopier(self.programs)  # the host tier's copy programs
        self._caches: Caches | None = None
        self._history: jax.Array | None = None
        # the request each history row holds
        self._history_owner: list = [None] * config.max_num_seqs
        self._open_masks: dict = {}  # tokens per row -> an all-allowed token mask on the device
        # a draft model's cache: per slot, (request, the first position the plain decode loop
        # wrote without it), filled in before the slot's next verify step (`draft_fills`)
        self._draft_gaps: dict[int, tuple] = {}

    # --- device state (read-only outside) ---------------------------------------------------------
    @property
    def caches(self) -> Caches | None:
        return self._caches

    @property
    def history(self) -> jax.Array | None:
        """[S, max_model_len] int32: each slot's tokens by position."""
        return self._history

    @property
    def pools(self) -> tuple:
        """The target's pools (allocated on first use)."""
        return self.allocate().target

    @property
    def compiled(self):
        """Every compiled program (`ProgramCache`, keyed (kind, *sizes)): a test counts these."""
        return self.programs.cache

    @property
    def compile_s(self) -> float:
        return self.programs.cache.compile_s

    def pool_spec(self) -> Caches:
        return self.programs.pool_spec()

    def history_spec(self) -> jax.ShapeDtypeStruct:
        return self.programs.history_spec()

    def allocate(self) -> Caches:
        """The zeroed pools, sharded from the start (never whole on one device), and the token
        history."""
        if self._caches is None:
            self._caches = mesh_lib.zeros(self.pool_spec())
        if self._history is None:
            self._history = mesh_lib.zeros(self.history_spec())
            self._history_owner = [None] * self.config.max_num_seqs
        return self._caches

    def pools_lost(self) -> bool:
        """Whether a failed program left the pools (or a shard of them) donated and deleted."""
        return self._caches is not None and any(
            x.is_deleted() or any(sh.data.is_deleted() for sh in x.addressable_shards)
            for x in jax.tree.leaves((self._caches, self._history)))

    def reset_pools(self) -> None:
        """Drop the pools (their KV is lost) and the token history; the next use allocates zeroed
        ones."""
        self._caches = self._history = None

    def run(self, program, inputs, *args):
        """Call a step program on the pools and history (donated) and keep the new ones; returns the
        program's other outputs. If it raises after donating them, `pools_lost` says so."""
        caches, self._history, *out = program(self.programs.weights, self.allocate(), self._history,
                                              inputs, *args)
        self._caches = caches
        return out

    # --- the host tier's copies -------------------------------------------------------------------
    def copy_pending(self) -> None:
        """Dispatch the host tier's pending copies: evicted blocks to the host, then host hits back
        into their fresh pages, ahead of any program that writes those pages."""
        if self.host_copies is None:
            return
        offloads, restores = self.host_copies()
        if offloads:
            self.copier.offload(self.allocate(), [b for b, _ in offloads], [p for _, p in offloads])
        if restores:
            self._caches = self.copier.restore(self.allocate(), [b for b, _ in restores],
                                               [p for _, p in restores])

    def finish_copies(self) -> None:
        """Take the host arrays of this iteration's offloads (their copies overlapped the step)."""
        self.copier.finish()

    def drop_copies(self) -> None:
        """After a failure: forget the offloads whose host arrays were not taken."""
        self.copier.drop()

    # --- one iteration ----------------------------------------------------------------------------
    def execute(self, plan: SchedulePlan) -> StepOutput:
        """Run a plan: the host tier's copies, then one ragged step over its prefill chunks and
        (unless the plan speculates) its decode rows' first tokens, their other K - 1 in the decode
        loop after it; with nothing to prefill, the K-step decode loop alone; a speculative plan's
        decode rows in the verify loop (after the ragged step's prefills). Returns what the
        programs produced, on the host."""
        out = StepOutput()
        self.copy_pending()
        if plan.prefills:
            self.ragged_iteration(plan, out)
        if plan.decode_slots and out.decode is None:
            self.decode_iteration(plan, out)
        self.finish_copies()
        return out

    def ragged_rows(self, plan: SchedulePlan, with_decode: bool) -> list:
        """(slot, request, first position, tokens) of each row of the plan's ragged step: the decode
        rows' one token each (unless a verify step takes them), then the prefill chunks."""
        rows = []
        if with_decode:
            rows += [(slot, r, int(plan.decode_positions[slot]), [int(plan.decode_tokens[slot])])
                     for r, slot in zip(plan.decode_requests, plan.decode_slots)]
        return rows + [(c.slot, c.request, c.start, c.token_ids) for c in plan.prefills]

    def ragged_iteration(self, plan: SchedulePlan, out: StepOutput) -> None:
        """One ragged step: the plan's prefill chunks and, unless a verify step follows
        (speculation), its decode rows' first tokens, in one program call padded to a step size;
        then the decode rows' other K - 1 tokens in the decode loop, started on the device from the
        tokens just sampled, with the requests whose prompt ended in the step (`plan.joining`)
        beside them."""
        t0 = time.perf_counter()
        with_decode = not plan.verify_steps and bool(plan.decode_slots)
        rows = self.ragged_rows(plan, with_decode)
        num_tokens = sum(len(ids) for *_, ids in rows)
        n = self.step_size(num_tokens)
        sampled = [(slot, r, []) for slot, r, *_ in rows[:len(rows) - len(plan.prefills)]]  # decode
        sampled += [(c.slot, c.request, []) for c in plan.prefills if c.is_last]  # and first tokens
        inputs = RaggedInputs.build(rows, n, self.config.max_num_seqs, plan.block_table,
                                    self.config.ragged_tile, self.token_mask(sampled, 1),
                                    self.eos_token_ids)
        self.fill_history(rows)
        tok, lp, top, scores = self.run(self.programs.ragged_program(n), inputs)
        k = plan.decode_steps if with_decode else 0
        if k > 1:  # queued behind the step (nothing comes back to the host in between)
            # the decoding rows from their next position; the joining ones from their first token
            loop_rows = plan.decode_rows(1) + [(c.slot, c.request, c.end) for c in plan.joining]
            more = self.decode_loop(loop_rows, tok[:, None], k - 1, plan.block_table)
        requests = [r for _, r, *_ in rows]
        tops = tops_on_host(requests, top, None)
        out.first = Sampled(host(tok)[:, None], host(lp)[:, None], tops)
        if any(c.request.scores_prompt for c in plan.prefills):
            out.prompt_scores = prompt_scores(rows, scores)
        for key, value in dict(ragged_steps=1, rows_computed=n, rows_useful=num_tokens,
                               prefill_s=time.perf_counter() - t0).items():
            out.count(key, value)
        if k > 1:
            t1 = time.perf_counter()
            tokens, logprobs = (host(x)[:, :k - 1] for x in more[:2])
            loop = Sampled(tokens, logprobs, tops_on_host(requests, more[2], k - 1))
            out.count("decode_s", time.perf_counter() - t1)
            out.count("decode_steps", k - 1)
            out.joined = loop if plan.joining else None
        if with_decode:  # (the step's first tokens are prefill's time)
            out.decode = out.first if k <= 1 else out.first.then(loop)

    def decode_loop(self, rows, tokens, steps: int, block_table):
        """Dispatch the decode loop for `steps` steps over `rows` ((slot, request, position) each:
        the slot's first input is its row of `tokens` [S, 1] (host or device), at that position)
        through `block_table`; returns its (tokens, logprobs) [S, K] and top logprobs (ids,
        log-probabilities) [S, K, 20] on the device."""
        s = self.config.max_num_seqs
        requests, positions, live = [None] * s, np.zeros(s, np.int32), np.zeros(s, bool)
        for slot, r, position in rows:
            requests[slot], positions[slot], live[slot] = r, position, True
        self.fill_history(rows)
        if self.draft is not None:  # (the loop writes the target's cache only)
            for slot, r, position in rows:
                gap = self._draft_gaps.get(slot)
                if gap is None or gap[0] is not r or position < gap[1]:
                    self._draft_gaps[slot] = (r, position)
        mask = self.token_mask([(slot, r, []) for slot, r, _ in rows], 1)
        inputs = StepInputs(tokens, positions[:, None], live[:, None], np.zeros(s, np.int32),
                            block_table, SamplingRows.of(requests, self.eos_token_ids), mask)
        # (a speculative engine's plain iterations run the decode loop too)
        program = (self.step_program() if self.speculative is None
                   else self.programs.decode_program())
        return self.run(program, inputs, np.int32(steps))

    def decode_iteration(self, plan: SchedulePlan, out: StepOutput) -> None:
        """A plan's decode iteration: up to K steps of the decode loop, or, when the plan
        speculates, the verify loop (`verify`). Its device time (`decode_s`) starts once its
        program is compiled."""
        k = plan.decode_steps
        if not plan.verify_steps:
            first = plan.decode_tokens[:, None]
            self.programs.decode_program()  # (compiled before the clock starts)
            t0 = time.perf_counter()
            tokens, logprobs, top = self.decode_loop(plan.decode_rows(), first, k, plan.block_table)
            counts, steps = None, k
        else:
            self.step_program()
            fills = self.draft_fills(plan)
            t0 = time.perf_counter()  # (decode_s holds the fill; draft_fill_s says how much)
            for program, inputs in fills:
                self.run(program, inputs)
            if fills:
                jax.block_until_ready(self._caches)
                out.count("draft_fill_s", time.perf_counter() - t0)
            tokens, logprobs, counts, top, steps = self.verify(plan, out)
        out.decode = Sampled(host(tokens)[:, :k], host(logprobs)[:, :k],
                             tops_on_host(plan.decode_requests, top, k), counts)
        out.count("decode_s", time.perf_counter() - t0)
        out.count("decode_steps", steps)

    def draft_fills(self, plan: SchedulePlan) -> list:
        """(program, inputs) of the draft-cache fills a verify iteration needs first: for each
        decode slot whose tokens the plain decode loop wrote without the draft model, those
        positions (up to its last token, which the verify step writes), in calls of at most
        FILL_SIZES[-1] tokens per slot, each the smallest size that holds the longest gap left;
        compiled here (before the iteration's clock)."""
        gaps = {}
        for r, slot in zip(plan.decode_requests, plan.decode_slots):
            gap = self._draft_gaps.pop(slot, None)
            end = int(plan.decode_positions[slot])
            if gap is not None and gap[0] is r and gap[1] < end:
                gaps[slot] = (r, gap[1], end)
        s, out = self.config.max_num_seqs, []
        while gaps:
            longest = max(e - a for _, a, e in gaps.values())
            n = padded_size(FILL_SIZES, min(longest, FILL_SIZES[-1]))
            tokens, valid = np.zeros((s, n), np.int32), np.zeros((s, n), bool)
            positions, kv_len = np.zeros((s, n), np.int32), np.zeros(s, np.int32)
            for slot, (r, a, e) in list(gaps.items()):
                b = min(e, a + n)
                tokens[slot, :b - a] = r.token_ids(a, b)
                valid[slot, :b - a] = True
                positions[slot] = np.minimum(a + np.arange(n, dtype=np.int32), b - 1)
                kv_len[slot] = b
                gaps[slot] = (r, b, e)
                if b == e:
                    del gaps[slot]
            inputs = StepInputs(tokens, positions, valid, kv_len, plan.block_table,
                                SamplingRows.of([None] * s, self.eos_token_ids),
                                np.full((s, n, 1), -1, np.int32))
            out.append((self.programs.draft_fill_program(n), inputs))
        return out

    def verify_inputs(self, plan: SchedulePlan) -> VerifyInputs:
        """The verify loop's inputs: each slot's last token [S, k+1] and its budget; the drafts of
        its first step `given` for a row with a structured output (its token mask must cover them:
        the host proposer's n-gram drafts; none with a draft model) and for every row when a host
        proposer was handed in; the other rows' drafts are made on the device."""
        s, k = self.config.max_num_seqs, self.speculative.num_tokens
        tokens, valid = np.zeros((s, k + 1), np.int32), np.zeros((s, k + 1), bool)
        tokens[:, 0], valid[:, 0] = plan.decode_tokens, plan.decode_mask
        given = np.zeros(s, bool)
        rows, mask_rows = [None] * s, []
        for r, slot in zip(plan.decode_requests, plan.decode_slots):
            rows[slot] = r
            given[slot] = (self.speculative.proposer is not None
                           or r.sampling.structured is not None)
            drafts = []
            if given[slot] and self.proposer is not None:
                # a verify step emits at most drafts + 1 tokens
                most = min(int(plan.decode_budget[slot]) - 1, k)
                drafts = self.proposer.propose(r, most)
                tokens[slot, 1:1 + len(drafts)] = drafts
                valid[slot, 1:1 + len(drafts)] = True
            # (token_mask keeps the constrained)
            mask_rows.append((slot, r, [int(t) for t in drafts]))
        positions = plan.decode_positions[:, None] + np.arange(k + 1, dtype=np.int32)[None]
        kv_len = np.where(plan.decode_mask, plan.decode_positions + valid.sum(axis=1), 0)
        return VerifyInputs(tokens, positions, valid, kv_len.astype(np.int32), plan.block_table,
                            SamplingRows.of(rows, self.eos_token_ids),
                            self.token_mask(mask_rows, k + 1), plan.decode_budget.astype(np.int32),
                            given)

    def verify(self, plan: SchedulePlan, out: StepOutput):
        """The verify loop over the plan's decode slots (up to `plan.verify_steps` steps in one
        call): (tokens, logprobs) [S, W] on the device, the count of each slot's tokens (host), the
        top logprobs [S, W, 20] (device) and the steps the loop ran; the drafts proposed and
        accepted, and the verify steps of each row, go into `out`."""
        inputs = self.verify_inputs(plan)
        self.fill_history([(slot, r, int(plan.decode_positions[slot]))
                           for r, slot in zip(plan.decode_requests, plan.decode_slots)])
        tokens, counts, logprobs, top, (drafted, accepted, row_steps) = self.run(
            self.step_program(), inputs, np.int32(plan.verify_steps))
        counts, row_steps = host(counts), host(row_steps)
        out.drafted = int(host(drafted)[plan.decode_slots].sum())
        out.accepted_per_pos = host(accepted).astype(np.int64)
        out.verify_rows = int(row_steps[plan.decode_slots].sum())
        return tokens, logprobs, counts, top, int(row_steps.max(initial=0))

    def step_program(self):
        """The program a decode iteration runs by default: the verify loop with speculation, else
        the decode loop."""
        return self.programs.step_program()

    def step_size(self, tokens: int) -> int:
        """The smallest step size that holds `tokens` tokens."""
        return padded_size(self.config.step_sizes, tokens)

    # --- host inputs ------------------------------------------------------------------------------
    def token_mask(self, rows, tokens: int):
        """The step's token mask [S, tokens, W]: each constrained row of `rows` ((slot, request,
        drafts) each) filled from its matcher, every other row all-allowed; with none constrained,
        the all-allowed mask kept on the device (nothing sent)."""
        rows = [row for row in rows if row[1].sampling.structured is not None]
        words = self.programs.mask_words
        if not rows:
            if tokens not in self._open_masks:
                shape = (self.config.max_num_seqs, tokens, words)
                self._open_masks[tokens] = jax.device_put(np.full(shape, -1, np.int32),
                                                          self.programs.replicated)
            return self._open_masks[tokens]
        mask = np.full((self.config.max_num_seqs, tokens, words), -1, np.int32)
        self.structured.fill(mask, rows)
        return mask

    def fill_history(self, rows) -> None:
        """Before a program: for each (slot, request, first position, ...) row whose request's
        sampling reads its earlier tokens (penalties, bad words; every row when n-gram drafts are
        looked up on the device), the tokens before the row's first position into the slot's
        history row (those already in the cache: no program wrote them there). A request's tokens
        never change, so a row its own request left holds them still."""
        for slot, r, count, *_ in rows:
            if not (r.sampling.needs_history or self.programs.keep_history):
                continue
            self.allocate()
            if self._history_owner[slot] is r:
                continue
            if count:
                n = padded_size(self.history_sizes(), count)
                ids = np.zeros(n, np.int32)
                ids[:count] = r.token_ids(0, count)
                self._history = self.programs.history_program(n)(self._history, np.int32(slot), ids,
                                                                 np.int32(count))
            self._history_owner[slot] = r

    # --- other writers and readers ----------------------------------------------------------------
    def write_pool_shards(self, write) -> None:
        """Per-device writes into the target's pools (prefill/decode disaggregation): `write(device,
        shards)`, for each of this process's devices, gets that device's shards of every pool array,
        in `jax.tree.leaves` order, donates them, and returns the new ones; the pools are
        reassembled from the shards without a copy. The host tier's pending copies run first. If
        `write` fails part way after donating shards, the pools are left deleted: `pools_lost` says
        so and the engine rebuilds them (`ServingEngine.recover_pools`), so no later step runs on
        dead buffers."""
        self.copy_pending()
        caches = self.allocate()
        leaves, tree = jax.tree.flatten(caches.target)
        shards = [{sh.device: sh.data for sh in leaf.addressable_shards} for leaf in leaves]
        devices = self.mesh.local_devices  # (this process's own)
        for dev in devices:
            new = write(dev, tuple(sh[dev] for sh in shards))
            for sh, piece in zip(shards, new):
                sh[dev] = piece
        sharding = self.programs.pool_sharding
        target = jax.tree.unflatten(tree, [
            jax.make_array_from_single_device_arrays(leaf.shape, sharding, [sh[d] for d in devices])
            for leaf, sh in zip(leaves, shards)])
        self._caches = Caches(target, caches.draft)

    def kv_bytes(self) -> dict:
        """KV bytes one device holds (its shards of the pool) and the pool's logical bytes (the
        target's; a draft model's pool adds draft_kv_bytes_per_device)."""
        caches = self.allocate()
        out = mesh_lib.kv_bytes(caches.target, self.model.kv_replication)
        if self.draft is not None:
            draft = mesh_lib.kv_bytes(caches.draft, self.draft.kv_replication)
            out["draft_kv_bytes_per_device"] = draft["kv_bytes_per_device"]
        return out

    def compile_all(self, step_sizes=None, decode: bool = True) -> None:
        """Compile the decode (or verify) program (unless not `decode`: a prefill-only role) and the
        ragged step of each of `step_sizes`; by default every program a request may run (what
        `LLM.load` and a server do before they serve): every step size, the history fills of every
        size and, with a host tier, its copies of up to a sequence's blocks. Allocates the pools."""
        programs = self.programs
        jobs = [self.step_program] if decode else []
        if decode and self.speculative is not None and self.speculative.auto_off:
            jobs.append(programs.decode_program)  # (the plain iterations while speculation is off)
            if self.draft is not None:  # (and the draft-cache fills after them)
                jobs += [partial(programs.draft_fill_program, n) for n in FILL_SIZES]
        jobs += [partial(programs.ragged_program, n)
                 for n in (self.config.step_sizes if step_sizes is None else step_sizes)]
        if step_sizes is None:
            jobs += [partial(programs.history_program, n) for n in self.history_sizes()]
        for job in jobs:
            job()
        if self.config.host_blocks and step_sizes is None:
            self.copier.compile_all(programs.max_blocks_per_seq)
        self.allocate()

    def history_sizes(self) -> list[int]:
        """The sizes `fill_history` pads a request's tokens to: powers of two from 16, capped at the
        context."""
        length, n, out = self.config.max_model_len, 16, []
        while n < length:
            out.append(n)
            n *= 2
        return out + [length]


def tops_on_host(requests, top, steps: int | None):
    """A step's top logprobs (ids, log-probabilities) on the host, the first `steps` columns (None:
    a ragged step's [S, 20], made [S, 1, 20]), when any of `requests` asked for them; else None (the
    arrays stay on the device)."""
    if not any(r is not None and r.sampling.top_logprobs for r in requests):
        return None
    return tuple(host(x)[:, None] if steps is None else host(x)[:, :steps] for x in top)


def prompt_scores(rows, scores) -> list:
    """(request, start, logprobs, ranks, top ids, top logprobs) for each row whose request scores
    its prompt (rows end to end in the flat batch, as `RaggedInputs.build` laid them)."""
    lps, ranks, ids, top = (host(x) for x in scores)
    out, at = [], 0
    for _, r, start, tokens in rows:
        m = len(tokens)
        if r.scores_prompt:
            out.append((r, start, lps[at:at + m], ranks[at:at + m], ids[at:at + m], top[at:at + m]))
        at += m
    return out


def page_bytes_per_device(model: CausalLM, mesh: Mesh, page_size: int, dtype,
                          kv_quant: str | None = None) -> int:
    """Bytes one page (one block-table entry) costs each device, over all layers and every cache
    array of a layer ((k, v), MLA's latent, DeepSeek-V3.2's index keys beside it); 8-bit pages
    (`kv_quant`) count their scales."""
    n_ctx = mesh_lib.axis_size(mesh, model.context_axes)
    sharding = mesh_lib.named(mesh, mesh_lib.kv_pool_spec(model.head_axes, model.context_axes))
    itemsize = np.dtype(kvq.storage_dtype(kv_quant, dtype)).itemsize
    per_layer = sum(math.prod(sharding.shard_shape((n_ctx, model.kv_heads, page_size, w)))
                    for w in model.cache_widths(kvq.width(model.config.head_dim, kv_quant)))
    return per_layer * model.config.num_layers * itemsize


def gpu_budget(mesh: Mesh, utilization: float) -> int:
    """Like vLLM's --gpu-memory-utilization: the fraction `utilization` of each device's memory,
    less what is already in use (weights), on the tightest device."""
    budgets = []
    for d in mesh.devices.flat:
        if d.platform != "gpu":
            raise UserError("--gpu-memory-utilization needs a GPU; on CPU give --kv-cache-memory "
                            "SIZE (bytes per device, e.g. 512MiB)")
        stats = d.memory_stats() or {}
        limit, used = int(stats.get("bytes_limit", 0)), int(stats.get("bytes_in_use", 0))
        budgets.append(int(utilization * limit) - used)
    return min(budgets)
