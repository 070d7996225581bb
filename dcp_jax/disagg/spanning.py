"""A decode instance on several processes (`jax.distributed`): each process pulls only the pieces of a
prompt's KV that its own devices keep, and every process admits the request at the same step.

    process 0 (HTTP, the prefill calls)                      process p > 0
    reserve a slot and the prompt's pages  -- "reserve" -->  the same reservation (same pages: the
                                                             schedulers are in lockstep)
    prefill call -> Offer, one part per decode process
      -- "pull" (the Offer), published at once ----------->  pull its part from the prefill instance
    pull its own part                                        (bounded), then report in the store:
                                                             `<lockstep key>/landed/<request>/<p>`
    every report in, none failed:  -- "admit" ----------->   write its pieces into those pages
    one failed (or its own pull):  -- "fail" (why) ------>   give the reservation back

The commands travel in the lockstep journal (`dcp_jax.serving.lockstep`), so every process applies them
at the same point of its schedule; the reports (a few bytes: the bytes pulled, or the error) go through
the same key-value store. No KV crosses between decode processes: a piece two processes keep (a kv head
replicated over tp ranks on both) is offered to each. Process 0 waits for the reports between steps
(the requests already decoding go on); a write that fails on any process is fatal (`LockstepError`):
its pages would differ between processes.
"""

from __future__ import annotations

import json
import threading

from dcp_jax.disagg.handoff import Offer
from dcp_jax.disagg.transfer import TransferError
from dcp_jax.serving.lockstep import LockstepError


def report_key(lockstep, request_id: str, process: int) -> str:
    return f"{lockstep.key}/landed/{request_id}/{process}"


def admit(decode, request, landed, process: int) -> None:
    """Write `process`'s pieces of a reserved request into its pages. Any failure is fatal: the other
    processes wrote theirs, so the processes' pages would differ."""
    try:
        ok = decode.admit(request, landed)
    except Exception as e:  # noqa: BLE001 - reported as the processes' divergence
        raise LockstepError(f"writing request {request.request_id}'s KV failed on process {process} "
                            f"({type(e).__name__}: {e})") from e
    if not ok:
        raise LockstepError(f"request {request.request_id} held no reservation on process {process}")


class Span:
    """Process 0's side: records the commands the other processes apply and collects their reports."""

    def __init__(self, decode, lockstep, num_processes: int):
        self.decode, self.lockstep, self.others = decode, lockstep, range(1, num_processes)
        self.bytes_by_process = {p: 0 for p in range(num_processes)}  # KV bytes each process pulled

    def record(self, kind: str, *args) -> None:
        self.lockstep.record(kind, *args)

    def offered(self, request, offer: Offer) -> None:
        """The prefill instance answered: the others start pulling their parts now (published at once,
        not with the next step)."""
        self.record("pull", request.request_id, offer.to_json())
        self.lockstep.publish()

    def verdict(self, request, landed) -> bool | str | None:
        """Between steps, for a request whose part landed here: None while another process is still
        pulling; else True (recorded "admit") or the first error (recorded "fail")."""
        reports = {}
        for p in self.others:
            body = self.lockstep.store.try_get(report_key(self.lockstep, request.request_id, p))
            if body is None:
                return None
            reports[p] = json.loads(body)
        for p in self.others:
            self.lockstep.store.delete(report_key(self.lockstep, request.request_id, p))
        errors = [f"process {p}: {r['error']}" for p, r in reports.items() if "error" in r]
        if errors:
            self.record("fail", request.request_id, errors[0])
            return errors[0]
        self.record("admit", request.request_id)
        self.bytes_by_process[0] += landed.transfer_bytes
        for p, r in reports.items():
            self.bytes_by_process[p] += r["bytes"]
        return True

    def admit(self, request, landed) -> None:
        """Write this process's pieces (after `verdict` said True); any failure is fatal."""
        admit(self.decode, request, landed, 0)

    def fail(self, request, error: str) -> None:
        """A request whose prefill or pull failed here: the others give its reservation back."""
        if self.decode.engine.scheduler.reserved.get(request.request_id) is request:
            self.record("fail", request.request_id, error)


class Follower:
    """A process p > 0 of the decode instance: applies process 0's reserve / pull / admit / fail (and
    abort) commands to its own engine, pulling its part of each offer on a helper thread."""

    def __init__(self, decode, lockstep):
        self.decode, self.lockstep = decode, lockstep
        self.landed: dict = {}  # request id -> Landed (this process's part, not yet written)
        self.lock = threading.Lock()
        lockstep.register(reserve=self.reserve, pull=self.pull, admit=self.admit, fail=self.fail,
                          abort=self.abort)

    def reserve(self, engine, body: bytes) -> None:
        request = self.lockstep.load_request(body)
        if engine.scheduler.reserve_prefilled(request) is not True:
            raise LockstepError(f"process {self.lockstep.process_id} could not reserve request "
                                f"{request.request_id}'s pages as process 0 did")

    def pull(self, engine, request_id: str, offer: dict) -> None:
        threading.Thread(target=self.fetch, args=(engine, request_id, Offer.from_json(offer)),
                         name="dcp-jax-fetch", daemon=True).start()

    def fetch(self, engine, request_id: str, offer: Offer) -> None:
        try:
            landed = self.decode.pull(offer)
        except Exception as e:  # noqa: BLE001 - reported: process 0 fails the request everywhere
            landed = TransferError(f"the KV transfer failed: {type(e).__name__}: {e}")
        if isinstance(landed, TransferError):
            report = dict(error=str(landed))
        else:
            with self.lock:
                if engine.scheduler.reserved.get(request_id) is not None:  # (not failed or aborted meanwhile)
                    self.landed[request_id] = landed
            report = dict(bytes=landed.transfer_bytes)
        self.lockstep.store.put(report_key(self.lockstep, request_id, self.lockstep.process_id),
                                json.dumps(report).encode())

    def admit(self, engine, request_id: str) -> None:
        request = engine.scheduler.reserved.get(request_id)
        with self.lock:
            landed = self.landed.pop(request_id, None)
        if request is None or landed is None:
            raise LockstepError(f"process {self.lockstep.process_id} has no reservation or KV for request "
                                f"{request_id}, which process 0 admitted")
        admit(self.decode, request, landed, self.lockstep.process_id)

    def fail(self, engine, request_id: str, error: str) -> None:
        request = engine.scheduler.reserved.get(request_id)
        if request is not None:
            engine.scheduler.fail(request, error, retryable=True)
        self.forget(request_id)

    def abort(self, engine, request_id: str, error: str | None = None) -> None:
        engine.abort(request_id, error)
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """Drop a landed part nobody will write (one still on the way is not kept when it lands)."""
        with self.lock:
            self.landed.pop(request_id, None)
