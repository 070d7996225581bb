"""Several processes, one schedule: a `ServingEngine` on JAX's multi-controller runtime.

With `jax.distributed` every process runs the same compiled programs on the same inputs, each
feeding its own devices; so the host side of every process must take the same steps. Process 0, the
*leader*, owns the requests (HTTP, `LLM` calls). Every other process, a *follower*, runs the same
engine with no requests of its own and replays the leader's:

    leader, each iteration:   apply commands (add / abort / reset the prefix cache) -> schedule ->
                              publish message `seq` = (the commands, the plan's digest) -> run the plan
    follower, each message:   apply the same commands -> schedule -> check the digest -> run the plan

The scheduler is deterministic plain Python and every program's results are replicated (each process
reads its own copy), so each follower's requests advance exactly as the leader's and its plans come
out the same; the digest (the plan's requests, chunks, slots, block table) checks that they do, so a
difference is an error naming the step, never a hang in a collective of mismatched programs. What is
broadcast per step is small: the commands since the previous step (a new request is its pickled
`Request`, prompt ids included) and a 4-byte digest; an iteration with no new request costs ~100
bytes.

Messages go through the distributed runtime's own key-value store (`jax.distributed`'s client: the
coordination service that process 0 hosts), key `dcp_jax/lockstep/<name>/<seq>`; no other transport.
An idle leader publishes a heartbeat every `timeout_s / 4` seconds, and a follower that hears
nothing for `timeout_s` raises `LockstepError` (process 0 stopped or stalled). A step that fails
raises `LockstepError` on every process that sees it: the processes ran its collectives together and
cannot recover apart (a lost peer also ends the others through JAX's own heartbeats).

Layers above add commands of their own (`Lockstep.register`, kind -> function): a disaggregated
decode instance's reserve / pull / admit / fail (`dcp_jax.disagg.spanning`).

`spmd=True` is the other way to drive several processes, the one `LLM.generate` and the generate CLI
use: every process makes the same calls (the same requests, in the same order) and schedules them
itself; process 0 still publishes each plan's digest and the others check theirs against it.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import pickle
import time
import zlib

import numpy as np

from dcp_jax.serving.request import Request

KEY = "dcp_jax/lockstep"
# messages kept in the store behind the newest (a follower is at most a step or two behind)
KEEP = 64
# SPMD: how long a process waits for process 0's plan. The processes' calls may drift apart in time
# (process 0 writing results between two `generate` calls); a process that is gone is ended by the
# runtime's heartbeats.
SPMD_WAIT_S = 24 * 3600.0
KNOWN = 4096  # requests a follower remembers by id (a sample's `follows` names an earlier one)


class LockstepError(RuntimeError):
    """The processes no longer take the same steps: a peer stopped or stalled, a step failed, or a
    plan differs from the leader's."""


def plan_digest(plan) -> int:
    """A CRC-32 of what a plan runs: its step, chunks, decode rows and block table."""
    head = (plan.step, [(c.request.request_id, c.slot, c.start, len(c.token_ids), c.is_last, c.joins)
                        for c in plan.prefills],
            [r.request_id for r in plan.decode_requests], list(plan.decode_slots),
            plan.decode_steps, plan.verify_steps)
    h = zlib.crc32(repr(head).encode())
    for a in (plan.decode_tokens, plan.decode_positions, plan.decode_budget, plan.block_table):
        h = zlib.crc32(np.ascontiguousarray(a).tobytes(), h)
    return h


class RuntimeStore:
    """The key-value store of JAX's distributed runtime (process 0's coordination service)."""

    def __init__(self, client=None):
        if client is None:
            # the runtime's client: jax.distributed has no public handle
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                raise LockstepError("jax.distributed is not initialized: several processes need it first")
        self.client = client

    def put(self, key: str, value: bytes) -> None:
        self.client.key_value_set_bytes(key, value)

    def get(self, key: str, timeout_s: float) -> bytes | None:
        """The value, or None when nothing came within timeout_s."""
        try:
            return self.client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
        # noqa: BLE001 - the runtime raises its own error type for a deadline
        except Exception as e:
            if "DEADLINE_EXCEEDED" in str(e) or "timed out" in str(e).lower():
                return None
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise LockstepError(f"the distributed runtime failed ({type(e).__name__}: {first}): process 0 "
                                "stopped, or its coordination service did") from e

    def try_get(self, key: str) -> bytes | None:
        """The value if the key is set now, else None (no wait)."""
        try:
            return self.client.key_value_try_get_bytes(key)
        except Exception as e:  # noqa: BLE001 - the runtime's own error type
            if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                return None
            raise LockstepError(f"the distributed runtime failed ({type(e).__name__}: "
                                f"{(str(e).strip().splitlines() or [''])[0][:200]})") from e

    def delete(self, key: str) -> None:
        try:
            self.client.key_value_delete(key)
        except Exception:  # noqa: BLE001 - best effort: a key left behind costs a few bytes
            pass


@dataclasses.dataclass
class Message:
    seq: int
    commands: list
    digest: int | None  # the plan to run; None: commands only (a heartbeat)
    stop: bool = False


class Lockstep:
    """One process's side of the protocol (module docstring). `process_id` 0 leads."""

    def __init__(self, store, process_id: int, timeout_s: float = 60.0, *, spmd: bool = False,
                 name: str = "serve", num_processes: int = 2):
        self.store, self.process_id, self.timeout_s = store, process_id, float(timeout_s)
        # the processes in step (the leader's and the followers')
        self.num_processes = num_processes
        self.leader, self.spmd, self.key = process_id == 0, spmd, f"{KEY}/{name}"
        self.seq = 0
        self.journal: list = []  # leader: commands applied since the last message
        # follower: the digest of the plan the current message runs
        self.expected: int | None = None
        # follower: the newest by id
        self.known: collections.OrderedDict[str, Request] = collections.OrderedDict()
        # more commands (kind -> fn(engine, *args)), from `register`: e.g. dcp_jax.disagg.spanning's
        self.handlers: dict = {}
        self.last_sent = time.monotonic()
        self.bytes_sent = self.messages = 0

    @classmethod
    def of_runtime(cls, timeout_s: float = 60.0, **kw) -> "Lockstep":
        import jax

        return cls(RuntimeStore(), jax.process_index(), timeout_s,
                   num_processes=jax.process_count(), **kw)

    def register(self, **handlers) -> None:
        """Commands of a layer above (kind=fn(engine, *args)) that a follower applies."""
        self.handlers.update(handlers)

    # --- the leader -------------------------------------------------------------------------------
    def record(self, kind: str, *args) -> None:
        """Note a command the leader applies (a new request is pickled now, before anything changes
        it)."""
        if not self.leader or self.spmd:
            return
        # "add", and other layers' commands about a request
        if args and isinstance(args[0], Request):
            args = (self.dump_request(args[0]), *args[1:])
        self.journal.append((kind, *args))

    def publish(self, digest: int | None = None, stop: bool = False) -> None:
        body = pickle.dumps(Message(self.seq, self.journal, digest, stop))
        self.store.put(f"{self.key}/{self.seq}", body)
        if self.seq >= KEEP:
            self.store.delete(f"{self.key}/{self.seq - KEEP}")
        self.seq, self.journal, self.last_sent = self.seq + 1, [], time.monotonic()
        self.bytes_sent += len(body)
        self.messages += 1

    def heartbeat(self) -> None:
        """An idle leader: publish the commands so far when nothing was sent for timeout_s / 4."""
        if self.leader and time.monotonic() - self.last_sent >= self.timeout_s / 4:
            self.publish()

    def agree(self, plan) -> None:
        """Before running `plan`: the leader publishes it; a follower checks it is the leader's."""
        digest = plan_digest(plan)
        if self.leader:
            self.publish(digest)
            return
        # every process made this plan from its own calls: compare it with process 0's
        if self.spmd:
            self.expected = self.receive(SPMD_WAIT_S).digest
        if digest != self.expected:
            raise LockstepError(f"process {self.process_id}'s plan for step {plan.step} differs from process 0's: "
                                "the processes' schedulers diverged")

    # --- a follower -------------------------------------------------------------------------------
    def receive(self, timeout_s: float | None = None) -> Message:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        body = self.store.get(f"{self.key}/{self.seq}", timeout_s)
        if body is None:
            raise LockstepError(f"process {self.process_id} heard nothing from process 0 for {timeout_s:g} s "
                                f"(message {self.seq}): process 0 stopped or stalled")
        msg = pickle.loads(body)
        if msg.seq != self.seq:
            raise LockstepError(f"message {msg.seq} came where {self.seq} was expected")
        self.seq += 1
        return msg

    def follow(self, engine) -> int:
        """A follower's loop: apply each message's commands and take the same step, until the leader
        stops (returns the steps taken). Raises LockstepError when process 0 goes silent or
        differs."""
        steps = 0
        while True:
            msg = self.receive()
            self.apply(engine, msg.commands)
            if msg.stop:
                return steps
            if msg.digest is not None:
                self.expected = msg.digest
                engine.step()
                steps += 1
            engine.scheduler.pop_finished()

    def apply(self, engine, commands) -> None:
        for kind, *args in commands:
            if kind in self.handlers:
                self.handlers[kind](engine, *args)
            elif kind == "add":
                engine.add_request(self.load_request(args[0]))
            elif kind == "abort":
                engine.abort(*args)
            elif kind == "reset_prefix_cache":
                engine.reset_prefix_cache()
            else:
                raise LockstepError(f"unknown command {kind!r} from process 0")

    # --- requests on the wire: a sample's `follows` travels as its id -----------------------------
    @staticmethod
    def dump_request(request: Request) -> bytes:
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf)
        pickler.persistent_id = lambda obj: (obj.request_id if isinstance(obj, Request) and obj is not request
                                             else None)
        pickler.dump(request)
        return buf.getvalue()

    def load_request(self, body: bytes) -> Request:
        """A request the leader recorded (`dump_request`), remembered by id (a later one may follow
        it)."""
        unpickler = pickle.Unpickler(io.BytesIO(body))
        unpickler.persistent_load = self.known.__getitem__
        r = unpickler.load()
        self.known[r.request_id] = r
        while len(self.known) > KNOWN:
            self.known.popitem(last=False)
        return r
