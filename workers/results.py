"""Writing results back, off the model thread: one complete call (and one fail call) for
the batches waiting to be written when the writer comes to them (group commit: one batch
when Redis keeps up, several in one call when it does not)."""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from typing import Any, Callable

import redis

from batchery.batching.calls import Failed
from batchery.batching.codec import encode_message
from batchery.batching.messages import DEAD, ERROR, EXPIRED, OK
from batchery.batching.sharded import ShardedQueue
from batchery.connection import Backoff, transient
from batchery.workers import metrics, tracing
from batchery.workers.execution import Executed, Outcome
from batchery.workers.leases import Leases

log = logging.getLogger(__name__)
BACKLOG = 8  # batches waiting to be written before the model thread waits for Redis
GROUP_MOST = 4  # batches one commit takes from those waiting (a group: ResultWriter.run)
NOTHING = object()  # ResultWriter.run: no item taken ahead


class ResultWriter(threading.Thread):
    def __init__(self, queue_: ShardedQueue, worker_id: str, leases: Leases,
                 on_committed: Callable[[list[Outcome]], None] | None = None) -> None:
        super().__init__(name="batchery-writer", daemon=True)
        self.queue, self.worker_id, self.leases = queue_, worker_id, leases
        self.on_committed = on_committed  # told which outcomes became the committed result
        self._backlog: queue.Queue[Executed | Callable[[], None] | None] = queue.Queue(maxsize=BACKLOG)

    def submit(self, executed: Executed) -> None:
        self._backlog.put(executed)

    def later(self, write: Callable[[], None]) -> None:
        """Run ``write`` on this thread, in order with the commits submitted around it
        (token streams: a stream's text goes before the commit that ends it), best effort:
        a failure is logged, not retried."""
        self._backlog.put(write)

    def close(self) -> None:
        """Write what is left, then stop."""
        self._backlog.put(None)
        self.join()

    def run(self) -> None:
        item = self._backlog.get()
        while item is not None:
            after: Any = NOTHING  # an item taken while gathering that does not join the group
            if isinstance(item, Executed):
                group, shard = [item], self._shard_of(item)
                while len(group) < GROUP_MOST:  # the batches of its shard waiting join it
                    try:
                        after = self._backlog.get_nowait()
                    except queue.Empty:
                        after = NOTHING
                        break
                    if not isinstance(after, Executed) or self._shard_of(after) is not shard:
                        break  # (a stream's text, the end, another shard's batch: after this one)
                    group.append(after)
                    after = NOTHING
                self.commit(group)
            else:
                try:
                    item()
                except Exception as exc:  # streams are best effort; results are not
                    log.warning("writing token streams failed: %s", exc)
            item = self._backlog.get() if after is NOTHING else after

    def _shard_of(self, executed: Executed) -> Any:
        """The shard of a batch's requests (a batch is claimed from one shard)."""
        return self.queue.shard(executed.outcomes[0].request.id) if executed.outcomes else None

    def commit(self, group: list[Executed]) -> None:
        """Write ``group``'s results in one call, retried while Redis is away. Refused for
        good (or a bug): a group is written again a batch at a time, so only the batch at
        fault gives up."""
        backoff = Backoff()
        while True:
            try:
                self.write(group)
                return
            except Exception as exc:
                if isinstance(exc, redis.RedisError) and transient(exc):
                    wait_s = backoff.next()  # keep the results; the leases may still hold
                    log.warning("writing results failed (%s); retrying in %.1fs", exc, wait_s)
                    threading.Event().wait(wait_s)
                    continue
                if len(group) > 1:  # the same call would fail again: each batch alone
                    for executed in group:
                        self.commit([executed])
                elif isinstance(exc, redis.RedisError):  # refused for good
                    self.give_up(group[0], exc)
                else:  # a bug: drop this batch; its leases expire and it reruns
                    log.exception("could not write %d result(s)", len(group[0].outcomes))
                    self.leases.drop(o.request.id for o in group[0].outcomes)
                return

    def give_up(self, executed: Executed, error: redis.RedisError) -> None:
        """Redis refuses the commit for good (out of memory, a setting it rejects): fail
        the batch's requests with the reason (retried with backoff, then dead-lettered);
        if even that is refused, release them. Either way stop renewing their leases."""
        ids = [o.request.id for o in executed.outcomes]
        metrics.redis_error("commit").inc()
        log.error("Redis refused the results of %d request(s): %s: %s; failing them with that "
                  "reason", len(ids), type(error).__name__, error)
        reason = {"type": "RedisError",
                  "message": f"Redis refused to store the result ({type(error).__name__}: {error})"}
        items = [(o.request.id, o.request.lease_token,
                  self._encode(o, executed.claimed_ms, DEAD, reason)[1]) for o in executed.outcomes]
        try:
            verdicts = self.queue.fail(items, [o.request.client for o in executed.outcomes])
            tracing.committed(0, 0, [], [], executed.outcomes, verdicts)
            metrics.RETRIES.inc(verdicts.count(Failed.RETRIED))
            metrics.DEAD_LETTERS.inc(verdicts.count(Failed.DEAD))
        except redis.RedisError as exc:
            metrics.redis_error("fail").inc()
            log.error("failing them was refused too (%s); releasing them to the queue", exc)
            try:
                self.queue.release([(o.request.id, o.request.lease_token) for o in executed.outcomes])
            except redis.RedisError as again:  # their leases lapse: the reaper takes them back
                metrics.redis_error("release").inc()
                log.error("releasing them failed too (%s); their leases will lapse", again)
        self.leases.drop(ids)

    def write(self, group: list[Executed]) -> None:
        began = tracing.clock()
        outcomes = [(o, e.claimed_ms) for e in group for o in e.outcomes]
        final = [o for o, _ in outcomes if not o.retry]
        failed = [o for o, _ in outcomes if o.retry]
        encoded = [self._encode(o, claimed_ms) for o, claimed_ms in outcomes if not o.retry]
        # a batch whose every request is retried adds no totals, alone or in a group
        # (RequestQueue.complete sends nothing for it alone)
        runs = [run for e in group if any(not o.retry for o in e.outcomes) for run in e.runs]
        totals = {"batches": len(runs), "tokens": sum(run.tokens for run in runs),
                  "padded_tokens": sum(run.padded for run in runs),
                  **Counter(status for status, _ in encoded)}
        # a heartbeat renewing while these commit finds their leases gone: not lost
        self.leases.committing(o.request.id for o, _ in outcomes)
        # the retries first: a group Redis refuses for good is written again a batch at a
        # time, and a fail sent again finds its leases let go (nothing done twice), where a
        # commit sent again would add its totals again
        verdicts = self.queue.fail([(o.request.id, o.request.lease_token,
                                     self._encode(o, claimed_ms, DEAD)[1])
                                    for o, claimed_ms in outcomes if o.retry],
                                   [o.request.client for o in failed])
        committed = self.queue.complete(
            [(o.request.id, o.request.lease_token, payload) for o, (_, payload) in zip(final, encoded)],
            totals, [o.request.client for o in final])
        ended = tracing.clock()
        finished = Counter((o.request.priority, status)
                           for o, (status, _), ok in zip(final, encoded, committed) if ok)
        for (priority, status), n in finished.items():  # one labels() lookup per kind, not per request
            metrics.REQUESTS.labels(self.queue.name, priority, status).inc(n)
        for o, verdict in zip(failed, verdicts):
            if verdict is Failed.RETRIED:
                metrics.RETRIES.inc()
            elif verdict is Failed.DEAD:
                metrics.DEAD_LETTERS.inc()
                metrics.REQUESTS.labels(self.queue.name, o.request.priority, DEAD).inc()
        lost = committed.count(False) + verdicts.count(Failed.LEASE_LOST)
        if lost:
            log.warning("discarded %d result(s): this worker no longer held their lease", lost)
        # before what follows: a heartbeat renewing meanwhile would count them as lost
        self.leases.drop(o.request.id for o, _ in outcomes)
        if self.on_committed:
            try:
                self.on_committed([o for o, ok in zip(final, committed) if ok])
            except Exception as exc:  # the results are in: what follows is best effort
                log.warning("after committing %d result(s): %s", len(final), exc)
        tracing.committed(began, ended, final, committed, failed, verdicts)

    def _encode(self, o: Outcome, claimed_ms: int, failed_status: str = ERROR,
                error: dict[str, str] | None = None) -> tuple[str, bytes]:
        r = o.request
        status = failed_status if error else EXPIRED if o.expired else OK if o.error is None \
            else failed_status
        body: dict[str, Any] = {"id": r.id, "status": status,
                                "output": None if error else o.output, "error": error or o.error,
                                "attempts": r.attempt, "worker": self.worker_id,
                                "batch_size": o.batch_size or None,
                                "queued_ms": max(0, claimed_ms - r.enqueued_ms),
                                "run_ms": o.run_ms or None}
        try:  # a lone surrogate in the output becomes "?"
            return status, encode_message(body, "output", errors="replace")
        except Exception as exc:  # any output that cannot be written fails its request alone
            body.update(status=ERROR, output=None, error={
                "type": "OutputNotJSON", "message": f"the runner's output is not JSON: "
                                                    f"{type(exc).__name__}: {str(exc)[:500]}"})
            return ERROR, encode_message(body, "output", errors="replace")
