"""The Redis reads that the generate worker's decode loop needs between steps, made on a
thread of their own so that no step waits on a round trip: the rank of the queue's head
(is a request more urgent than the running ones waiting?) and who holds the leases of
the sequences in flight (cancelled? taken over after a stall?). The loop reads the latest
values; a value a few milliseconds old only delays a preemption or a cancel by as much."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)
HEAD_EVERY_S = 0.02   # how often the head's rank is read: a realtime arrival waits at most this
LEASES_EVERY_S = 0.05  # how often the leases are read: a cancel stops within this and a step


class Lookout:
    def __init__(self, queue_: Any) -> None:
        self._queue = queue_
        self._lock = threading.Lock()
        self._leases: list[tuple[str, str]] = []       # (id, lease token) to read, as last handed in
        self._owners: dict[str, str | None] | None = None  # the latest read, until taken
        self.head: float | None = None                 # the head's rank, as last read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="batchery-lookout", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def lost(self, held: list[Any]) -> list[tuple[Any, str | None]]:
        """Of the sequences ``held`` (whose leases the next reads cover), those the latest
        read (taken once) shows no longer held by their lease: with '' (another claim holds
        it, or it is queued again) or None (cancelled)."""
        with self._lock:
            self._leases = [(s.key.request.id, s.key.request.lease_token) for s in held]
            owners, self._owners = self._owners, None
        if owners is None:
            return []
        read = [(s, owners[s.key.request.id]) for s in held if s.key.request.id in owners]
        return [(s, owner) for s, owner in read if owner != s.key.request.lease_token]

    def _run(self) -> None:
        leases_read = 0.0
        while not self._stop.wait(HEAD_EVERY_S):
            try:
                self.head = self._queue.head_rank()
                if time.monotonic() - leases_read >= LEASES_EVERY_S:
                    leases_read = time.monotonic()
                    with self._lock:
                        leases = self._leases
                    if leases:
                        owners = dict(zip((i for i, _ in leases), self._queue.holders(leases)))
                        with self._lock:
                            self._owners = owners
            except Exception as exc:  # Redis away: the loop goes on with what it knows
                log.debug("reading the queue's head or leases failed: %s", exc)
