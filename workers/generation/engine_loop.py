"""The generate worker's model thread over an external engine (``--engine vllm``).

The queue side is the decode loop's: claims into the room the budget leaves (the queue's
head alone when it is more urgent than a running request), leases renewed by the
heartbeat and read by the lookout, streams, cancels, deadlines, SIGTERM's hand-back, one
commit per claim. The engine does the rest: each claimed request is added with its rank
in the queue as its priority (lower runs first; the engine's own scheduler preempts for
a more urgent one), ``step()`` advances every request it runs, and a request cancelled,
taken over or past its deadline is aborted in it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from batchery.batching.messages import Claimed
from batchery.batching.sharded import ShardedQueue
from batchery.connection import retrying
from batchery.workers import metrics, tracing
from batchery.workers.claiming import Claimer
from batchery.workers.execution import Executed, failure
from batchery.workers.generation.batch import Sequence
from batchery.workers.generation.engine import EngineRunner
from batchery.workers.generation.queue_side import QueueSide
from batchery.workers.generation.slot import Slot, rank
from batchery.workers.leases import Leases
from batchery.workers.results import ResultWriter
from batchery.workers.runners.base import InputError

log = logging.getLogger(__name__)
FINISH_REASONS = {"stop": "stop", "length": "length"}  # the engine's, as batchery reports them


class EngineLoop(QueueSide):
    def __init__(self, queue_: ShardedQueue, runner: EngineRunner, claimer: Claimer,
                 leases: Leases, writer: ResultWriter, options: Any,
                 count: Callable[..., None] = lambda **_: None) -> None:
        super().__init__(queue_, runner, claimer, leases, writer, options, count)
        self.engine = runner.engine
        self.running: dict[str, Sequence] = {}  # engine request id -> the request's sequence
        self.steps = 0
        self.preempted = 0  # the engine preempts on its own: not seen from here

    def _turns(self, stop: Any, burst: bool) -> None:
        handed_back = False
        while True:
            if stop.is_set() and not handed_back:
                self._hand_back()
                handed_back = True
            if not stop.is_set() and self._claim(burst) is None:
                return  # a burst worker with nothing left
            if not self.running:
                if stop.is_set():
                    return
                continue
            self._step()
            self._check_deadlines()
            self._check_leases()
            self._flush_streams()

    # -- claiming ----------------------------------------------------------------------
    def _claim(self, burst: bool) -> bool | None:
        """Claim into the room left, or the head alone when it is more urgent than a
        running request (the engine preempts for it); None: the burst is over."""
        held = list(self.running.values())
        slots = self.options.max_batch_size - len(held)
        tokens = self.options.max_batch_tokens - sum(s.reserved for s in held)
        head = self.lookout.head
        size: tuple[int, int] | None = None
        if slots >= 1 and tokens >= 1:
            size = slots, tokens
        elif head is not None and head < max(rank(s) for s in held):
            size = 1, 1  # a claim always takes the head, whatever its size
        return self._claim_into(size, not held, burst, self._add_all)

    def _add_all(self, claimed: list[Claimed], now_ms: int) -> None:
        for request in claimed:
            self._add(request, now_ms)

    def _add(self, request: Claimed, now_ms: int) -> None:
        """Hand the request to the engine; one it refuses fails here, alone."""
        slot = Slot.claimed(request, now_ms)
        slot.started = time.perf_counter()
        try:
            s = self.runner.sequence(slot, request.input)
            try:
                self.engine.add_request(_engine_id(request), {"prompt_token_ids": s.prompt_ids},
                                        self.runner.engine_params(s.params), priority=rank(s))
            except ValueError as exc:  # the engine's word on this input: no retry
                raise InputError(str(exc)) from exc
        except Exception as exc:  # InputError: no retry; anything else: retried as any
            self.writer.submit(Executed(now_ms, [failure(request, exc)]))
            return
        self.running[_engine_id(request)] = s
        if s.params.stream:
            self.streams.start(request.id, request.attempt)

    def _hand_back(self) -> None:
        """At SIGTERM: requests with no token yet go back to the queue at their rank; the
        others finish."""
        fresh = {rid: s for rid, s in self.running.items() if not s.generated}
        if not fresh:
            return
        self.engine.abort_request(list(fresh))
        leases = [(s.key.request.id, s.key.request.lease_token) for s in fresh.values()]
        retrying(lambda: self.queue.release(leases))
        self.leases.drop(i for i, _ in leases)
        for rid in fresh:
            del self.running[rid]
        log.info("returned %d claimed request(s) to the queue; finishing %d started",
                 len(leases), len(self.running))

    # -- the engine's step ---------------------------------------------------------------
    def _step(self) -> None:
        started = time.perf_counter()
        try:
            results = self.engine.step()
        except Exception as exc:  # the engine's own failure: every request fails this attempt
            log.warning("engine step over %d requests failed: %s", len(self.running), exc)
            failed = list(self.running.values())
            self._abort(list(self.running))
            self._commit([], [(s, exc) for s in failed])
            return
        self.steps += 1
        metrics.INFERENCE.observe(time.perf_counter() - started)
        metrics.BATCH_SIZE.observe(len(self.running))
        ended, new_tokens = [], 0
        for result in results:
            s = self.running.get(result.request_id)
            if s is None:  # aborted since
                continue
            new_tokens += self._update(s, result.outputs[0])
            if result.finished:
                reason = result.outputs[0].finish_reason
                s.finish_reason = FINISH_REASONS.get(reason, reason or "stop")
                del self.running[result.request_id]
                ended.append(s)
            if s.params.stream:
                self._stream(s)
        self.count(runs=1, tokens=new_tokens, padded=new_tokens)
        if ended:
            self._commit(ended)

    def _update(self, s: Sequence, out: Any) -> int:
        """Take the engine's cumulative text and tokens; the tokens it added."""
        added = len(out.token_ids) - len(s.generated)
        s.generated, s.text = list(out.token_ids), out.text
        if s.params.logprobs is not None and out.logprobs:
            s.logprobs = [_logprobs(token, ranked, s.params.logprobs)
                          for token, ranked in zip(s.generated, out.logprobs)]
        return max(0, added)

    def _commit(self, ended: list[Sequence], failed: list[tuple[Sequence, Exception]] | None = None) -> None:
        super()._commit(ended, failed, in_flight=len(self.running))

    # -- between steps -----------------------------------------------------------------
    def _check_deadlines(self) -> None:
        now = time.monotonic()
        late = {rid: s for rid, s in self.running.items()
                if s.key.deadline is not None and now >= s.key.deadline}
        if late:
            self._abort(list(late))
            for s in late.values():
                s.finish_reason = "deadline"
                if s.params.stream:
                    self._stream(s)
            self._commit(list(late.values()))

    def _check_leases(self) -> None:
        """Abort requests whose lease is gone: cancelled (their stream ends here), or
        taken over by another worker after a stall."""
        lost = self.lookout.lost(list(self.running.values()))
        if not lost:
            return
        gone = [s for s, _ in lost]
        self._abort([_engine_id(s.key.request) for s in gone])
        self.leases.drop(s.key.request.id for s in gone)
        tracing.released([s.key.request for s in gone], "cancelled, or taken over after a stall")
        for s, owner in lost:
            s.finish_reason = "cancelled"
            if owner is None:  # cancelled: the result gets the text so far
                self._attach(s)
                if s.params.stream:
                    self._stream(s)
                    self.streams.end(s.key.request.id, "cancelled")
        log.info("stopped %d request(s) cancelled or taken over", len(lost))

    def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            self.running.pop(rid, None)
        try:
            self.engine.abort_request(ids)
        except Exception as exc:  # already finished in the engine: nothing to free
            log.debug("aborting %d request(s) in the engine: %s", len(ids), exc)



def _engine_id(request: Claimed) -> str:
    """The request's id in the engine: this claim of it (a rerun is another request)."""
    return f"{request.id}@{request.lease_token}"


def _logprobs(token: int, ranked: dict[int, Any], top: int) -> tuple[int, float, list[tuple[int, float]]]:
    """vLLM's ``{token_id: Logprob}`` of one position as batchery's (token, its
    log-probability, the likeliest ``top`` alternatives)."""
    values = {t: float(getattr(lp, "logprob", lp)) for t, lp in ranked.items()}
    best = sorted(values.items(), key=lambda kv: -kv[1])[:top]
    return token, values.get(token, float("nan")), best
