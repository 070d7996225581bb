"""The engine core: one iteration = schedule (host) -> execute (device) -> update (host).

    plan   = scheduler.schedule()       which chunks prefill, which slots decode K steps, pages
                                        reserved
    output = runner.execute(plan)       the step's programs (`ModelRunner`: it alone owns the pools,
                                        the token history and every compiled program)
    scheduler.update(plan, output)      one call with the whole step's result: tokens appended,
                                        stop rules applied, finished requests collected

`ServingEngine.step` is what every driver calls: `LLM.generate` (`run_requests`), the server's
engine thread (`AsyncEngine`), a follower of several processes (`Lockstep.follow`), both
disaggregated roles. The collaborators are made or handed in here, at construction: the structured
outputs (to the scheduler and the runner), the host tier's copy queue (the KV manager's, to the
runner), the lockstep (several processes).

A step that raises fails the requests of that step alone (finish_reason "error", retryable) and the
engine goes on; when the failure left the pools donated and deleted, the pools are rebuilt, the
prefix cache is dropped with them, and the other running requests are preempted (recomputed from
their tokens, so their outputs do not change).

Speculative decoding (`dcp_jax.spec`) rolls a rejected draft back by the sequence's length alone:
the host advances a request by the tokens it accepted, and every rank-local length and mask is
recomputed on the device from that global length (`PagedLayout`), so the rejected drafts' KV lies
past the length, is never attended to, and is overwritten when the sequence gets there.

On several processes (`jax.distributed`) an engine runs on each, in lockstep (`lockstep`: process 0
publishes its commands and each plan; the others replay them); requests then come in through
`add_request` / `abort`, which the leader records, and a failed step is fatal (`LockstepError`).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from dcp_jax.layout import PagedLayout
from dcp_jax.serving.config import ServingConfig
from dcp_jax.serving.host_copy import host_bytes
from dcp_jax.serving.lockstep import Lockstep, LockstepError
from dcp_jax.serving.plan import StepOutput
from dcp_jax.serving.request import Request
from dcp_jax.serving.runner import ModelRunner
from dcp_jax.serving.scheduler import SchedulePlan, Scheduler
from dcp_jax.spec.proposers import SpeculativeConfig
from dcp_jax.structured import StructuredOutputs

TIMING = ("prefill_s", "prefill_tokens", "decode_s", "decode_tokens", "decode_steps",
          "ragged_steps", "rows_computed", "rows_useful", "draft_fill_s")


class ServingEngine:
    """A `CausalLM` on a ("tp","dcp") mesh serving requests from a paged, sequence-sharded KV
    pool."""

    def __init__(self, model, mesh, config: ServingConfig, layout: PagedLayout, *,
                 impl: str | None = None, combine: str = "auto", detokenize=None,
                 speculative: SpeculativeConfig | None = None, tokenizer=None,
                 lockstep: Lockstep | None = None):
        if speculative is not None and lockstep is not None and speculative.auto_off:
            # several processes must take the same steps: no decision that reads a clock
            speculative = dataclasses.replace(speculative, auto_off=False)
        self.config, self.speculative = config, speculative
        self.layout = layout  # where the pool puts tokens (`LLM.paged_layout`)
        vocab, eos = model.config.vocab_size, model.config.eos_token_ids
        self.structured = StructuredOutputs(tokenizer, vocab, eos)
        k = 0 if speculative is None else speculative.num_tokens
        steps = 1 if speculative is None else speculative.verify_steps(config.decode_steps)
        sched_config = config.scheduler_config(
            self.layout, eos_token_ids=eos, vocab_size=vocab, num_speculative_tokens=k,
            verify_steps=steps, spec_auto_off=speculative is not None and speculative.auto_off)
        self.scheduler = Scheduler(sched_config, detokenize=detokenize, structured=self.structured)
        kv = self.scheduler.kv
        self.runner = ModelRunner(model, mesh, config, self.layout, impl=impl, combine=combine,
                                  speculative=speculative, structured=self.structured,
                                  host_copies=kv.take_copies if kv.host is not None else None)
        self.lockstep = lockstep  # several processes: this one's side (leader or follower)
        # verify steps (row by row): drafts proposed, steps; drafts accepted by their position in
        # the draft (vLLM's spec_decode_num_accepted_tokens_per_pos; their sum is
        # spec_accepted_tokens)
        self.spec_counts = dict(spec_drafted_tokens=0, spec_verify_steps=0)
        self.spec_accepted_per_pos = np.zeros(k, np.int64)
        # time in the device programs (results on the host) and the tokens they produced for
        # requests; rows_computed / rows_useful: tokens the ragged steps ran (padded to a step size)
        # / needed
        self.timing = dict.fromkeys(TIMING, 0)
        self.num_failed_steps = self.num_pool_resets = 0
        # held by whoever drives the engine (an AsyncEngine's thread, an LLM.generate call): one at
        # a time
        self.lock = threading.Lock()

    # --- requests in and out (what a leader records for its followers) ----------------------------
    def add_request(self, request: Request) -> Request:
        """Queue `request`; one the scheduler refuses outright (a duplicate id) is failed, not
        raised."""
        if self.lockstep is not None:
            self.lockstep.record("add", request)
        try:
            self.scheduler.add_request(request)  # one that can never run finishes at once ("error")
        # noqa: BLE001 - e.g. a duplicate id: this request fails, the engine goes on
        except Exception as e:
            self.scheduler.fail(request, f"the request was refused: {e}")
        return request

    def abort(self, request: Request | str, error: str | None = None) -> None:
        """Finish a request now (finish_reason "abort"), e.g. its client went away: a Request
        wherever it is (also one held outside the scheduler), or the id of one in the scheduler."""
        rid = request if isinstance(request, str) else request.request_id
        if self.lockstep is not None:
            self.lockstep.record("abort", rid, error)
        r = self.scheduler.get(rid) if isinstance(request, str) else request
        if r is not None:
            self.scheduler.abort(r, error)

    # --- one iteration ----------------------------------------------------------------------------
    def step(self) -> SchedulePlan:
        """Schedule, execute and update: one iteration. A failure while executing fails the plan's
        requests (see `recover`) instead of raising; returns the plan."""
        plan = self.scheduler.schedule()
        if self.lockstep is not None:
            # the leader publishes it; a follower checks it is the leader's
            self.lockstep.agree(plan)
        try:
            output = self.runner.execute(plan)
        # noqa: BLE001 - any failure of a step is that step's requests' failure
        except Exception as e:
            self.recover(plan, e)
            # its collectives ran on every process: none can go on alone
            if self.lockstep is not None:
                first = (str(e).strip().splitlines() or [""])[0][:300]
                who = self.lockstep.process_id
                raise LockstepError(f"step {plan.step} failed on process {who} "
                                    f"({type(e).__name__}: {first})") from e
            return plan
        self.update(plan, output)
        return plan

    def update(self, plan: SchedulePlan, output: StepOutput) -> None:
        """Hand the step's result to the scheduler and count it (timing, speculation)."""
        lengths = lambda rs: [len(r.output_token_ids) for r in rs]  # noqa: E731
        joining = [c.request for c in plan.joining]
        decoding0, joining0 = lengths(plan.decode_requests), lengths(joining)
        self.scheduler.update(plan, output)
        for key, value in output.timing.items():
            self.timing[key] += value
        self.timing["prefill_tokens"] += plan.num_prefill_tokens
        # the decode loop's tokens: a ragged step's first token of each row is prefill's
        first = 1 if plan.prefills and not plan.verify_steps else 0
        self.timing["decode_tokens"] += sum(
            max(n - n0 - first, 0) for n, n0 in zip(lengths(plan.decode_requests), decoding0))
        self.timing["decode_tokens"] += sum(
            max(n - n0 - 1, 0) for n, n0 in zip(lengths(joining), joining0))
        if output.accepted_per_pos is not None:
            self.spec_counts["spec_drafted_tokens"] += output.drafted
            self.spec_counts["spec_verify_steps"] += output.verify_rows
            self.spec_accepted_per_pos += output.accepted_per_pos

    def run_until_idle(self, on_step=None) -> None:
        """Step until no request is unfinished; `on_step(plan)` after each step, before the next."""
        while self.scheduler.has_unfinished():
            plan = self.step()
            if on_step is not None:
                on_step(plan)

    def recover(self, plan: SchedulePlan, error: BaseException) -> None:
        """After `plan` failed with `error`: fail its unfinished requests (retryable: the server's
        fault); if the pools were lost (donated to the failed program), rebuild them, drop the
        prefix cache with them and preempt every other running request (its KV went with the pool;
        it is recomputed)."""
        self.num_failed_steps += 1
        why = f"the step failed on the server ({type(error).__name__}: {error})"
        self.scheduler.fail_plan(plan, why)
        if not self.recover_pools() and self.scheduler.kv.host is not None:
            # a copy back may not have run, yet its blocks are registered: forget the device's
            # cached blocks (the host tier keeps what was copied out)
            self.forget_copies()
            self.scheduler.reset_prefix_cache(host=False)

    def recover_pools(self) -> bool:
        """If a failure left the pools donated and deleted: preempt every running request (its KV
        went with them; it is recomputed from its tokens), drop the prefix cache and make a zeroed
        pool. Returns whether it had to."""
        if not self.runner.pools_lost():
            return False
        sched = self.scheduler
        for r in list(reversed(sched.running)):
            sched.preempt(r)
        if sched.kv.host is not None:
            self.forget_copies()
        # the host tier's blocks are on the host: they stay usable
        sched.reset_prefix_cache(host=False)
        self.runner.reset_pools()
        self.num_pool_resets += 1
        return True

    def forget_copies(self) -> None:
        """After a failure: drop the host tier's copies that did not run and its blocks never
        filled."""
        self.scheduler.kv.take_copies()
        self.runner.drop_copies()
        self.scheduler.kv.host.drop_unfilled()

    # --- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """The scheduler's stats, plus speculation's when it is on: drafted and accepted tokens,
        verify steps (one per sequence per step) and the mean acceptance length (tokens a sequence
        gains per step: 1 + accepted / steps)."""
        out = dict(self.scheduler.stats(), failed_steps=self.num_failed_steps,
                   pool_resets=self.num_pool_resets)
        if self.scheduler.kv.host is not None:
            out.update(self.runner.copier.counts,
                       host_bytes=host_bytes(self.scheduler.kv.host.blocks.values()))
        if self.speculative is not None:
            out.update(self.spec_stats())
        return out

    def spec_stats(self) -> dict:
        accepted = int(self.spec_accepted_per_pos.sum())
        c = dict(self.spec_counts, spec_accepted_tokens=accepted)
        steps, drafted = c["spec_verify_steps"], c["spec_drafted_tokens"]
        return dict(c, speculative=self.speculative.method,
                    num_speculative_tokens=self.speculative.num_tokens,
                    spec_accepted_per_pos=[int(x) for x in self.spec_accepted_per_pos],
                    spec_acceptance_rate=accepted / max(drafted, 1),
                    mean_acceptance_length=1 + accepted / steps if steps else 0.0)

    def kv_bytes(self) -> dict:
        """KV bytes one device holds and the pool's logical bytes (`ModelRunner.kv_bytes`)."""
        return self.runner.kv_bytes()

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block no request holds, on the device and in the host tier;
        returns how many."""
        if self.lockstep is not None:
            self.lockstep.record("reset_prefix_cache")
        self.runner.copy_pending()  # (copies already scheduled run first: nothing half-dropped)
        self.runner.finish_copies()
        return self.scheduler.reset_prefix_cache()


def run_requests(engine: ServingEngine, requests: list[Request], arrivals=None,
                 on_step=None) -> dict:
    """Serve `requests` to completion through `engine` (continuous batching). `arrivals` (seconds
    after the start, one per request; default all at once) lets requests join mid-flight;
    `on_step(plan)` after each step. Each request's output is on the request; returns the wall time,
    each request's time to first token (`first_token_s`, by id) and the engine's stats."""
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
        plan = engine.step()
        t = time.perf_counter()
        for c in plan.prefills:  # a request's first token comes from its last prefill chunk
            r = c.request
            if c.is_last and r.output_token_ids and r.request_id not in first_token:
                first_token[r.request_id] = t - r.arrival_time
        if on_step is not None:
            on_step(plan)
        sched.pop_finished()
    return dict(wall_s=time.perf_counter() - t0, first_token_s=first_token, **engine.stats())
