"""One blocking read per client: a reply list that workers push results onto.

Each client owns one list per queue shard it enqueued into (``Keys.reply(client_id)``:
a script pushes only within its shard's slot). One reader pops them all in bulk with one
BLPOP on a single Redis; on a Cluster (where a BLPOP cannot span slots) one reader per
shard does. The readers start as the queue routes the client's first request to a shard
(``follow_routes``), and resolve the futures of the handles waiting on them. A result
nobody waits for any more (its handle was dropped) is not kept: it stays readable under
its key.
Results that reached a waiter are deleted from Redis when ``deletes_delivered()`` says
so (QueueSettings.delete_delivered), by the reader's next read, in its round trip
(calls.reply_read); dead letters are not, they stay for ``batchery queue dead list``,
nor cancelled ones (kept for result_ttl): the worker that was generating one attaches
its text after the cancel (lua/attach.lua).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Sequence

import redis

from batchery import tracing
from batchery.batching.async_sharded import AsyncShardedQueue
from batchery.batching.messages import CANCELLED, DEAD, Result
from batchery.batching.sharded import ShardedQueue
from batchery.connection import Backoff

log = logging.getLogger(__name__)
BLOCK_S = 0.5      # how long one blocking pop waits; bounds how long close() takes
DRAIN = 1000       # results popped per round trip once one arrived
# what a read may raise and its reader outlives: Redis' errors, and redis-py's refusals of
# a Cluster command (not a RedisError)
READ_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


def read_when_done(future: "asyncio.Future[Any]") -> "asyncio.Future[Any]":
    """``future``, its ending read whenever it comes: asyncio logs an exception nobody read
    as lost, with a traceback, and a cancelled gather ends with its children's
    CancelledError as its exception."""
    future.add_done_callback(lambda done: done.cancelled() or done.exception())
    return future


class ReplyListener:
    """Resolves concurrent.futures of one synchronous client, from a daemon thread."""

    def __init__(self, queue: ShardedQueue, client_id: str,
                 deletes_delivered: Callable[[], bool] | None = None) -> None:
        self._queue = queue
        self._client_id = client_id
        self._deletes_delivered = deletes_delivered
        self._waiters: weakref.WeakValueDictionary[str, Future] = weakref.WeakValueDictionary()
        self._sinks: dict[str, Callable[[Result], None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # the shards' tags this client enqueued into; a reader per tag (Cluster) or one
        # reader, keyed None, over all of them (a single Redis)
        self._followed: tuple[str, ...] = ()
        self._readers: dict[str | None, threading.Thread] = {}
        queue.follow_routes(self.follow)

    def watch(self, request_id: str) -> Future:
        """A future for the request's result; register it before enqueueing the request."""
        with self._lock:
            future = self._waiters.get(request_id)
            if future is None:
                future = Future()
                self._waiters[request_id] = future
        return future

    def collect(self, request_ids: Iterable[str], sink: Callable[[Result], None]) -> None:
        """Hand each request's result to ``sink`` once, from the listener thread.

        What ``Client.stream`` waits with: no future per request. Register before
        enqueueing; ``forget`` the ids no longer waited for.
        """
        with self._lock:
            self._sinks.update((request_id, sink) for request_id in request_ids)

    def follow(self, tags: Iterable[str]) -> None:
        """Read the reply lists of these shards too (called as an enqueue routes)."""
        new = [t for t in tags if t not in self._followed]
        if not new:
            return
        with self._lock:
            self._followed = tuple(dict.fromkeys([*self._followed, *new]))
            for reader in (new if self._queue.cluster else [None]):
                if reader not in self._readers:
                    self._readers[reader] = threading.Thread(
                        target=self._run, args=(reader,), name="batchery-replies", daemon=True)
                    self._readers[reader].start()

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._waiters.pop(request_id, None)
            self._sinks.pop(request_id, None)

    def deliver(self, result: Result) -> bool:
        """Resolve the waiter of a result (popped, or found by a direct read); True if
        someone waited for it."""
        return bool(self.deliver_many([result]))

    def deliver_many(self, results: list[Result]) -> list[Result]:
        """Resolve the waiters of results; those someone waited for. The lock is held
        once: a bulk read's thousand results cost one acquire, not one each."""
        for result in results:
            tracing.delivered(result)
        with self._lock:
            sinks = [self._sinks.pop(r.id, None) for r in results]
            futures = ([self._waiters.pop(r.id, None) for r in results] if len(self._waiters)
                       else [None] * len(results))
        reached = []
        for result, sink, future in zip(results, sinks, futures):
            if sink is not None:
                sink(result)
            if future is not None and not future.done():
                future.set_result(result)
                reached.append(result)
            elif sink is not None:
                reached.append(result)
        return reached

    def delivered(self, results: list[Result]) -> None:
        """Delete now, where the owner deletes delivered results, those a direct read
        delivered (a reader's own are deleted by its next read)."""
        self._delete(to_delete(results, self._deletes_delivered))

    def _delete(self, ids: list[str]) -> None:
        try:
            if ids:
                self._queue.forget_results(ids)
        except redis.RedisError as exc:
            _not_deleted(ids, exc)

    def close(self) -> None:
        self._stop.set()
        for reader in list(self._readers.values()):
            reader.join(timeout=BLOCK_S * 4)

    def _run(self, tag: str | None) -> None:
        backoff = Backoff()
        forget: list[str] = []  # delivered, deleted by the next read
        while not self._stop.is_set():
            try:
                popped = self._queue.pop_replies(self._client_id, BLOCK_S, DRAIN,
                                                 self._followed if tag is None else (tag,),
                                                 forget)
                forget = to_delete(self.deliver_many(popped), self._deletes_delivered)
                backoff.reset()
            except READ_ERRORS as exc:  # Redis restarting: wait and carry on
                forget = []  # (never retried: they expire after result_ttl anyway)
                wait_s = backoff.next()
                log.warning("reply list read failed (%s); retrying in %.1fs", exc, wait_s)
                self._stop.wait(wait_s)
        self._delete(forget)


def to_delete(reached: Sequence[Result], deletes_delivered: Callable[[], bool] | None
              ) -> list[str]:
    """The ids of results that reached their waiters and are to be deleted: none when the
    queue keeps delivered results, nor dead letters or cancelled ones (module docstring)."""
    ids = [r.id for r in reached if r.status not in (DEAD, CANCELLED)]
    if not ids or deletes_delivered is None:
        return []
    try:
        return ids if deletes_delivered() else []
    except redis.RedisError as exc:  # the settings unreadable: kept, expiring after result_ttl
        _not_deleted(ids, exc)
        return []


def _not_deleted(ids: Sequence[str], exc: Exception) -> None:
    if ids:  # they expire after result_ttl anyway
        log.warning("deleting %d delivered result(s) failed (%s)", len(ids), exc)


class AsyncReplyListener:
    """The asyncio twin of ReplyListener: one task per client resolves asyncio futures."""

    def __init__(self, queue: AsyncShardedQueue, client_id: str,
                 deletes_delivered: Callable[[], bool] | None = None) -> None:
        self._queue = queue
        self._client_id = client_id
        self._deletes_delivered = deletes_delivered
        self._waiters: weakref.WeakValueDictionary[str, asyncio.Future] = weakref.WeakValueDictionary()
        self._sinks: dict[str, Callable[[Result], None]] = {}
        self._followed: tuple[str, ...] = ()
        self._tasks: dict[str | None, asyncio.Task] = {}
        self._stopping = False
        queue.follow_routes(self._follow)

    def watch(self, request_id: str) -> asyncio.Future:
        future = self._waiters.get(request_id)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._waiters[request_id] = future
        return future

    def collect(self, request_ids: Iterable[str], sink: Callable[[Result], None]) -> None:
        """As ReplyListener.collect: ``sink`` gets each result once, in the event loop."""
        self._sinks.update((request_id, sink) for request_id in request_ids)

    def forget(self, request_id: str) -> None:
        self._waiters.pop(request_id, None)
        self._sinks.pop(request_id, None)

    def _follow(self, tags: Iterable[str]) -> None:
        """As ReplyListener.follow, with a task per reader (called in the event loop)."""
        new = [t for t in tags if t not in self._followed]
        if not new:
            return
        self._followed = tuple(dict.fromkeys([*self._followed, *new]))
        for reader in (new if self._queue.cluster else [None]):
            if reader not in self._tasks:
                self._tasks[reader] = asyncio.create_task(self._run(reader), name="batchery-replies")

    def deliver(self, result: Result) -> bool:
        """As ReplyListener.deliver: True if someone waited for it."""
        tracing.delivered(result)
        sink = self._sinks.pop(result.id, None)
        if sink is not None:
            sink(result)
        future = self._waiters.pop(result.id, None) if self._waiters else None
        if future is not None and not future.done():
            future.set_result(result)
            return True
        return sink is not None

    async def delivered(self, results: list[Result]) -> None:
        """As ReplyListener.delivered."""
        await self._delete(to_delete(results, self._deletes_delivered))

    async def _delete(self, ids: list[str]) -> None:
        try:
            if ids:
                await self._queue.forget_results(ids)
        except redis.RedisError as exc:
            _not_deleted(ids, exc)

    async def close(self) -> None:
        """Stop after the current blocking pop (at most BLOCK_S) rather than cancel it:
        cancelling a read redis-py has nearly finished can leave the task stuck."""
        if not self._tasks:
            return
        self._stopping = True
        tasks = list(self._tasks.values())
        readers = read_when_done(asyncio.gather(*tasks))  # (its readers may be cancelled below)
        try:
            await asyncio.wait_for(asyncio.shield(readers), BLOCK_S * 4)
        except asyncio.TimeoutError:
            for task in tasks:
                task.cancel()

    async def _run(self, tag: str | None) -> None:
        backoff = Backoff()
        forget: list[str] = []  # delivered, deleted by the next read
        while not self._stopping:
            try:
                popped = await self._queue.pop_replies(self._client_id, BLOCK_S, DRAIN,
                                                       self._followed if tag is None else (tag,),
                                                       forget)
                forget = to_delete([r for r in popped if self.deliver(r)],
                                   self._deletes_delivered)
                backoff.reset()
            except READ_ERRORS as exc:
                forget = []  # as ReplyListener's
                wait_s = backoff.next()
                log.warning("reply list read failed (%s); retrying in %.1fs", exc, wait_s)
                await asyncio.sleep(wait_s)
        await self._delete(forget)
