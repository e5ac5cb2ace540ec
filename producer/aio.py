"""The asyncio client: the same protocol as Client, awaited."""

from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from typing import Any, AsyncIterator, Iterable, Mapping

from batchery import tracing
from batchery.batching.async_sharded import open_async_queue
from batchery.batching.calls import Cancelled
from batchery.batching.keys import check_queue_name
from batchery.batching.messages import Result
from batchery.batching.pricing import TokenCounter
from batchery.batching.request import (DEFAULT_PRIORITY, DEFAULT_TENANT, Request, RequestIds,
                                      check_tenant, make_request, map_requests)
from batchery.batching.streams import StreamEvent, StreamReader
from batchery.config import DEFAULT_QUEUE
from batchery.connection import RedisSettings
from batchery.errors import ResultTimeout
from batchery.producer.client import (ENQUEUE_CHUNK, MAX_IN_FLIGHT, POLL_S, check_timeout,
                                      is_cancelled, lost, refill)
from batchery.producer.coalesce import EnqueueCoalescer
from batchery.producer.replies import AsyncReplyListener


class AsyncHandle:
    def __init__(self, client: "AsyncClient", request_id: str, future: asyncio.Future,
                 tokens: int | None = None) -> None:
        self.id = request_id
        self.tokens = tokens  # the request's cost as priced at enqueue (None: estimated later)
        self._client = client
        self._future = future

    async def result(self, timeout: float | None = None) -> Result:
        """The request's result; raises ResultTimeout (a TimeoutError) after ``timeout`` s,
        RequestLost when Redis holds no trace of the request any more."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            try:
                return await asyncio.wait_for(asyncio.shield(self._future), max(left, 0))
            except asyncio.TimeoutError:
                found = (await self._client.lookup([self.id]))[0]
                if isinstance(found, Result):
                    if self._client.replies.deliver(found):
                        await self._client.replies.delivered([found])
                    return found
                if not found and await self._client.replies.confirm_gone([self.id]):
                    if self._future.done():  # its reply was delivered as we looked
                        return self._future.result()
                    raise lost(self.id)
            if deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeout(f"no result for request {self.id!r} within {timeout}s; it "
                                    "stays queued: wait again, or cancel it")

    async def cancel(self) -> bool:
        """Cancel the request: True unless it had finished otherwise."""
        return is_cancelled((await self._client.cancel([self.id]))[0], self._future)

    async def stream(self, timeout: float | None = None) -> AsyncIterator[StreamEvent]:
        """``Handle.stream`` awaited: text as generated, "restarted", then "result"."""
        timeout = check_timeout(timeout)
        reader = StreamReader(self._client.queue.keys_for(self.id), self.id)
        heard = time.monotonic()
        while not reader.ended:
            events = await reader.aread(self._client._conn)
            for event in events:
                yield event
            if events:
                heard = time.monotonic()
            elif not reader.ended and (self._future.done() or isinstance(
                    (await self._client.lookup([self.id]))[0], Result)):
                for event in await reader.aread(self._client._conn, block=False):
                    yield event
                break
            elif timeout is not None and time.monotonic() - heard >= timeout:
                raise ResultTimeout(f"nothing streamed for request {self.id!r} within "
                                    f"{timeout}s; it stays queued: wait again, or cancel it")
        result = await self.result(timeout)
        if reader.ended and result.status == "cancelled" and result.output is None:
            result = await self._client.queue.result(self.id) or result  # the text its worker attached
            await self._client._forget_delivered([self.id])  # (delivered now: see replies.py)
        yield StreamEvent("result", result=result)


class AsyncClient:
    """``async with AsyncClient(url, queue="embed") as ac: r = await ac.submit(...)``."""

    def __init__(self, redis_url: str | None = None, queue: str = DEFAULT_QUEUE, *,
                 cluster: bool = False, tenant: str = DEFAULT_TENANT) -> None:
        self.tenant = check_tenant(tenant)  # as Client's
        self.redis = RedisSettings.from_url(redis_url, cluster=cluster)
        self._conn: Any = None
        self._queue_name = check_queue_name(queue)
        self.client_id = ""  # drawn as it connects (connect)
        self._new_id = RequestIds()
        self._count: TokenCounter | None = None
        self._delete_delivered = True  # read from the queue's settings on connect

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        # drawn where it connects: a client made before a fork (a server's preloaded app)
        # and connected in each child names a reply list of each child's own
        self.client_id = secrets.token_hex(8)
        self._conn = await asyncio.to_thread(self.redis.async_client)  # may start embedded Redis
        self.queue = await open_async_queue(self._conn, self._queue_name)
        self.replies = AsyncReplyListener(self.queue, self.client_id,
                                          lambda: self._delete_delivered)
        self._coalescer = EnqueueCoalescer(self._send, ENQUEUE_CHUNK)
        await self.queue.register()  # listed for `batchery queue stats`
        await self._load_settings()

    async def _load_settings(self) -> None:
        settings = await self.queue.settings()
        self._delete_delivered = settings.delete_delivered
        self._count = await asyncio.to_thread(TokenCounter, settings.tokenizer,
                                              settings.max_input_tokens)

    async def _refresh_settings(self) -> None:
        """Read the queue's settings again when the token counter says workers may have
        announced a tokenizer since."""
        if self._count is not None and self._count.stale:
            await self._load_settings()

    def _count_tokens(self, value: Any) -> int | None:
        assert self._count is not None, "use `async with AsyncClient(...)` or await connect()"
        return self._count(value)

    async def close(self) -> None:
        if self._conn is not None:
            await self.replies.close()
            await self._conn.aclose()
            self._conn = None

    def request(self, fields: Mapping[str, Any]) -> Request:
        assert self._count is not None, "use `async with AsyncClient(...)` or await connect()"
        return make_request(fields, self._new_id, self._count, self.tenant)

    async def enqueue(self, input: Any, priority: str | int = DEFAULT_PRIORITY,
                      deadline: float | None = None, id: str | None = None,
                      tokens: int | None = None, meta: dict[str, Any] | None = None,
                      tenant: str | None = None) -> AsyncHandle:
        return (await self.enqueue_many([{"input": input, "priority": priority, "deadline": deadline,
                                          "id": id, "tokens": tokens, "meta": meta,
                                          "tenant": tenant}]))[0]

    async def enqueue_many(self, requests: Iterable[Mapping[str, Any]]) -> list[AsyncHandle]:
        await self._refresh_settings()
        batch = [self.request(r) for r in requests]
        if not batch:
            return []
        futures = [self.replies.watch(r.id) for r in batch]
        await self._enqueue(batch)
        return [AsyncHandle(self, r.id, f, r.tokens) for r, f in zip(batch, futures)]

    async def _enqueue(self, batch: list[Request]) -> None:
        with tracing.enqueue(self.queue.name, batch) as batch:
            await self._coalescer.enqueue(batch)

    async def _send(self, batch: list[Request]) -> None:
        await self.queue.enqueue(batch, self.client_id)

    async def submit(self, input: Any, timeout: float | None = None, **fields: Any) -> Result:
        """Enqueue one request and await its result."""
        handle = await self.enqueue(input, **fields)
        return await handle.result(timeout)

    async def map(self, inputs: Iterable[Any], priority: str | int = DEFAULT_PRIORITY,
                  deadline: float | None = None, max_in_flight: int = MAX_IN_FLIGHT,
                  timeout: float | None = None, tenant: str | None = None) -> list[Result]:
        """Run every input and return the results in input order, ``max_in_flight`` queued.

        As Client.map: no future per request. The reply listener hands each result to
        one sink that wakes this coroutine once per bulk read, however many are in flight.
        """
        timeout = check_timeout(timeout)
        values = list(inputs)
        results: list[Result | None] = [None] * len(values)
        place: dict[str, int] = {}  # id -> its input's index, while it is awaited
        arrived: list[Result] = []
        woken = asyncio.Event()

        def sink(result: Result) -> None:
            arrived.append(result)
            woken.set()

        source = map_requests(values, priority, deadline, self._new_id, self._count_tokens,
                              tenant or self.tenant)
        sent, progress = 0, time.monotonic()
        try:
            while sent < len(values) or place:
                while sent < len(values) and (room := refill(len(place), max_in_flight)):
                    await self._refresh_settings()
                    batch = list(itertools.islice(source, room))
                    ids = [r.id for r in batch]
                    self.replies.collect(ids, sink)
                    place.update(zip(ids, range(sent, sent + len(batch))))
                    sent += len(batch)
                    await self._enqueue(batch)
                gone: list[str] = []
                try:
                    await asyncio.wait_for(woken.wait(), POLL_S)
                except asyncio.TimeoutError:  # replies may have been lost (a Redis restart)
                    gone = await self._look_up(list(place))
                woken.clear()
                for result in arrived:
                    if result.id in place:
                        results[place.pop(result.id)] = result
                        progress = time.monotonic()
                arrived.clear()
                gone = [i for i in gone if i in place]
                if gone:
                    raise lost(gone[0])
                if timeout is not None and place and time.monotonic() - progress >= timeout:
                    raise ResultTimeout(f"no result for any of {len(place)} requests within "
                                        f"{timeout}s; they stay queued")
        finally:
            for request_id in place:
                self.replies.forget(request_id)
        return results  # type: ignore[return-value]

    async def _look_up(self, ids: list[str]) -> list[str]:
        """Deliver the results found by reading them; returns the ids Redis knows nothing of."""
        delivered, gone = [], []
        for request_id, found in zip(ids, await self.lookup(ids)):
            if isinstance(found, Result):
                if self.replies.deliver(found):
                    delivered.append(found)
            elif not found:
                gone.append(request_id)
        await self.replies.delivered(delivered)
        return await self.replies.confirm_gone(gone)

    async def lookup(self, ids: list[str]) -> list[Result | bool]:
        """Each request's Result; else True while Redis holds it, False when it does not."""
        found: list[Result | bool] = []
        for start in range(0, len(ids), ENQUEUE_CHUNK):
            found += await self.queue.lookup(ids[start:start + ENQUEUE_CHUNK])
        return found

    async def _forget_delivered(self, ids: list[str]) -> None:
        if self._delete_delivered:
            await self.queue.forget_results(ids)

    async def get(self, request_id: str) -> Result | None:
        """The committed result, or None while it is queued or running (or unknown)."""
        return await self.queue.result(request_id)

    async def cancel(self, ids: list[str]) -> list[Cancelled]:
        return await self.queue.cancel(ids)

