"""The generate worker's model thread: one decode step at a time, claiming from Redis
into the room freed between steps (see workers/generating.py for the whole design)."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from batchery.batching.messages import Claimed
from batchery.batching.sharded import ShardedQueue
from batchery.batching.streams import StreamWriter
from batchery.workers import metrics, tracing
from batchery.workers.claiming import Claimer
from batchery.workers.execution import Executed, Outcome, failure
from batchery.workers.leases import Leases, report_redis_error
from batchery.workers.loop import _retrying
from batchery.workers.results import ResultWriter
from batchery.workers.runners.decoding import Prefill, Sequence

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
    def __init__(self, queue_: ShardedQueue, runner: Any, claimer: Claimer, leases: Leases,
                 writer: ResultWriter, options: Any,
                 count: Callable[..., None] = lambda **_: None) -> None:
        self.queue, self.runner, self.claimer = queue_, runner, claimer
        self.leases, self.writer, self.options, self.count = leases, writer, options, count
        self.batch = runner.new_batch()
        self.prefilling: list[Prefill] = []  # admitted, context being prefilled; most urgent first
        self.waiting: list[Sequence] = []    # claimed or preempted, no room yet; most urgent first
        self.preempted = 0                   # sequences paused to make room for a more urgent one
        # preempted rows still in the batch's cache: cutting it copies the whole cache (tens
        # of ms), so it waits until the newcomer's first token is out (_cut_preempted)
        self._preempting: list[Sequence] = []
        self.streams = StreamWriter(queue_.client, queue_.keys_for)
        self._checked = time.monotonic()
        self._claim_backoff, self._claim_after = 0.1, 0.0

    def run(self, stop: Any, burst: bool) -> None:
        handed_back = False
        while True:
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

    # -- admission -------------------------------------------------------------------
    def _running(self) -> list[Sequence]:
        """Sequences holding room: decoding, or being prefilled."""
        return self._running_rows() + [s for p in self.prefilling for s in p.seqs]

    def _running_rows(self) -> list[Sequence]:
        """Decoding rows, less those preempted this step (still in the cache until cut)."""
        return [s for s in self.batch.rows if s not in self._preempting]

    def _room(self, held: list[Sequence]) -> tuple[int, int]:
        """Sequences and cache tokens still free beside ``held``."""
        return (self.options.max_batch_size - len(held),
                self.options.max_batch_tokens - sum(s.reserved for s in held))

    def _claim(self, burst: bool) -> bool | None:
        """Claim into the room left, or the queue's head alone when it is more urgent than
        a running sequence (room is made for it in ``_admit``); None: burst over."""
        if time.monotonic() < self._claim_after:
            return True
        running = self._running()
        slots, tokens = self._room(running + self.waiting)
        if slots >= 1 and tokens >= 1 and not self.waiting:
            size = slots, tokens
        elif self._overtaken():
            size = 1, 1  # a claim always takes the head, whatever its size
        else:
            return True
        idle = not running and not self.waiting
        held_before = len(self.leases)
        try:
            claimed, reply = self.claimer.claim_requests(
                *size, self.options.max_wait_ms if idle else 0)
            self._claim_backoff = 0.1
        except Exception as exc:  # Redis away: keep decoding, claim again later
            report_redis_error("claim", exc, self._claim_backoff)
            self._claim_after = time.monotonic() + self._claim_backoff
            self._claim_backoff = min(2 * self._claim_backoff, RETRY_CAP_S)
            if idle:
                time.sleep(self._claim_backoff)
            return True
        if claimed:
            self.count(claimed_ms=reply.now_ms)
            self.waiting += [s for s in (self._sequence(r, reply.now_ms) for r in claimed) if s]
            self._flush_streams()  # readers see the run start at its claim
        elif idle:
            if reply.wait_ms == -1 and burst and not held_before:
                return None
            self.claimer.idle(reply)
        return True

    def _overtaken(self) -> bool:
        """The worker is full: is the queue's head more urgent than a running sequence
        (and than what already waits for room)?"""
        if not self.batch.rows:
            return False
        try:
            head = self.queue.head_rank()
        except Exception as exc:  # cannot tell now: the next step will
            log.debug("reading the queue's head failed: %s", exc)
            return False
        least = max(_rank(s) for s in self.batch.rows)
        return head is not None and head < least and (not self.waiting or head < _rank(self.waiting[0]))

    def _sequence(self, request: Claimed, now_ms: int) -> Sequence | None:
        """The request as a sequence; a request that cannot run fails here, alone."""
        deadline = (time.monotonic() + (request.expire_ms - now_ms) / 1000
                    if request.expire_ms else None)
        slot = Slot(request, now_ms, deadline)
        try:
            seq: Sequence = self.runner.sequence(slot, request.input)
        except Exception as exc:  # InputError: no retry; anything else: the runner's bug
            self.writer.submit(Executed(now_ms, [failure(request, exc)]))
            return None
        if seq.params.stream:
            self.streams.start(request.id, request.attempt)
        return seq

    def _admit(self) -> None:
        """Start prefilling what waits, most urgent first, while it fits (preempting less
        urgent running sequences for it); the rest waits for room."""
        self.waiting.sort(key=_rank)
        slots, tokens = self._room(self._running())
        joining: list[Sequence] = []
        while self.waiting:
            s = self.waiting[0]
            busy = bool(self.batch.rows or self.prefilling or joining)  # an empty batch takes anything
            if busy and (slots < 1 or s.reserved > tokens):
                freed = self._preempt(s, 1 - slots, s.reserved - tokens)
                if freed is None:
                    break
                slots, tokens = slots + freed[0], tokens + freed[1]
            joining.append(self.waiting.pop(0))
            slots, tokens = slots - 1, tokens - s.reserved
        # each priority class in its own prefill, most urgent first: a realtime newcomer's
        # first token does not wait for a long batch-class prompt claimed with it
        for _, group in itertools.groupby(joining, key=lambda s: s.key.request.priority):
            seqs = list(group)
            for s in seqs:
                s.key.started = s.key.started or time.perf_counter()
            self.prefilling.append(self.batch.start(seqs))
        self.prefilling.sort(key=lambda p: min(_rank(s) for s in p.seqs))

    def _preempt(self, s: Sequence, slots: int, tokens: int) -> tuple[int, int] | None:
        """Free ``slots`` sequences and ``tokens`` of cache for ``s`` from decoding rows
        less urgent than it, least urgent first: (slots, tokens) freed, or None (and
        nothing preempted) if they cannot make room. The preempted wait, leased, to be
        prefilled again from their prompt and what they generated."""
        chosen, got_slots, got_tokens = [], 0, 0
        for victim in sorted(self._running_rows(), key=_rank, reverse=True):
            if got_slots >= slots and got_tokens >= tokens or _rank(victim) <= _rank(s):
                break
            chosen.append(victim)
            got_slots, got_tokens = got_slots + 1, got_tokens + victim.reserved
        if got_slots < slots or got_tokens < tokens:
            return None
        self._preempting += chosen  # their cache is cut after the newcomer's first token
        self.waiting += chosen
        self.waiting.sort(key=_rank)
        self.preempted += len(chosen)
        log.info("preempted %d sequence(s) for %s request %s", len(chosen),
                 s.key.request.priority, s.key.request.id)
        return got_slots, got_tokens

    def _prefill(self) -> None:
        """Prefill up to ``prefill_chunk_tokens`` this step, most urgent first (all of it
        when no row decodes: there is nothing to stall); sequences whose context is all in
        emit their first token and join the decoding rows. A prefill more urgent than
        every decoding row is not chunked: the rows it would stall rank below it (as for
        preemption), and a decode step between its chunks would delay its first token."""
        budget = self.options.prefill_chunk_tokens if self.batch.rows else 0
        least = max((_rank(s) for s in self._running_rows()), default=None)
        spent = 0
        for p in list(self.prefilling):
            whole = not budget or least is None or max(_rank(s) for s in p.seqs) < least
            if not whole and spent >= budget:
                return
            before = p.done
            try:
                with tracing.prefill([s.key.request for s in p.seqs]):  # a span per chunk
                    tokens = self.batch.advance(p, 0 if whole else budget - spent)
            except Exception as exc:  # a prefill that fails fails its newcomers (retried)
                log.warning("prefill of %d request(s) failed: %s", len(p.seqs), exc)
                self.prefilling.remove(p)
                self._commit([], failed=[(s, exc) for s in p.seqs])
                continue
            chunk = p.mask[:, before:p.done]
            spent += chunk.numel()
            self.count(runs=1, tokens=int(chunk.sum()), padded=chunk.numel())
            if tokens is not None:
                self.prefilling.remove(p)
                self._joined(p, tokens)

    def _joined(self, p: Prefill, tokens: list[int]) -> None:
        self._advance(p.seqs, tokens, joined=False)
        self._flush_streams()  # the first tokens go out before the cache is copied
        self._cut_preempted()
        self.batch.join(p, tokens)
        ended = [s for s in p.seqs if s.finish_reason]
        if ended:  # done at their first token (max_new_tokens 1, EOS, a stop string)
            self.batch.drop(ended)

    def _cut_preempted(self) -> None:
        if self._preempting:
            self.batch.drop(self._preempting)
            self._preempting = []

    def _hand_back(self) -> None:
        """At SIGTERM: requests never started go back to the queue at their rank (the
        preempted ones are finished with the rest)."""
        fresh = [s for s in self.waiting if not s.key.started]
        if fresh:
            leases = [(s.key.request.id, s.key.request.lease_token) for s in fresh]
            _retrying(lambda: self.queue.release(leases))
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
        except Exception as exc:  # every running sequence fails this attempt (retried)
            log.warning("decode step over %d sequences failed: %s", len(rows), exc)
            self.batch.drop(rows)
            self._commit([], failed=[(s, exc) for s in rows])
            return
        metrics.INFERENCE.observe(time.perf_counter() - started)
        metrics.BATCH_SIZE.observe(len(rows))
        self.count(runs=1, tokens=len(rows), padded=len(rows))
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
        # the first token always gets an entry, its text possibly empty (a special token):
        # the reader learns that generation started
        if shown > len(s.sent) or len(s.generated) == 1 and not s.sent:
            self.streams.text(s.key.request.id, s.text[len(s.sent):shown], len(s.generated))
            s.sent = s.text[:shown]

    def _commit(self, ended: list[Sequence], failed: list[tuple[Sequence, Exception]] | None = None) -> None:
        self._flush_streams()  # a stream's text goes before its end, which follows the commit
        size = len(self.batch.rows) + len(ended)
        outcomes = []
        for s in ended:
            output = {"text": s.text, "tokens": len(s.generated),
                      "prompt_tokens": len(s.prompt_ids), "finish_reason": s.finish_reason}
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
        self.count(requests=len(ended))

    # -- between steps -----------------------------------------------------------------
    def _check_leases(self) -> None:
        """Stop sequences whose lease is gone: cancelled (their stream ends here), or taken
        over by another worker after a stall (that worker's run restarts the stream)."""
        if time.monotonic() - self._checked < LEASE_CHECK_S:
            return
        self._checked = time.monotonic()
        held = self._running() + self.waiting
        try:
            owners = self.queue.holders([s.key.request.id for s in held])
        except Exception as exc:  # cannot tell now: the next check will
            log.debug("lease check failed: %s", exc)
            return
        lost = [(s, owner) for s, owner in zip(held, owners) if owner != s.key.request.lease_token]
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
            if owner is None:  # cancelled (or dead-lettered: then attach finds no cancel)
                self._attach(s)
                if s.params.stream:
                    self._stream(s)
                    self.streams.end(s.key.request.id, "cancelled")
        log.info("stopped %d sequence(s) whose request was cancelled or taken over", len(lost))

    def _attach(self, s: Sequence) -> None:
        """Give a cancelled sequence's result the text generated so far, before its stream
        ends (the reader reads the result at the end)."""
        s.text = s.text if s.params.stop or s.params.stream else self.runner.text(s.generated)
        output = {"text": s.text, "tokens": len(s.generated),
                      "prompt_tokens": len(s.prompt_ids), "finish_reason": "cancelled"}
        try:
            self.queue.attach_output(s.key.request.id, s.key.request.lease_token, output)
        except Exception as exc:  # the result stays the cancel's, without output
            log.warning("attaching the text of cancelled request %s failed: %s", s.key.request.id, exc)

    def _flush_streams(self) -> None:
        try:
            self.streams.flush()
        except Exception as exc:  # streams are best effort; results are not
            log.warning("writing token streams failed: %s", exc)


def _rank(s: Sequence) -> int:
    """The request's rank in the queue (enqueue ms + class delay ms): lower is more urgent."""
    return int(s.key.request.rank)
