"""The synchronous client: enqueue requests, await their results, map over many."""

from __future__ import annotations

import itertools
import logging
import math
import os
import secrets
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from queue import Empty, SimpleQueue
from typing import Any, Iterable, Iterator, Mapping

from batchery import tracing
from batchery.batching.calls import Cancelled
from batchery.batching.messages import CANCELLED, Result
from batchery.batching.pricing import QueueCounter
from batchery.batching.request import (DEFAULT_PRIORITY, DEFAULT_TENANT, Request, RequestIds,
                                      check_tenant, make_request, map_requests)
from batchery.batching.sharded import open_queue
from batchery.batching.streams import StreamEvent, StreamReader
from batchery.config import DEFAULT_QUEUE
from batchery.connection import RedisSettings
from batchery.errors import ConfigError, RequestLost, ResultTimeout
from batchery.producer.coalesce import ThreadEnqueueCoalescer
from batchery.producer.replies import ReplyListener

log = logging.getLogger(__name__)

POLL_S = 1.0          # a waiter also reads the result key this often (covers lost replies)
ENQUEUE_CHUNK = 500   # requests per enqueue call in map/stream: one Lua call each
MAX_IN_FLIGHT = 2000  # requests map/stream keep queued at once by default


def refill(in_flight: int, max_in_flight: int) -> int:
    """How many requests map and stream send now: none until a call's worth of room is
    free (ENQUEUE_CHUNK, or a quarter of max_in_flight where that is less), then up to a
    call's worth. Topping up each slot as its result came made calls of a few requests (on
    a 3-shard queue 40 a call, split again per shard, against 333 on one: 2.3x the
    enqueue's Redis time per request)."""
    room = max_in_flight - in_flight
    return min(ENQUEUE_CHUNK, room) if room >= min(ENQUEUE_CHUNK, max(1, max_in_flight // 4)) else 0


def lost(request_id: str) -> RequestLost:
    return RequestLost(
        f"request {request_id!r} is not in Redis any more: not queued, not running, and no "
        "result. Its result was delivered already (and deleted: queue setting "
        "delete_delivered) or expired (result_ttl), or Redis lost the request itself (a "
        "crash loses the last second of writes under appendfsync everysec; a failover, the writes "
        "its replica had not received yet). Enqueue it again "
        "to run it.")


def check_timeout(timeout: float | None) -> float | None:
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or math.isnan(timeout) or timeout < 0):
        raise ConfigError(f"timeout must be None (no limit) or seconds >= 0, got {timeout!r}")
    return None if timeout is None or math.isinf(timeout) else timeout


def is_cancelled(outcome: Cancelled, future: Any) -> bool:
    """A cancel's answer: what its script did (lua/cancel.lua), or, once the cancelled
    result reached this handle (and was deleted from Redis), that result."""
    if outcome is not Cancelled.NOT:
        return True
    return (future.done() and not future.cancelled() and future.exception() is None
            and future.result().status == CANCELLED)


class Handle:
    """A request that was accepted; wait for its result or cancel it."""

    def __init__(self, client: "Client", request_id: str, future: Future,
                 own: bool = True) -> None:
        self.id = request_id
        self._client = client
        self._future = future
        self._own = own  # enqueued by this client (not a handle made by id)

    def result(self, timeout: float | None = None) -> Result:
        """The request's result; raises ResultTimeout (a TimeoutError) after ``timeout`` s,
        RequestLost when Redis holds no trace of the request any more."""
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
            try:
                return self._future.result(timeout=max(left, 0))
            except FutureTimeout:
                found = self._client.queue.lookup([self.id])[0]
                if isinstance(found, Result):
                    if self._client.replies.deliver(found):
                        self._client.replies.delivered([found])
                    return found
                if not found and self._client.replies.confirm_gone([self.id], not self._own):
                    if self._future.done():  # its reply was delivered as we looked
                        return self._future.result()
                    raise lost(self.id)
            if deadline is not None and time.monotonic() >= deadline:
                raise ResultTimeout(f"no result for request {self.id!r} within {timeout}s; it "
                                    "stays queued: wait again, or cancel it")

    def stream(self, timeout: float | None = None) -> Iterator[StreamEvent]:
        """A generation's text as the worker writes it, then its result: StreamEvents of
        kind "text" (``.text``, ``.tokens`` so far), "restarted" (a rerun began from the
        start: drop the text so far) and last "result" (``.result``). A request enqueued
        without ``"stream": true`` in its input yields its result alone. ``timeout``
        bounds the wait for each event; raises ResultTimeout past it."""
        timeout = check_timeout(timeout)
        reader = StreamReader(self._client.queue.keys_for(self.id), self.id)
        heard = time.monotonic()
        while not reader.ended:
            events = reader.read(self._client.queue.client)
            yield from events
            if events:
                heard = time.monotonic()
            elif not reader.ended and self._finished():
                yield from reader.read(self._client.queue.client, block=False)
                break
            elif timeout is not None and time.monotonic() - heard >= timeout:
                raise ResultTimeout(f"nothing streamed for request {self.id!r} within "
                                    f"{timeout}s; it stays queued: wait again, or cancel it")
        result = self.result(timeout)
        if reader.ended and result.status == "cancelled" and result.output is None:
            result = self._client.queue.result(self.id) or result  # the text its worker attached
            self._client._forget_delivered([self.id])  # (delivered now: see replies.py)
        yield StreamEvent("result", result=result)

    def _finished(self) -> bool:
        """A result is in (a cancel, an expiry, a dead letter: results with no stream end)."""
        return self._future.done() or isinstance(self._client.queue.lookup([self.id])[0], Result)

    def done(self) -> bool:
        return self._future.done()

    def cancel(self) -> bool:
        """Cancel the request: True unless it had finished otherwise (a cancelled request
        reports True again)."""
        return is_cancelled(self._client.queue.cancel([self.id])[0], self._future)

    def __repr__(self) -> str:
        return f"Handle({self.id!r})"


# The open clients of this process: a forked child gives each its own reply list
# (Client._own_replies)
_CLIENTS: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _after_fork() -> None:
    for client in list(_CLIENTS):
        try:
            client._own_replies(forked=True)
        except Exception:  # one client's trouble leaves the others theirs
            log.exception("a client's reply list was not renewed after a fork")


os.register_at_fork(after_in_child=_after_fork)


class Client:
    """A producer for one queue. ``redis_url`` None: BATCHERY_REDIS_URL, else embedded.
    ``tenant``: whose fair share its requests are served from, where a call names none."""

    def __init__(self, redis_url: str | None = None, queue: str = DEFAULT_QUEUE, *,
                 cluster: bool = False, tenant: str = DEFAULT_TENANT) -> None:
        self.tenant = check_tenant(tenant)
        self.redis = RedisSettings.from_url(redis_url, cluster=cluster)
        self._conn = self.redis.client()
        self.queue = open_queue(self._conn, queue)
        self._delete_delivered: bool | None = None
        self._new_id = RequestIds()
        self._count = QueueCounter(self.queue.settings)
        self._registered = False
        _CLIENTS.add(self)  # (first: a fork from another thread meanwhile renews it too)
        self._own_replies()

    def _own_replies(self, forked: bool = False) -> None:
        """This process's client id, the reply list it names, its reader and its enqueue
        coalescer; made again in a forked child (a server's preloaded workers, a pool of
        processes): the parent's reply list is the parent's (a child reading it would take
        the parent's results, and the parent its), and the threads and locks of its reader
        and coalescer did not cross the fork, nor a Cluster's enqueue threads. What the
        parent waited for stays the parent's: a ``map`` or ``stream`` the parent began is
        not carried on in the child."""
        if forked:
            self.queue.forked(self.replies.follow)
        self.client_id = secrets.token_hex(8)
        self.replies = ReplyListener(self.queue, self.client_id, self._deletes_delivered)
        self._coalescer = ThreadEnqueueCoalescer(self._send, ENQUEUE_CHUNK)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        _CLIENTS.discard(self)
        self.replies.close()
        self._conn.close()

    def enqueue(self, input: Any, priority: str | int = DEFAULT_PRIORITY, deadline: float | None = None,
                id: str | None = None, tokens: int | None = None,
                meta: dict[str, Any] | None = None, tenant: str | None = None) -> Handle:
        """Queue one request; raises QueueFull under backpressure, ValueError if invalid."""
        return self.enqueue_many([{"input": input, "priority": priority, "deadline": deadline,
                                   "id": id, "tokens": tokens, "meta": meta,
                                   "tenant": tenant}])[0]

    def enqueue_many(self, requests: Iterable[Mapping[str, Any]], reply: bool = True) -> list[Handle]:
        """Queue requests (dicts with the fields of ``enqueue``) in one all-or-nothing call.

        ``reply=False``: this client will not wait, so results are not pushed to it (they
        stay readable by id, e.g. with ``get`` or ``handle(id).result()``).
        """
        batch = [self.request(r) for r in requests]
        futures = [self.replies.watch(r.id) if reply else Future() for r in batch]
        self._enqueue(batch, reply)
        return [Handle(self, r.id, f) for r, f in zip(batch, futures)]

    def _enqueue(self, batch: list[Request], reply: bool) -> None:
        """Enqueues from many threads at once go as one call (producer/coalesce.py);
        ``reply=False`` ones (no reply list named) go alone."""
        if not batch:
            return
        if not self._registered:
            self.queue.register()
            self._registered = True
        with tracing.enqueue(self.queue.name, batch) as batch:
            if reply:
                self._coalescer.enqueue(batch)
            else:
                self.queue.enqueue(batch, "")

    def _send(self, batch: list[Request]) -> None:
        self.queue.enqueue(batch, self.client_id)

    def request(self, fields: Mapping[str, Any]) -> Request:
        """A validated Request from a dict; an absent id is generated, tokens counted."""
        return make_request(fields, self._new_id, self.count_tokens, self.tenant)

    def _deletes_delivered(self) -> bool:
        """Whether results are deleted once delivered (the queue's settings, read once)."""
        if self._delete_delivered is None:
            self._delete_delivered = self.queue.settings().delete_delivered
        return self._delete_delivered

    def _forget_delivered(self, ids: list[str]) -> None:
        if self._deletes_delivered():
            self.queue.forget_results(ids)

    def count_tokens(self, value: Any) -> int | None:
        """Exact tokens of ``value`` with the queue's tokenizer; None: estimated."""
        return self._count(value)

    def handle(self, request_id: str) -> Handle:
        """A handle for a request enqueued earlier (by this or another client)."""
        return Handle(self, request_id, self.replies.watch(request_id), own=False)

    def get(self, request_id: str) -> Result | None:
        """The committed result, or None while it is queued or running (or unknown)."""
        return self.queue.result(request_id)

    def stream(self, requests: Iterable[Mapping[str, Any]], max_in_flight: int = MAX_IN_FLIGHT,
               timeout: float | None = None) -> Iterator[Result]:
        """Yield results as they complete, keeping at most ``max_in_flight`` queued.

        Results come in completion order; each carries its request's id. ``timeout``
        bounds the wait for any one result.
        """
        yield from self._stream(map(self.request, requests), max_in_flight, timeout)

    def _stream(self, source: Iterator[Request], max_in_flight: int,
                timeout: float | None) -> Iterator[Result]:
        """``stream`` over requests checked already (each checked as it is drawn)."""
        timeout = check_timeout(timeout)
        done: SimpleQueue[Result] = SimpleQueue()  # filled by the reply listener
        waiting: set[str] = set()
        exhausted = False
        try:
            while True:
                while not exhausted and (room := refill(len(waiting), max_in_flight)):
                    chunk = list(itertools.islice(source, room))
                    exhausted = not chunk
                    if chunk:
                        ids = [r.id for r in chunk]
                        waiting.update(ids)
                        self.replies.collect(ids, done.put)
                        self._enqueue(chunk, reply=True)
                if not waiting:
                    return
                yield from self._collect(done, waiting, timeout)
        finally:
            for request_id in waiting:
                self.replies.forget(request_id)

    def _collect(self, done: SimpleQueue[Result], waiting: set[str],
                 timeout: float | None) -> Iterator[Result]:
        """Wait for at least one of ``waiting`` to finish; yield and drop all that did."""
        started = time.monotonic()
        while True:
            gone: list[str] = []
            try:
                arrived = [done.get(timeout=POLL_S)]
            except Empty:  # replies may be lost (a Redis restart): read the results
                gone = self._look_up(list(waiting))
                arrived = []
            while not done.empty():
                arrived.append(done.get_nowait())
            fresh = [r for r in arrived if r.id in waiting]
            gone = [i for i in gone if i not in {r.id for r in fresh}]
            if gone:
                raise lost(gone[0])
            if fresh:
                waiting.difference_update(r.id for r in fresh)
                yield from fresh
                return
            if timeout is not None and time.monotonic() - started >= timeout:
                raise ResultTimeout(f"no result for any of {len(waiting)} requests within "
                                    f"{timeout}s; they stay queued")

    def _look_up(self, ids: list[str]) -> list[str]:
        """Deliver the results found by reading them; returns the ids Redis knows nothing of."""
        gone, delivered = [], []
        for start in range(0, len(ids), ENQUEUE_CHUNK):
            chunk = ids[start:start + ENQUEUE_CHUNK]
            for request_id, found in zip(chunk, self.queue.lookup(chunk)):
                if isinstance(found, Result):
                    if self.replies.deliver(found):
                        delivered.append(found)
                elif not found:
                    gone.append(request_id)
        self.replies.delivered(delivered)
        return self.replies.confirm_gone(gone)

    def map(self, inputs: Iterable[Any], priority: str | int = DEFAULT_PRIORITY,
            deadline: float | None = None, max_in_flight: int = MAX_IN_FLIGHT,
            timeout: float | None = None, tenant: str | None = None) -> list[Result]:
        """Run every input and return the results in input order."""
        index: dict[str, int] = {}

        def requests() -> Iterator[Request]:
            for i, request in enumerate(map_requests(inputs, priority, deadline, self._new_id,
                                                     self.count_tokens, tenant or self.tenant)):
                index[request.id] = i
                yield request

        ordered: dict[int, Result] = {}
        for result in self._stream(requests(), max_in_flight, timeout):
            ordered[index[result.id]] = result
        return [ordered[i] for i in range(len(ordered))]
