"""An OpenAI-compatible HTTP front end (FastAPI) over an engine client.

`create_app(...)` serves `POST /v1/completions`, `POST /v1/chat/completions` (streaming with SSE
or not), Anthropic's `POST /v1/messages` and `POST /v1/messages/count_tokens`, `GET /v1/models`,
vLLM's `POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info` (what lm-eval's remote
tokenizer reads), `GET /health` and `GET /metrics` (Prometheus text, one registry per app so two
apps in one process never share counters). Each route is a method of a handler object
(`CompletionsHandler`, `ChatHandler`, `MessagesHandler`, `TokenizeHandler`, `ModelsHandler`) over
the same `EngineClient`: the handlers never see the engine's insides. Requests become
`dcp_jax.serving.request.Request`s and go through the scheduler like any other: validation that
the scheduler owns (prompt longer than the context, a pool too small, stop strings without a
tokenizer) comes back from it as an "error" finish and is answered 400. Every error is OpenAI's
JSON shape (Anthropic's on its routes), never a traceback; a `UserError` that reaches the app is a
400 whose `param` is the error's `field`. An API key is taken as `Authorization: Bearer <key>` or
as `x-api-key: <key>` (what Anthropic's clients send).
"""

from __future__ import annotations

from dcp_jax.chat_template import ChatTemplate
from dcp_jax.errors import UserError
from dcp_jax.server import anthropic
from dcp_jax.server.chat import ChatHandler
from dcp_jax.server.client import AsyncEngineClient, EngineClient
from dcp_jax.server.completions import CompletionsHandler
from dcp_jax.server.intake import DEFAULT_MAX_REQUEST_BYTES, Intake
from dcp_jax.server.messages import MessagesHandler
from dcp_jax.server.metrics import Metrics
from dcp_jax.server.models import ModelsHandler
from dcp_jax.server.protocol import (
    APIError,
    authorized,
    error_response,
    unauthorized,
    validation_error,
)
from dcp_jax.server.tokenize import TokenizeHandler

try:
    from fastapi import FastAPI
    from fastapi import Request as HTTPRequest
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None

GUARDED = ("/tokenize", "/detokenize", "/tokenizer_info")  # besides /v1/*: what an API key guards


def create_app(engine, *, model_name: str, max_model_len: int | None = None, tokenizer=None,
               chat_template: ChatTemplate | None = None, tp: int = 1, dcp: int = 1,
               api_key: str | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """The FastAPI app over `engine`: an `EngineClient`, or an `AsyncEngine` (wrapped in an
    `AsyncEngineClient` with `max_model_len`, `tokenizer` and `chat_template`). The app's lifespan
    starts the engine and shuts it down. `tokenizer` (a `tokenizers.Tokenizer`-like object, or
    None) encodes text prompts and decodes outputs. With `api_key`, every /v1 route answers 401
    unless the request carries `Authorization: Bearer <key>` or `x-api-key: <key>`.
    `tool_call_parser`, `reasoning_parser`: the parsers by name (`dcp_jax.agents`) of the chat
    endpoint and the Messages API (None: tool_choice auto is refused, thinking stays in the answer
    and the Messages API refuses thinking)."""
    from contextlib import asynccontextmanager

    client = engine if isinstance(engine, EngineClient) else AsyncEngineClient(
        engine, max_model_len=max_model_len, tokenizer=tokenizer, chat_template=chat_template)
    metrics = Metrics(tp, dcp)
    client.subscribe(metrics.update, lambda reason: metrics.finished.labels(reason).inc())
    metrics.update(client.stats)
    intake = Intake(model_name=model_name, max_model_len=client.max_model_len,
                    tokenizer=client.tokenizer, max_request_bytes=max_request_bytes)

    @asynccontextmanager
    async def lifespan(app):
        client.start()
        yield
        client.shutdown()

    app = FastAPI(title="dcp_jax", lifespan=lifespan)
    app.state.client = client
    add_guard(app, metrics, api_key)
    add_error_handlers(app)
    args = (client, intake, metrics, model_name)
    parsers = {"tool_parser": tool_call_parser, "reasoning_parser": reasoning_parser}
    add_routes(app, ModelsHandler(*args), TokenizeHandler(*args), CompletionsHandler(*args),
               ChatHandler(*args, **parsers), MessagesHandler(*args, **parsers))
    return app


def add_routes(app: FastAPI, models: ModelsHandler, tokens: TokenizeHandler,
               completions: CompletionsHandler, chat: ChatHandler,
               messages: MessagesHandler) -> None:
    """Each route onto its handler's method."""
    app.add_api_route("/health", models.health, methods=["GET"])
    app.add_api_route("/v1/models", models.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", models.show_model, methods=["GET"])
    app.add_api_route("/metrics", models.prometheus, methods=["GET"])
    app.add_api_route("/tokenize", tokens.tokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", tokens.tokenizer_info, methods=["GET"])
    app.add_api_route("/detokenize", tokens.detokenize_ids, methods=["POST"])
    app.add_api_route("/v1/completions", completions.create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat.create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/messages", messages.create_message, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"])


def add_guard(app: FastAPI, metrics: Metrics, api_key: str | None) -> None:
    """The API key (401 without it) and the request counter by status."""

    @app.middleware("http")
    async def count(request: HTTPRequest, call_next):
        path = request.url.path
        guarded = path.startswith("/v1") or path in GUARDED
        headers = request.headers
        if guarded and not authorized(headers.get("authorization"), api_key,
                                      headers.get("x-api-key")):
            metrics.requests.labels("401").inc()
            if anthropic.speaks_anthropic(path):
                return anthropic.error_response(401, "a valid API key is needed: send x-api-key: "
                                                "<key> (or Authorization: Bearer <key>)")
            return unauthorized()
        response = await call_next(request)
        if path.startswith("/v1/") and request.method == "POST":
            metrics.requests.labels(str(response.status_code)).inc()
        return response


def shaped(request: HTTPRequest, e: APIError):
    """An error in the shape of the API the route speaks: OpenAI's, or Anthropic's on its
    routes."""
    if anthropic.speaks_anthropic(request.url.path):
        return anthropic.error_response(e.status, e.message, e.param)
    return error_response(e.status, e.message, e.type, e.param, e.code)


def add_error_handlers(app: FastAPI) -> None:
    """Every error as the API's JSON error shape; never a traceback in a response."""

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return shaped(request, e)

    @app.exception_handler(UserError)
    async def user_error(request, e: UserError):
        return shaped(request, APIError(400, str(e), param=e.field))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request, e: RequestValidationError):
        return shaped(request, validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return shaped(request, APIError(e.status_code, str(e.detail), kind))

    @app.exception_handler(Exception)
    async def any_error(request, e: Exception):
        return shaped(request, APIError(500, f"internal error: {type(e).__name__}",
                                        "server_error"))
