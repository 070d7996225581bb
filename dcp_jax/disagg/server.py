"""The two server roles of a disaggregated pair (`python -m dcp_jax.serve --role prefill|decode`).

    prefill:  a FastAPI app of its own (the control channel: HTTP + JSON over the existing stack),
              GET /disagg/handshake, POST /disagg/prefill, POST /disagg/release, GET /disagg/stats,
              GET /health; the KV itself leaves through its jax.experimental.transfer server, cut
              for the decode instance's placement, which each prefill item carries ("decode").
    decode:   the OpenAI server (dcp_jax.serving.openai) over `DisaggAsyncEngine`: a request's prompt
              goes to the prefill instance, its KV is pulled, and it joins the decode batch.

Pairing happens when the decode instance starts: it fetches the prefill instance's handshake and
refuses to start, with one line, if the prefill instance is unreachable or the models differ.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading

from dcp_jax.disagg.roles import DecodeInstance, PrefillInstance
from dcp_jax.disagg.transfer import TransferError, TransferPort
from dcp_jax.launch import load_llm, openai_app, serve_forever
from dcp_jax.serving.async_engine import AsyncEngine


# --- the prefill side's control channel ---------------------------------------------------------------


def make_prefill_app(instance: PrefillInstance, reap_every_s: float = 0.5):
    """The prefill instance's FastAPI app. Prefills run one batch at a time on one worker thread; a
    reaper drains offers the decode side never released (it went away) after the offer timeout."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp-jax-prefill")
    stop = threading.Event()

    def reap():
        while not stop.wait(reap_every_s):
            instance.port.reap()

    @asynccontextmanager
    async def lifespan(app):
        reaper = threading.Thread(target=reap, name="dcp-jax-reaper", daemon=True)
        reaper.start()
        yield
        stop.set()
        worker.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="dcp_jax prefill instance", lifespan=lifespan)

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
        loop = asyncio.get_running_loop()
        try:
            offers = await loop.run_in_executor(worker, instance.prefill, items)
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
        return dict(instance.stats, pending_offers=instance.port.num_pending(), dropped_offers=instance.port.dropped)

    return app


class HttpPrefill:
    """The decode side's handle on a prefill instance at HOST:PORT (httpx; every call time-bounded)."""

    def __init__(self, address: str, timeout_s: float = 60.0):
        import httpx

        self.address = address
        self.client = httpx.Client(base_url=f"http://{address}", timeout=timeout_s)
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
        return self.call("POST", "/disagg/prefill", timeout_s=timeout_s, json={"items": items})["offers"]

    def release(self, uuid: int, pulled: bool) -> None:
        self.call("POST", "/disagg/release", timeout_s=10, json={"uuid": uuid, "pulled": pulled})


# --- the decode side ---------------------------------------------------------------------------------


class DisaggAsyncEngine(AsyncEngine):
    """`AsyncEngine` whose requests are prefilled remotely: a submitted request is fetched (prefill +
    pull, bounded by the decode instance's timeout) on a helper thread; when its KV has landed the
    engine thread admits it between steps (pages permitting, in arrival order). A request whose fetch
    fails finishes with finish_reason "error" and the TransferError's line; the others go on."""

    def __init__(self, engine, decode: DecodeInstance, **kw):
        super().__init__(engine, **kw)
        self.decode = decode
        self.backlog: collections.deque = collections.deque()  # (Request, Landed), in landing order

    def fetch(self, tracked) -> None:
        try:
            landed = self.decode.fetch(tracked.request)
            self.commands.put(("landed", (tracked, landed)))
        except TransferError as e:
            self.commands.put(("failed", (tracked, str(e))))
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            self.commands.put(("failed", (tracked, f"the KV transfer failed: {type(e).__name__}: {e}")))

    def drain(self, block: bool) -> None:
        self.decode.admit_ready(self.backlog)  # landed earlier, waiting for pages
        super().drain(block)

    def handle(self, kind: str, arg) -> None:
        sched = self.engine.scheduler
        if kind == "add":
            self.tracked[arg.request.request_id] = arg
            if not sched.refuse(arg.request):  # a refused one is never sent to the prefill instance
                threading.Thread(target=self.fetch, args=(arg,), name="dcp-jax-fetch", daemon=True).start()
        elif kind == "landed":
            tracked, landed = arg
            self.backlog.append((tracked.request, landed))
            self.decode.admit_ready(self.backlog)
        elif kind == "failed":
            tracked, error = arg
            sched.fail(tracked.request, error, retryable=True)  # the prefill instance's failure, not the request's
        else:
            super().handle(kind, arg)  # cancel: in the scheduler, or still fetching / in the backlog


def make_decode_app(model_dir, *, prefill_at: str, timeout_s: float, served_model_name, max_pending,
                    host: str = "127.0.0.1", **llm_kw):
    """Load, pair with the prefill instance at `prefill_at` (UserError if that fails), compile, and
    return (FastAPI app, LLM, DecodeInstance). `llm_kw`: as `dcp_jax.launch.load_llm`."""
    llm, path, embedded = load_llm(model_dir, **llm_kw)
    engine = llm.engine
    engine.runner.decode_program()
    engine.runner.allocate()
    port = TransferPort(llm.mesh.devices.flat[0], host=host)
    decode = DecodeInstance(engine, HttpPrefill(prefill_at, timeout_s), port, timeout_s=timeout_s)
    runner = DisaggAsyncEngine(engine, decode, max_pending=max_pending)
    app = openai_app(runner, llm, path, embedded, served_model_name)

    @app.get("/disagg/stats")
    async def stats():  # the transfers so far, and the scheduler's snapshot after the last step
        return dict(decode.stats, source=decode.source, scheduler=runner.stats)

    return app, llm, decode


def make_prefill(model_dir, *, timeout_s: float, host: str = "127.0.0.1", **llm_kw):
    """Load and compile the prefill role: (FastAPI app, LLM, PrefillInstance)."""
    llm, _, _ = load_llm(model_dir, **llm_kw)
    engine = llm.engine
    engine.runner.prefill_program()
    engine.runner.allocate()
    port = TransferPort(llm.mesh.devices.flat[0], host=host, offer_timeout_s=timeout_s)
    instance = PrefillInstance(engine, port)
    return make_prefill_app(instance), llm, instance


def run_role(args, llm_kw: dict) -> int:
    """`python -m dcp_jax.serve --role prefill|decode ...` after the arguments were checked; `llm_kw`:
    `load_llm`'s keywords from the shared flags."""
    import sys

    from dcp_jax.cli import RUN_ERROR

    llm_kw = dict(llm_kw, interleave=args.interleave)
    try:
        if args.role == "prefill":
            app, llm, inst = make_prefill(args.model, timeout_s=args.transfer_timeout, host=args.host, **llm_kw)
            what = f"prefill instance (KV transfer server {inst.port.address})"
        else:
            app, llm, inst = make_decode_app(args.model, prefill_at=args.prefill_at, timeout_s=args.transfer_timeout,
                                             served_model_name=args.served_model_name,
                                             max_pending=args.max_pending, host=args.host, **llm_kw)
            src = inst.source
            what = (f"decode instance paired with the prefill instance at {args.prefill_at} "
                    f"(tp={src['tp']} x dcp={src['dcp']}, interleave {src['interleave']}, page {src['page_size']})")
    except (ValueError, ImportError) as e:  # UserError and the library's own ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return RUN_ERROR
    lay = inst.engine.layout
    print(f"serving {llm.source} as the {what} on http://{args.host}:{args.port} (tp={llm.mesh.shape['tp']} x "
          f"dcp={llm.mesh.shape['dcp']}, interleave {lay.interleave}, page {lay.page_size})", file=sys.stderr,
          flush=True)
    return serve_forever(app, args.host, args.port, args.log_level)
