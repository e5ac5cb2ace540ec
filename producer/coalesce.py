"""Enqueues started together go to Redis as one call.

A service awaiting ``AsyncClient.submit`` for each of its callers starts many one-request
enqueues at once; each its own call cost 65-92 us of Redis and 140-320 us of the client
per request (``bench.submit_cost``), against 16 and 11 for ``map``. The enqueues started
within one turn of the event loop are sent as one call (at most ENQUEUE_CHUNK requests
each), and while a call is out the next ones gather for the call after it (a group
commit: under load the groups grow, alone an enqueue waits one turn). A call is all or
nothing, so a refused one (queue full, a request too large, an unknown priority) is sent
again caller by caller: each caller gets its own answer, as if it had been alone.
ThreadEnqueueCoalescer does the same for the sync Client's callers on many threads.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Callable

from batchery.batching.request import Request
from batchery.errors import InvalidRequest, QueueFull

Send = Callable[[list[Request]], Awaitable[object]]
REFUSALS = (QueueFull, InvalidRequest)  # RequestTooLarge is an InvalidRequest


class EnqueueCoalescer:
    def __init__(self, send: Send, most: int) -> None:
        self._send = send
        self._most = most  # requests per combined call
        self._waiting: list[tuple[list[Request], asyncio.Future]] = []
        self._flush: asyncio.Task | None = None

    async def enqueue(self, batch: list[Request]) -> None:
        """Send ``batch`` with whatever else is enqueued in this turn; raise its error."""
        if len(batch) >= self._most:  # a call's worth already: nothing to gain by waiting
            await self._send(batch)
            return
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((batch, done))
        if self._flush is None:
            self._flush = asyncio.create_task(self._send_waiting())
        await done

    async def _send_waiting(self) -> None:
        try:
            await asyncio.sleep(0)  # the other coroutines of this turn add theirs
            while self._waiting:
                calls, size = [], 0
                while self._waiting and (not calls or size + len(self._waiting[0][0]) <= self._most):
                    calls.append(self._waiting.pop(0))
                    size += len(calls[-1][0])
                await self._send_together(calls)
        finally:
            self._flush = None

    async def _send_together(self, calls: list[tuple[list[Request], asyncio.Future]]) -> None:
        try:
            await self._send([r for batch, _ in calls for r in batch])
        except REFUSALS as exc:
            if len(calls) == 1:
                _settle(calls[0][1], exc)
                return
            for batch, done in calls:  # whose was refused: each on its own
                try:
                    await self._send(batch)
                except Exception as own:
                    _settle(done, own)
                else:
                    _settle(done, None)
            return
        except Exception as exc:  # Redis away past the retries: every caller hears it
            for _, done in calls:
                _settle(done, exc)
            return
        for _, done in calls:
            _settle(done, None)


def _settle(done: asyncio.Future, error: BaseException | None) -> None:
    if done.done():  # its caller was cancelled
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


class _Call:
    """One caller's requests waiting in a ThreadEnqueueCoalescer."""

    __slots__ = ("batch", "woken", "lead", "error")

    def __init__(self, batch: list[Request]) -> None:
        self.batch = batch
        self.woken = threading.Event()  # settled, or made the next leader
        self.lead = False
        self.error: BaseException | None = None


class ThreadEnqueueCoalescer:
    """EnqueueCoalescer for threads (the sync Client shared by a thread pool).

    The first caller with no call out sends at once (alone, no wait); callers arriving
    while a call is out queue up, and when it returns the oldest of them sends its own
    requests and the others' (at most ``most``) as one call: a group commit, where
    the groups grow with the load. Each caller waits on its own event, woken once to be
    settled or to lead. A refused call is sent again caller by caller, as above."""

    def __init__(self, send: Callable[[list[Request]], object], most: int) -> None:
        self._send = send
        self._most = most
        self._lock = threading.Lock()
        self._waiting: list[_Call] = []
        self._sending = False  # a leader's call is out

    def enqueue(self, batch: list[Request]) -> None:
        """Send ``batch`` alone or with the others waiting; raise its own error."""
        if len(batch) >= self._most:
            self._send(batch)
            return
        call = _Call(batch)
        with self._lock:
            call.lead = not self._sending
            self._sending = True
            if not call.lead:
                self._waiting.append(call)
        if not call.lead:
            call.woken.wait()
        if call.lead:
            self._lead(call)
        if call.error is not None:
            raise call.error

    def _lead(self, call: _Call) -> None:
        group, size = [call], len(call.batch)
        try:
            with self._lock:
                while self._waiting and size + len(self._waiting[0].batch) <= self._most:
                    group.append(self._waiting.pop(0))
                    size += len(group[-1].batch)
            self._send_together(group)
        except BaseException as exc:  # interrupted: the group hears it, the next one leads
            for each in group:
                each.error = each.error or exc
            raise
        finally:
            for each in group[1:]:
                each.woken.set()
            with self._lock:
                if self._waiting:
                    successor = self._waiting.pop(0)
                    successor.lead = True
                    successor.woken.set()
                else:
                    self._sending = False

    def _send_together(self, group: list[_Call]) -> None:
        try:
            self._send([r for call in group for r in call.batch])
        except REFUSALS as exc:
            if len(group) == 1:
                group[0].error = exc
                return
            for call in group:  # whose was refused: each on its own
                try:
                    self._send(call.batch)
                except Exception as own:
                    call.error = own
        except Exception as exc:  # Redis away past the retries: every caller hears it
            for call in group:
                call.error = exc
