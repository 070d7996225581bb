"""The `ServingEngine` behind an asyncio server: one background thread owns the engine.

The scheduler and the device programs are not thread-safe, and JAX programs block: so exactly one
thread touches them. HTTP handlers only put commands on a thread-safe queue (add a request, cancel
one) and await their own `asyncio.Queue`; the thread admits queued requests, runs `engine.step()`
while there is work, and after each step pushes every request's new tokens (and its finish) to that
request's queue with `loop.call_soon_threadsafe`. Cancellation goes through the same thread, so
`Scheduler.cancel` frees the pages at once and never races with a step. On several processes this
thread drives the leader's engine: it publishes a heartbeat while idle and a stop message when it
ends (`dcp_jax.serving.lockstep`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time

from dcp_jax.serving.request import Request


class QueueFull(Exception):
    """The server holds `max_pending` unfinished requests already: the caller answers 503."""


@dataclasses.dataclass
class Update:
    """What one request produced since its previous update. `finished` comes once, last; then
    `finish_reason`, `error`, `text` (the final text, cut before a stop string) and `stop_reason`
    (the EOS or stop token id, or the stop string, that ended it: `Request.stop_reason`) are set.
    `num_cached_tokens`: its prompt tokens the prefix cache held (`Request.num_cached_tokens`; 0
    before it is admitted)."""

    token_ids: list[int]
    logprobs: list[float]
    time: float
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    text: str | None = None
    retryable: bool = False  # an error on the server's side (Request.error_retryable)
    # per token (id, logprob) pairs, if asked
    top_logprobs: list = dataclasses.field(default_factory=list)
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None


@dataclasses.dataclass
class _Tracked:
    request: Request
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue
    emitted: int = 0


class AsyncEngine:
    """Drives `engine` (a `ServingEngine`) from one thread; `submit` and `cancel` may be called from
    any thread (the event loop's). At most `max_pending` requests are unfinished at once (queued or
    in the scheduler): beyond that `submit` raises `QueueFull` instead of letting latency grow
    unbounded. Listeners (`subscribe`, or `on_step` / `on_finish` here): `on_step(plan, stats)` runs
    on the engine thread after every step, `on_finish(request)` for every request that finished
    (metrics)."""

    def __init__(self, engine, *, max_pending: int = 256, on_step=None, on_finish=None):
        self.engine = engine
        self.max_pending = max_pending
        self.step_listeners, self.finish_listeners = [], []
        self.subscribe(on_step, on_finish)
        self.commands: queue.Queue = queue.Queue()
        self.tracked: dict[str, _Tracked] = {}  # owned by the engine thread
        self.pending = 0  # unfinished requests submitted: guarded by `lock`
        self.lock = threading.Lock()
        self.stats = dict(engine.stats())  # a snapshot the engine thread replaces after each step
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.failure: BaseException | None = None

    @property
    def config(self):
        """The engine's `SchedulerConfig` (read-only: its limits, e.g. max_model_len, vocab_size,
        eos_token_ids), for front ends that check requests before they submit them."""
        return self.engine.scheduler.config

    # --- any thread -------------------------------------------------------------------------------
    def subscribe(self, on_step=None, on_finish=None) -> None:
        """Add listeners (before `start`): `on_step(plan, stats)` after every step,
        `on_finish(request)` for every finished request, both on the engine thread."""
        if on_step is not None:
            self.step_listeners.append(on_step)
        if on_finish is not None:
            self.finish_listeners.append(on_finish)

    def start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="dcp-jax-engine", daemon=True)
            self.thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; unfinished requests are aborted (their clients
        get a final update)."""
        self.stopping.set()
        self.commands.put(("wake", None))
        if self.thread is not None:
            self.thread.join(timeout)
            self.thread = None

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Queue:
        """Queue `request`; its `Update`s arrive on the returned queue (in `loop`, default the
        running one)."""
        if self.stopping.is_set() or self.failure is not None:
            raise QueueFull("the engine is shutting down" if self.failure is None
                            else f"the engine stopped: {self.failure}")
        with self.lock:
            if self.pending >= self.max_pending:
                raise QueueFull(f"the server already holds {self.max_pending} requests: retry later")
            self.pending += 1
        loop = loop or asyncio.get_running_loop()
        sink: asyncio.Queue = asyncio.Queue()
        self.commands.put(("add", _Tracked(request, loop, sink)))
        return sink

    def cancel(self, request_id: str) -> None:
        """Abort a request (e.g. its client went away); its pages are freed by the engine thread."""
        self.commands.put(("cancel", request_id))

    # --- the engine thread ------------------------------------------------------------------------
    def run(self) -> None:
        """The engine thread. A step's failure fails that step's requests (`ServingEngine.step`) and
        the loop goes on; only a failure outside a step (a bug) ends it, and then `failure` is
        set."""
        sched = self.engine.scheduler
        self.engine.lock.acquire()  # this thread drives the engine until it ends
        try:
            while not self.stopping.is_set():
                self.drain(block=not sched.has_unfinished())
                if self.stopping.is_set():
                    break
                plan = self.engine.step() if sched.has_unfinished() else None
                self.publish()
                for listener in self.step_listeners if plan is not None else ():
                    listener(plan, self.stats)
        # noqa: BLE001 - a device failure: fail every request rather than hang them
        except BaseException as e:
            self.failure = e
        # submit refuses from now on; commands already queued are answered below
        self.stopping.set()
        reason = "the server is shutting down" if self.failure is None else f"the engine stopped: {self.failure}"
        while True:
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":  # never admitted: finish it without the scheduler
                arg.request.finish("abort", error=reason)
                self.push(arg, Update([], [], time.monotonic(), True, "abort", reason))
                with self.lock:
                    self.pending -= 1
        for t in list(self.tracked.values()):
            self.abort(t.request.request_id, reason)
        self.publish(error=reason)
        if self.engine.lockstep is not None and self.engine.lockstep.leader:
            try:  # the followers stop with this thread
                self.engine.lockstep.publish(stop=True)
            # noqa: BLE001 - the runtime is gone already: the followers stop on their own
            except Exception:
                pass
        self.engine.lock.release()

    def drain(self, block: bool) -> None:
        """Apply queued commands; wait for one first when there is no work."""
        while True:
            try:
                kind, arg = self.commands.get(timeout=0.5) if block else self.commands.get_nowait()
            except queue.Empty:
                if block:
                    # several processes: an idle leader's heartbeat
                    if self.engine.lockstep is not None:
                        self.engine.lockstep.heartbeat()
                    continue  # idle: keep waiting (the loop re-checks `stopping`)
                return
            block = False
            if kind == "wake":
                return
            self.handle(kind, arg)
            self.publish()

    def handle(self, kind: str, arg) -> None:
        """Apply one queued command (on the engine thread): "add" a tracked request, "cancel" an
        id."""
        if kind == "add":
            self.tracked[arg.request.request_id] = arg
            # one that can never run finishes at once ("error")
            self.engine.add_request(arg.request)
        elif kind == "cancel":
            self.abort(arg)

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Finish a tracked request now (finish_reason "abort"), in the scheduler or, when a
        subclass holds it outside (e.g. while its KV is on the way from a prefill instance), here;
        the next `publish` sends its final update."""
        t = self.tracked.get(request_id)
        if t is not None:
            self.engine.abort(t.request, error)

    def publish(self, error: str | None = None) -> None:
        """Push each tracked request's new tokens, and finished requests' final updates."""
        now = time.monotonic()
        for t in self.tracked.values():
            r = t.request
            n = len(r.output_token_ids)
            if n > t.emitted and not r.is_finished:
                self.push(t, Update(r.output_token_ids[t.emitted:n], r.output_logprobs[t.emitted:n], now,
                                    top_logprobs=r.output_top_logprobs[t.emitted:n],
                                    num_cached_tokens=r.num_cached_tokens or 0))
                t.emitted = n
        for r in self.engine.scheduler.pop_finished():
            t = self.tracked.pop(r.request_id, None)
            if t is None:
                continue
            n = len(r.output_token_ids)
            self.push(t, Update(r.output_token_ids[t.emitted:n], r.output_logprobs[t.emitted:n], now, True,
                                r.finish_reason, r.error or (error if r.finish_reason == "abort" else None), r.text,
                                r.error_retryable, r.output_top_logprobs[t.emitted:n],
                                r.num_cached_tokens or 0, r.stop_reason))
            with self.lock:
                self.pending -= 1
            for listener in self.finish_listeners:
                listener(r)
        self.stats = dict(self.engine.stats())

    @staticmethod
    def push(t: _Tracked, update: Update) -> None:
        try:
            t.loop.call_soon_threadsafe(t.sink.put_nowait, update)
        except RuntimeError:  # the loop closed (server stopped): nobody is listening
            pass
