"""Continuous batching on the host: which requests prefill, which decode, and where their KV lives.

vLLM-v1 style, plain Python over integers and NumPy (testable without devices). Each iteration:

    plan = scheduler.schedule()          # chunks to prefill, slots to decode K steps, the block table
    ... the device runs plan.prefills and each decode slot's first token in one ragged step, then the
        other K - 1 decode steps (with no prefills: the K decode steps alone) ...
    scheduler.update(plan, output)       # the whole step's result at once (`StepOutput`): first
                                         # tokens, the loop's tokens [max_num_seqs, K], stop rules

Device programs have fixed shapes (`max_num_seqs` slots × `max_blocks_per_seq` blocks), so a running
request owns a slot (a row of the replicated block table) and whole logical blocks of `page_size ·
dcp` tokens (`PagedLayout`). Block-table entries that name no page hold `NULL_PAGE` (0): page 0 of
the pool is reserved, never holds a sequence's KV, and takes the writes of padded rows.

One token budget per iteration (`max_num_batched_tokens`): every decoding request's first token of
the iteration (it runs in the ragged step beside the chunks; without speculation) and the prefill
chunks, of running requests and then of waiting ones, oldest first. An iteration in which no
request decodes has the larger `idle_batched_tokens` (no decoding request waits on its step, so a
lone long prompt prefills in fewer, larger chunks).

Pages are reserved before the device runs: a prefill chunk gets the blocks up to its end, a decoding
request gets the blocks for all K steps. A request whose prompt ends in the iteration's ragged step
joins the K - 1 decode steps that run after it for the decoding requests (when there are any: a
first token is never held back for a loop run for it alone), if it may produce K tokens, has no
structured output and free pages hold them (it never preempts another); no joining under
speculation. When pages run out, the NEWEST running request is preempted: its pages are freed and it
goes back to the front of the waiting queue, to be recomputed later by prefilling prompt + the
tokens it generated so far (the token sampled after that prefill is its next one). The oldest
running request therefore always progresses, and `add_request` refuses requests that could not fit
the pool even alone, so the schedule cannot deadlock.

Policy only: where KV lives (pages, the block table, the prefix table) is the KV manager's
(`dcp_jax.kv.manager.KVCacheManager`, the only way into the allocator and prefix table). With
`enable_prefix_caching` an admitted (or resumed) request starts after the longest run of cached full
blocks of its tokens, sharing those pages, and every block a request fills is registered for later
requests. Cached pages no request holds count as available: taking one evicts it (least recently
used first). See docs/SERVING.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from dcp_jax.errors import UserError
from dcp_jax.kv.manager import NULL_PAGE, KVCacheManager
from dcp_jax.serving.config import SchedulerConfig
from dcp_jax.serving.plan import PrefillChunk, Sampled, SchedulePlan, StepOutput
from dcp_jax.serving.request import Request, RequestState
from dcp_jax.spec.policy import SpecSwitch

__all__ = ["NULL_PAGE", "PrefillChunk", "SchedulePlan", "Scheduler", "SchedulerConfig"]


class Scheduler:
    """FCFS continuous batching with chunked prefill, K-step decode and recompute preemption, and
    the admission of requests prefilled elsewhere (`reserve_prefilled`, `admit_prefilled`).

    `detokenize(ids) -> str` (None without a tokenizer) is needed for stop strings and fills
    `Request.text`. `structured`: the engine's structured outputs (`dcp_jax.structured.
    StructuredOutputs`: `problem(request)` when one enters, `advance(request)` after it emits), None
    without a tokenizer (such requests are refused). Finished requests (including refused and
    cancelled ones) are collected until `pop_finished()`.
    """

    def __init__(self, config: SchedulerConfig, *, detokenize: Callable[[Sequence[int]], str] | None = None,
                 clock: Callable[[], float] = time.monotonic, structured=None):
        self.config, self.detokenize, self.clock = config, detokenize, clock
        self.structured = structured
        self.layout = config.layout
        self.kv = KVCacheManager(config.layout, config.num_pages, config.max_num_seqs, config.max_blocks_per_seq,
                                 config.enable_prefix_caching, config.host_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is the newest
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.finished: list[Request] = []  # not yet popped
        # prompts prefilled elsewhere whose KV is on the way: each holds a slot and its prompt's
        # pages
        self.reserved: dict[str, Request] = {}
        self.num_preemptions = 0
        self.last_plan: SchedulePlan | None = None
        self.step = 0
        # with speculation: whether each decode iteration speculates (measured; dcp_jax.spec.policy)
        self.spec_switch = (SpecSwitch(config.spec_auto_off) if config.num_speculative_tokens
                            else None)

    # --- requests in and out ----------------------------------------------------------------------
    def add_request(self, request: Request) -> Request:
        """Queue `request` (FCFS). A request that can never run is finished at once with
        finish_reason "error" and a one-line message naming the fix; the others are not affected.
        A duplicate id raises UserError (the first request keeps it)."""
        if self.refuse(request):
            return request
        request.state = RequestState.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return request

    def refuse(self, request: Request) -> bool:
        """Stamp a new request's arrival; finish it at once (finish_reason "error", collected with
        the finished) when it can never run, returning True. A duplicate id raises UserError."""
        if request.request_id in self.requests or request.request_id in self.reserved:
            raise UserError(f"request id {request.request_id!r} is already in use: give each request a unique id")
        if request.arrival_time is None:
            request.arrival_time = self.clock()
        problem = self.validate(request)
        if problem is None:
            return False
        self.fail(request, problem)
        return True

    def validate(self, request: Request) -> str | None:
        """Why `request` can never run (one line, with the fix), or None (`Request.problem`; a
        structured output's grammar: `structured.problem(request)`)."""
        problem = request.problem(self.config, self.kv.num_usable, can_detokenize=self.detokenize is not None)
        if problem is None and request.sampling.structured is not None:
            if self.structured is None:
                return "structured outputs need the model's tokenizer (tokenizer.json)"
            problem = self.structured.problem(request)
        return problem

    def cancel(self, request_id: str) -> bool:
        """Abort a request in any state, returning its slot and pages at once; False if it is
        unknown or already finished. Results for it in an outstanding plan are ignored by the
        updates."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.finish(request, "abort")
        return True

    def fail(self, request: Request, error: str, retryable: bool = False) -> None:
        """Finish `request` with finish_reason "error" and a one-line message, wherever it is
        (queued, running, or never added: e.g. held by a caller while its KV was on the way); its
        slot and pages come back at once. `retryable`: the server's fault, not the request's (the
        same request may succeed when sent again)."""
        if not request.is_finished:
            request.error_retryable = retryable
            self.end(request, "error", error)

    def abort(self, request: Request, error: str | None = None) -> None:
        """Finish `request` with finish_reason "abort" wherever it is (as `fail`), e.g. its client
        went away."""
        if not request.is_finished:
            self.end(request, "abort", error)

    def end(self, request: Request, reason: str, error: str | None) -> None:
        if self.requests.get(request.request_id) is request:
            self.finish(request, reason, error=error)
            return
        # its KV was on the way: the reservation back
        if self.reserved.get(request.request_id) is request:
            del self.reserved[request.request_id]
            self.kv.release(request)
        # otherwise held outside: nothing to free
        request.finish(reason, error=error, detokenize=self.detokenize)
        self.finished.append(request)

    def pop_finished(self) -> list[Request]:
        """Requests finished since the last call (stop, length, abort or error)."""
        out, self.finished = self.finished, []
        return out

    def get(self, request_id: str) -> Request | None:
        """An unfinished request by id (also one holding a reservation: `reserve_prefilled`)."""
        return self.requests.get(request_id) or self.reserved.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- the plan ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulePlan:
        """Choose this iteration's work; reserve its pages (preempting the newest if needed)."""
        if self.last_plan is not None and not self.last_plan.applied:
            raise RuntimeError("apply the previous plan's results (update) before scheduling again")
        self.step += 1
        decoding = [r for r in self.running if r.state is RequestState.DECODING]
        verify_steps = self.verify_steps(decoding)
        k_steps, budget_of, budget = self.decode_budget(decoding, verify_steps)
        prefills: list[PrefillChunk] = []
        decodes: list[Request] = []
        preempted: list[str] = []
        budget = self.schedule_running(budget_of, budget, prefills, decodes, preempted)
        if not preempted:  # (after a preemption the pool is short already)
            self.admit_waiting(budget, prefills)
        if not verify_steps and k_steps > 1 and decodes:
            self.join_loop(k_steps, prefills)
        self.last_plan = self.make_plan(prefills, decodes, k_steps, budget_of, preempted,
                                        verify_steps)
        return self.last_plan

    def verify_steps(self, decoding: list[Request]) -> int:
        """The verify steps this iteration's decode rows run (0: plain decoding): none without
        speculation or while it is off (`SpecSwitch`), one when a row has a structured output (its
        drafts' token masks are made on the host), else the configured `verify_steps` (fewer for a
        probe of speculation while it is off, or to fit an iteration that prefills too)."""
        if self.spec_switch is None or not decoding:
            return 0
        prefilling = bool(self.waiting and self.kv.free_slots) or any(
            r.state is RequestState.PREFILLING for r in self.running)
        if not self.spec_switch.choose(len(decoding), prefilling, self.config.decode_steps):
            return 0
        if any(r.sampling.structured is not None for r in decoding):
            return 1
        return self.spec_switch.verify_steps(self.config.verify_steps)

    def decode_budget(self, decoding: list[Request], verify_steps: int = 0):
        """(K, each decoding request's tokens this iteration, the prefill token budget left).

        No decoding request may pass its max_tokens or the model length within the K steps (its
        pages and block-table columns are sized for that); preemptions only remove requests, so K
        stays valid for those that remain. Speculating (`verify_steps` > 0), K = verify_steps ·
        (k + 1) columns and each request is budgeted by its own tokens left instead."""
        cfg = self.config
        left = lambda r: r.tokens_left(cfg.max_model_len)  # noqa: E731
        # nobody waits on an iteration in which nothing decodes: a lone prompt takes larger chunks
        budget = cfg.max_num_batched_tokens if decoding else max(
            cfg.max_num_batched_tokens, cfg.idle_batched_tokens or 0)
        if verify_steps:
            k_steps = cfg.tokens_per_decode(verify_steps) if decoding else 0
            return k_steps, lambda r: min(k_steps, left(r)), budget
        k_steps = min([cfg.decode_steps] + [left(r) for r in decoding]) if decoding else 0
        if any(r.sampling.structured is not None for r in decoding):
            k_steps = min(k_steps, 1)  # a structured output's next mask needs the token before it
        # an iteration that prefills runs each decoding request's first token in the ragged step,
        # beside the chunks: one token of the budget each (its other K - 1 follow in the decode
        # loop)
        return k_steps, lambda r: k_steps, budget - len(decoding)

    def schedule_running(self, budget_of, budget: int, prefills: list, decodes: list,
                         preempted: list) -> int:
        """Running requests, oldest first: each decoding one's K steps, each prefilling one's next
        chunk within `budget`; a page shortage preempts from the newest end of `running` (not yet
        visited), down to the request itself. Returns the budget left."""
        kv, lay, i = self.kv, self.layout, 0
        while i < len(self.running):
            r = self.running[i]
            if r.state is RequestState.DECODING:
                target = r.num_computed + budget_of(r)
            else:
                target = r.num_computed + min(r.num_tokens - r.num_computed, max(budget, 0))
                if target == r.num_computed:
                    i += 1
                    continue
            need = kv.blocks_needed(r, target)
            while need > kv.num_available and self.running[-1] is not r:
                preempted.append(self.preempt(self.running[-1]))
            if need > kv.num_available:  # r is the newest running request
                if r.state is RequestState.DECODING:
                    preempted.append(self.preempt(r))
                    continue
                target = min(target, lay.capacity_tokens(len(r.pages) + kv.num_available))
                need = kv.blocks_needed(r, target)
                if target <= r.num_computed:
                    i += 1
                    continue
            kv.grow(r, need)
            if r.state is RequestState.DECODING:
                decodes.append(r)
            else:
                prefills.append(self.chunk(r, target))
                budget -= target - r.num_computed
            i += 1
        return budget

    def admit_waiting(self, budget: int, prefills: list) -> None:
        """Admit waiting requests in arrival order while slots, pages and budget last. Strict FCFS:
        the head waits, nobody overtakes it."""
        kv, lay = self.kv, self.layout
        while self.waiting and kv.free_slots and budget > 0:
            r = self.waiting[0]
            if (kv.enable_prefix_caching and r.follows is not None
                    and r.follows.state is RequestState.PREFILLING):
                break  # n samples: the first's prefill fills the full blocks the others then share
            hit = kv.lookup(r)
            available = kv.num_available - kv.num_taken_by(hit)
            from_host = min(kv.lookup_host(r, len(hit)), available)  # copied back into fresh pages
            start = lay.capacity_tokens(len(hit) + from_host)
            target = min(r.num_tokens, start + budget, lay.capacity_tokens(len(hit) + available))
            if target <= start:
                break
            self.waiting.popleft()
            kv.admit(r, hit, from_host)
            r.state, r.num_computed = RequestState.PREFILLING, start
            self.running.append(r)
            kv.grow(r, kv.blocks_needed(r, target))
            prefills.append(self.chunk(r, target))
            budget -= target - start

    def join_loop(self, k_steps: int, prefills: list) -> None:
        """Requests whose prompt ends in this step join the decode loop that runs after it for the
        decoding ones (its K - 1 steps), when free pages hold them (never preempting another)."""
        for i, c in enumerate(prefills):
            r = c.request
            if (not c.is_last or r.sampling.structured is not None
                    or r.tokens_left(self.config.max_model_len) < k_steps):
                continue
            # the loop writes end .. end + K - 2
            need = self.kv.blocks_needed(r, c.end + k_steps - 1)
            if need <= self.kv.num_available:
                self.kv.grow(r, need)
                prefills[i] = dataclasses.replace(c, joins=True)

    def make_plan(self, prefills, decodes, k_steps: int, budget_of, preempted,
                  verify_steps: int = 0) -> SchedulePlan:
        n = self.config.max_num_seqs
        tokens, positions, mask = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, bool)
        budgets = np.zeros(n, np.int32)
        for r in decodes:
            tokens[r.slot], positions[r.slot], mask[r.slot] = r.output_token_ids[-1], r.num_computed, True
            budgets[r.slot] = budget_of(r)
        return SchedulePlan(
            step=self.step, prefills=prefills, decode_requests=decodes,
            decode_slots=[r.slot for r in decodes], decode_steps=k_steps if decodes else 0,
            decode_tokens=tokens, decode_positions=positions, decode_mask=mask,
            block_table=self.kv.block_table.copy(), preempted=preempted, decode_budget=budgets,
            verify_steps=verify_steps if decodes else 0)

    def reset_prefix_cache(self, host: bool = True) -> int:
        """Forget every cached prefix block no request holds (and, with `host`, the host tier's);
        returns how many were dropped."""
        return self.kv.reset_prefix_cache(host)

    def chunk(self, r: Request, target: int) -> PrefillChunk:
        """The prefill chunk taking `r` from num_computed to `target` tokens in cache."""
        return PrefillChunk(request=r, slot=r.slot, start=r.num_computed,
                            token_ids=r.token_ids(r.num_computed, target), is_last=target == r.num_tokens)

    def preempt(self, r: Request) -> str:
        """Return a running request's slot and pages and queue it first, to be recomputed
        (prompt + output so far) when it is admitted again. Returns its id."""
        self.kv.release(r)
        self.running.remove(r)
        r.state, r.num_computed = RequestState.WAITING, 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)
        return r.request_id

    def finish(self, r: Request, reason: str | None = None, error: str | None = None) -> None:
        """Take a request out of the queues, free its pages at once, and collect it as finished.
        With `reason`, finish it first (abort, error); otherwise it finished by a stop rule
        already."""
        if reason is not None:
            r.finish(reason, error=error, detokenize=self.detokenize)
        self.kv.release(r)
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        del self.requests[r.request_id]
        self.finished.append(r)

    # --- what the device produced -----------------------------------------------------------------
    def update(self, plan: SchedulePlan, output: StepOutput) -> list[Request]:
        """Apply one plan's whole result (`StepOutput`): the prefill chunks' first tokens, the
        joined requests' loop tokens, the decode rows' tokens, prompt scores; structured outputs'
        matchers advanced over what each request emitted. Each token's input is now in the cache: a
        request's length grows by what it emitted, so a rejected draft's KV is left past the length,
        masked, and overwritten later. Tokens after a stop are discarded. Returns the requests that
        finished."""
        # (before anything changes: a refused output changes nothing)
        self.check_output(plan, output)
        self.check_plan(plan)
        done: list[Request] = []
        if plan.prefills:
            done += self.apply_prefill(plan, output.first)
            for request, start, *scores in output.prompt_scores:
                request.record_prompt_scores(start, *scores)
        if plan.joining:
            done += self.apply_joined(plan, output.joined)
        if plan.decode_slots:
            done += self.apply_decode(plan, output.decode)
            self.observe_decode(plan, output)
        self.advance_structured([c.request for c in plan.prefills] + plan.decode_requests)
        return done

    def observe_decode(self, plan: SchedulePlan, output: StepOutput) -> None:
        """Tell the speculation switch what this iteration's decode rows measured."""
        if self.spec_switch is None:
            return
        tokens = 0
        if plan.verify_steps and output.decode.counts is not None:
            tokens = int(np.sum(output.decode.counts[plan.decode_slots]))
        # a draft model's cache fill after plain iterations is the pause's cost, not the verify
        # steps': a probe after a long pause would otherwise look slower than speculation is
        fill = output.timing.get("draft_fill_s", 0.0)
        self.spec_switch.observe(bool(plan.verify_steps), len(plan.decode_slots),
                                 output.timing.get("decode_s", 0.0) - fill,
                                 output.timing.get("decode_steps", 0), tokens, output.verify_rows,
                                 catch_up=fill)

    def check_output(self, plan: SchedulePlan, output: StepOutput) -> None:
        """Raise ValueError unless `output` has every result `plan` needs, in its shapes."""
        if any(c.is_last for c in plan.prefills):
            self.check_shape(output.first, 1, "first")
        if plan.joining:
            self.check_shape(output.joined, plan.decode_steps - 1, "joined")
        if plan.decode_slots:
            self.check_shape(output.decode, plan.decode_steps, "decode")

    def apply_prefill(self, plan: SchedulePlan, first: Sampled | None) -> list[Request]:
        """The prefill chunks' results: each chunk's tokens are in the cache (its full blocks
        registered); a last chunk's request records its first token (`first`, row = slot)."""
        done = []
        for c in plan.prefills:
            r = c.request
            if r.state is not RequestState.PREFILLING or r.slot != c.slot:
                continue  # cancelled after the plan was made
            r.num_computed = c.end
            self.kv.register(r)
            if not c.is_last:
                continue
            r.state = RequestState.DECODING
            token, logprob = first.tokens[c.slot, 0], first.logprobs[c.slot, 0]
            if self.append(r, token, logprob, first.top(c.slot, 0)):
                done.append(r)
        return done

    def apply_decode(self, plan: SchedulePlan, out: Sampled) -> list[Request]:
        """The decode rows' tokens [max_num_seqs, K] (a verify step: `counts` per slot, 1 <= count
        <= its decode_budget; else K each)."""
        k = plan.decode_steps
        done = []
        for r, slot in zip(plan.decode_requests, plan.decode_slots):
            if r.state is not RequestState.DECODING or r.slot != slot:
                continue  # cancelled after the plan was made
            count = k if out.counts is None else int(out.counts[slot])
            if not 1 <= count <= plan.decode_budget[slot]:
                raise ValueError(f"slot {slot}: {count} tokens for a budget of {plan.decode_budget[slot]}")
            if self.append_decoded(r, count, out):
                done.append(r)
        return done

    def apply_joined(self, plan: SchedulePlan, out: Sampled) -> list[Request]:
        """The decode loop's K - 1 tokens [max_num_seqs, K - 1] of the requests that joined it
        (`plan.joining`), after their first token. One that stopped at its first token gets none."""
        k = plan.decode_steps - 1
        done = []
        for c in plan.joining:
            r = c.request
            if r.state is not RequestState.DECODING or r.slot != c.slot or r.num_computed != c.end:
                continue  # stopped at its first token, or cancelled after the plan was made
            if self.append_decoded(r, k, out):
                done.append(r)
        return done

    def check_shape(self, out: Sampled | None, k: int, what: str) -> None:
        shape = None if out is None else np.shape(out.tokens)
        if shape != (self.config.max_num_seqs, k):
            want = (self.config.max_num_seqs, k)
            raise ValueError(f"{what} tokens have shape {shape}, expected {want}")

    def advance_structured(self, requests) -> None:
        """Feed each structured request's matcher the tokens it just emitted; a token its grammar
        refused (never sampled under its mask: a bug) fails the request."""
        for r in requests:
            if r.matcher is None or r.is_finished:
                continue
            if error := self.structured.advance(r):
                self.fail(r, f"the structured output left its grammar: {error}")

    def fail_plan(self, plan: SchedulePlan, error: str) -> None:
        """`plan` could not run: fail its unfinished requests (retryable: the server's fault, not
        the request's) and take it as applied."""
        plan.applied = True
        for r in [c.request for c in plan.prefills] + list(plan.decode_requests):
            self.fail(r, error, retryable=True)

    def append_decoded(self, r: Request, count: int, out: Sampled) -> bool:
        """Record the first `count` tokens of row `r.slot` of a decode loop's output, each one's
        input now in the cache; stop at a stop rule (returns True: the request finished)."""
        slot = r.slot
        for step in range(count):
            r.num_computed += 1  # the step's input token is now in the cache
            token, logprob = out.tokens[slot, step], out.logprobs[slot, step]
            if self.append(r, token, logprob, out.top(slot, step)):
                return True  # finish() registered its full blocks before freeing them
        self.kv.register(r)
        return False

    def check_plan(self, plan: SchedulePlan) -> None:
        if plan is not self.last_plan:
            raise RuntimeError(f"plan of step {plan.step} is not the latest (step {self.step})")
        if plan.applied:
            raise RuntimeError(f"plan of step {plan.step}: its results were applied already")
        plan.applied = True

    def append(self, r: Request, token, logprob, top=None) -> bool:
        """Record a sampled token (and its top logprobs); finish the request (freeing its pages) if
        a stop rule fired."""
        if r.append_token(token, logprob, top=top, eos_token_ids=self.config.eos_token_ids,
                          max_model_len=self.config.max_model_len, detokenize=self.detokenize):
            self.finish(r)
            return True
        if self.structured is not None and self.structured.ended(r):
            # a model with no EOS: a structured output ends where its grammar is complete
            r.finish("stop", detokenize=self.detokenize)
            self.finish(r)
            return True
        return False

    # --- requests prefilled elsewhere (prefill/decode disaggregation, `dcp_jax.disagg`) -----------
    def reserve_prefilled(self, request: Request) -> bool | None:
        """Hold a slot and the prompt's pages for `request` before a prefill instance computes its
        KV (which `admit_prefilled` then writes straight into them): what is on the way counts
        against the pool like what is running. True when reserved; None when no slot or pages are
        free now, or requests wait for recompute (FCFS: try again after a step); False when the
        request can never run (finished, as `add_request`). `fail` and `abort` give a reservation
        back."""
        if self.refuse(request):
            return False
        if (taken := self.take_prompt_pages(request)) is None:
            return None
        self.reserved[request.request_id] = taken
        return True

    def take_prompt_pages(self, request: Request) -> Request | None:
        kv, need = self.kv, self.layout.blocks_for(request.num_prompt_tokens)
        if self.waiting or not kv.free_slots or need > kv.num_available:
            return None
        kv.admit(request)
        kv.grow(request, need)
        return request

    def admit_prefilled(self, request: Request, first_token: int, first_logprob: float | None,
                        write: Callable[[list[int]], None], top=None) -> bool | None:
        """Admit `request` straight into decoding: its prompt's KV was computed elsewhere (a prefill
        instance) and its first token sampled there. Uses its reservation (`reserve_prefilled`) or
        takes a slot and the prompt's pages now, calls `write(pages)` to put the KV into them
        (block-table order), then records the first token (which may finish the request at once).
        Returns True when admitted; without a reservation None when no slot or pages are free now,
        or requests wait for recompute (try again after a step), False when the request can never
        run (finished with finish_reason "error", as `add_request` does); `top`: the first token's
        top logprobs (ids, logprobs). A duplicate id raises UserError."""
        if self.reserved.get(request.request_id) is request:
            del self.reserved[request.request_id]
        elif self.refuse(request):
            return False
        elif self.take_prompt_pages(request) is None:
            return None
        request.state, request.num_computed = RequestState.DECODING, request.num_prompt_tokens
        self.requests[request.request_id] = request
        self.running.append(request)
        write(list(request.pages))
        self.append(request, first_token, first_logprob, top=top)
        return True

    # --- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for logs and metrics. pages_used counts pages requests hold; cached blocks no
        request uses are free for the pool's purposes (evicted on demand) and counted in
        cached_blocks. prefix_query_tokens / prefix_hit_tokens sum over admissions (a resumed
        request counts again)."""
        out = dict(preemptions=self.num_preemptions, running=len(self.running),
                   waiting=len(self.waiting), reserved=len(self.reserved), **self.kv.stats())
        if self.spec_switch is not None:
            out.update(self.spec_switch.stats())
        return out

    def check(self) -> None:
        """Assert the scheduler's invariants (tests call it after every step)."""
        self.kv.check(self.running + list(self.reserved.values()))
        # a slot and exactly its prompt's pages, nothing computed yet
        for r in self.reserved.values():
            assert r.num_computed == 0 and len(r.pages) == self.layout.blocks_for(r.num_prompt_tokens)
        for r in self.running:
            assert r.state in (RequestState.PREFILLING, RequestState.DECODING)
            if r.state is RequestState.DECODING:
                assert r.num_computed == r.num_tokens - 1
        for r in self.waiting:
            assert r.state is RequestState.WAITING and not r.pages and r.slot is None and r.num_computed == 0
        assert {r.request_id for r in self.running} | {r.request_id for r in self.waiting} == set(self.requests)
