"""The generate worker's model thread: one decode step at a time, claiming from Redis
into the room freed between steps (see workers/generating.py for the whole design)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from batchery import tracing
from batchery.batching.messages import Claimed
from batchery.batching.queue import RequestQueue
from batchery.batching.streams import StreamWriter
from batchery.workers import metrics
from batchery.workers.claiming import Claimer
from batchery.workers.execution import Executed, Outcome, failure
from batchery.workers.leases import Leases, report_redis_error
from batchery.workers.loop import _retrying
from batchery.workers.results import ResultWriter
from batchery.workers.runners.decoding import Sequence

log = logging.getLogger(__name__)
LEASE_CHECK_S = 0.05  # how often running sequences are checked for cancellation
RETRY_CAP_S = 5.0


@dataclass(eq=False)
class Slot:
    """A claimed request on this worker: the claim and the local clock's view of it."""

    request: Claimed
    claimed_ms: int        # Redis clock at claim
    deadline: float | None  # time.monotonic() past which it stops (finish_reason deadline)
    started: float = 0.0   # time.perf_counter() at prefill


class DecodeLoop:
    def __init__(self, queue_: RequestQueue, runner: Any, claimer: Claimer, leases: Leases,
                 writer: ResultWriter, options: Any) -> None:
        self.queue, self.runner, self.claimer = queue_, runner, claimer
        self.leases, self.writer, self.options = leases, writer, options
        self.batch = runner.new_batch()
        self.waiting: list[Sequence] = []   # claimed, no room yet
        self.streams = StreamWriter(queue_.client, queue_.keys)
        self._checked = time.monotonic()
        self._claim_backoff, self._claim_after = 0.1, 0.0

    def run(self, stop: Any, burst: bool) -> None:
        handed_back = False
        while True:
            if stop.is_set() and not handed_back:
                self._hand_back()
                handed_back = True
            if not stop.is_set():
                if self._fill(burst) is None:
                    return  # a burst worker with nothing left
            if not self.batch.rows:
                if stop.is_set():
                    return
                continue
            self._step()
            self._check_leases()
            self._flush_streams()

    # -- admission -------------------------------------------------------------------
    def _room(self, held: list[Sequence]) -> tuple[int, int]:
        """Sequences and cache tokens still free beside ``held``."""
        return (self.options.max_batch_size - len(held),
                self.options.max_batch_tokens - sum(s.reserved for s in held))

    def _fill(self, burst: bool) -> bool | None:
        """Admit waiting requests, then claim into the room left; None: burst over."""
        self._admit([])
        slots, tokens = self._room(self.batch.rows + self.waiting)
        if self.waiting or slots < 1 or tokens < 1 or time.monotonic() < self._claim_after:
            return True
        idle = not self.batch.rows
        held_before = len(self.leases)
        try:
            claimed, reply = self.claimer.claim_requests(
                slots, tokens, self.options.max_wait_ms if idle else 0)
            self._claim_backoff = 0.1
        except Exception as exc:  # Redis away: keep decoding, claim again later
            report_redis_error("claim", exc, self._claim_backoff)
            self._claim_after = time.monotonic() + self._claim_backoff
            self._claim_backoff = min(2 * self._claim_backoff, RETRY_CAP_S)
            if idle:
                time.sleep(self._claim_backoff)
            return True
        if claimed:
            self._admit([self._sequence(r, reply.now_ms) for r in claimed])
        elif idle:
            if reply.wait_ms == -1 and burst and not held_before:
                return None
            self.claimer.idle(reply)
        return True

    def _sequence(self, request: Claimed, now_ms: int) -> Sequence | None:
        """The request as a sequence; a request that cannot run fails here, alone."""
        deadline = (time.monotonic() + (request.expire_ms - now_ms) / 1000
                    if request.expire_ms else None)
        slot = Slot(request, now_ms, deadline)
        try:
            return self.runner.sequence(slot, request.input)
        except Exception as exc:  # InputError: no retry; anything else: the runner's bug
            self.writer.submit(Executed(now_ms, [failure(request, exc)]))
            return None

    def _admit(self, claimed: list[Sequence | None]) -> None:
        """Prefill what fits, in claim order; the rest waits for room."""
        queue_ = self.waiting + [s for s in claimed if s is not None]
        self.waiting, joining = [], []
        slots, tokens = self._room(self.batch.rows)
        for s in queue_:
            fits = not self.waiting and len(joining) < slots and s.reserved <= tokens
            if fits or not (self.batch.rows or joining):  # an empty batch takes anything
                joining.append(s)
                tokens -= s.reserved
            else:
                self.waiting.append(s)
        # most urgent first, each priority class in its own prefill: a realtime newcomer's
        # first token does not wait for a long batch-class prompt claimed with it
        joining.sort(key=lambda s: s.key.request.rank)
        for _, group in itertools.groupby(joining, key=lambda s: s.key.request.priority):
            self._prefill(list(group))

    def _prefill(self, joining: list[Sequence]) -> None:
        for s in joining:
            s.key.started = time.perf_counter()
            if s.params.stream:
                self.streams.start(s.key.request.id, s.key.request.attempt)
        self._flush_streams()  # readers see the start now, the first text after the prefill
        try:
            with tracing.prefill([s.key.request for s in joining]):
                tokens, join = self.batch.prefill(joining)
        except Exception as exc:  # a prefill that fails fails its newcomers (retried)
            log.warning("prefill of %d request(s) failed: %s", len(joining), exc)
            self._commit([], failed=[(s, exc) for s in joining])
            return
        self._advance(joining, tokens, joined=False)
        self._flush_streams()  # the first tokens go out before the cache is copied
        join()
        ended = [s for s in joining if s.finish_reason]
        if ended:  # done at their first token (max_new_tokens 1, EOS, a stop string)
            self.batch.drop(ended)

    def _hand_back(self) -> None:
        """At SIGTERM: requests not started go back to the queue at their rank."""
        if self.waiting:
            leases = [(s.key.request.id, s.key.request.token) for s in self.waiting]
            _retrying(lambda: self.queue.release(leases))
            self.leases.drop(i for i, _ in leases)
            log.info("returned %d claimed request(s) to the queue; finishing %d running",
                     len(leases), len(self.batch.rows))
            self.waiting = []

    # -- decoding --------------------------------------------------------------------
    def _step(self) -> None:
        rows = list(self.batch.rows)
        started = time.perf_counter()
        try:
            tokens = self.batch.step()
        except Exception as exc:  # every running sequence fails this attempt (retried)
            log.warning("decode step over %d sequences failed: %s", len(rows), exc)
            self.batch.drop(rows)
            self._commit([], failed=[(s, exc) for s in rows])
            return
        metrics.INFERENCE.observe(time.perf_counter() - started)
        metrics.BATCH_SIZE.observe(len(rows))
        self._advance(rows, tokens)

    def _advance(self, rows: list[Sequence], tokens: list[int], joined: bool = True) -> None:
        """Append each row's token; rows that ended are committed and (``joined``: they
        are in the batch) leave it."""
        now = time.monotonic()
        ended = []
        for s, token in zip(rows, tokens):
            self._append(s, token)
            if s.finish_reason is None and s.key.deadline is not None and now >= s.key.deadline:
                s.finish_reason = "deadline"
                s.text = s.text if s.params.stop else self.runner.text(s.generated)
            if s.params.stream:
                self._stream(s)
            if s.finish_reason:
                ended.append(s)
        if ended:
            if joined:
                self.batch.drop(ended)
            self._commit(ended)

    def _append(self, s: Sequence, token: int) -> None:
        p = s.params
        if token in self.runner.eos_ids:
            s.finish_reason = "stop"
        else:
            s.generated.append(token)
        if p.stop or p.stream or s.finish_reason:
            s.text = self.runner.text(s.generated)
        if p.stop:
            cut = min((i for i in (s.text.find(stop) for stop in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                s.text, s.finish_reason = s.text[:cut], "stop"
        if s.finish_reason is None and len(s.generated) >= p.max_new_tokens:
            s.finish_reason = "length"
            s.text = s.text if p.stop or p.stream else self.runner.text(s.generated)

    def _stream(self, s: Sequence) -> None:
        """Write the new text, less a trailing half character (a byte-level token may
        end inside one) and what could begin a stop string; all of it at the end. If
        decoding ever rewrote text already sent, the rest waits for the result."""
        if not s.text.startswith(s.sent):
            return
        shown = len(s.text)
        if not s.finish_reason:
            shown = min(len(s.text.rstrip("\ufffd")), shown - s.params.holdback)
        if shown > len(s.sent):
            self.streams.text(s.key.request.id, s.text[len(s.sent):shown], len(s.generated))
            s.sent = s.text[:shown]

    def _commit(self, ended: list[Sequence], failed: list[tuple[Sequence, Exception]] | None = None) -> None:
        self._flush_streams()  # a stream's text goes before its end, which follows the commit
        size = len(self.batch.rows) + len(ended)
        outcomes = []
        for s in ended:
            output = {"text": s.text, "tokens": len(s.generated), "finish_reason": s.finish_reason}
            run_ms = round((time.perf_counter() - s.key.started) * 1000, 3)
            if s.finish_reason == "deadline":
                outcomes.append(Outcome(s.key.request, output=output, expired=True, batch_size=size,
                                        run_ms=run_ms, error={"type": "DeadlineExceeded", "message":
                                        "the deadline passed while generating; output holds the "
                                        "text so far"}))
            else:
                outcomes.append(Outcome(s.key.request, output=output, batch_size=size, run_ms=run_ms))
        failed = failed or []
        outcomes += [failure(s.key.request, exc) for s, exc in failed]
        by_claim: dict[int, list[Outcome]] = {}
        for s, o in zip([*ended, *(s for s, _ in failed)], outcomes):
            by_claim.setdefault(s.key.claimed_ms, []).append(o)
        for claimed_ms, group in by_claim.items():
            self.writer.submit(Executed(claimed_ms, group))

    # -- between steps -----------------------------------------------------------------
    def _check_leases(self) -> None:
        """Stop sequences whose lease is gone: cancelled (their stream ends here), or taken
        over by another worker after a stall (that worker's run restarts the stream)."""
        if time.monotonic() - self._checked < LEASE_CHECK_S:
            return
        self._checked = time.monotonic()
        held = self.batch.rows + self.waiting
        try:
            owners = self.queue.holders([s.key.request.id for s in held])
        except Exception as exc:  # cannot tell now: the next check will
            log.debug("lease check failed: %s", exc)
            return
        lost = [(s, owner) for s, owner in zip(held, owners) if owner != s.key.request.token]
        if not lost:
            return
        gone = [s for s, _ in lost]
        self.batch.drop(gone)
        self.waiting = [s for s in self.waiting if s not in gone]
        self.leases.drop(s.key.request.id for s in gone)
        tracing.released([s.key.request for s in gone], "cancelled, or taken over after a stall")
        for s, owner in lost:
            s.finish_reason = "cancelled"
            if s.params.stream and owner is None:
                self._stream(s)
                self.streams.end(s.key.request.id, "cancelled")
        log.info("stopped %d sequence(s) whose request was cancelled or taken over", len(lost))

    def _flush_streams(self) -> None:
        try:
            self.streams.flush()
        except Exception as exc:  # streams are best effort; results are not
            log.warning("writing token streams failed: %s", exc)
