"""One run of an offline job: stream the input into the request queue, write results.

At most ``max_in_flight`` of the job's requests are queued at once; each result line is
written as it arrives. A run resumes what earlier runs left: lines already in the
output or errors file are skipped, and requests they left queued (their ids are the
same: ``JOB:custom_id``) are collected, not enqueued again. Every ``CHECK_S`` the run
saves its progress in the RQ job's meta and looks for a cancellation (RQ status
``canceled``) or a warm shutdown of its worker (then it hands the job back to RQ).
"""

from __future__ import annotations

import logging
import os
import queue as stdlib_queue
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Generator, Iterator

import redis
from rq import Retry, get_current_job
from rq.exceptions import InvalidJobOperation
from rq.job import Job, JobStatus

from batchery.batching.messages import CANCELLED as CANCELLED_RESULT, DEAD as DEAD_RESULT
from batchery.batching.messages import OK, Result
from batchery.batching.request import Request
from batchery.batching.sharded import open_queue
from batchery import tracing
from batchery.connection import text_client
from batchery.errors import InvalidRequest, QueueFull
from batchery.producer.client import ENQUEUE_CHUNK
from batchery.producer.jobs.files import (Invalid, JobFiles, Line, LineParser, LineSet,
                                          count_lines, line_limit, read_lines, recover)
from batchery.producer.jobs.spec import (CANCELLED, COUNTING, FINALIZING, FINISHED, RUNNING,
                                         STOPPED, JobSpec, Progress)
from batchery.producer.replies import ReplyListener
from batchery.batching.pricing import QueueCounter

log = logging.getLogger(__name__)
CHECK_S = 0.5       # progress saved, cancellation and shutdown checked this often
EARLIER_POLL_S = 1.0       # results of requests an earlier run enqueued are read this often
SCAN_PAUSE = 2000   # a long stretch of skipped or invalid lines pauses for checks this often
FULL_BACKOFF_START_S = 0.05  # a full queue is tried again after this, doubling ...
FULL_BACKOFF_CAP_S = 2.0     # ... up to this
HANDBACK_RETRIES = 1000  # a job handed back on shutdown may be handed back this often

# What became of a line the run tried to enqueue.
ACCEPTED, KNOWN, FULL, REFUSED = "accepted", "known", "full", "refused"
END = object()    # the input has no more lines
PAUSE = object()  # a long stretch without a line to enqueue: time to save progress and check

# Set by the jobs worker on a warm shutdown: the running job hands itself back to RQ.
SHUTDOWN = threading.Event()


def run_job(**kwargs: Any) -> Any:
    """The RQ job function: run (or resume) the job; returns its final counts."""
    job = get_current_job()
    if job is None:
        raise RuntimeError("run_job runs inside an RQ worker (batchery job worker)")
    spec = JobSpec.from_kwargs(kwargs)
    with tracing.job(job, spec.queue):
        outcome = JobRun(job, spec).run()
    if outcome.get("phase") == STOPPED:
        return Retry(max=HANDBACK_RETRIES)  # back to the queue: the next run resumes
    return outcome


class JobRun:
    def __init__(self, job: Job, spec: JobSpec) -> None:
        self.job, self.spec = job, spec
        self.conn = text_client(job.connection)
        self.queue = open_queue(self.conn, spec.queue)
        self.client_id = f"job-{job.id}-{secrets.token_hex(4)}"
        self.replies = ReplyListener(self.queue, self.client_id)
        self.progress = Progress()
        self.pending: dict[str, Line] = {}  # request id -> its line, for each queued request
        self.orphans: set[str] = set()  # queued by an earlier run: their results come by polling
        self._arrived: stdlib_queue.SimpleQueue[Result] = stdlib_queue.SimpleQueue()
        self._next_check = self._next_poll = 0.0
        self._quiet = False             # no result arrived since the last poll
        self.held: list[Line] = []      # lines a full queue refused: enqueued before new ones
        self._retry_at = 0.0
        self._backoff = FULL_BACKOFF_START_S
        self.written: list[str] = []    # ids whose result is in the output, to delete from Redis
        self.delete_written = True      # QueueSettings.delete_delivered
        self.files: JobFiles

    def run(self) -> dict[str, Any]:
        self._check_input()
        settings = self.queue.settings()
        self.delete_written = settings.delete_delivered
        out, err = Path(self.spec.output), Path(self.spec.errors)
        try:
            with JobFiles(out, err, self.spec.output_format) as self.files:
                written = recover(out, err)
                self.progress = Progress(ok=written.ok, error=written.failed + written.invalid,
                                         invalid=written.invalid)
                self.progress.done_at_start = self.progress.done
                self._publish(COUNTING)
                self.progress.total = count_lines(Path(self.spec.input), line_limit(settings))
                self._publish(RUNNING)
                self.queue.register()
                parser = LineParser(self.job.id, self.spec.priority, settings,
                                    QueueCounter(self.queue.settings),
                                    expires_at=self.spec.expires_at, tenant=self.spec.tenant)
                phase = self._stream(parser, written.lines)
                if phase == FINISHED:
                    self._publish(FINALIZING)
                    self.files.sync()
        finally:
            self.replies.close()
            self.conn.close()
        return self._publish(phase)

    def _check_input(self) -> None:
        try:
            stat = os.stat(self.spec.input)
        except OSError as exc:
            raise RuntimeError(f"cannot read the input {self.spec.input}: {exc.strerror}") from None
        if (stat.st_size, stat.st_mtime_ns) != (self.spec.input_size, self.spec.input_mtime_ns):
            raise RuntimeError(f"the input {self.spec.input} changed since it was submitted, so "
                               "this job cannot resume it; submit it again as a new job")

    # -- the loop ------------------------------------------------------------------------
    def _stream(self, parser: LineParser, written: LineSet) -> str:
        source = self._lines(parser, written)
        exhausted = False
        try:
            while True:
                stop = self._checkpoint()
                if stop:
                    self._leave(stop)
                    return stop
                if self._room(exhausted):
                    exhausted = self._fill(source) or exhausted
                if exhausted and not self.held and not self.pending:
                    return FINISHED
                self._collect(0.0 if self._room(exhausted) else self._wait_s())
        finally:
            source.close()
            self._forget_written()

    def _forget_written(self) -> None:
        """Delete from Redis the results now in the output (flushed first: a crash after
        this loses none; one before it reruns their lines)."""
        self.files.flush()
        ids, self.written = self.written, []
        if not self.delete_written or not ids:
            return
        try:
            for start in range(0, len(ids), ENQUEUE_CHUNK):
                self.queue.forget_results(ids[start:start + ENQUEUE_CHUNK])
        except redis.RedisError as exc:  # they expire after result_ttl anyway
            log.warning("deleting %d written result(s) from Redis failed (%s)", len(ids), exc)

    def _room(self, exhausted: bool) -> bool:
        """Lines to enqueue, room for them in flight, and the queue not known full."""
        return (bool(self.held) or not exhausted) and time.monotonic() >= self._retry_at and \
            len(self.pending) < self.spec.max_in_flight

    def _wait_s(self) -> float:
        return min(CHECK_S, max(self._retry_at - time.monotonic(), 0.0) or CHECK_S)

    def _lines(self, parser: LineParser, written: LineSet) -> Generator[Line | object, None, None]:
        """Valid lines not yet written, and PAUSE now and then; invalid ones go to the
        errors file."""
        with open(self.spec.input, "rb") as f:
            for i, (number, raw) in enumerate(read_lines(f, line_limit(parser.settings))):
                if i % SCAN_PAUSE == SCAN_PAUSE - 1:
                    yield PAUSE
                line = parser.parse(number, raw, written=number in written)
                if isinstance(line, Invalid):
                    self._invalid(line)
                elif line is not None:
                    yield line

    def _invalid(self, line: Invalid) -> None:
        self.files.invalid(line)
        self.progress.error += 1
        self.progress.invalid += 1

    def _fill(self, source: Iterator[Line | object]) -> bool:
        """Enqueue up to a chunk: lines a full queue refused first, then new ones.
        True once the input is exhausted."""
        room = min(ENQUEUE_CHUNK, self.spec.max_in_flight - len(self.pending))
        chunk, self.held = self.held[:room], self.held[room:]
        exhausted = False
        while len(chunk) < room:
            line = next(source, END)
            if line is END:
                exhausted = True
                break
            if line is PAUSE:
                break
            chunk.append(line)  # type: ignore[arg-type]
        self._enqueue(chunk)
        return exhausted

    def _enqueue(self, lines: list[Line]) -> None:
        if not lines:
            return
        ids = [line.request.id for line in lines]
        self.pending.update(zip(ids, lines))
        self.replies.collect(ids, self._arrived.put)  # results arrive in self._arrived
        try:
            verdicts = self._fitting([x.request for x in lines])
        except InvalidRequest:  # the queue's settings changed under the job: one by one
            verdicts = [self._enqueue_one(line) for line in lines]
        refused = [line for line, v in zip(lines, verdicts) if v in (FULL, REFUSED)]
        for line in refused:
            self.pending.pop(line.request.id, None)
            self.replies.forget(line.request.id)
        self.orphans.update(x.request.id for x, v in zip(lines, verdicts) if v == KNOWN)
        full = [line for line, v in zip(lines, verdicts) if v == FULL]
        self.held[:0] = full
        if full:  # try again after a pause, collecting results meanwhile
            if self._backoff == FULL_BACKOFF_START_S:
                log.warning("queue %r is full (its max_pending); the job waits for room",
                            self.queue.name)
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, FULL_BACKOFF_CAP_S)
        else:
            self._backoff = FULL_BACKOFF_START_S

    def _enqueue_one(self, line: Line) -> str:
        try:
            return self._fitting([line.request])[0]
        except InvalidRequest as exc:
            self._invalid(Invalid(line.number, line.custom_id, "invalid", str(exc)))
            return REFUSED

    def _fitting(self, requests: list[Request]) -> list[str]:
        """Enqueue what fits: ACCEPTED, KNOWN (an earlier run enqueued it) or FULL for
        each request. A chunk over the queue's room is split, so a small room still fills."""
        try:
            with tracing.enqueue(self.queue.name, requests) as requests:
                flags = self.queue.enqueue(requests, self.client_id)
        except QueueFull:
            if len(requests) == 1:
                return [FULL]
            half = len(requests) // 2
            return self._fitting(requests[:half]) + self._fitting(requests[half:])
        return [ACCEPTED if new else KNOWN for new in flags]

    def _collect(self, timeout: float) -> None:
        """Write the results that arrived (waiting up to ``timeout`` for the first)."""
        arrived: list[Result] = []
        try:
            arrived.append(self._arrived.get(timeout=timeout) if timeout else self._arrived.get_nowait())
            while True:
                arrived.append(self._arrived.get_nowait())
        except stdlib_queue.Empty:
            pass
        for result in arrived:
            self._write(result)
        self._quiet = self._quiet and not arrived
        if time.monotonic() >= self._next_poll:
            self._poll()

    def _write(self, result: Result) -> None:
        line = self.pending.pop(result.id, None)
        if line is None:
            return
        self.orphans.discard(result.id)
        if result.status == CANCELLED_RESULT and self._cancelled():
            return  # withdrawn by `batchery job cancel`: the line did not run
        self.files.result(line, result)
        if result.status != DEAD_RESULT:  # dead letters stay for `batchery queue dead list`
            self.written.append(result.id)
        if result.status == OK:
            self.progress.ok += 1
        else:
            self.progress.error += 1

    def _poll(self) -> None:
        """Read results directly: an earlier run's requests, or all when replies went quiet.
        A request Redis has no trace of (lost in a crash) is enqueued again."""
        ids = list(self.pending if self._quiet else self.orphans)
        lost: list[Line] = []
        for start in range(0, len(ids), ENQUEUE_CHUNK):
            chunk = ids[start:start + ENQUEUE_CHUNK]
            for request_id, found in zip(chunk, self.queue.lookup(chunk)):
                if isinstance(found, Result):
                    self.replies.deliver(found)
                elif not found and request_id in self.pending:  # not written meanwhile
                    lost.append(self.pending.pop(request_id))
                    self.replies.forget(request_id)
                    self.orphans.discard(request_id)
        if lost:
            log.warning("job %s: Redis lost %d queued request(s); enqueueing them again",
                        self.job.id, len(lost))
            self.held[:0] = lost
        self._quiet = True
        self._next_poll = time.monotonic() + EARLIER_POLL_S

    # -- checks --------------------------------------------------------------------------
    def _checkpoint(self) -> str | None:
        """Every CHECK_S: save progress; CANCELLED or STOPPED when the run must end."""
        if time.monotonic() < self._next_check:
            return None
        self._next_check = time.monotonic() + CHECK_S
        self._forget_written()
        if self._cancelled():
            return CANCELLED
        if SHUTDOWN.is_set():
            return STOPPED
        self._publish(RUNNING)
        return None

    def _cancelled(self) -> bool:
        try:
            return self.job.get_status(refresh=True) == JobStatus.CANCELED
        except InvalidJobOperation:  # the job was deleted from RQ: nobody waits for it
            return True

    def _leave(self, phase: str) -> None:
        """Cancelled: withdraw the queued requests. Stopped: leave them for the next run."""
        if phase != CANCELLED:
            return
        ids = list(self.pending)
        withdrawn = 0
        for start in range(0, len(ids), ENQUEUE_CHUNK):
            withdrawn += sum(1 for flag in self.queue.cancel(ids[start:start + ENQUEUE_CHUNK]) if flag)
        self.job.meta["withdrawn"] = withdrawn
        log.info("job %s cancelled; %d queued request(s) withdrawn", self.job.id, withdrawn)

    def _publish(self, phase: str) -> dict[str, Any]:
        meta = self.progress.meta(phase)
        self.job.meta.update(meta)
        try:
            self.job.save_meta()
        except redis.RedisError as exc:  # progress is advisory: the run carries on
            log.warning("saving job progress failed (%s)", exc)
        return meta
