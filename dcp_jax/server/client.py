"""What the HTTP front end needs from an engine, and nothing more: `EngineClient`.

The handlers see only this interface: submit a `Request` and read its `Update`s from a queue, cancel
it, read the stats and whether the engine still runs, the limits the intake checks against (context
length, vocabulary size, EOS ids) and the text side of the model (tokenizer, chat template).
`AsyncEngineClient` implements it over `dcp_jax.serving.async_engine.AsyncEngine` (and its
subclasses, e.g. the disaggregated decode side's); a test or another engine implements the same
methods.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable

from dcp_jax.serving.async_engine import AsyncEngine, QueueFull
from dcp_jax.serving.request import Request

__all__ = ["AsyncEngineClient", "EngineClient", "EngineOverloaded"]


class EngineOverloaded(Exception):
    """The engine takes no more requests now (full queue, shutting down): answered 503."""


class EngineClient(abc.ABC):
    """The engine as the front end sees it. `submit` and `cancel` are called on the event loop."""

    tokenizer = None  # a `tokenizers.Tokenizer`-like object, or None: prompts are then token ids
    chat_template = None  # a `ChatTemplate`, or None: /v1/chat/completions is refused

    # --- limits the intake checks a request against ---
    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """The context: prompt plus generated tokens."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int | None:
        """Token ids are in [0, vocab_size); None when the engine does not say."""

    @property
    @abc.abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a sequence (the first is the EOS token /tokenizer_info names)."""

    # --- the requests ---
    @abc.abstractmethod
    def submit(self, request: Request) -> asyncio.Queue:
        """Queue `request`; its `Update`s (the last with `finished`) arrive on the returned queue.
        Raises EngineOverloaded when the engine takes no more requests now."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """Abort a request (its client went away); a final update follows on its queue."""

    # --- state ---
    @property
    @abc.abstractmethod
    def stats(self) -> dict:
        """The engine's latest counters and levels (`ServingEngine.stats()` names)."""

    @property
    @abc.abstractmethod
    def failure(self) -> BaseException | None:
        """Why the engine stopped for good, or None while it runs (readiness: /health)."""

    @abc.abstractmethod
    def subscribe(self, on_stats: Callable[[dict], None], on_finish: Callable[[str], None]) -> None:
        """Call `on_stats(stats)` after every engine step and `on_finish(finish_reason)` for every
        finished request (from any thread: the callbacks must be thread-safe)."""

    # --- lifetime (the app's lifespan) ---
    @abc.abstractmethod
    def start(self) -> None:
        """Start serving (idempotent)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop: unfinished requests are aborted (their clients get a final update)."""


class AsyncEngineClient(EngineClient):
    """`EngineClient` over an `AsyncEngine`. `max_model_len` defaults to the engine's own."""

    def __init__(self, engine: AsyncEngine, *, max_model_len: int | None = None, tokenizer=None,
                 chat_template=None):
        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self._max_model_len = max_model_len

    @property
    def max_model_len(self) -> int:
        if self._max_model_len is not None:
            return self._max_model_len
        return self.engine.config.max_model_len

    @property
    def vocab_size(self) -> int | None:
        return self.engine.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.engine.config.eos_token_ids)

    def submit(self, request: Request) -> asyncio.Queue:
        try:
            return self.engine.submit(request)
        except QueueFull as e:
            raise EngineOverloaded(str(e)) from None

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    @property
    def stats(self) -> dict:
        return self.engine.stats

    @property
    def failure(self) -> BaseException | None:
        return self.engine.failure

    def subscribe(self, on_stats, on_finish) -> None:
        self.engine.subscribe(on_step=lambda plan, stats: on_stats(stats),
                              on_finish=lambda r: on_finish(r.finish_reason))

    def start(self) -> None:
        self.engine.start()

    def shutdown(self) -> None:
        self.engine.shutdown()
