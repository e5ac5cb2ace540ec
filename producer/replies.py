"""One blocking read per client: a reply list that workers push results onto.

Each client owns one list per queue shard it enqueued into (``Keys.reply(client_id)``:
a script pushes only within its shard's slot). One reader reads them all with one
round trip on a single Redis; on a Cluster (where a blocking pop cannot span slots) one
reader per shard does. The readers start as the queue routes the client's first request
to a shard (``follow_routes``), and resolve the futures of the handles waiting on them.

A read (reply_lists.reply_read) marks the reader on each shard, blocks on its bells (rung by
each push while the mark lasts), moves each list whole to an inbox and reads it; the
next read deletes that inbox, once what it held was delivered. Where the reader's owner
deletes delivered results (``deletes_delivered``: QueueSettings.delete_delivered) the
mark says it reads alone: a commit then pushes a result onto the list alone, not under
its key too (lua/complete.lua). Such a result that reaches nobody (its handle was
dropped) is stored under its key then (keep_results), to stay readable by id; one that
reaches its waiter is nowhere else. A result kept under its key too (pushed while no
reader was marked, a dead letter, a cancel) is deleted once delivered where the owner
deletes delivered results, by the reader's next read, in its round trip; dead letters
are not, they stay for ``batchery queue dead list``, nor cancelled ones (kept for
result_ttl): the worker that was generating one attaches its text after the cancel
(lua/attach.lua). A reader that stops lifts its marks; what its lists still hold the
reaper keeps under the result keys (lua/drain.lua).

So a request Redis knows nothing of may have its result on its way, on a list or in an
inbox: ``confirm_gone`` tells those from requests Redis lost before a waiter gives up.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable

import redis

from batchery import tracing
from batchery.batching.async_sharded import AsyncShardedQueue
from batchery.batching.reply_lists import ReadState, not_deleted, to_delete
from batchery.batching.messages import Result
from batchery.batching.sharded import ShardedQueue
from batchery.connection import Backoff

log = logging.getLogger(__name__)
BLOCK_S = 0.5      # how long one blocking read waits; bounds how long close() takes
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
        # it reads its lists alone where its owner deletes what it delivers
        self._alone = deletes_delivered is not None
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

    def confirm_gone(self, ids: list[str], others: bool = False) -> list[str]:
        """Of ``ids``, which a lookup found Redis knew nothing of (neither request nor
        result), those gone: none while this client's lists or its reads' inboxes hold
        anything (their results may be there, on their way); else all of them, and any
        result of theirs that was on its way reached its waiter before (an inbox is
        deleted once what it held was delivered): the caller sees it there. ``others``:
        the ids may be other clients' (a handle made by id), whose results a stopped
        reader may hold until the reaper keeps them: none while one is listed."""
        if not ids or not others and (not self._alone or not self._followed):
            return ids
        waiting = self._queue.replies_waiting(self._client_id, self._followed, others)
        return [] if waiting else ids

    def _delete(self, ids: list[str]) -> None:
        try:
            if ids:
                self._queue.forget_results(ids)
        except redis.RedisError as exc:
            not_deleted(ids, exc)

    def close(self) -> None:
        self._stop.set()
        for reader in list(self._readers.values()):
            reader.join(timeout=BLOCK_S * 4)

    def _run(self, tag: str | None) -> None:
        backoff, state = Backoff(), ReadState(self._alone)
        tags = self._followed if tag is None else (tag,)
        while not self._stop.is_set():
            tags = self._followed if tag is None else tags
            try:
                if state.keep:  # before the next read, which lets go of their inbox
                    self._queue.keep_results(state.keep)
                    state.keep = []
                read = state.next_read(time.monotonic())
                popped = self._queue.pop_replies(self._client_id, BLOCK_S, tags, read.forget,
                                                 read.parity, read.alone, read.mark)
                state.done(read, popped, self.deliver_many(popped.results), self._deletes_delivered)
                backoff.reset()
            except READ_ERRORS as exc:  # Redis restarting: wait and carry on
                state.failed(exc)
                wait_s = backoff.next()
                log.warning("reply list read failed (%s)%s; retrying in %.1fs", exc,
                            access_hint(exc), wait_s)
                self._stop.wait(wait_s)
        try:
            if state.keep:
                self._queue.keep_results(state.keep)
            self._delete(state.forget)
            self._queue.unmark_reader(self._client_id, tags, state.parity)
        except READ_ERRORS as exc:  # the mark lapses; the reaper keeps what the inbox holds
            log.warning("stopping this reader cleanly failed (%s)", exc)


def access_hint(exc: Exception) -> str:
    """What to do about a read Redis refused for want of rights: the producer's ACL."""
    if isinstance(exc, redis.exceptions.NoPermissionError) or isinstance(
            exc.__cause__, redis.exceptions.NoPermissionError):
        return (": grant the producer every key of docs/guides/least-privilege.md (its "
                "reply lists, inboxes, bells and reader marks)")
    return ""


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
        self._alone = deletes_delivered is not None  # as ReplyListener's
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
            not_deleted(ids, exc)

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

    async def confirm_gone(self, ids: list[str]) -> list[str]:
        """As ReplyListener.confirm_gone."""
        if not ids or not self._alone or not self._followed:
            return ids
        return [] if await self._queue.replies_waiting(self._client_id, self._followed) else ids

    async def _run(self, tag: str | None) -> None:
        backoff, state = Backoff(), ReadState(self._alone)
        tags = self._followed if tag is None else (tag,)
        while not self._stopping:
            tags = self._followed if tag is None else tags
            try:
                if state.keep:  # as ReplyListener's
                    await self._queue.keep_results(state.keep)
                    state.keep = []
                read = state.next_read(time.monotonic())
                popped = await self._queue.pop_replies(self._client_id, BLOCK_S, tags,
                                                       read.forget, read.parity, read.alone,
                                                       read.mark)
                state.done(read, popped, [r for r in popped.results if self.deliver(r)],
                           self._deletes_delivered)
                backoff.reset()
            except READ_ERRORS as exc:
                state.failed(exc)
                wait_s = backoff.next()
                log.warning("reply list read failed (%s)%s; retrying in %.1fs", exc,
                            access_hint(exc), wait_s)
                await asyncio.sleep(wait_s)
        try:
            if state.keep:
                await self._queue.keep_results(state.keep)
            await self._delete(state.forget)
            await self._queue.unmark_reader(self._client_id, tags, state.parity)
        except READ_ERRORS as exc:
            log.warning("stopping this reader cleanly failed (%s)", exc)
