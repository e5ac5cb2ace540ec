"""What both generate loops (batchery's decode loop, an external engine's) do on the
queue's side: claim into the room they report, with back-off while Redis is away; hand
stream entries to the result writer's thread; commit ended sequences by claim; attach a
cancelled one's text. Each loop decides the room and runs its own steps."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from batchery.batching.messages import Claimed
from batchery.batching.sharded import ShardedQueue
from batchery.batching.streams import StreamWriter
from batchery.connection import Backoff
from batchery.workers.claiming import Claimer
from batchery.workers.generation import outputs, text
from batchery.workers.generation.batch import Sequence
from batchery.workers.generation.lookout import Lookout
from batchery.workers.leases import Leases, report_redis_error
from batchery.workers.results import ResultWriter

log = logging.getLogger(__name__)


class QueueSide:
    def __init__(self, queue_: ShardedQueue, runner: Any, claimer: Claimer, leases: Leases,
                 writer: ResultWriter, options: Any, count: Callable[..., None]) -> None:
        self.queue, self.runner, self.claimer = queue_, runner, claimer
        self.leases, self.writer, self.options, self.count = leases, writer, options, count
        self.streams = StreamWriter(queue_.client, queue_.keys_for)
        self.lookout = Lookout(queue_)  # the head's rank and the leases, read off the step's path
        self._claim_backoff, self._claim_after = Backoff(), 0.0

    def run(self, stop: Any, burst: bool) -> None:
        self.lookout.start()
        try:
            self._turns(stop, burst)
        finally:
            self.lookout.stop()

    def _turns(self, stop: Any, burst: bool) -> None:
        raise NotImplementedError

    def _claim_into(self, size: tuple[int, int] | None, idle: bool, burst: bool,
                    take: Callable[[list[Claimed], int], None]) -> bool | None:
        """Claim up to ``size`` (sequences, tokens; None: no room) and ``take`` what came
        (with the Redis clock at the claim); an ``idle`` loop waits for work instead. Redis
        away: go on, claim again after a back-off. None: a burst worker with nothing left."""
        if size is None or time.monotonic() < self._claim_after:
            return True
        held_before = len(self.leases)
        try:
            claimed, reply = self.claimer.claim_requests(
                *size, self.options.max_wait_ms if idle else 0)
            self._claim_backoff.reset()
        except Exception as exc:  # Redis away: keep stepping, claim again later
            wait_s = self._claim_backoff.next()
            report_redis_error("claim", exc, wait_s)
            self._claim_after = time.monotonic() + wait_s
            if idle:
                time.sleep(wait_s)
            return True
        if claimed:
            self.count(claimed_ms=reply.now_ms)
            take(claimed, reply.now_ms)
            self._flush_streams()  # readers see the run start at its claim
        elif idle:
            if reply.wait_ms == -1 and burst and not held_before:
                return None
            self.claimer.idle(reply)
        return True

    def _stream(self, s: Sequence) -> None:
        delta = text.stream_delta(s)
        if delta is not None:
            self.streams.text(s.key.request.id, delta, len(s.generated))

    def _commit(self, ended: list[Sequence], failed: list[tuple[Sequence, Exception]] | None = None,
                in_flight: int = 0) -> None:
        """Commit what ended and what failed, one call per claim; ``in_flight``: the
        sequences still running beside them (the results' batch size)."""
        self._flush_streams()  # a stream's text goes before its end, which follows the commit
        for executed in outputs.by_claim(ended, failed or [], self.runner, in_flight + len(ended)):
            self.writer.submit(executed)
        self.count(requests=len(ended))

    def _attach(self, s: Sequence) -> None:
        """Give a cancelled sequence's result the text generated so far, before its stream
        ends (the reader reads the result at the end)."""
        s.text = text.so_far(s, self.runner)
        try:
            self.queue.attach_output(s.key.request.id, s.key.request.lease_token, outputs.cancelled(s))
        except Exception as exc:  # the result stays the cancel's, without output
            log.warning("attaching the text of cancelled request %s failed: %s", s.key.request.id, exc)

    def _flush_streams(self) -> None:
        """Hand the stream entries added so far to the writer's thread: written off the
        step's path, in order with the commits (a stream's text before its end)."""
        entries = self.streams.take()
        if entries:
            self.writer.later(lambda: self.streams.write(entries))
