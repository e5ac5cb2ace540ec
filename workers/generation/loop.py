"""The generate worker's model thread: one decode step at a time, claiming from Redis
into the room freed between steps (see workers/generation/worker.py for the whole design)."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

from batchery.batching.messages import Claimed
from batchery.batching.sharded import ShardedQueue
from batchery.connection import retrying
from batchery.workers import metrics, tracing
from batchery.workers.claiming import Claimer
from batchery.workers.execution import BatchCap, Executed, failure, is_out_of_memory
from batchery.workers.generation import prefix_cache, scheduler, text
from batchery.workers.generation.batch import Prefill, Sequence
from batchery.workers.generation.queue_side import QueueSide
from batchery.workers.generation.slot import Slot, rank
from batchery.workers.leases import Leases
from batchery.workers.results import ResultWriter

log = logging.getLogger(__name__)


class DecodeLoop(QueueSide):
    def __init__(self, queue_: ShardedQueue, runner: Any, claimer: Claimer, leases: Leases,
                 writer: ResultWriter, options: Any,
                 count: Callable[..., None] = lambda **_: None, cap: BatchCap | None = None) -> None:
        super().__init__(queue_, runner, claimer, leases, writer, options, count)
        prefix = options.prefix_cache_tokens  # None: a share of the KV budget
        self.batch = runner.new_batch(int(prefix_cache.CACHE_SHARE * options.max_batch_tokens)
                                      if prefix is None else prefix)
        self.cap = cap or BatchCap(options.oom_hold_s)  # sequences in flight, halved after OOM
        self.prefilling: list[Prefill] = []  # admitted, context being prefilled; most urgent first
        self.waiting: list[Sequence] = []    # claimed or preempted, no room yet; most urgent first
        self.preempted = 0                   # sequences paused to make room for a more urgent one
        # preempted rows still in the batch's cache: cutting it copies the whole cache (tens
        # of ms), so it waits until the newcomer's first token is out (_cut_preempted)
        self._preempting: list[Sequence] = []
        self._spent: dict[str, float] = {}  # the batch's seconds by phase, as last counted

    def _turns(self, stop: Any, burst: bool) -> None:
        handed_back = False
        while True:
            started = time.perf_counter()
            if stop.is_set() and not handed_back:
                self._hand_back()
                handed_back = True
            if not stop.is_set() and self._claim(burst) is None:
                return  # a burst worker with nothing left
            self._admit()
            if not (self.batch.rows or self.prefilling):
                if stop.is_set():  # (an empty batch admits anything: nothing waits)
                    return
                continue
            self._prefill()
            if self.batch.rows:
                self._step()
            self._check_leases()
            self._flush_streams()
            spent = dict(self.batch.seconds)  # this turn's time by phase
            metrics.count_generate_turn(self._spent, spent, time.perf_counter() - started)
            self._spent = spent

    # -- admission -------------------------------------------------------------------
    def _running(self) -> list[Sequence]:
        """Sequences holding room: decoding, or being prefilled."""
        return self._running_rows() + [s for p in self.prefilling for s in p.seqs]

    def _running_rows(self) -> list[Sequence]:
        """Decoding rows, less those preempted this step (still in the cache until cut)."""
        return [s for s in self.batch.rows if s not in self._preempting]

    def _budget(self) -> scheduler.Budget:
        """Sequences and cache tokens in flight: the options', less after out of memory."""
        return scheduler.Budget(self.cap.apply(self.options.max_batch_size),
                                self.options.max_batch_tokens)

    def _room(self, held: list[Sequence]) -> tuple[int, int]:
        """Sequences and cache tokens still free beside ``held``."""
        return scheduler.room(map(_entry, held), self._budget())

    def _claim(self, burst: bool) -> bool | None:
        """Claim into the room left, or the queue's head alone when it is more urgent than
        a running sequence (room is made for it in ``_admit``); None: burst over."""
        running = self._running()
        slots, tokens = self._room(running + self.waiting)
        size: tuple[int, int] | None = None
        if slots >= 1 and tokens >= 1 and not self.waiting:
            size = slots, tokens
        elif self._overtaken():
            size = 1, 1  # a claim always takes the head, whatever its size
        return self._claim_into(size, not running and not self.waiting, burst, self._wait)

    def _wait(self, claimed: list[Claimed], now_ms: int) -> None:
        """Claimed requests wait for room as sequences, most urgent first (in _admit)."""
        self.waiting += [s for s in (self._sequence(r, now_ms) for r in claimed) if s]

    def _overtaken(self) -> bool:
        """The worker is full: is the queue's head more urgent than a running sequence
        (and than what already waits for room)?"""
        if not self.batch.rows:
            return False
        head = self.lookout.head
        least = max(rank(s) for s in self.batch.rows)
        return head is not None and head < least and (not self.waiting or head < rank(self.waiting[0]))

    def _sequence(self, request: Claimed, now_ms: int) -> Sequence | None:
        """The request as a sequence; a request that cannot run fails here, alone."""
        slot = Slot.claimed(request, now_ms)
        try:
            seq: Sequence = self.runner.sequence(slot, request.input)
        except Exception as exc:  # InputError: no retry; anything else: the runner's bug
            self.writer.submit(Executed(now_ms, [failure(request, exc)]))
            return None
        if seq.params.stream:
            self.streams.start(request.id, request.attempt)
        return seq

    def _admit(self) -> None:
        """Start prefilling what waits and preempt for it, as the scheduler decides
        (workers/generation/scheduler.py: most urgent first, while it fits, pausing less urgent
        decoding rows for a more urgent newcomer); the rest waits for room."""
        decision = scheduler.admit([_entry(s) for s in self.waiting],
                                   [_entry(s) for s in self._running()],
                                   [_entry(s) for s in self._running_rows()],
                                   self._budget(),
                                   busy=bool(self.batch.rows or self.prefilling))
        if decision.preempt:  # their cache is cut after the newcomers' first token
            self._preempting += decision.preempt
            self.preempted += len(decision.preempt)
            log.info("preempted %d sequence(s) for more urgent request(s)", len(decision.preempt))
        started = {id(s) for s in decision.start}
        self.waiting = sorted((s for s in self.waiting + decision.preempt if id(s) not in started),
                              key=rank)
        # each priority class in its own prefill, most urgent first: a realtime newcomer's
        # first token does not wait for a long batch-class prompt claimed with it
        for _, group in itertools.groupby(decision.start, key=lambda s: s.key.request.priority):
            seqs = list(group)
            for s in seqs:
                s.key.started = s.key.started or time.perf_counter()
            self._start(seqs)
        self.prefilling.sort(key=lambda p: min(rank(s) for s in p.seqs))

    def _start(self, seqs: list[Sequence]) -> None:
        """Their prefills, one per shared prefix; a failure is narrowed down (_bisect)."""
        try:
            self.prefilling += self.batch.prefills(seqs)
        except Exception as exc:
            self._bisect(seqs, exc, "admission")

    def _prefill(self) -> None:
        """Prefill up to ``prefill_chunk_tokens`` this step, most urgent first (all of it
        when no row decodes: there is nothing to stall); sequences whose context is all in
        emit their first token and join the decoding rows. A prefill more urgent than
        every decoding row is not chunked: the rows it would stall rank below it (as for
        preemption), and a decode step between its chunks would delay its first token."""
        budget = self.options.prefill_chunk_tokens if self.batch.rows else 0
        least = max((rank(s) for s in self._running_rows()), default=None)
        spent = 0
        for p in list(self.prefilling):
            whole = not budget or least is None or max(rank(s) for s in p.seqs) < least
            if not whole and spent >= budget:
                return
            fed, padded = p.fed, p.padded
            try:
                with tracing.prefill([s.key.request for s in p.seqs]):  # a span per chunk
                    tokens = self.batch.advance(p, 0 if whole else budget - spent)
            except Exception as exc:  # narrowed down to the newcomer that raised
                self.prefilling.remove(p)
                self._bisect(p.seqs, exc, "prefill")
                continue
            spent += p.padded - padded
            self.count(runs=1, tokens=p.fed - fed, padded=p.padded - padded)
            if tokens is not None:
                self.prefilling.remove(p)
                self._joined(p, tokens)

    def _joined(self, p: Prefill, tokens: list[Any]) -> None:
        self._advance(p.seqs, tokens, joined=False)
        self._flush_streams()  # the first tokens go out before the cache is copied
        self._cut_preempted()
        try:
            self.batch.join(p, tokens)
        except Exception as exc:  # (the batch is as it was) narrowed down as a prefill is
            self._bisect([s for s in p.seqs if not s.finish_reason], exc, "join")
            return
        ended = [s for s in p.seqs if s.finish_reason]
        if ended:  # done at their first token (max_new_tokens 1, EOS, a stop string, an error)
            self.batch.drop(ended)

    def _bisect(self, seqs: list[Sequence], exc: Exception, what: str) -> None:
        """A shared call over newcomers raised: more are prefilled again in two halves,
        each from its context (what it generated is kept), so the one that raises ends up
        alone in about log2(n) calls and the others go on. One alone fails (its own error,
        retried as any), unless it ran out of memory beside other sequences: then it
        waits, leased, with fewer in flight for a while (as after a decode step's)."""
        if len(seqs) <= 1 and is_out_of_memory(exc) and (self.batch.rows or self.prefilling):
            self._back_off([], [], paused=seqs)
            return
        if len(seqs) <= 1:
            self._commit([], failed=[(s, exc) for s in seqs])
            return
        log.warning("%s of %d request(s) failed (%s: %s); trying each half apart", what,
                    len(seqs), type(exc).__name__, str(exc)[:200])
        half = len(seqs) // 2
        self._start(seqs[:half])
        self._start(seqs[half:])
        self.prefilling.sort(key=lambda p: min(rank(s) for s in p.seqs))

    def _cut_preempted(self) -> None:  # (see _preempting)
        if self._preempting:
            self.batch.drop(self._preempting)
            self._preempting = []

    def _hand_back(self) -> None:
        """At SIGTERM: requests never started go back to the queue at their rank (the
        preempted ones are finished with the rest)."""
        fresh = [s for s in self.waiting if not s.key.started]
        if fresh:
            leases = [(s.key.request.id, s.key.request.lease_token) for s in fresh]
            retrying(lambda: self.queue.release(leases))
            self.leases.drop(i for i, _ in leases)
            log.info("returned %d claimed request(s) to the queue; finishing %d started",
                     len(leases), len(self._running()) + len(self.waiting) - len(fresh))
            self.waiting = [s for s in self.waiting if s.key.started]

    # -- decoding --------------------------------------------------------------------
    def _step(self) -> None:
        self._cut_preempted()
        rows = list(self.batch.rows)
        started = time.perf_counter()
        try:
            tokens = self.batch.step()
        except Exception as exc:  # (a row's fault is its own: step() bisects) the batch's own
            # failure, out of memory in its bisection: every running sequence fails this attempt
            log.warning("decode step over %d sequences failed: %s", len(rows), exc)
            self.batch.drop(rows)
            self._commit([], failed=[(s, exc) for s in rows])
            return
        metrics.INFERENCE.observe(time.perf_counter() - started)
        metrics.BATCH_SIZE.observe(len(rows))
        self.count(runs=1, tokens=len(rows), padded=len(rows))
        if len(rows) > 1 and any(is_out_of_memory(e) for e in self.batch.errors):
            rows, tokens = self._back_off(rows, tokens)
        self._advance(rows, tokens)

    def _back_off(self, rows: list[Sequence], tokens: list[Any],
                  paused: list[Sequence] = ()) -> tuple[list[Sequence], list[Any]]:
        """Out of memory in this step (its halves got through, or a row alone did not), or
        for ``paused`` newcomers alone in a prefill or join: halve the sequences in flight
        for a while (BatchCap, WorkerOptions.oom_hold_s) and pause the least urgent rows
        past that, any row that ran out of memory alone, and ``paused``. They wait, leased,
        to be prefilled again from what they generated (a step's token of theirs was never
        emitted): nothing is lost. The rows kept and their tokens."""
        flight = len(rows) if rows else len(self._running()) + len(paused)
        self.cap.shrink(flight)
        metrics.OOM_BACKOFFS.inc()
        keep = self.cap.apply(len(rows))
        alone = {id(s) for s, t in zip(rows, tokens) if isinstance(t, Exception) and is_out_of_memory(t)}
        ranked = sorted((s for s in rows if id(s) not in alone), key=rank)
        stopped = {id(s) for s in ranked[keep:]} | alone
        dropped = [s for s in rows if id(s) in stopped]
        self.batch.drop(dropped)
        gone = dropped + list(paused)
        self.waiting = sorted(self.waiting + gone, key=rank)
        self.preempted += len(gone)
        log.warning("out of memory in a %s of %d sequences: %d paused, at most %d in flight for "
                    "%.0fs", "decode step" if rows else "prefill", flight, len(gone),
                    self.cap.apply(flight), self.cap.hold_s)
        kept = [(s, t) for s, t in zip(rows, tokens) if id(s) not in stopped]
        return [s for s, _ in kept], [t for _, t in kept]

    def _advance(self, rows: list[Sequence], tokens: list[Any], joined: bool = True) -> None:
        """Append each row's token; rows that ended, or met their own error, are committed
        and (``joined``: they are in the batch) leave it."""
        now = time.monotonic()
        ended, failed = [], []
        for s, token in zip(rows, tokens):
            if isinstance(token, Exception):
                s.finish_reason = "error"
                failed.append((s, token))
                continue
            text.append(s, token, self.runner)
            if s.finish_reason is None and s.key.deadline is not None and now >= s.key.deadline:
                s.finish_reason = "deadline"
                s.text = text.so_far(s, self.runner)
            if s.params.stream:
                self._stream(s)
            if s.finish_reason:
                ended.append(s)
        if ended or failed:
            if joined:
                self.batch.drop(ended + [s for s, _ in failed])
            self._commit(ended, failed)

    def _commit(self, ended: list[Sequence], failed: list[tuple[Sequence, Exception]] | None = None) -> None:
        super()._commit(ended, failed, in_flight=len(self.batch.rows))

    # -- between steps -----------------------------------------------------------------
    def _check_leases(self) -> None:
        """Stop sequences whose lease is gone: cancelled (their stream ends here), or taken
        over by another worker after a stall (that worker's run restarts the stream)."""
        lost = self.lookout.lost(self._running() + self.waiting)
        if not lost:
            return
        gone = [s for s, _ in lost]
        self.batch.drop(gone)
        for p in list(self.prefilling):
            self.batch.shrink(p, gone)
            if not p.seqs:
                self.prefilling.remove(p)
        self.waiting = [s for s in self.waiting if s not in gone]
        self.leases.drop(s.key.request.id for s in gone)
        tracing.released([s.key.request for s in gone], "cancelled, or taken over after a stall")
        for s, owner in lost:
            s.finish_reason = "cancelled"
            if owner is None:  # cancelled: the result gets the text so far
                self._attach(s)
                if s.params.stream:
                    self._stream(s)
                    self.streams.end(s.key.request.id, "cancelled")
        log.info("stopped %d sequence(s) whose request was cancelled or taken over", len(lost))



def _entry(s: Sequence) -> scheduler.Entry:
    return scheduler.Entry(s, rank(s), s.reserved)
