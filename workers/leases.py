"""Leases a worker holds, the heartbeat that renews them, and the reaper it runs."""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable

import redis

from batchery.batching.messages import Claimed
from batchery.batching.sharded import ShardedQueue
from batchery.connection import transient
from batchery.workers import metrics, tracing

log = logging.getLogger(__name__)
WORKER_FORGOTTEN_AFTER_LEASES = 100  # dead workers leave `stats` at once; the registry later


class Leases:
    """The requests this worker holds (claimed, not yet committed): id -> lease token."""

    def __init__(self) -> None:
        self._held: dict[str, str] = {}
        # ids whose results are on their way to Redis: a commit deletes their leases, so a
        # renew racing it finds them gone; the writer reports any it really lost
        self._committing: set[str] = set()
        self._lock = threading.Lock()

    def add(self, requests: Iterable[Claimed]) -> None:
        with self._lock:
            self._held.update((r.id, r.lease_token) for r in requests)
            metrics.INFLIGHT.set(len(self._held))

    def drop(self, ids: Iterable[str]) -> None:
        with self._lock:
            for request_id in ids:
                self._held.pop(request_id, None)
                self._committing.discard(request_id)
            metrics.INFLIGHT.set(len(self._held))

    def committing(self, ids: Iterable[str]) -> None:
        """Their results are being written (until ``drop``)."""
        with self._lock:
            self._committing.update(i for i in ids if i in self._held)

    def still_held(self, ids: Iterable[str]) -> list[str]:
        """Of ``ids`` (a renew's lost ones), those held and not being committed."""
        with self._lock:
            return [i for i in ids if i in self._held and i not in self._committing]

    def snapshot(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self._held.items())

    def __len__(self) -> int:
        return len(self._held)


def report_redis_error(operation: str, exc: Exception, retry_in: float) -> None:
    """Log an error a worker thread meets and retries: a warning when it may heal (Redis
    away), an error and the batchery_redis_errors_total metric when Redis refuses the
    command itself (out of memory, no permission), a traceback when it is a bug."""
    if isinstance(exc, redis.RedisError) and not transient(exc):
        metrics.redis_error(operation).inc()
        log.error("%s refused by Redis (%s: %s); retrying in %.1fs", operation,
                  type(exc).__name__, exc, retry_in)
        return
    log.warning("%s failed (%s); retrying in %.1fs", operation, exc, retry_in,
                exc_info=not isinstance(exc, redis.RedisError))


class Heartbeat(threading.Thread):
    """Every lease_seconds/3: renew held leases, mark the worker live, maybe reap.

    Every live worker tries the reaper; a short lock lets one of them run it per beat.
    """

    def __init__(self, queue: ShardedQueue, worker_id: str, leases: Leases,
                 stop: threading.Event, info: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__(name="batchery-heartbeat", daemon=True)
        self.queue, self.worker_id, self.leases, self.stop = queue, worker_id, leases, stop
        self.info = info  # what this worker reports for the dashboard
        self.interval_s = 1.0

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception as exc:  # never let the heartbeat die: leases would lapse
                report_redis_error("heartbeat", exc, self.interval_s)

    def beat(self) -> None:
        settings = self.queue.settings()
        self.interval_s = settings.lease_seconds / 3
        lost = self.leases.still_held(self.queue.renew(self.worker_id, self.leases.snapshot()))
        if lost:  # not those committed, or being committed, while the renew was on its way
            log.warning("lost the lease on %d request(s) (taken over or cancelled): %s",
                        len(lost), ", ".join(lost[:5]))
        if self.info:
            self.queue.publish_worker(self.worker_id, {**self.info(), "inflight": len(self.leases)},
                                      settings.lease_seconds)
        lock_ms = max(1, int(self.interval_s * 1000 * 0.9))
        if self.queue.take_reaper_turn(self.worker_id, lock_ms):
            self.queue.forget_workers(older_than_s=WORKER_FORGOTTEN_AFTER_LEASES * settings.lease_seconds)
            reaped = self.queue.reap()
            if reaped.requeued or reaped.dead:
                log.warning("reaper: %d expired lease(s) back in the queue, %d dead-lettered",
                            len(reaped.requeued), len(reaped.dead))
                metrics.DEAD_LETTERS.inc(len(reaped.dead))
                tracing.reaped(self.queue, reaped.requeued, reaped.dead)
        for priority, n in self.queue.depth().items():
            metrics.QUEUE_DEPTH.labels(self.queue.name, priority).set(n)
        metrics.tenant_loads(self.queue.name, *self.queue.top_tenants())
