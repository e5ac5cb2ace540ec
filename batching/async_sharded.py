"""The asyncio twin of ShardedQueue (batching/sharded.py), for the producer's calls.

Same layout and routing: a request lives on its id's shard (``keys.shard_of``); a shard
count changed since this queue read it (lua/enqueue.lua refuses with ``shards``) is read
again and the requests re-routed.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Sequence

from batchery.batching.async_queue import AsyncRequestQueue
from batchery.batching.calls import Cancelled
from batchery.batching.reply_lists import (Popped, parse_reply_read, reply_read, unmark_in,
                                           waiting_in)
from batchery.batching.keys import Keys, shard_of, shard_tags
from batchery.batching.messages import Result
from batchery.batching.request import Request
from batchery.batching.scripts import Scripts
from batchery.batching.settings import QueueSettings
from batchery.batching.shard_layout import RELAYOUT_TRIES, grouped, is_cluster
from batchery.errors import ConfigError, ShardsChanged


async def open_async_queue(client: Any, name: str) -> "AsyncShardedQueue":
    """The queue ``name`` over its shards, as its settings say (one read)."""
    queue = AsyncShardedQueue(client, name)
    await queue.settings()
    return queue


class AsyncShardedQueue:
    """One logical queue over its shards (each an AsyncRequestQueue)."""

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.scripts = Scripts(client)
        self.first = AsyncRequestQueue(client, name, scripts=self.scripts)
        self.name, self.keys = self.first.name, self.first.keys
        self.cluster = is_cluster(client)
        self.shards: tuple[AsyncRequestQueue, ...] = (self.first,)
        self.route_listeners: list[Callable[[Sequence[str]], None]] = []

    def _layout(self, n: int) -> None:
        if n != len(self.shards):
            self.shards = tuple(self.first if tag == self.name else
                                AsyncRequestQueue(self.client, self.name, tag, self.scripts)
                                for tag in shard_tags(self.name, n))

    def tags(self) -> list[str]:
        return [q.keys.tag for q in self.shards]

    def keys_for(self, request_id: str) -> Keys:
        shards = self.shards
        return shards[shard_of(request_id, len(shards))].keys

    async def _routed(self, ids: Sequence[str],
                      call: Callable[[AsyncRequestQueue, list[str]], Awaitable[Sequence[Any]]]) -> list[Any]:
        shards, out = self.shards, [None] * len(ids)
        for i, positions in grouped(ids, len(shards)).items():
            for p, value in zip(positions, await call(shards[i], [ids[p] for p in positions])):
                out[p] = value
        return out

    async def register(self) -> None:
        await self.first.register()

    async def settings(self) -> QueueSettings:
        current = await self.first.settings()
        self._layout(current.shards)
        return current

    def follow_routes(self, listener: Callable[[Sequence[str]], None]) -> None:
        self.route_listeners.append(listener)

    async def enqueue(self, requests: Sequence[Request], client_id: str = "") -> list[bool]:
        """As ShardedQueue.enqueue."""
        for attempt in range(RELAYOUT_TRIES):
            shards = self.shards
            groups = grouped([r.id for r in requests], len(shards))
            if client_id:
                for listener in self.route_listeners:
                    listener([shards[i].keys.tag for i in groups])
            flags = [False] * len(requests)
            sends = [shards[i].enqueue([requests[p] for p in positions], client_id, len(shards))
                     for i, positions in groups.items()]
            # at once; once all are answered, the first error (as ShardedQueue.enqueue)
            replies = await asyncio.gather(*sends, return_exceptions=True)
            try:
                for positions, accepted in zip(groups.values(), replies):
                    if isinstance(accepted, BaseException):
                        raise accepted
                    for p, flag in zip(positions, accepted):
                        flags[p] = flag
                return flags
            except ShardsChanged as changed:
                if attempt == RELAYOUT_TRIES - 1:
                    raise ConfigError(f"queue {self.name!r} keeps changing its shard count "
                                      f"(now {changed.shards}); enqueue again") from None
                await self.settings()
        raise AssertionError("unreachable")

    async def cancel(self, ids: Sequence[str]) -> list[Cancelled]:
        return await self._routed(ids, AsyncRequestQueue.cancel)

    async def lookup(self, ids: Sequence[str]) -> list[Result | bool]:
        """As ShardedQueue.lookup: an id unknown on its shard is looked for on the others."""
        found = await self._routed(ids, AsyncRequestQueue.lookup)
        missing = [p for p, f in enumerate(found) if f is False]
        for other in self.shards if missing and len(self.shards) > 1 else ():
            for p, hit in zip(missing, await other.lookup([ids[p] for p in missing])):
                found[p] = hit if hit is not False else found[p]
            missing = [p for p in missing if found[p] is False]
            if not missing:
                break
        return found

    async def result(self, request_id: str) -> Result | None:
        if len(self.shards) == 1:
            return await self.first.result(request_id)
        found = (await self.lookup([request_id]))[0]
        return found if isinstance(found, Result) else None

    async def forget_results(self, ids: Sequence[str]) -> None:
        shards = self.shards
        for i, positions in grouped(ids, len(shards)).items():
            await shards[i].forget_results([ids[p] for p in positions])

    async def keep_results(self, results: Sequence[Result]) -> None:
        shards = self.shards
        for i, positions in grouped([r.id for r in results], len(shards)).items():
            await shards[i].keep_results([results[p] for p in positions])

    def _shard_at(self, tag: str) -> AsyncRequestQueue:
        return next((q for q in self.shards if q.keys.tag == tag), None) or \
            AsyncRequestQueue(self.client, self.name, tag, self.scripts)

    async def pop_replies(self, client_id: str, block_s: float,
                          tags: Sequence[str] | None = None, forget: Sequence[str] = (),
                          parity: int = 0, alone: bool = False, mark: bool = True) -> Popped:
        """As ShardedQueue.pop_replies."""
        shards = [self._shard_at(t).keys for t in tags or self.tags()]
        forgotten = [self.keys_for(i).result(i) for i in forget]
        pipe = self.client.pipeline(transaction=False)
        deletes = reply_read(pipe, shards, client_id, parity, alone, block_s, forgotten,
                             self.cluster, mark)
        replies = await pipe.execute(raise_on_error=False)
        return parse_reply_read(replies, deletes, len(shards), mark)

    async def replies_waiting(self, client_id: str, tags: Sequence[str]) -> bool:
        """As ShardedQueue.replies_waiting, for this client's own requests (an AsyncClient
        makes no handle by id)."""
        pipe = self.client.pipeline(transaction=False)
        waiting_in(pipe, [self._shard_at(t).keys for t in tags], client_id)
        return any(await pipe.execute())

    async def unmark_reader(self, client_id: str, tags: Sequence[str], parity: int) -> None:
        """As ShardedQueue.unmark_reader."""
        pipe = self.client.pipeline(transaction=False)
        unmark_in(pipe, [self._shard_at(t).keys for t in tags], client_id, parity)
        await pipe.execute()
