"""The asyncio twin of RequestQueue: the producer's operations awaited.

Same scripts, same call builders and reply parsers (batching/calls.py), over an asyncio
client, so the synchronous and asyncio clients speak one protocol.
"""

from __future__ import annotations

from typing import Any, Sequence

import redis

from batchery.batching.calls import (Cancelled, cancel_call, enqueue_call, lookup_call,
                                     memory_full, parse_cancel, parse_clients, parse_enqueue,
                                     parse_lookup)
from batchery.batching.keys import QUEUES, Keys, check_queue_name
from batchery.batching.messages import Result
from batchery.batching.reply_lists import keep_in
from batchery.batching.request import Request
from batchery.batching.scripts import Scripts
from batchery.batching.settings import QueueSettings


class AsyncRequestQueue:
    """The Redis protocol of one queue, over an asyncio client (``redis.asyncio``)."""

    def __init__(self, client: Any, name: str, tag: str | None = None,
                 scripts: Scripts | None = None) -> None:
        self.name = check_queue_name(name)
        self.keys = Keys(tag or name)  # shard 0 is tagged with the queue's own name
        self.client = client
        self.scripts = scripts or Scripts(client)

    def keys_for(self, request_id: str) -> Keys:
        return self.keys

    async def register(self) -> None:
        await self.client.sadd(QUEUES, self.name)

    async def settings(self) -> QueueSettings:
        return QueueSettings.from_redis(await self.client.hgetall(self.keys.settings))

    async def enqueue(self, requests: Sequence[Request], client_id: str = "",
                      shards: int = 1) -> list[bool]:
        call = enqueue_call(self.keys, requests, client_id, shards)
        try:
            reply = await self.scripts.enqueue(call.keys, call.args)
        except redis.OutOfMemoryError as exc:
            raise memory_full(exc) from None
        return parse_enqueue(reply, requests)

    async def cancel(self, ids: Sequence[str]) -> list[Cancelled]:
        if not ids:
            return []
        clients = parse_clients(await self.client.hmget(self.keys.sched, list(ids)))
        call = cancel_call(self.keys, ids, clients)
        return parse_cancel(await self.scripts.cancel(call.keys, call.args))

    async def result(self, request_id: str) -> Result | None:
        raw = await self.client.get(self.keys.result(request_id))
        return Result.from_json(raw, request_id) if raw else None

    async def lookup(self, ids: Sequence[str]) -> list[Result | bool]:
        if not ids:
            return []
        call = lookup_call(self.keys, ids)
        return parse_lookup(await self.scripts.lookup(call.keys, call.args), ids)

    async def keep_results(self, results: Sequence[Result]) -> None:
        """As RequestQueue.keep_results."""
        if results:
            pipe = self.client.pipeline(transaction=False)
            keep_in(pipe, self.keys, results, (await self.settings()).result_ttl)
            await pipe.execute()

    async def forget_results(self, ids: Sequence[str]) -> None:
        if ids:
            await self.client.delete(*(self.keys.result(i) for i in ids))

