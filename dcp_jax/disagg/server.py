"""The two server roles of a disaggregated pair (`python -m dcp_jax.serve --role prefill|decode`).

    prefill:  a FastAPI app of its own (the control channel: HTTP + JSON over the existing stack),
              GET /disagg/handshake, POST /disagg/prefill, POST /disagg/release, GET /disagg/stats,
              GET /health; the KV itself leaves through its jax.experimental.transfer server, cut
              for the decode instance's placement, which each prefill item carries ("decode").
    decode:   the OpenAI server (dcp_jax.server) over `DisaggAsyncEngine`: a request's prompt
              goes to the prefill instance, its KV is pulled, and it joins the decode batch.

Pairing happens when the decode instance starts: it fetches the prefill instance's handshake and
refuses to start, with one line, if the prefill instance is unreachable or the models differ.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import queue
import threading
import time

from dcp_jax.disagg.roles import DecodeInstance, PrefillInstance
from dcp_jax.disagg.transfer import TransferError, TransferPort
from dcp_jax.launch import join_lockstep, load_llm, openai_app, serve_forever, serve_kw
from dcp_jax.serving.async_engine import AsyncEngine


# --- the prefill side's control channel ---------------------------------------------------------------


class PrefillQueue:
    """The prefill role's one worker: the items of every /disagg/prefill call wait here, and when a
    batch ends everything waiting runs as the next one (one `PrefillInstance.prefill` call: the engine
    batches them under its slots and token budget). A call is answered as soon as its own items are
    done. Items that waited in the queue longer than their call's bound (`queue_timeout_s`, the decode
    side's --prefill-queue-timeout) are answered with an error and never prefilled: nobody would pull
    them. The queue's bound is separate from the transfer's: a burst waits here, it does not eat into
    the time the decode side gives each pull."""

    def __init__(self, instance: PrefillInstance, queue_timeout_s: float = 60.0):
        self.instance, self.queue_timeout_s = instance, queue_timeout_s
        self.calls: queue.Queue = queue.Queue()  # (items, deadline, bound, Future)
        self.stats = dict(batches=0, max_batch=0, queue_timeouts=0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="dcp-jax-prefill", daemon=True)

    def submit(self, items: list[dict], queue_timeout_s: float | None = None) -> concurrent.futures.Future:
        """Queue one call's items; the Future's result is their results, in order (or the batch's exception)."""
        bound = self.queue_timeout_s if queue_timeout_s is None else float(queue_timeout_s)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.calls.put((items, time.monotonic() + bound, bound, done))
        return done

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                calls = [self.calls.get(timeout=0.5)]
            except queue.Empty:
                continue
            while True:  # everything that waits joins this batch
                try:
                    calls.append(self.calls.get_nowait())
                except queue.Empty:
                    break
            self.run_batch(calls)

    def run_batch(self, calls: list) -> None:
        now, live = time.monotonic(), []
        for items, deadline, bound, done in calls:
            if now <= deadline:
                live.append((items, done))
                continue
            self.stats["queue_timeouts"] += len(items)
            done.set_result([dict(request_id=it.get("request_id"), error=f"it waited over {bound:g} s in the prefill "
                                  "instance's queue (the decode side's --prefill-queue-timeout)") for it in items])
        if not live:
            return
        flat = [(it, c) for c, (items, _) in enumerate(live) for it in items]
        results: list[list] = [[None] * len(items) for items, _ in live]
        first = [sum(len(items) for items, _ in live[:c]) for c in range(len(live))]
        left = [len(items) for items, _ in live]

        def on_result(i: int, result: dict) -> None:  # answer a call once its last item is done
            c = flat[i][1]
            results[c][i - first[c]] = result
            left[c] -= 1
            if left[c] == 0:
                live[c][1].set_result(results[c])

        self.stats["batches"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(flat))
        try:
            self.instance.prefill([it for it, _ in flat], on_result)
        except Exception as e:  # noqa: BLE001 - every call still waiting gets the batch's failure
            for _, done in live:
                if not done.done():
                    done.set_exception(e)


def make_prefill_app(instance: PrefillInstance, reap_every_s: float = 0.5, queue_timeout_s: float = 60.0,
                     api_key: str | None = None):
    """The prefill instance's FastAPI app. Prefills run in batches on one worker (`PrefillQueue`:
    calls that arrive while a batch runs form the next one); a reaper drains offers the decode side
    never released (it went away) after the offer timeout. With `api_key`, the /disagg control channel
    answers 401 unless a call carries `Authorization: Bearer <key>` (the decode side sends it)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.responses import JSONResponse

    from dcp_jax.server.protocol import authorized, unauthorized

    worker = PrefillQueue(instance, queue_timeout_s)
    stop = threading.Event()

    def reap():
        while not stop.wait(reap_every_s):
            instance.port.reap()

    @asynccontextmanager
    async def lifespan(app):
        reaper = threading.Thread(target=reap, name="dcp-jax-reaper", daemon=True)
        reaper.start()
        worker.thread.start()
        yield
        stop.set()
        worker.stop.set()

    app = FastAPI(title="dcp_jax prefill instance", lifespan=lifespan)

    @app.middleware("http")
    async def key(request: HTTPRequest, call_next):
        if request.url.path.startswith("/disagg") and not authorized(request.headers.get("authorization"), api_key):
            return unauthorized()
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "role": "prefill"}

    @app.get("/disagg/handshake")
    async def handshake():
        return instance.info()

    @app.post("/disagg/prefill")
    async def prefill(body: dict):
        items = body.get("items")
        if not isinstance(items, list) or not all(isinstance(i, dict) and "prompt_token_ids" in i for i in items):
            return JSONResponse({"error": "give {'items': [{'request_id', 'prompt_token_ids', ...}]}"}, 400)
        bound = body.get("queue_timeout_s")
        if bound is not None and not (isinstance(bound, (int, float)) and bound > 0):
            return JSONResponse({"error": f"queue_timeout_s must be a number > 0, got {bound!r}"}, 400)
        try:
            offers = await asyncio.wrap_future(worker.submit(items, bound))
        except Exception as e:  # noqa: BLE001 - one line back to the decode side, never a traceback
            return JSONResponse({"error": f"the prefill failed: {type(e).__name__}: {e}"}, 500)
        return {"offers": offers}

    @app.post("/disagg/release")
    async def release(body: dict):
        uuid, pulled = int(body["uuid"]), bool(body.get("pulled", True))
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(None, instance.release, uuid, pulled)
        return {"released": found}

    @app.get("/disagg/stats")
    async def stats():
        return dict(instance.stats, **worker.stats, pending_offers=instance.port.num_pending(),
                    dropped_offers=instance.port.dropped)

    return app


class HttpPrefill:
    """The decode side's handle on a prefill instance at HOST:PORT (httpx; every call time-bounded). A
    prefill call waits up to `queue_timeout_s` (its items' time in the prefill instance's queue, which
    that side enforces) plus `timeout_s` (the prefill itself; the pull has its own `timeout_s` after)."""

    def __init__(self, address: str, timeout_s: float = 60.0, queue_timeout_s: float = 60.0,
                 api_key: str | None = None):
        import httpx

        self.address, self.queue_timeout_s = address, queue_timeout_s
        # a fresh connection per call: a pooled idle one can be closed by the server's keep-alive timer
        # just as a call goes out on it (connection reset), and a prefill call is not safe to resend
        self.client = httpx.Client(base_url=f"http://{address}", timeout=timeout_s,
                                   limits=httpx.Limits(max_keepalive_connections=0),
                                   headers={} if api_key is None else {"Authorization": f"Bearer {api_key}"})
        self.httpx = httpx

    def call(self, method: str, path: str, timeout_s: float | None = None, **kw) -> dict:
        try:
            r = self.client.request(method, path, timeout=timeout_s or self.client.timeout, **kw)
        except self.httpx.HTTPError as e:
            raise TransferError(f"the prefill instance at {self.address} did not answer {path} "
                                f"({type(e).__name__}: {e})") from None
        try:
            body = r.json()
        except ValueError:
            body = {"error": r.text[:200]}
        if r.status_code != 200:
            raise TransferError(f"the prefill instance at {self.address} answered {path} with "
                                f"{r.status_code}: {body.get('error', body)}")
        return body

    def handshake(self) -> dict:
        from dcp_jax.errors import UserError

        try:
            return self.call("GET", "/disagg/handshake", timeout_s=10)
        except TransferError as e:
            raise UserError(f"cannot pair with the prefill instance at {self.address}: {e}; start it first with "
                            "`python -m dcp_jax.serve --role prefill` and give its --host:--port to --prefill-at") from None

    def prefill(self, items: list[dict], timeout_s: float) -> list[dict]:
        body = {"items": items, "queue_timeout_s": self.queue_timeout_s}
        return self.call("POST", "/disagg/prefill", timeout_s=self.queue_timeout_s + timeout_s, json=body)["offers"]

    def release(self, uuid: int, pulled: bool) -> None:
        self.call("POST", "/disagg/release", timeout_s=10, json={"uuid": uuid, "pulled": pulled})


# --- the decode side ---------------------------------------------------------------------------------


class DisaggAsyncEngine(AsyncEngine):
    """`AsyncEngine` whose requests are prefilled remotely: a submitted request waits (first come,
    first served) until the engine thread has reserved a slot and its prompt's pages, then is fetched
    (prefill + pull, each bounded) on a helper thread; when its KV has landed the engine thread writes
    it into those pages between steps. A request whose fetch fails finishes with finish_reason "error"
    and the TransferError's line, its reservation back; the others go on."""

    def __init__(self, engine, decode: DecodeInstance, **kw):
        super().__init__(engine, **kw)
        self.decode = decode
        self.waiting: collections.deque = collections.deque()  # Requests waiting for a reservation (FCFS)
        self.backlog: collections.deque = collections.deque()  # (Request, Landed), in landing order

    def fetch(self, tracked) -> None:
        try:
            (offer,) = self.decode.offers([tracked.request])
            if isinstance(offer, TransferError):
                raise offer
            if self.decode.span is not None:  # several processes: the others pull their parts meanwhile
                self.commands.put(("offered", (tracked, offer)))
            landed = self.decode.pull(offer)
            if isinstance(landed, TransferError):
                raise landed
            self.commands.put(("landed", (tracked, landed)))
        except TransferError as e:
            self.commands.put(("failed", (tracked, str(e))))
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            self.commands.put(("failed", (tracked, f"the KV transfer failed: {type(e).__name__}: {e}")))

    def fetch_ready(self) -> None:
        """Fetch every waiting request the pool now has a slot and pages for (reserved first)."""
        for r in self.decode.reserve_ready(self.waiting):
            threading.Thread(target=self.fetch, args=(self.tracked[r.request_id],), name="dcp-jax-fetch",
                             daemon=True).start()

    def drain(self, block: bool) -> None:
        self.decode.admit_ready(self.backlog)
        self.fetch_ready()  # pages freed by the last step or command
        block = block and not self.engine.scheduler.has_unfinished()  # (one admitted just now: step, don't wait)
        if block and self.backlog and self.decode.span is not None:  # landed here, another process still pulling
            super().drain(False)
            self.engine.lockstep.heartbeat()
            time.sleep(0.002)
            return
        super().drain(block)

    def handle(self, kind: str, arg) -> None:
        sched = self.engine.scheduler
        if kind == "add":
            self.tracked[arg.request.request_id] = arg
            try:
                if arg.request.sampling.prompt_logprobs is not None:  # (scored on the prefill instance)
                    raise ValueError("prompt_logprobs (and echo with logprobs) are not supported by a "
                                     "disaggregated server: send them to a single instance")
                refused = sched.refuse(arg.request)  # a refused one is never sent to the prefill instance
            except Exception as e:  # noqa: BLE001 - e.g. a duplicate id: this request fails, the engine goes on
                sched.fail(arg.request, f"the request was refused: {e}")
                refused = True
            if not refused:
                self.waiting.append(arg.request)
                self.fetch_ready()
        elif kind == "offered":  # several processes: the others pull their parts now
            tracked, offer = arg
            if not tracked.request.is_finished:
                self.decode.span.offered(tracked.request, offer)
        elif kind == "landed":
            tracked, landed = arg
            self.backlog.append((tracked.request, landed))
            self.decode.admit_ready(self.backlog)
        elif kind == "failed":
            tracked, error = arg
            if self.decode.span is not None:  # the other processes give its reservation back too
                self.decode.span.fail(tracked.request, error)
            sched.fail(tracked.request, error, retryable=True)  # the prefill instance's failure, not the request's
        else:
            super().handle(kind, arg)  # cancel: in the scheduler, or still fetching / in the backlog


def decode_instance(model_dir, *, prefill_at: str, timeout_s: float, host: str = "127.0.0.1",
                    queue_timeout_s: float = 60.0, api_key: str | None = None, advertise: str | None = None,
                    lockstep_timeout: float | None = None, **llm_kw):
    """Load, pair with the prefill instance at `prefill_at` (UserError if that fails) and compile: (LLM,
    model path, embedded, DecodeInstance). Several processes (`lockstep_timeout`): join the others; on
    process 0 the instance leads them (`spanning.Span`), on the others it follows (`spanning.Follower`)."""
    llm, path, embedded = load_llm(model_dir, **serve_kw(llm_kw, lockstep_timeout))
    port = TransferPort(llm.mesh.local_devices[0], host=host, advertise=advertise)  # this process's own
    # (several processes: process 0's instance leads the others', which follow: `spanning`)
    decode = DecodeInstance(llm.engine, HttpPrefill(prefill_at, timeout_s, queue_timeout_s, api_key), port,
                            timeout_s=timeout_s)
    decode.warm()  # before the port opens: no request compiles a program in the engine thread
    if lockstep_timeout is not None:
        join_lockstep(llm, lockstep_timeout)
    return llm, path, embedded, decode


def make_decode_app(model_dir, *, prefill_at: str, timeout_s: float, served_model_name, max_pending,
                    host: str = "127.0.0.1", queue_timeout_s: float = 60.0, api_key: str | None = None,
                    max_request_bytes: int | None = None, advertise: str | None = None,
                    lockstep_timeout: float | None = None, **llm_kw):
    """Load, pair with the prefill instance at `prefill_at` (UserError if that fails), compile, and
    return (FastAPI app, LLM, DecodeInstance). `timeout_s` bounds each prefill and each pull,
    `queue_timeout_s` a request's wait in the prefill instance's queue; `api_key` guards /v1 and is sent
    to the prefill instance's control channel; `lockstep_timeout`: several processes, this one process 0.
    `llm_kw`: as `dcp_jax.launch.load_llm`."""
    llm, path, embedded, decode = decode_instance(
        model_dir, prefill_at=prefill_at, timeout_s=timeout_s, host=host, queue_timeout_s=queue_timeout_s,
        api_key=api_key, advertise=advertise, lockstep_timeout=lockstep_timeout, **llm_kw)
    engine = llm.engine
    runner = DisaggAsyncEngine(engine, decode, max_pending=max_pending)
    app_kw = dict(api_key=api_key) | ({} if max_request_bytes is None else dict(max_request_bytes=max_request_bytes))
    app = openai_app(runner, llm, path, embedded, served_model_name, **app_kw)

    @app.get("/disagg/stats")
    async def stats():  # the transfers so far, and the scheduler's snapshot after the last step
        span = {} if decode.span is None else dict(bytes_by_process=decode.span.bytes_by_process)
        return dict(decode.stats, **span, source=decode.source, scheduler=runner.stats)

    return app, llm, decode


def make_prefill(model_dir, *, timeout_s: float, host: str = "127.0.0.1", queue_timeout_s: float = 60.0,
                 api_key: str | None = None, advertise: str | None = None, **llm_kw):
    """Load and compile the prefill role: (FastAPI app, LLM, PrefillInstance). `timeout_s`: how long an
    offer waits to be pulled; `queue_timeout_s`: the queue bound of calls that name none."""
    llm, _, _ = load_llm(model_dir, **llm_kw)
    engine = llm.engine
    engine.runner.compile_all(decode=False)
    port = TransferPort(llm.mesh.devices.flat[0], host=host, offer_timeout_s=timeout_s, advertise=advertise)
    instance = PrefillInstance(engine, port)
    return make_prefill_app(instance, queue_timeout_s=queue_timeout_s, api_key=api_key), llm, instance


def run_role(args, llm_kw: dict, api_key: str | None = None, lockstep_timeout: float | None = None) -> int:
    """`python -m dcp_jax.serve --role prefill|decode ...` after the arguments were checked; `llm_kw`:
    `load_llm`'s keywords from the shared flags; `api_key`: the key both roles share;
    `lockstep_timeout`: a decode instance on several processes (process 0 serves HTTP, the others follow)."""
    import sys

    import jax

    from dcp_jax.cli import RUN_ERROR
    from dcp_jax.serving.lockstep import LockstepError

    llm_kw = dict(llm_kw, interleave=args.interleave)
    transfer = dict(host=args.transfer_host or args.host, advertise=args.transfer_advertise)
    try:
        if lockstep_timeout is not None and jax.process_index() > 0:  # a follower: no HTTP
            _, _, _, inst = decode_instance(args.model, prefill_at=args.prefill_at, timeout_s=args.transfer_timeout,
                                            **transfer, queue_timeout_s=args.prefill_queue_timeout, api_key=api_key,
                                            lockstep_timeout=lockstep_timeout, **llm_kw)
            with inst.engine.lock:
                inst.engine.lockstep.follow(inst.engine)
            return 0
        if args.role == "prefill":
            app, llm, inst = make_prefill(args.model, timeout_s=args.transfer_timeout, **transfer,
                                          queue_timeout_s=args.prefill_queue_timeout, api_key=api_key, **llm_kw)
            what = f"prefill instance (KV transfer server {inst.port.address})"
        else:
            app, llm, inst = make_decode_app(args.model, prefill_at=args.prefill_at, timeout_s=args.transfer_timeout,
                                             served_model_name=args.served_model_name,
                                             max_pending=args.max_pending, **transfer,
                                             queue_timeout_s=args.prefill_queue_timeout, api_key=api_key,
                                             max_request_bytes=args.max_request_bytes,
                                             lockstep_timeout=lockstep_timeout, **llm_kw)
            src = inst.source
            what = (f"decode instance paired with the prefill instance at {args.prefill_at} "
                    f"(tp={src['tp']} x dcp={src['dcp']}, interleave {src['interleave']}, page {src['page_size']})")
    except (ValueError, ImportError, LockstepError) as e:  # UserError and the library's own ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR
    lay = inst.engine.layout
    print(f"serving {llm.source} as the {what} on http://{args.host}:{args.port} (tp={llm.mesh.shape['tp']} x "
          f"dcp={llm.mesh.shape['dcp']}, interleave {lay.interleave}, page {lay.page_size})", file=sys.stderr,
          flush=True)
    return serve_forever(app, args.host, args.port, args.log_level, args.shutdown_timeout)
