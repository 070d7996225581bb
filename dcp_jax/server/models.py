"""`GET /v1/models` (and one model's card), `GET /health` (readiness: 503 once the engine
stopped) and `GET /metrics` (Prometheus text)."""

from __future__ import annotations

import time

from dcp_jax.server.base import Handler
from dcp_jax.server.protocol import error_response

try:
    from fastapi.responses import PlainTextResponse
    from prometheus_client import generate_latest
except ImportError as e:  # pragma: no cover - the message names the fix
    raise ImportError("the server needs the 'serve' extra: "
                      f"pip install 'dcp_jax[serve]' ({e})") from None


class ModelsHandler(Handler):
    """The served model's card, the engine's health and the server's metrics."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.card = {"id": self.model_name, "object": "model", "created": int(time.time()),
                     "owned_by": "dcp_jax", "max_model_len": self.client.max_model_len}

    async def list_models(self):
        return {"object": "list", "data": [self.card]}

    async def show_model(self, model_id: str):
        self.intake.check_model(model_id)
        return self.card

    async def health(self):
        if self.client.failure is not None:
            return error_response(503, f"the engine stopped: {self.client.failure}", "server_error")
        return {"status": "ok"}

    async def prometheus(self):
        self.metrics.update(self.client.stats)
        return PlainTextResponse(generate_latest(self.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")
