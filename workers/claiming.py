"""Claiming: the next batch is claimed and tokenized while the current one runs."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

import redis

from batchery.batching.claim_call import ClaimReply, by_lease
from batchery.batching.messages import Claimed
from batchery.batching.pricing import exact_counts
from batchery.batching.sharded import ShardedQueue
from batchery.workers import metrics, tracing
from batchery.connection import Backoff
from batchery.workers.execution import Batch, BatchCap, Executed, Outcome
from batchery.workers.leases import Leases, report_redis_error
from batchery.workers.options import WorkerOptions
from batchery.workers.runners import Runner

log = logging.getLogger(__name__)
DRAINED = None  # put on the batch queue when a burst worker has drained its queue
# Claims that count estimated candidates before one may lease on estimates: new estimated
# requests can enter the lookahead between two calls; a busy producer cannot stall a claim.
PRICING_ROUNDS = 3
# Batches one claim may lease: with a deep queue, the next batch comes with this one's,
# under a lease of its own, and runs after it (given back if overtaken, as any batch
# claimed ahead): a claim's fixed cost to Redis is paid once for two (lua/claim.lua).
CLAIM_BATCHES = 2


class Claimer(threading.Thread):
    """Fills ``batches`` with prepared batches, ``options.prefetch`` ahead of the model."""

    def __init__(self, queue_: ShardedQueue, runner: Runner, options: WorkerOptions,
                 leases: Leases, cap: BatchCap, on_final: Callable[[Executed], None],
                 stop: threading.Event, burst: bool = False) -> None:
        super().__init__(name="batchery-claimer", daemon=True)
        self.queue, self.runner, self.options = queue_, runner, options
        self.leases, self.cap, self.on_final = leases, cap, on_final
        self.stop, self.burst = stop, burst
        # (batch, frees_slot): a claim split into several batches frees its slot once
        self.batches: queue.Queue[tuple[Batch | None, bool]] = queue.Queue()
        self.slots = threading.Semaphore(options.prefetch)  # one per claim not yet running
        self._claims = 0
        self._ahead: list[tuple[str, Any]] = []  # (id, input) the last claim priced ahead
        # the token of a claim whose reply never came back (its call failed): the next
        # claim goes out under it again, so the script hands back the batch the lost reply
        # held (lua/claim.lua remembers a token's batch) instead of it waiting out a lease
        self._unanswered: str | None = None
        # a runner that counts tokens exactly prices what producers could only estimate
        self.counts = getattr(runner, "count_tokens", lambda _: None)(["a"]) is not None

    def take(self, timeout: float) -> Batch | None:
        """The next batch for the model; raises queue.Empty after ``timeout``.

        A batch claimed ahead goes back to the queue if something more urgent arrived
        while it waited (a realtime request during a flood): the next claim starts with
        that request instead of making it wait for one more batch. A batch the model
        waited for did not wait: its claim's own read of the queue's heads stands, none is
        read again (on N shards, N reads a batch). Once a burst is drained, every caller
        gets DRAINED.
        """
        while True:
            idle = self.batches.empty()  # the model waits: the batch it gets did not wait
            batch, frees_slot = self.batches.get(timeout=timeout)
            if batch is DRAINED:
                self.batches.put((DRAINED, False))  # every model thread that asks sees it
                return DRAINED
            given_back = not idle and self._give_back_if_overtaken(batch)
            if frees_slot:
                self.slots.release()
            if not given_back:
                return batch

    def _give_back_if_overtaken(self, batch: Batch) -> bool:
        """Release ``batch`` to the queue if a more urgent request is pending; False: run it."""
        try:
            head = self.queue.head_rank()
            # the rank it was chosen against: its own head's, or under fair share the
            # class's oldest, which it passed over on purpose
            against = min(r.chosen_against or r.rank for r in batch.requests)
            if head is None or head >= against:
                return False
            self.queue.release([(r.id, r.lease_token) for r in batch.requests])
        except redis.RedisError:
            return False  # cannot tell, or cannot give it back: run it
        self.leases.drop(r.id for r in batch.requests)
        tracing.released(batch.requests, "given back: a more urgent request arrived")
        return True

    def leftovers(self) -> list[Batch]:
        """Batches claimed but not taken (at shutdown)."""
        left: list[Batch] = []
        while True:
            try:
                batch, _ = self.batches.get_nowait()
            except queue.Empty:
                return left
            if batch is not DRAINED:
                left.append(batch)

    def run(self) -> None:
        backoff = Backoff()
        while not self.stop.is_set():
            if not self.slots.acquire(timeout=0.2):
                continue
            try:
                claimed = self.claim_once()
                backoff.reset()
            except Exception as exc:  # Redis away, or a bug: keep serving, leases cover it
                self.slots.release()
                wait_s = backoff.next()
                report_redis_error("claim", exc, wait_s)
                self.stop.wait(wait_s)
                continue
            if claimed is None:
                self.batches.put((DRAINED, False))
                return
            now_ms, leases = claimed
            if not leases:
                self.slots.release()
            for n, requests in enumerate(leases):  # each handed over once prepared: the
                batches = self.prepare(requests, now_ms)  # first runs while the next is
                for i, batch in enumerate(batches):  # tokenized; the last frees the slot
                    self.batches.put((batch, n == len(leases) - 1 and i == len(batches) - 1))

    def claim_once(self) -> tuple[int, list[list[Claimed]]] | None:
        """Claim: the claim's Redis time and the runnable requests it leased, a list per
        lease (its own batch, then a deep queue's next one), each committed whole; no list
        when nothing is ready yet, None when a burst is over."""
        o = self.options
        # read before the claim: the writer drops a lease only after its retry is scheduled,
        # so none held then and nothing pending nor delayed now means the burst is over
        held_before = len(self.leases)
        batch, reply = self.claim_requests(self.cap.apply(o.max_batch_size), o.max_batch_tokens,
                                           o.max_wait_ms, CLAIM_BATCHES)
        if batch:
            return reply.now_ms, by_lease(batch)
        if reply.nothing_pending and self.burst and not held_before:
            return None
        self.idle(reply)
        return reply.now_ms, []

    def claim_requests(self, max_size: int, max_tokens: int, max_wait_ms: int,
                       batches: int = 1) -> tuple[list[Claimed], ClaimReply]:
        """Lease the next requests that fit (``batches`` 2: a deep queue's next batch may
        come too, its requests under a lease of their own); those past their deadline or
        unreadable are finished at once (``on_final``). The runnable ones, and the claim's
        reply."""
        token = self._unanswered
        if token is None:
            self._claims += 1
            token = f"{self.options.worker_id}#{self._claims}"
        self._unanswered = token
        reply = self._claim(token, max_size, max_tokens, max_wait_ms, batches)
        self._unanswered = None
        self.leases.add(reply.expired + reply.batch)  # first: nothing after it loses a lease
        tracing.claimed(self.queue.name, self.options.worker_id, reply)
        invalid = [r for r in reply.batch if r.invalid]
        if reply.expired or invalid:
            self.on_final(Executed(reply.now_ms, [
                *(Outcome(r, expired=True, error={"type": "DeadlineExceeded", "message":
                          "the request's deadline passed before a worker could run it"})
                  for r in reply.expired),
                *(Outcome(r, error={"type": "InvalidRequest", "message": r.invalid or ""})
                  for r in invalid)]))
        batch = [r for r in reply.batch if not r.invalid]
        metrics.queue_waits(reply.now_ms, batch)
        return batch, reply

    def _claim(self, token: str, max_size: int, max_tokens: int, max_wait_ms: int,
               batches: int = 1) -> ClaimReply:
        """Claim on exact counts: candidates a producer priced by estimate are counted
        with this runner's tokenizer and sent with the next claim (a few rounds at most: new
        estimated requests can enter the lookahead between two calls). A claim that leases
        estimated requests hands over the requests next in line too (``price_ahead``):
        counted at the next claim and sent with it, they need no pricing round of their own."""
        counts: list[tuple[str, int]] = []
        ahead = self._count(self._ahead) if self._ahead and self.counts else []
        self._ahead = []
        for round_ in range(PRICING_ROUNDS + 1):
            reply = self.queue.claim(token, max_size, max_tokens, max_wait_ms,
                                     self.options.claim_lookahead,
                                     price_estimates=self.counts and round_ < PRICING_ROUNDS,
                                     counts=counts, ahead=ahead, batches=batches)
            if not reply.to_price:
                self._ahead = reply.price_ahead  # counted next time: this batch goes first
                return reply
            counts, ahead = self._count(reply.to_price), []
        return reply

    def _count(self, candidates: list[tuple[str, Any]]) -> list[tuple[str, int]]:
        """(id, exact tokens) of candidates priced by estimate, for the next claim."""
        exact = exact_counts(self.runner.count_tokens, candidates)
        metrics.REPRICED.inc(len(exact))
        return exact

    def idle(self, reply: ClaimReply) -> None:
        """Wait for the held head, a due retry, or an enqueue signal (whichever is first)."""
        o = self.options
        wait_s = reply.wait_ms / 1000 if reply.wait_ms > 0 else o.idle_poll_s
        if self.burst and reply.wait_ms == -1:
            wait_s = 0.05  # a burst worker waits only for its own batches in flight
        if reply.wait_ms > 0 and reply.wait_ms <= o.max_wait_ms:
            self.stop.wait(wait_s)  # the head is being held: claim again when it is due
        else:
            self.queue.wait_for_work(max(0.01, min(wait_s, o.idle_poll_s)))

    def prepare(self, requests: list[Claimed], claimed_ms: int) -> list[Batch]:
        """Tokenize; if the exact count busts the token budget, split by length to fit."""
        try:
            with tracing.tokenize(requests):
                prepared = self.runner.prepare([r.input for r in requests])
        except Exception as exc:  # a bad input: the executor falls back to one at a time
            return [Batch(requests, claimed_ms, error=exc)]
        if prepared.padded <= self.options.max_batch_tokens or len(requests) == 1:
            return [Batch(requests, claimed_ms, prepared)]
        by_length = sorted(zip(prepared.lengths, range(len(requests))))
        groups: list[list[Claimed]] = [[]]
        widest = 0
        for length, i in by_length:
            group = groups[-1]
            if group and max(widest, length) * (len(group) + 1) > self.options.max_batch_tokens:
                groups.append([])
                group, widest = groups[-1], 0
            group.append(requests[i])
            widest = max(widest, length)
        return [self._prepared(group, claimed_ms) for group in groups]

    def _prepared(self, requests: list[Claimed], claimed_ms: int) -> Batch:
        try:
            with tracing.tokenize(requests):
                return Batch(requests, claimed_ms, self.runner.prepare([r.input for r in requests]))
        except Exception as exc:
            return Batch(requests, claimed_ms, error=exc)
