"""The models the gateway serves: batchery queues, each with the task and model its
workers announce, and one AsyncClient per queue to enqueue into it.

Nothing is kept but caches: the queues registered in Redis (or the ``--queue`` list) and
what their workers report are read again every CATALOG_S, so replicas agree and a new
queue shows up without a restart.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from batchery.batching.sharded import ShardedQueue, open_queue
from batchery.connection import RedisSettings
from batchery.gateway.auth import Principal
from batchery.gateway.errors import bad_request, unknown_model
from batchery.producer.aio import AsyncClient
from batchery.producer.openai_api import TASKS

CATALOG_S = 2.0   # how stale the list of queues and their workers' models may be
TASK_NAMES = ("embed", "generate", "classify")


@dataclass(frozen=True)
class Model:
    id: str          # the queue's name
    task: str        # embed | generate | classify | custom; "" while no worker reported
    model: str       # what its workers run, as they report it ("minilm", a directory)
    created: int     # the oldest live worker's start (OpenAI's "created"), 0 if none

    def card(self) -> dict[str, Any]:
        """GET /v1/models' entry."""
        return {"id": self.id, "object": "model", "created": self.created,
                "owned_by": "batchery", "task": self.task or None, "root": self.model or None}


def describe(queue: str, reports: list[dict[str, Any]]) -> Model:
    """A queue's model from its workers' reports ("embed minilm", "mymodule:factory")."""
    live = [r for r in reports if r.get("live")] or reports
    runs = next((str(r.get("model", "")) for r in live if r.get("model")), "")
    task, _, model = runs.partition(" ")
    if task not in TASK_NAMES:
        task, model = ("custom", runs) if runs else ("", "")
    started = [int(float(r.get("started", 0))) for r in live if r.get("started")]
    return Model(queue, task, model, min(started, default=0))


class Catalog:
    def __init__(self, redis: RedisSettings, queues: tuple[str, ...] = ()) -> None:
        self.redis = redis
        self.fixed = queues             # --queue: only these; else every registered queue
        self._conn: Any = None
        self._models: dict[str, Model] = {}
        self._read_at = -CATALOG_S
        self._lock = asyncio.Lock()
        self._clients: dict[str, AsyncClient] = {}
        self._client_lock = asyncio.Lock()

    def _read(self) -> dict[str, Model]:
        if self._conn is None:
            self._conn = self.redis.client()
        names = self.fixed or tuple(ShardedQueue.known_queues(self._conn))
        return {n: describe(n, open_queue(self._conn, n).worker_reports()[1]) for n in names}

    async def models(self) -> dict[str, Model]:
        if time.monotonic() - self._read_at >= CATALOG_S:
            async with self._lock:
                if time.monotonic() - self._read_at >= CATALOG_S:
                    self._models = await run_in_threadpool(self._read)
                    self._read_at = time.monotonic()
        return self._models

    async def listed(self, who: Principal) -> list[Model]:
        return [m for name, m in sorted((await self.models()).items()) if who.may_use(name)]

    async def require(self, name: str, endpoint: str, who: Principal) -> Model:
        """The model a call names, checked against the endpoint's task and the caller's
        key; raises ApiError 404, 403 or 400."""
        model = (await self.models()).get(name)
        if model is None and name not in self.fixed and self._read_at > 0:
            self._read_at = -CATALOG_S  # a queue registered since the last read?
            model = (await self.models()).get(name)
        if model is None:
            raise unknown_model(name)
        who.check(name)
        wanted = TASKS[endpoint]
        if model.task and model.task != wanted and model.task != "custom":
            raise bad_request(f"the model {name!r} is a {model.task} queue; {endpoint} needs "
                              f"a {wanted} queue", "model")
        return model

    async def client(self, queue: str) -> AsyncClient:
        """The AsyncClient of ``queue``, connected on first use and kept."""
        found = self._clients.get(queue)
        if found is not None:
            return found
        async with self._client_lock:
            if queue not in self._clients:
                client = AsyncClient(self.redis.url, queue, cluster=self.redis.cluster)
                await client.connect()
                self._clients[queue] = client
        return self._clients[queue]

    def ping(self) -> bool:
        if self._conn is None:
            self._conn = self.redis.client()
        return bool(self._conn.ping())

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        if self._conn is not None:
            self._conn.close()
