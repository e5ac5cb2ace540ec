"""The gateway's web app: OpenAI's routes under /v1, health and readiness.

Starlette on uvicorn, as the dashboard: a handful of routes, async handlers over
batchery's AsyncClient (one per queue, kept), nothing else. Stateless: the queues and
their models are read from Redis, files and batches live in the file store and RQ, so
any number of replicas can stand behind one load balancer.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from batchery.gateway.auth import Keys, Principal
from batchery.gateway.catalog import Catalog
from batchery.gateway.errors import HANDLERS, ApiError, json_response, not_found
from batchery.gateway.online import Online


@dataclass
class Gateway:
    """What the app serves with."""

    catalog: Catalog
    keys: Keys
    extra_routes: list[Route] = field(default_factory=list)  # files and batches

    def authorize(self, request: Request) -> Principal:
        return self.keys.authorize(request.headers.get("authorization"),
                                   request.headers.get("host"))


def create_app(gateway: Gateway) -> Starlette:
    online = Online(gateway.catalog, gateway.authorize)

    async def models(request: Request) -> Response:
        who = gateway.authorize(request)
        cards = [m.card() for m in await gateway.catalog.listed(who)]
        return json_response({"object": "list", "data": cards})

    async def model(request: Request) -> Response:
        who = gateway.authorize(request)
        name = request.path_params["model"]
        found = next((m for m in await gateway.catalog.listed(who) if m.id == name), None)
        if found is None:
            raise not_found(f"the model {name!r} does not exist (GET /v1/models lists them)",
                            "model_not_found", "model")
        return json_response(found.card())

    async def health(_request: Request) -> Response:
        """Liveness: the process answers."""
        return json_response({"status": "ok"})

    async def ready(_request: Request) -> Response:
        """Readiness: Redis answers too (503 otherwise, from the Redis error handler)."""
        await run_in_threadpool(gateway.catalog.ping)
        return json_response({"status": "ready"})

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await gateway.catalog.close()

    routes = [Route("/health", health), Route("/ready", ready),
              Route("/v1/models", models), Route("/v1/models/{model:path}", model),
              Route("/v1/embeddings", online.embeddings, methods=["POST"]),
              Route("/v1/completions", online.completions, methods=["POST"]),
              Route("/v1/chat/completions", online.chat, methods=["POST"]),
              *gateway.extra_routes]
    handlers: dict[Any, Any] = dict(HANDLERS)
    handlers[404] = _unknown_route
    handlers[405] = _wrong_method
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)


async def _unknown_route(request: Request, _exc: Exception) -> Response:
    return not_found(f"no route {request.method} {request.url.path}: batchery serves "
                     "/v1/models, /v1/embeddings, /v1/completions, /v1/chat/completions, "
                     "/v1/files and /v1/batches", "unknown_url").response()


async def _wrong_method(request: Request, _exc: Exception) -> Response:
    return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                    code="method_not_allowed").response()
