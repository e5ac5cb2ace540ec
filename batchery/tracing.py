"""OpenTelemetry traces of requests, from enqueue to result, across processes.

The one owner of tracing: the producer, the worker and the offline jobs call the hooks
below in one line each. Without the ``otel`` extra (opentelemetry not importable) every
hook is a no-op and nothing of OpenTelemetry is imported. With it, hooks stay no-ops
until a tracer provider is set: by :func:`configure` (batchery's own commands, from the
standard ``OTEL_*`` environment), by the application (``trace.set_tracer_provider``),
or by ``opentelemetry-instrument``.

The producer's span travels as a W3C ``traceparent`` in the request's payload (the
optional ``trace`` field, batching/messages.py), so the worker's spans join the
caller's trace; its sampling decision is the request's (a worker makes no span for a
request its producer did not sample). The span tree (README, "Tracing"): per request
enqueue, await result, and per attempt process > queue wait > batch hold, tokenize,
model run | fallback run, prefill, decode, commit, with events for expiry, retries and
dead letters; per model run a batch span linked to each request; per offline job one
trace. Worker times are the worker's clock; enqueue and claim times come from Redis
(in the claim's reply: no extra round trip).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

try:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags
except ImportError:  # the otel extra is not installed: every hook below is a no-op
    trace = None  # type: ignore[assignment]

from batchery.errors import ConfigError

SYSTEM = "batchery"
STALE_NS = 3600 * 10**9   # a span left open this long (its request never came back) is ended
SWEEP_NS = 60 * 10**9     # ... looked for this often

_provider: Any = None     # set by use_tracer_provider: wins over the global provider
_tracers: dict[int, Any] = {}
# request id -> (its enqueue span's context, the span's end): its result's arrival ends an
# "await result" span in its trace (at most MAX_AWAITED: a result never read does not stay)
_awaited: dict[str, tuple[Any, int]] = {}
MAX_AWAITED = 100_000
_job: contextvars.ContextVar[Any] = contextvars.ContextVar("batchery_job_span", default=None)
_local = threading.local()  # per claiming thread: when its claims began to be held back


def use_tracer_provider(provider: Any) -> None:
    """Trace with ``provider`` instead of the global one (None: the global again); for an
    application or a test that keeps its provider to itself."""
    global _provider
    _provider = provider


def _tracer() -> Any:
    """batchery's tracer, or None when nothing would record (no SDK configured)."""
    if trace is None:
        return None
    provider = _provider or trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    tracer = _tracers.get(id(provider))
    if tracer is None:
        tracer = _tracers[id(provider)] = provider.get_tracer("batchery")
    return tracer


def configure(service: str = "batchery") -> bool:
    """Install the OpenTelemetry SDK from the OTEL_* environment (the SDK's own
    auto-configuration: exporters, sampler, resource) when it asks for traces:
    OTEL_TRACES_EXPORTER set (not ``none``) or an OTLP endpoint set. A provider set
    already (``opentelemetry-instrument``) is kept. True when traces are on."""
    env = os.environ
    exporters = env.get("OTEL_TRACES_EXPORTER", "").strip()
    endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or exporters.lower() == "none" \
            or not (exporters or endpoint):
        return False
    if trace is None:
        raise ConfigError("the environment asks for OpenTelemetry traces (OTEL_TRACES_EXPORTER or "
                          "OTEL_EXPORTER_OTLP_ENDPOINT) but OpenTelemetry is not installed: "
                          "pip install 'batchery[otel]', or unset them")
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return True
    from opentelemetry.sdk._configuration import _OTelSDKConfigurator
    named = "OTEL_SERVICE_NAME" in env or "service.name" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    try:
        _OTelSDKConfigurator().configure(trace_exporter_names=[] if exporters else ["otlp"],
                                         resource_attributes={} if named else {"service.name": service})
    except Exception as exc:  # an exporter not installed, a protocol misspelled
        raise ConfigError(f"OpenTelemetry configuration from OTEL_* is wrong: {exc}; see "
                          "https://opentelemetry.io/docs/languages/sdk-configuration/") from None
    return True


TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def _traceparent(span: Any) -> str:
    """The W3C traceparent of ``span``: batchery's own channel between its producer and
    worker, whatever propagators the application uses for its own."""
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{c.trace_flags:02x}"


def _parent(traceparent: Any) -> Any:
    """The context a traceparent names; None: no parent (absent, or not W3C); False: its
    producer did not sample it."""
    if not isinstance(traceparent, str):
        return None
    found = TRACEPARENT.fullmatch(traceparent)
    if found is None:
        return None
    flags = TraceFlags(int(found[3], 16))
    if not flags.sampled:
        return False
    return trace.set_span_in_context(NonRecordingSpan(SpanContext(
        int(found[1], 16), int(found[2], 16), is_remote=True, trace_flags=flags)))


def _error(span: Any, message: str) -> None:
    span.set_status(StatusCode.ERROR, message)


# -- producers ------------------------------------------------------------------------
@contextlib.contextmanager
def enqueue(queue: str, requests: list[Any]) -> Iterator[list[Any]]:
    """Around one enqueue call: a PRODUCER span per request (inside an offline job, each
    a new trace linked to the job's); yields the requests carrying their trace context."""
    tracer = _tracer()
    if tracer is None or not requests:
        yield requests
        return
    job = _job.get()
    parent, links = (Context(), [Link(job)]) if job is not None else (None, None)
    spans = [tracer.start_span(f"enqueue {queue}", context=parent, kind=SpanKind.PRODUCER, links=links,
                               attributes={"messaging.system": SYSTEM, "messaging.operation.type": "send",
                                           "messaging.destination.name": queue,
                                           "messaging.message.id": r.id, "batchery.priority": r.priority})
             for r in requests]
    try:
        yield [replace(r, trace=_traceparent(s)) for r, s in zip(requests, spans)]
    except BaseException as exc:
        for span in spans:
            span.record_exception(exc)
            _error(span, f"{type(exc).__name__}: {exc}")
            span.end()
        raise
    end = time.time_ns()
    for r, span in zip(requests, spans):
        span.end(end)
        if span.get_span_context().trace_flags.sampled:
            _awaited[r.id] = (span.get_span_context(), end)
    while len(_awaited) > MAX_AWAITED:
        _awaited.pop(next(iter(_awaited)), None)


def delivered(result: Any) -> None:
    """A result reached the producer that enqueued it: its wait, from enqueue to here
    (the gap after the worker's commit span is the delivery)."""
    if not _awaited:
        return
    found = _awaited.pop(result.id, None)
    tracer = _tracer()
    if found is None or tracer is None:
        return
    context, enqueued = found
    span = tracer.start_span("await result", context=trace.set_span_in_context(
        trace.NonRecordingSpan(context)), start_time=enqueued,
        attributes={"messaging.message.id": result.id, "batchery.status": result.status,
                    "batchery.attempts": result.attempts or 0})
    if result.status != "ok":
        _error(span, f"{result.status}: {(result.error or {}).get('message', '')}")
    span.end()


@contextlib.contextmanager
def job(rq_job: Any, queue: str) -> Iterator[None]:
    """Around one run of an offline job: its span, in the job's one trace (kept in the
    RQ job's meta, so a resumed run joins it)."""
    tracer = _tracer()
    if tracer is None:
        yield
        return
    parent = _parent(rq_job.meta.get("trace"))
    if parent is False:
        yield  # the job's first run was not sampled: none of its runs are
        return
    span = tracer.start_span("job run", context=parent or Context(), attributes={
        "batchery.job.id": rq_job.id, "messaging.destination.name": queue})
    if parent is None:
        rq_job.meta["trace"] = _traceparent(span)
    token = _job.set(span.get_span_context())
    try:
        with trace.use_span(span, end_on_exit=True):
            yield
    finally:
        _job.reset(token)


# -- workers --------------------------------------------------------------------------
@dataclass
class _Open:
    """A claimed request's process span, until its attempt is committed here."""

    span: Any
    token: str          # the lease token of this attempt
    queue: str
    enqueued_ns: int    # enqueue time on this worker's clock
    claimed_ns: int
    fallback: bool = False       # its batch failed: its next run is a fallback run
    stepped_ns: int = 0          # the end of its latest step (tokenize, prefill)
    first_token_ns: int = 0      # generation: when its first token was out

    def child(self, name: str, start: int, end: int | None = None, **kwargs: Any) -> Any:
        span = _tracer().start_span(name, context=trace.set_span_in_context(self.span),
                                    start_time=start, **kwargs)
        if end is not None:
            span.end(end)
        return span


_open: dict[str, _Open] = {}
_swept = [0]


def claimed(queue: str, worker: str, reply: Any) -> None:
    """After each claim call: open the process span of each claimed request, with its
    queue wait and batch hold (from the times in the claim's reply)."""
    tracer = _tracer()
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
        parent = _parent(r.trace)
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
        entry = _Open(span, r.token, queue, enqueued, now)
        if first:
            wait = entry.child("queue wait", enqueued, attributes={
                "batchery.priority": r.priority, "batchery.class_delay_ms": r.rank - r.enqueued_ms})
            if held_ms:
                start = max(enqueued, held_ms * 1_000_000 + offset)
                _tracer().start_span("batch hold", context=trace.set_span_in_context(wait),
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
    tracer = _tracer()
    if tracer is None or not (requeued or dead):
        return
    ids = [*requeued, *dead]
    now = time.time_ns()
    for request_id, traceparent in zip(ids, queue.traces(ids)):
        parent = _parent(traceparent)
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
            _error(span, reason)
        span.end(now)


def _traced(requests: Sequence[Any]) -> list[tuple[Any, _Open]]:
    found = [(r, _open.get(r.id)) for r in requests] if _open else []
    return [(r, e) for r, e in found if e is not None and e.token == r.token]


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
                _error(span, failed)
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
    batch = _tracer().start_span(
        f"batch {traced[0][1].queue}", context=Context(), start_time=start,
        links=[Link(e.span.get_span_context(), {"messaging.message.id": r.id}) for r, e in traced],
        attributes={"batchery.batch_size": size, "batchery.tokens": sum(prepared.lengths),
                    "batchery.padded_tokens": prepared.padded,
                    "batchery.padding_efficiency": round(prepared.efficiency, 4),
                    "batchery.device": str(getattr(runner, "device", "") or "")})
    runs = [entry.child("fallback run" if entry.fallback and size == 1 else "model run", start,
                        links=[Link(batch.get_span_context())],
                        attributes={"batchery.attempt": r.attempt, "batchery.batch_size": size})
            for r, entry in traced]
    try:
        yield
    except BaseException as exc:
        for span in (batch, *runs):
            span.record_exception(exc)
            _error(span, f"{type(exc).__name__}: {exc}")
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
              failed: Sequence[Any], flags: Sequence[int]) -> None:
    """After one commit (its Lua calls from ``began`` to ``ended``; 0: now): a commit span
    per traced request, the events of what became of it, and the end of its process
    span. ``final``/``committed``: outcomes stored as
    results and whether this worker still held them; ``failed``/``flags``: outcomes to
    retry and fail.lua's verdict (1 retry scheduled, 2 dead-lettered, 0 lease lost)."""
    if not _open:
        return
    now = ended or time.time_ns()
    began = began or now
    for outcome, flag in [*((o, 3 if ok else 0) for o, ok in zip(final, committed)),
                          *zip(failed, flags)]:
        entry = _open.get(outcome.request.id)
        if entry is None or entry.token != outcome.request.token:
            continue
        del _open[outcome.request.id]
        _finish(entry, outcome, flag, began, now)


def _finish(entry: _Open, outcome: Any, flag: int, began: int, now: int) -> None:
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
    if flag == 0:
        span.add_event("discarded", {"batchery.reason": "this worker no longer held the lease "
                                     "(cancelled, or taken over after a stall)"}, timestamp=now)
    elif flag == 1:
        span.add_event("retry scheduled", {"batchery.reason": reason,
                                           "batchery.attempt": outcome.request.attempt}, timestamp=now)
    elif flag == 2:
        span.add_event("dead-lettered", {"batchery.reason": reason,
                                         "batchery.attempt": outcome.request.attempt}, timestamp=now)
    if error:
        _error(span, reason)
    span.set_attribute("batchery.status", ("dead" if flag == 2 else "retry" if flag == 1 else
                                           "expired" if outcome.expired else
                                           "error" if error else "ok"))
    span.end(now)
