"""The worker's OpenTelemetry hooks (batchery/tracing.py owns the setup and the trace
context a request carries): per attempt a process span in the caller's trace, with queue
wait, batch hold, tokenize, model or fallback run, prefill and decode, and commit; per
model run a batch span linked to each request; events for expiry, retries, dead letters
and leases the reaper took back. No-ops, importing nothing of OpenTelemetry, unless a
tracer provider is set.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from batchery.batching.calls import Failed
from batchery.tracing import SYSTEM, get_tracer, mark_error, parent_context, trace

if trace is not None:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, SpanKind

STALE_NS = 3600 * 10**9   # a span left open this long (its request never came back) is ended
SWEEP_NS = 60 * 10**9     # ... looked for this often
_local = threading.local()  # per claiming thread: when its claims began to be held back


@dataclass
class _Open:
    """A claimed request's process span, until its attempt is committed here."""

    span: Any
    lease_token: str    # the lease of this attempt
    queue: str
    enqueued_ns: int    # enqueue time on this worker's clock
    claimed_ns: int
    fallback: bool = False       # its batch failed: its next run is a fallback run
    stepped_ns: int = 0          # the end of its latest step (tokenize, prefill)
    first_token_ns: int = 0      # generation: when its first token was out

    def child(self, name: str, start: int, end: int | None = None, **kwargs: Any) -> Any:
        span = get_tracer().start_span(name, context=trace.set_span_in_context(self.span),
                                    start_time=start, **kwargs)
        if end is not None:
            span.end(end)
        return span


_open: dict[str, _Open] = {}
_swept = [0]


def claimed(queue: str, worker: str, reply: Any) -> None:
    """After each claim call: open the process span of each claimed request, with its
    queue wait and batch hold (from the times in the claim's reply)."""
    tracer = get_tracer()
    if tracer is None:
        return
    if not (reply.batch or reply.expired):
        held = reply.wait_ms > 0  # the head is held back for the batch to fill
        _local.held_ms = (getattr(_local, "held_ms", 0) or reply.now_ms) if held else 0
        return
    held_ms, _local.held_ms = getattr(_local, "held_ms", 0), 0
    now = time.time_ns()
    offset = now - reply.now_ms * 1_000_000  # Redis clock -> this worker's clock
    for r in [*reply.expired, *reply.batch]:
        enqueued = r.enqueued_ms * 1_000_000 + offset
        parent = parent_context(r.trace)
        if parent is False:
            continue
        first = r.attempt == 1
        span = tracer.start_span(
            f"process {queue}", context=parent or Context(),
            kind=SpanKind.CONSUMER, start_time=enqueued if first else now,
            attributes={"messaging.system": SYSTEM, "messaging.operation.type": "process",
                        "messaging.destination.name": queue, "messaging.message.id": r.id,
                        "batchery.attempt": r.attempt, "batchery.priority": r.priority,
                        "batchery.tokens": r.tokens, "batchery.worker": worker,
                        "batchery.queued_ms": reply.now_ms - r.enqueued_ms})
        if not span.is_recording():
            continue
        entry = _Open(span, r.lease_token, queue, enqueued, now)
        if first:
            wait = entry.child("queue wait", enqueued, attributes={
                "batchery.priority": r.priority, "batchery.class_delay_ms": r.rank - r.enqueued_ms})
            if held_ms:
                start = max(enqueued, held_ms * 1_000_000 + offset)
                get_tracer().start_span("batch hold", context=trace.set_span_in_context(wait),
                                     start_time=start).end(now)
            wait.end(now)
        stale = _open.pop(r.id, None)
        if stale is not None:
            _close(stale, now, "released", "claimed again")
        _open[r.id] = entry
    if now - _swept[0] > SWEEP_NS:
        _sweep(now)


def _close(entry: _Open, now: int, event: str, reason: str) -> None:
    entry.span.add_event(event, {"batchery.reason": reason}, timestamp=now)
    entry.span.end(now)


def _sweep(now: int) -> None:
    """End spans whose request never came back to this worker (a lease lost to a stall)."""
    _swept[0] = now
    for request_id, entry in list(_open.items()):
        if now - entry.claimed_ns > STALE_NS:
            _open.pop(request_id, None)
            _close(entry, now, "abandoned", "no result from this worker within an hour")


def released(requests: Sequence[Any], reason: str) -> None:
    """Claimed requests handed back to the queue unrun."""
    if not _open:
        return
    now = time.time_ns()
    for r in requests:
        entry = _open.pop(r.id, None)
        if entry is not None:
            _close(entry, now, "released", reason)


def reaped(queue: Any, requeued: Sequence[str], dead: Sequence[str]) -> None:
    """Leases the reaper took back (their worker died or hung): a ``reap`` span in each
    traced request's trace, with the event of what became of it."""
    tracer = get_tracer()
    if tracer is None or not (requeued or dead):
        return
    ids = [*requeued, *dead]
    now = time.time_ns()
    for request_id, traceparent in zip(ids, queue.traces(ids)):
        parent = parent_context(traceparent)
        if not parent:  # untraced, or its producer did not sample it
            continue
        last = request_id in dead
        span = tracer.start_span(f"reap {queue.name}", context=parent, start_time=now,
                                 attributes={"messaging.system": SYSTEM,
                                             "messaging.message.id": request_id})
        reason = "its worker died or hung: the lease expired"
        span.add_event("dead-lettered" if last else "requeued", {"batchery.reason": reason},
                       timestamp=now)
        if last:
            mark_error(span, reason)
        span.end(now)


def _traced(requests: Sequence[Any]) -> list[tuple[Any, _Open]]:
    found = [(r, _open.get(r.id)) for r in requests] if _open else []
    return [(r, e) for r, e in found if e is not None and e.lease_token == r.lease_token]


@contextlib.contextmanager
def _step(name: str, requests: Sequence[Any]) -> Iterator[list[_Open]]:
    """Around one step of a batch: a span ``name`` in each traced request's trace; the
    step's end is each one's ``stepped_ns``."""
    traced = [entry for _, entry in _traced(requests)]
    start, failed = time.time_ns(), ""
    try:
        yield traced
    except BaseException as exc:
        failed = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        end = time.time_ns()
        for entry in traced:
            span = entry.child(name, start, attributes={"batchery.batch_size": len(requests)})
            if failed:
                mark_error(span, failed)
            span.end(end)
            entry.stepped_ns = end


def tokenize(requests: Sequence[Any]) -> Any:
    """Around tokenizing a batch."""
    return _step("tokenize", requests)


@contextlib.contextmanager
def prefill(requests: Sequence[Any]) -> Iterator[None]:
    """Around a generation prefill: it yields each request's first token."""
    with _step("prefill", requests) as traced:
        yield
    for entry in traced:
        entry.first_token_ns = entry.stepped_ns
        entry.span.set_attribute("batchery.time_to_first_token_ms",
                                 round((entry.stepped_ns - entry.enqueued_ns) / 1e6, 3))


@contextlib.contextmanager
def model_run(requests: Sequence[Any], prepared: Any, runner: Any) -> Iterator[None]:
    """Around one model run: the batch's span (its own trace, linked to each request) and
    a model run (or fallback run) span in each traced request's trace, linked to it."""
    traced = _traced(requests)
    if not traced:
        yield
        return
    start = time.time_ns()
    size = len(requests)
    batch = get_tracer().start_span(
        f"batch {traced[0][1].queue}", context=Context(), start_time=start,
        links=[Link(e.span.get_span_context(), {"messaging.message.id": r.id}) for r, e in traced],
        attributes={"batchery.batch_size": size, "batchery.tokens": sum(prepared.lengths),
                    "batchery.padded_tokens": prepared.padded,
                    "batchery.padding_efficiency": round(prepared.efficiency, 4),
                    "batchery.device": str(getattr(runner, "device", "") or "")})
    runs = [entry.child("fallback run" if entry.fallback else "model run", start,
                        links=[Link(batch.get_span_context())],
                        attributes={"batchery.attempt": r.attempt, "batchery.batch_size": size})
            for r, entry in traced]
    try:
        yield
    except BaseException as exc:
        for span in (batch, *runs):
            span.record_exception(exc)
            mark_error(span, f"{type(exc).__name__}: {exc}")
        for _, entry in traced:
            entry.fallback = entry.fallback or size > 1
        raise
    finally:
        end = time.time_ns()
        for span in (batch, *runs):
            span.end(end)


def clock() -> int:
    """Now, for :func:`committed`'s ``began``."""
    return time.time_ns()


def committed(began: int, ended: int, final: Sequence[Any], committed: Sequence[bool],
              failed: Sequence[Any], verdicts: Sequence[Failed]) -> None:
    """After one commit (its Lua calls from ``began`` to ``ended``; 0: now): a commit span
    per traced request, the events of what became of it, and the end of its process
    span. ``final``/``committed``: outcomes stored as
    results and whether this worker still held them; ``failed``/``verdicts``: outcomes to
    retry and what fail.lua did with each."""
    if not _open:
        return
    now = ended or time.time_ns()
    began = began or now
    stored = [(o, None if ok else Failed.LEASE_LOST) for o, ok in zip(final, committed)]
    for outcome, verdict in [*stored, *zip(failed, verdicts)]:
        entry = _open.get(outcome.request.id)
        if entry is None or entry.lease_token != outcome.request.lease_token:
            continue
        del _open[outcome.request.id]
        _finish(entry, outcome, verdict, began, now)


def _finish(entry: _Open, outcome: Any, verdict: Failed | None, began: int, now: int) -> None:
    """``verdict``: None where the outcome was stored as the request's result."""
    span, error = entry.span, outcome.error
    output = outcome.output if isinstance(outcome.output, dict) else {}
    if entry.first_token_ns:  # generation: the decode, after its first token
        entry.child("decode", entry.first_token_ns, began)
    if "finish_reason" in output:
        span.set_attribute("batchery.tokens_generated", output.get("tokens") or 0)
        span.set_attribute("batchery.finish_reason", str(output["finish_reason"]))
    entry.child("commit", began, now, attributes={"batchery.reply_pushed": bool(outcome.request.client)})
    reason = f"{error.get('type')}: {error.get('message')}" if error else ""
    if outcome.batch_size:
        span.set_attribute("batchery.batch_size", outcome.batch_size)
    if outcome.expired:
        span.add_event("expired", {"batchery.reason": reason}, timestamp=now)
    if verdict is Failed.LEASE_LOST:
        span.add_event("discarded", {"batchery.reason": "this worker no longer held the lease "
                                     "(cancelled, or taken over after a stall)"}, timestamp=now)
    elif verdict is Failed.RETRIED:
        span.add_event("retry scheduled", {"batchery.reason": reason,
                                           "batchery.attempt": outcome.request.attempt}, timestamp=now)
    elif verdict is Failed.DEAD:
        span.add_event("dead-lettered", {"batchery.reason": reason,
                                         "batchery.attempt": outcome.request.attempt}, timestamp=now)
    if error:
        mark_error(span, reason)
    span.set_attribute("batchery.status", ("dead" if verdict is Failed.DEAD else
                                           "retry" if verdict is Failed.RETRIED else
                                           "expired" if outcome.expired else
                                           "error" if error else "ok"))
    span.end(now)
