"""The serving engine: one iteration = schedule (host) -> run (the runner's programs) -> update (host).

    plan = scheduler.schedule()       which chunks prefill, which slots decode K steps, pages reserved
    runner programs                   one ragged step (every decoding slot's first token and the prompt
                                      chunks in one flat batch), then the decode loop for the other K - 1
                                      (the prompts that ended in the step decoding too); with nothing to
                                      prefill, the decode loop alone (or a verify step)
    scheduler.update_*(plan, ...)     tokens appended, stop rules applied, finished requests collected

`ServingEngine` joins a `Scheduler` (dcp_jax.serving.scheduler: policy, plain Python) and a
`ModelRunner` (dcp_jax.serving.runner: the pools and the compiled programs). A step that raises fails
the requests of that step alone (finish_reason "error", retryable) and the engine goes on; when the
failure left the pools donated and deleted, the pools are rebuilt, the prefix cache is dropped with
them, and the other running requests are preempted (recomputed from their tokens, so their outputs do
not change).

Speculative decoding (`dcp_jax.spec`) rolls a rejected draft back by the sequence's length alone: the
host advances a request by the tokens it accepted, and every rank-local length and mask is recomputed
on the device from that global length (`PagedLayout`), so the rejected drafts' KV lies past the length,
is never attended to, and is overwritten when the sequence gets there.

On several processes (`jax.distributed`) an engine runs on each, in lockstep (`lockstep`: process 0
publishes its commands and each plan; the others replay them); requests then come in through
`add_request` / `abort`, which the leader records, and a failed step is fatal (`LockstepError`).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from dcp_jax.mesh import host
from dcp_jax.sampling import SamplingRows
from dcp_jax.serving.config import ServingConfig
from dcp_jax.serving.host_copy import host_bytes
from dcp_jax.serving.request import Request
from dcp_jax.serving.inputs import RaggedInputs, StepInputs
from dcp_jax.serving.lockstep import Lockstep, LockstepError
from dcp_jax.serving.runner import ModelRunner
from dcp_jax.serving.scheduler import SchedulePlan, Scheduler
from dcp_jax.spec.proposers import NgramProposer, SpeculativeConfig


class ServingEngine:
    """A `CausalLM` on a ("tp","dcp") mesh serving requests from a paged, sequence-sharded KV pool."""

    def __init__(self, model, mesh, config: ServingConfig, *, interleave: int = 1, impl: str | None = None,
                 combine: str = "auto", detokenize=None, speculative: SpeculativeConfig | None = None,
                 tokenizer=None):
        self.config = config
        self.runner = ModelRunner(model, mesh, config, interleave=interleave, impl=impl, combine=combine,
                                  speculative=speculative)
        self.layout, self.speculative = self.runner.layout, speculative
        self.proposer = (NgramProposer(speculative.num_tokens, speculative.min_n, speculative.max_n)
                         if speculative is not None and speculative.method == "ngram" else None)
        self.scheduler = Scheduler(config.scheduler_config(
            self.layout, eos_token_ids=model.config.eos_token_ids, vocab_size=model.config.vocab_size,
            num_speculative_tokens=0 if speculative is None else speculative.num_tokens), detokenize=detokenize)
        # verify steps (row by row): drafts proposed, drafts accepted, steps; the tokens they made
        self.spec_counts = dict(spec_drafted_tokens=0, spec_verify_steps=0)
        # drafts accepted by their position in the draft (vLLM's spec_decode_num_accepted_tokens_per_pos;
        # their sum is spec_accepted_tokens)
        self.spec_accepted_per_pos = np.zeros(0 if speculative is None else speculative.num_tokens, np.int64)
        # time in the device programs (results on the host) and the tokens they produced for requests
        # rows_computed / rows_useful: tokens the ragged steps ran (padded to a step size) / needed
        self.timing = dict(prefill_s=0.0, prefill_tokens=0, decode_s=0.0, decode_tokens=0, decode_steps=0,
                           ragged_steps=0, rows_computed=0, rows_useful=0)
        self.num_failed_steps = self.num_pool_resets = 0
        # the host tier's copies (dcp_jax.kv.host): run before every step and every transfer's write
        self.copier = self.runner.copier
        if self.scheduler.kv.host is not None:
            self.runner.before_pool_write = self.copy_kv
        # structured outputs (dcp_jax.structured): the grammars, made when the first such request comes
        self.tokenizer, self.grammars = tokenizer, None
        self.scheduler.structured = self.structured_problem
        # held by whoever drives the engine (an AsyncEngine's thread, an LLM.generate call): one at a time
        self.lock = threading.Lock()
        self.lockstep: Lockstep | None = None  # several processes: this one's side (leader or follower)

    # --- requests in and out (what a leader records for its followers) -------------------------------
    def add_request(self, request: Request) -> Request:
        """Queue `request`; one the scheduler refuses outright (a duplicate id) is failed, not raised."""
        if self.lockstep is not None:
            self.lockstep.record("add", request)
        try:
            self.scheduler.add_request(request)  # one that can never run finishes at once ("error")
        except Exception as e:  # noqa: BLE001 - e.g. a duplicate id: this request fails, the engine goes on
            self.scheduler.fail(request, f"the request was refused: {e}")
        return request

    def abort(self, request: Request | str, error: str | None = None) -> None:
        """Finish a request now (finish_reason "abort"), e.g. its client went away: a Request wherever it
        is (also one held outside the scheduler), or the id of one in the scheduler."""
        rid = request if isinstance(request, str) else request.request_id
        if self.lockstep is not None:
            self.lockstep.record("abort", rid, error)
        r = self.scheduler.get(rid) if isinstance(request, str) else request
        if r is not None:
            self.scheduler.abort(r, error)

    # --- one iteration -----------------------------------------------------------------------------
    def step(self, on_prefill=None) -> SchedulePlan:
        """Schedule, run the plan's prefill chunks and decode steps, and apply the results. A failure
        while running fails the plan's requests (see `recover`) instead of raising."""
        plan = self.scheduler.schedule()
        if self.lockstep is not None:
            self.lockstep.agree(plan)  # the leader publishes it; a follower checks it is the leader's
        try:
            self.run(plan, on_prefill)
        except Exception as e:  # noqa: BLE001 - any failure of a step is that step's requests' failure
            self.recover(plan, e)
            if self.lockstep is not None:  # its collectives ran on every process: none can go on alone
                raise LockstepError(f"step {plan.step} failed on process {self.lockstep.process_id} "
                                    f"({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]})") from e
        return plan

    def recover(self, plan: SchedulePlan, error: BaseException) -> None:
        """After `plan` failed with `error`: fail its unfinished requests (retryable: the server's fault);
        if the pools were lost (donated to the failed program), rebuild them, drop the prefix cache with
        them and preempt every other running request (its KV went with the pool; it is recomputed)."""
        sched, message = self.scheduler, f"the step failed on the server ({type(error).__name__}: {error})"
        self.num_failed_steps += 1
        plan.prefill_applied = plan.decode_applied = plan.joined_applied = True
        for r in [c.request for c in plan.prefills] + list(plan.decode_requests):
            sched.fail(r, message, retryable=True)
        if not self.recover_pools() and sched.kv.host is not None:
            # a copy back may not have run, yet its blocks are registered: forget the device's cached
            # blocks (the host tier keeps what was copied out)
            self.forget_copies()
            sched.reset_prefix_cache(host=False)

    def recover_pools(self) -> bool:
        """If a failure left the pools donated and deleted: preempt every running request (its KV went
        with them; it is recomputed from its tokens), drop the prefix cache and make a zeroed pool.
        Returns whether it had to."""
        if not self.runner.pools_lost():
            return False
        sched = self.scheduler
        for r in list(reversed(sched.running)):
            sched.preempt(r)
        if sched.kv.host is not None:
            self.forget_copies()
        sched.reset_prefix_cache(host=False)  # the host tier's blocks are on the host: they stay usable
        self.runner.reset_pools()
        self.num_pool_resets += 1
        return True

    def run(self, plan: SchedulePlan, on_prefill=None) -> None:
        """Run a plan and apply its results: one ragged step over its prefill chunks and (without
        speculation) its decode rows' first tokens, their other K - 1 in the decode loop after it; with
        nothing to prefill, the K-step decode loop alone; with speculation, the verify step after the
        ragged step's prefills. The host tier's copies of the plan run first (`copy_kv`)."""
        self.copy_kv()
        if plan.prefills:
            self.ragged_iteration(plan, on_prefill)
        if plan.decode_slots and not plan.decode_applied:
            self.decode_iteration(plan)
        self.copier.finish()  # the host arrays of this iteration's offloads (their copies overlapped the step)

    def forget_copies(self) -> None:
        """After a failure: drop the host tier's copies that did not run and its blocks never filled."""
        self.scheduler.kv.take_copies()
        self.copier.pending.clear()
        self.scheduler.kv.host.drop_unfilled()

    def copy_kv(self) -> None:
        """Dispatch the host tier's pending copies: evicted blocks to the host, then host hits back into
        their fresh pages, ahead of any program that writes those pages."""
        offloads, restores = self.scheduler.kv.take_copies()
        if offloads:
            self.copier.offload([b for b, _ in offloads], [p for _, p in offloads])
        if restores:
            self.copier.restore([b for b, _ in restores], [p for _, p in restores])

    def ragged_iteration(self, plan: SchedulePlan, on_prefill=None) -> None:
        """One ragged step: the plan's prefill chunks and, unless a verify step follows (speculation),
        its decode rows' first tokens, in one program call padded to a step size; then the decode rows'
        other K - 1 tokens in the decode loop, started on the device from the tokens just sampled, with
        the requests whose prompt ended in the step (`plan.joining`) decoding beside them."""
        t0 = time.perf_counter()
        sched, runner = self.scheduler, self.runner
        with_decode = self.speculative is None and bool(plan.decode_slots)
        rows = []
        if with_decode:
            rows += [(slot, r, int(plan.decode_positions[slot]), [int(plan.decode_tokens[slot])])
                     for r, slot in zip(plan.decode_requests, plan.decode_slots)]
        rows += [(c.slot, c.request, c.start, c.token_ids) for c in plan.prefills]
        num_tokens = sum(len(ids) for *_, ids in rows)
        n = runner.step_size(num_tokens)
        sampled = [(slot, r, []) for slot, r, *_ in rows[:len(rows) - len(plan.prefills)]]  # decode rows
        sampled += [(c.slot, c.request, []) for c in plan.prefills if c.is_last]  # and first tokens
        inputs = RaggedInputs.build(rows, n, self.config.max_num_seqs, plan.block_table, self.config.ragged_tile,
                                    self.token_mask(sampled, 1), sched.config.eos_token_ids)
        self.fill_history(rows)
        program, caches = runner.ragged_program(n), runner.allocate()
        # the pools are donated: if this raises after donating them, `recover` sees them deleted
        caches, runner.history, tok, lp, top, scores = program(runner.weights, caches, runner.history, inputs)
        runner.caches = caches
        joining = plan.joining  # (only beside decode rows, never under speculation)
        k = plan.decode_steps if with_decode else 0
        if k > 1:  # queued behind the step (nothing comes back to the host in between)
            # the decoding rows from their next position; the joining ones from their first token, just sampled
            loop_rows = plan.decode_rows(1) + [(c.slot, c.request, c.end) for c in joining]
            more = self.decode_loop(loop_rows, tok[:, None], k - 1, plan.block_table)
        tok, lp = host(tok), host(lp)
        requests = [r for _, r, *_ in rows]
        if any(c.request.scores_prompt for c in plan.prefills):
            self.record_prompt_scores(rows, scores)
        top = top_on_host(requests, top)
        self.timing["ragged_steps"] += 1
        self.timing["rows_computed"] += n
        self.timing["rows_useful"] += num_tokens
        if on_prefill is not None:
            for c in plan.prefills:
                on_prefill(len(c.token_ids))
        dt = time.perf_counter() - t0
        self.timing["prefill_s"] += dt
        self.timing["prefill_tokens"] += plan.num_prefill_tokens
        sched.update_prefill(plan, [int(tok[c.slot]) if c.is_last else None for c in plan.prefills],
                             [float(lp[c.slot]) if c.is_last else None for c in plan.prefills],
                             None if top is None else [(top[0][c.slot], top[1][c.slot]) for c in plan.prefills])
        self.advance_matchers(c.request for c in plan.prefills)
        if k > 1:
            t1 = time.perf_counter()
            out, out_lp = (host(x)[:, :k - 1] for x in more[:2])
            more_top = top_on_host(requests, more[2], k - 1)
            self.timing["decode_s"] += time.perf_counter() - t1
            self.timing["decode_steps"] += k - 1
        if joining:  # (beside decode rows only, so k > 1 here; decode_s and decode_tokens count the loop alone)
            before = sum(len(c.request.output_token_ids) for c in joining)
            sched.update_joined(plan, out, out_lp, tops=more_top)
            self.timing["decode_tokens"] += sum(len(c.request.output_token_ids) for c in joining) - before
        if with_decode:  # (the step's first tokens are prefill's time)
            tokens, logprobs = tok[:, None], lp[:, None]
            tops = None if top is None else tuple(x[:, None] for x in top)
            if k > 1:
                tokens, logprobs = np.concatenate([tokens, out], axis=1), np.concatenate([logprobs, out_lp], axis=1)
                if tops is not None:
                    tops = tuple(np.concatenate([a, b], axis=1) for a, b in zip(tops, more_top))
            before = sum(len(r.output_token_ids) for r in plan.decode_requests)
            sched.update_decode(plan, tokens, logprobs, tops=tops)
            self.advance_matchers(plan.decode_requests)
            gained = sum(len(r.output_token_ids) for r in plan.decode_requests) - before
            self.timing["decode_tokens"] += max(gained - len(plan.decode_slots), 0)  # the loop's share

    def decode_loop(self, rows, tokens, steps: int, block_table):
        """Dispatch the decode loop for `steps` steps over `rows` ((slot, request, position) each: the
        slot's first input is its row of `tokens` [S, 1] (host or device), at that position) through
        `block_table`; returns its (tokens, logprobs) [S, K] and top logprobs (ids, log-probabilities)
        [S, K, 20] on the device."""
        s, runner = self.config.max_num_seqs, self.runner
        requests, positions, live = [None] * s, np.zeros(s, np.int32), np.zeros(s, bool)
        for slot, r, position in rows:
            requests[slot], positions[slot], live[slot] = r, position, True
        self.fill_history(rows)
        mask = self.token_mask([(slot, r, []) for slot, r, _ in rows], 1)
        inputs = StepInputs(tokens, positions[:, None], live[:, None], np.zeros(s, np.int32), block_table,
                            SamplingRows.of(requests, self.scheduler.config.eos_token_ids), mask)
        caches, runner.history, out, out_lp, top = runner.step_program()(
            runner.weights, runner.allocate(), runner.history, inputs, np.int32(steps))
        runner.caches = caches
        return out, out_lp, top

    def decode_iteration(self, plan: SchedulePlan) -> None:
        """Run and apply a plan's decode iteration: up to K steps of the decode loop, or, with
        speculation, one verify step of each slot's last token and its drafts (from the host proposer,
        or drafted on the device by the draft model)."""
        t0 = time.perf_counter()
        before = sum(len(r.output_token_ids) for r in plan.decode_requests)
        if self.speculative is None:
            out, out_lp, top = self.decode_loop(plan.decode_rows(), plan.decode_tokens[:, None], plan.decode_steps,
                                                plan.block_table)
            counts, steps = None, plan.decode_steps
        else:
            out, out_lp, counts, top = self.verify(plan)
            steps = 1
        k = plan.decode_steps
        out, out_lp = host(out)[:, :k], host(out_lp)[:, :k]
        tops = top_on_host(plan.decode_requests, top, k)
        self.timing["decode_s"] += time.perf_counter() - t0
        self.timing["decode_steps"] += steps
        self.scheduler.update_decode(plan, out, out_lp, counts, tops=tops)
        self.advance_matchers(plan.decode_requests)
        self.timing["decode_tokens"] += sum(len(r.output_token_ids) for r in plan.decode_requests) - before

    def verify(self, plan: SchedulePlan):
        """One speculative verify step over the plan's decode slots: (tokens, logprobs) [S, k+1] on the
        device, the count of each slot's tokens (host), and the top logprobs [S, k+1, 20] (device)."""
        s, runner = self.config.max_num_seqs, self.runner
        width = self.speculative.num_tokens + 1
        tokens, valid = np.zeros((s, width), np.int32), np.zeros((s, width), bool)
        tokens[:, 0], valid[:, 0] = plan.decode_tokens, plan.decode_mask
        rows, draft_model, mask_rows = [None] * s, runner.draft is not None, []
        for r, slot in zip(plan.decode_requests, plan.decode_slots):
            rows[slot] = r
            most = int(plan.decode_budget[slot]) - 1  # a verify step emits at most drafts + 1 tokens
            drafts = []
            if self.proposer is not None:
                drafts = self.proposer.propose(r, most)
                tokens[slot, 1:1 + len(drafts)] = drafts
                valid[slot, 1:1 + len(drafts)] = True
            elif draft_model and r.sampling.structured is None:  # (drafted on the device: no mask for them)
                valid[slot, 1:1 + most] = True
            mask_rows.append((slot, r, [int(t) for t in drafts]))  # (token_mask keeps the constrained)
        positions = plan.decode_positions[:, None] + np.arange(width, dtype=np.int32)[None]
        kv_len = np.where(plan.decode_mask, plan.decode_positions + valid.sum(axis=1), 0).astype(np.int32)
        inputs = StepInputs(tokens, positions, valid, kv_len, plan.block_table,
                            SamplingRows.of(rows, self.scheduler.config.eos_token_ids),
                            self.token_mask(mask_rows, width))
        self.fill_history([(slot, r, int(plan.decode_positions[slot]))
                           for r, slot in zip(plan.decode_requests, plan.decode_slots)])
        caches, runner.history, out, counts, out_lp, top = runner.step_program()(
            runner.weights, runner.allocate(), runner.history, inputs)
        runner.caches = caches
        counts = host(counts)
        self.spec_counts["spec_drafted_tokens"] += int(valid[plan.decode_slots, 1:].sum())
        self.spec_counts["spec_verify_steps"] += len(plan.decode_slots)
        accepted = counts[plan.decode_slots] - 1
        self.spec_accepted_per_pos += (np.arange(width - 1)[None] < accepted[:, None]).sum(axis=0)
        return out, out_lp, counts, top

    # --- structured outputs --------------------------------------------------------------------------
    def structured_problem(self, request) -> str | None:
        """Why `request`'s structured output cannot run (the scheduler asks when it enters), or None."""
        if self.tokenizer is None:
            return "structured outputs need the model's tokenizer (tokenizer.json)"
        try:
            if self.grammars is None:
                from dcp_jax.structured import Grammars

                cfg = self.scheduler.config
                self.grammars = Grammars(self.tokenizer, self.runner.model.config.vocab_size, cfg.eos_token_ids)
            return self.grammars.problem(request)
        except ValueError as e:  # UserError included: one line
            return str(e)

    def token_mask(self, rows, tokens: int):
        """The step's token mask [S, tokens, W]: each constrained row of `rows` ((slot, request, drafts)
        each) filled from its matcher, every other row all-allowed; with none constrained, the
        all-allowed mask kept on the device (nothing sent)."""
        rows = [row for row in rows if row[1].sampling.structured is not None]
        if not rows:
            return self.runner.open_mask(tokens)
        mask = np.full((self.config.max_num_seqs, tokens, self.runner.mask_words), -1, np.int32)
        self.grammars.fill(mask, rows)
        return mask

    def advance_matchers(self, requests) -> None:
        """Feed each structured request's matcher the tokens it just emitted; a token its grammar
        refused (never sampled under its mask: a bug) fails the request."""
        for r in requests:
            if r.matcher is not None and (error := self.grammars.advance(r)) and not r.is_finished:
                self.scheduler.fail(r, f"the structured output left its grammar: {error}")

    @staticmethod
    def record_prompt_scores(rows, scores) -> None:
        """Give each row whose request scores its prompt the scores of its tokens (rows end to end in
        the flat batch, as `RaggedInputs.build` laid them)."""
        lps, ranks, ids, top = (host(x) for x in scores)
        at = 0
        for _, r, start, tokens in rows:
            m = len(tokens)
            if r.scores_prompt:
                r.record_prompt_scores(start, lps[at:at + m], ranks[at:at + m], ids[at:at + m], top[at:at + m])
            at += m

    def fill_history(self, rows) -> None:
        """Before a program: for each (slot, request, first position, ...) row whose request's sampling
        reads its earlier tokens (penalties, bad words), the tokens before the row's first position into
        the slot's history row (those already in the cache: no program wrote them there)."""
        for slot, r, start, *_ in rows:
            if r.sampling.needs_history:
                self.runner.fill_history(slot, r, start)

    def stats(self) -> dict:
        """The scheduler's stats, plus speculation's when it is on: drafted and accepted tokens, verify
        steps (one per sequence per step) and the mean acceptance length (tokens a sequence gains per
        step: 1 + accepted / steps)."""
        out = dict(self.scheduler.stats(), failed_steps=self.num_failed_steps, pool_resets=self.num_pool_resets)
        if self.scheduler.kv.host is not None:
            out.update(self.copier.counts, host_bytes=host_bytes(self.scheduler.kv.host.blocks.values()))
        if self.speculative is not None:
            c = dict(self.spec_counts, spec_accepted_tokens=int(self.spec_accepted_per_pos.sum()))
            steps = c["spec_verify_steps"]
            out.update(c, speculative=self.speculative.method, num_speculative_tokens=self.speculative.num_tokens,
                       spec_accepted_per_pos=[int(x) for x in self.spec_accepted_per_pos],
                       spec_acceptance_rate=c["spec_accepted_tokens"] / max(c["spec_drafted_tokens"], 1),
                       mean_acceptance_length=1 + c["spec_accepted_tokens"] / steps if steps else 0.0)
        return out

    def kv_bytes(self) -> dict:
        """KV bytes one device holds and the pool's logical bytes (`ModelRunner.kv_bytes`)."""
        return self.runner.kv_bytes()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block no request holds, on the device and in the host tier; returns
        how many."""
        if self.lockstep is not None:
            self.lockstep.record("reset_prefix_cache")
        self.copy_kv()  # (copies already scheduled run first: nothing half-dropped)
        self.copier.finish()
        return self.scheduler.reset_prefix_cache()


def top_on_host(requests, top, steps: int | None = None):
    """A step's top logprobs (ids, log-probabilities) on the host, the first `steps` columns, when any
    of `requests` asked for them; else None (the arrays stay on the device)."""
    if not any(r.sampling.top_logprobs for r in requests):
        return None
    return tuple(host(x) if steps is None else host(x)[:, :steps] for x in top)


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
            engine.add_request(r)
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
