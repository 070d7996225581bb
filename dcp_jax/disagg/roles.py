"""The two roles of a disaggregated pair, independent of how they talk (in-process calls or HTTP).

    decode instance (the client's)                    prefill instance
    ------------------------------                    ----------------
    pair():      handshake  ───────────────────────►  info(): identity, cache geometry, placement
                 refuses a mismatch (one line); warm(): compile every write program
    reserve_ready(): a slot and the prompt's pages for r (between engine steps, FCFS)
    fetch(r):    prefill(r, this side's placement) ►  prefill(): run the prompt through its engine
                                                      (max_tokens=1: the first token is sampled here),
                                                      cut the KV into pieces per decode rank and head
                                                      shard, offer them under a uuid
                 ◄──────────── Offer (first token, uuid, piece shapes)
                 pull each piece onto the device that
                 keeps it (bounded wait)  ◄═════════  TransferServer (jax.experimental.transfer)
                 release(uuid) ────────────────────►  forget the offer (unreleased ones are drained
                                                      after the offer timeout)
    admit(r):    each device writes its own pieces into the reserved pages, record the first token;
                 then the request decodes with every other one

The prefill side samples the first token (as vLLM's prefill instances do) rather than the decode side
recomputing the last prompt token: the prompt's last row runs once, the decode side needs no prefill
program, and the first token is ready as soon as the prefill is. Sampling keys come from (seed,
position), so the token is the one a single instance would sample.

The decode side asks for a prefill only once it has pages for the KV (`reserve_ready`), so what is
on the way counts in its pool and landed KV never waits; a stalled or dead prefill instance fails the
request (TransferError) within its deadline and the reservation comes back. A write that fails fails
that request alone (`admit_ready`).
"""

from __future__ import annotations

import dataclasses
import threading
import time

from dcp_jax.disagg.handoff import (Offer, check_model, check_pairing, describe, head_ranges,
                                    new_uuid, placement, process_groups, src_layout)
from dcp_jax.disagg.spanning import Follower, Span
from dcp_jax.disagg.transfer import Receiver, Stager, TransferError, TransferPort
from dcp_jax.errors import UserError
from dcp_jax.sampling import SamplingParams
from dcp_jax.serving.request import Request


def request_item(r: Request, decode: dict, eos_token_ids=()) -> dict:
    """What the prefill side needs of a request (JSON-able): its prompt, what its first token is sampled
    with (every sampling rule; with min_tokens, the stop ids the first token may not be) and `decode`,
    the decode side's `placement` (how to cut the KV into pieces for it)."""
    sampling = dataclasses.asdict(r.sampling)
    sampling.update(prompt_logprobs=None)  # (the first token's top logprobs come back in the offer)
    return dict(request_id=r.request_id, prompt_token_ids=list(r.prompt_token_ids), sampling=sampling, seed=r.seed,
                banned_ids=r.banned_ids(eos_token_ids) if r.min_tokens else [], decode=decode)


class PrefillInstance:
    """A `ServingEngine` that only prefills: each request runs to its first token, then its KV waits on
    this instance's transfer server for the decode instance to pull it. Thread-safe (one lock)."""

    def __init__(self, engine, port: TransferPort):
        check_model(engine)
        self.engine, self.port = engine, port
        self.stager = Stager(engine.runner)
        self.lock = threading.Lock()
        self.stats = dict(requests=0, prompt_tokens=0, prefill_s=0.0, stage_s=0.0, offered_bytes=0)

    def info(self) -> dict:
        return describe(self.engine.runner.programs, "prefill", self.port.address)

    def prefill(self, items: list[dict], on_result=None) -> list[dict]:
        """Prefill every item (request_item's fields) in one batch; per item, an Offer's JSON or
        {"request_id", "error"}. Each item's KV is cut for the decode placement it names ("decode"; one
        like this instance's if none); an unusable placement refuses that item. `on_result(i, result)`
        is called for item i as soon as its result is known (before the batch ends)."""
        with self.lock:
            eng = self.engine
            eng.runner.allocate()
            reqs, dests, results = [], {}, {}  # reqs: (request_id, Request or the reason it was refused)
            report = (lambda i, result: None) if on_result is None else on_result
            own = self.info()  # (an item naming no decode placement is cut for one like this)
            for it in items:
                got = self.admit(it, own)
                reqs.append((it["request_id"], got[0] if isinstance(got, tuple) else got))
                if isinstance(got, str):
                    report(len(reqs) - 1, dict(request_id=it["request_id"], error=got))
                else:
                    dests[got[0].request_id] = got[1]
            t0 = time.perf_counter()
            index = {r.request_id: i for i, (_, r) in enumerate(reqs) if not isinstance(r, str)}

            def offer_finished(plan):  # before the next step: the gather reads the pool as it is now
                for c in plan.prefills:
                    r = c.request
                    if c.is_last and r.output_token_ids:
                        i = index[r.request_id]
                        results[r.request_id] = self.offer(c, plan, dests[r.request_id], reqs[i][0], t0)
                        report(i, results[r.request_id])
                eng.scheduler.pop_finished()

            eng.run_until_idle(on_step=offer_finished)
            eng.scheduler.pop_finished()
            self.stats["prefill_s"] += time.perf_counter() - t0
            out = []
            for i, (rid, r) in enumerate(reqs):
                if isinstance(r, str):
                    out.append(dict(request_id=rid, error=r))
                elif r.request_id in results:
                    out.append(results[r.request_id])
                else:  # its prefill failed (a failed step) or it was refused
                    out.append(dict(request_id=rid, error=r.error or f"the prefill ended with {r.finish_reason}"))
                    report(i, out[-1])
            return out

    def admit(self, it: dict, own: dict):
        """One item into the engine: (Request, its decode placement), or why it was refused. One
        malformed item is refused alone: it shares the batch with other callers' items."""
        eng = self.engine
        try:
            dest = placement(it.get("decode") or own)  # none named: cut for a side laid out as this one
            src_layout(dest)
            if max(hi for _, hi in head_ranges(dest)) > eng.runner.model.config.num_kv_heads:
                raise ValueError("more kv heads than the model's")
        except (KeyError, TypeError, ValueError) as e:
            return f"the request names no usable decode placement: {e!r}"
        try:
            sampling = SamplingParams(**it.get("sampling", {}))
            banned = [int(t) for t in it.get("banned_ids", ())]  # min_tokens: not the first token
            r = Request(f"p{new_uuid()}", [int(t) for t in it["prompt_token_ids"]], sampling=sampling,
                        seed=int(it.get("seed", 0)), max_tokens=1, ignore_eos=True, stop_token_ids=banned,
                        min_tokens=1 if banned else 0)
        except (TypeError, ValueError) as e:  # UserError included
            return f"the request is malformed: {e}"
        eng.scheduler.add_request(r)  # one that can never run is finished at once, its error answered
        return r, dest

    def offer(self, c, plan, dest: dict, request_id: str, t0: float) -> dict:
        """Stage a prefilled request's KV (chunk `c` of `plan` was its last) for `dest` and offer it on
        the transfer server: the Offer's JSON, or {"request_id", "error"} when staging failed."""
        r, ts = c.request, time.perf_counter()
        try:  # (the gather reads the pool, donates nothing: a failure here is this item's alone)
            arrays, specs = self.stager.stage(plan.block_table[c.slot], c.end, dest)
            parts = []  # one offer per decode process (each pulls only its own devices' pieces)
            for process, idx in sorted(process_groups(specs, dest).items()):
                parts.append((process, new_uuid(), idx))
                self.port.offer(parts[-1][1], [arrays[j] for j in idx])
        except Exception as e:  # noqa: BLE001 - this item fails, the batch goes on
            result = dict(request_id=request_id, error=f"staging its KV failed: "
                          f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
        else:
            top = r.output_top_logprobs[0] if r.output_top_logprobs else []
            result = Offer(request_id, parts, c.end, r.output_token_ids[0], r.output_logprobs[0], specs,
                           time.perf_counter() - t0, top).to_json()
            self.stats["offered_bytes"] += sum(specs[j].nbytes for _, _, idx in parts for j in idx)
            self.stats["requests"] += 1
            self.stats["prompt_tokens"] += c.end
        self.stats["stage_s"] += time.perf_counter() - ts
        return result

    def release(self, uuid: int, pulled: bool) -> bool:
        """The decode side is done with `uuid`: pulled, or gave up (then the offer is drained here)."""
        return self.port.confirm(uuid) if pulled else self.port.drop(uuid)


class LocalPrefill:
    """The decode side's handle on a `PrefillInstance` in the same process (the in-process pair)."""

    def __init__(self, instance: PrefillInstance):
        self.instance = instance

    def handshake(self) -> dict:
        return self.instance.info()

    def prefill(self, items: list[dict], timeout_s: float) -> list[dict]:
        return self.instance.prefill(items)

    def release(self, uuid: int, pulled: bool) -> None:
        self.instance.release(uuid, pulled)


@dataclasses.dataclass
class Landed:
    """A request's KV pulled onto this process's decode devices (its part of the offer), not yet in the
    pool."""

    offer: Offer
    pieces: list
    transfer_bytes: int
    transfer_s: float
    device_bytes: dict = dataclasses.field(default_factory=dict)  # device id -> KV bytes placed there (write)


class DecodeInstance:
    """The client-facing side: asks `prefill` (LocalPrefill or an HTTP client) for a request's KV, pulls
    it within `timeout_s`, and admits the request into `engine`'s decoding."""

    def __init__(self, engine, prefill, port: TransferPort, *, timeout_s: float = 60.0):
        check_model(engine)
        self.engine, self.prefill, self.port, self.timeout_s = engine, prefill, port, timeout_s
        lockstep = engine.lockstep  # several processes, a server: process 0 leads the others' writes
        self.source = prefill.handshake()
        check_pairing(self.source, self.info())
        self.receiver = Receiver(engine.runner, self.source)
        self.placement = placement(dict(self.info(), processes=self.receiver.processes()))
        self.stats = dict(transfer_bytes=0, transfer_s=0.0, write_s=0.0, transfers=0, failed=0)
        # several processes, on process 0: the other processes' side (`disagg.spanning`); on the others,
        # the handlers of process 0's commands
        self.span = None
        if lockstep is not None and not lockstep.spmd:
            if lockstep.leader:
                self.span = Span(self, lockstep, lockstep.num_processes)
            else:
                Follower(self, lockstep)

    def info(self) -> dict:
        return describe(self.engine.runner.programs, "decode", self.port.address)

    def warm(self) -> int:
        """Compile what decoding runs and allocate the pool, then every write program a prompt this
        instance admits can need (`Receiver.warm`), so no prompt length compiles anything in the engine
        thread while others decode. Returns the write programs compiled."""
        runner = self.engine.runner
        runner.step_program()
        runner.allocate()
        return self.receiver.warm(runner.config.max_model_len - 1)

    def offers(self, requests: list[Request]) -> list[Offer | TransferError]:
        """Prefill `requests` on the prefill instance (one batch): per request its Offer or the
        TransferError that failed it (bounded by `timeout_s`)."""
        try:
            eos = self.engine.scheduler.config.eos_token_ids
            offers = self.prefill.prefill([request_item(r, self.placement, eos) for r in requests], self.timeout_s)
        except TransferError as e:
            self.stats["failed"] += len(requests)
            return [e] * len(requests)
        out = []
        for offer in offers:
            if "error" in offer:
                self.stats["failed"] += 1
                out.append(TransferError(f"the prefill instance refused the request: {offer['error']}"))
                continue
            out.append(Offer.from_json(offer))
        return out

    def fetch_many(self, requests: list[Request]) -> list[Landed | TransferError]:
        """Prefill `requests` on the prefill instance (one batch) and pull each one's KV. Blocking, every
        wait bounded by `timeout_s`; per request a Landed or the TransferError that failed it."""
        return [o if isinstance(o, TransferError) else self.pull(o) for o in self.offers(requests)]

    def fetch(self, request: Request) -> Landed:
        (landed,) = self.fetch_many([request])
        if isinstance(landed, TransferError):
            raise landed
        return landed

    def pull(self, offer: Offer) -> Landed | TransferError:
        """Pull this process's part of `offer` (the pieces its devices keep; none when they keep no
        token of the prompt) within `timeout_s`, and release it on the prefill side."""
        t0 = time.perf_counter()
        uuid, specs = offer.part(self.receiver.process)
        if uuid is None:
            return Landed(offer, [], 0, 0.0)
        try:
            devices = self.receiver.pull_devices(specs)  # each piece onto a device that keeps it
            pieces = self.port.pull(self.source["transfer_address"], uuid, specs, devices, self.timeout_s)
        except TransferError as e:
            self.stats["failed"] += 1
            try:
                self.prefill.release(uuid, pulled=False)
            except TransferError:
                pass  # the prefill instance is gone: nothing to release
            return e
        dt = time.perf_counter() - t0
        try:
            self.prefill.release(uuid, pulled=True)
        except TransferError:
            pass  # it will drain the (already consumed) offer after its timeout
        nbytes = sum(int(p.nbytes) for p in pieces)  # what the transfer delivered
        self.stats["transfer_bytes"] += nbytes
        self.stats["transfer_s"] += dt
        self.stats["transfers"] += 1
        return Landed(offer, pieces, nbytes, dt)

    def admit(self, request: Request, landed: Landed) -> bool | None:
        """Between engine steps: take pages, write the landed KV, record the first token (see
        `Scheduler.admit_prefilled` for the answers)."""
        o = landed.offer
        if o.length != request.num_prompt_tokens:
            raise TransferError(f"the prefill instance sent {o.length} tokens of KV for a {request.num_prompt_tokens}-"
                                "token prompt")
        t0 = time.perf_counter()

        def write(pages):
            _, mine = o.part(self.receiver.process)  # the specs of this process's pieces
            landed.device_bytes = self.receiver.write(landed.pieces, mine, o.length, pages)

        ok = self.engine.scheduler.admit_prefilled(request, o.first_token, o.first_logprob, write,
                                                   top=list(zip(*o.first_top)) if o.first_top else None)
        if ok:
            self.stats["write_s"] += time.perf_counter() - t0
            landed.pieces = []  # the staged copies can go
        return ok

    def reserve_ready(self, waiting) -> list[Request]:
        """Between engine steps: reserve a slot and the prompt's pages (`Scheduler.reserve_prefilled`)
        for requests from the front of `waiting` (a deque, first come first served) while the pool
        allows; returns those reserved, to be fetched. So the decode side asks for (and pulls) only KV
        it has pages for, and what is on the way counts in its pool. A request cancelled meanwhile, or
        one that can never run (finished with its reason), leaves the queue."""
        sched, reserved = self.engine.scheduler, []
        while waiting:
            request = waiting[0]
            if not request.is_finished:
                # several processes: the others reserve for the request as it is before this reservation
                before = self.span.lockstep.dump_request(request) if self.span is not None else None
                try:
                    ok = sched.reserve_prefilled(request)
                except UserError as e:  # a duplicate id: this request fails, the others go on
                    sched.fail(request, f"the request was refused: {e}")
                    ok = False
                if ok is None:
                    break
                if ok:
                    reserved.append(request)
                    if self.span is not None:  # the other processes reserve the same pages
                        self.span.record("reserve", before)
            waiting.popleft()
        return reserved

    def admit_ready(self, backlog) -> list[Request]:
        """Admit landed requests from the front of `backlog` (a deque of (Request, Landed), in landing
        order), between engine steps; returns those admitted. A reserved request (`reserve_ready`) goes
        in at once, one without a reservation while slots and pages allow. A request cancelled meanwhile
        is dropped; one whose KV cannot be written fails alone (finish_reason "error", retryable; its
        slot and pages back) and is collected with the scheduler's finished; if the write lost the pool,
        the engine rebuilds it (`ServingEngine.recover_pools`)."""
        sched, admitted = self.engine.scheduler, []
        while backlog:
            request, landed = backlog[0]
            if not request.is_finished and self.span is not None:  # several processes: each pulled its part?
                verdict = self.span.verdict(request, landed)  # (recorded for the others: admit, or fail and why)
                if verdict is None:
                    break  # another process is still pulling: admit in order, after a step
                if verdict is not True:
                    sched.fail(request, verdict, retryable=True)
                    backlog.popleft()
                    continue
                self.span.admit(request, landed)  # a failed write is fatal: its pages differ between processes
                admitted.append(request)
                backlog.popleft()
                continue
            if not request.is_finished:
                try:
                    ok = self.admit(request, landed)
                except Exception as e:  # noqa: BLE001 - this request fails alone; its slot and pages come back
                    why = str(e) if isinstance(e, TransferError) else f"writing its KV failed: {type(e).__name__}: {e}"
                    sched.fail(request, why, retryable=True)
                    self.engine.recover_pools()  # a write that died after donating the pool shards
                    ok = False
                if ok is None:
                    break
                if ok:
                    admitted.append(request)
            backlog.popleft()
        return admitted
