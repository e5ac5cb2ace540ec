"""OpenTelemetry traces of requests, from enqueue to result, across processes.

The owner of tracing: its setup, the trace context a request carries, and the hooks the
producer and the offline jobs call in one line each (the worker's hooks, on the same
tracer: batchery/workers/tracing.py). Without the ``otel`` extra (opentelemetry not importable) every
hook is a no-op and nothing of OpenTelemetry is imported. With it, hooks stay no-ops
until a tracer provider is set: by :func:`configure` (batchery's own commands, from the
standard ``OTEL_*`` environment), by the application (``trace.set_tracer_provider``),
or by ``opentelemetry-instrument``.

The producer's span travels as a W3C ``traceparent`` in the request's payload (the
optional ``trace`` field, batching/messages.py), so the worker's spans join the
caller's trace; its sampling decision is the request's (a worker makes no span for a
request its producer did not sample). The span tree (docs/guides/observability.md): per request
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
import time
from dataclasses import replace
from typing import Any, Iterator

try:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags
except ImportError:  # the otel extra is not installed: every hook below is a no-op
    trace = None  # type: ignore[assignment]

from batchery.errors import ConfigError

SYSTEM = "batchery"

_provider: Any = None     # set by use_tracer_provider: wins over the global provider
_tracers: dict[int, tuple[Any, Any]] = {}  # id(provider) -> (provider, its tracer)
# request id -> (its enqueue span's context, the span's end): its result's arrival ends an
# "await result" span in its trace (at most MAX_AWAITED: a result never read does not stay)
_awaited: dict[str, tuple[Any, int]] = {}
MAX_AWAITED = 100_000  # a Client.map's in-flight requests many times over; ~20 MB at most
_job: contextvars.ContextVar[Any] = contextvars.ContextVar("batchery_job_span", default=None)


def use_tracer_provider(provider: Any) -> None:
    """Trace with ``provider`` instead of the global one (None: the global again); for an
    application or a test that keeps its provider to itself."""
    global _provider
    _provider = provider


def get_tracer() -> Any:
    """batchery's tracer, or None when nothing would record (no SDK configured)."""
    if trace is None:
        return None
    provider = _provider or trace.get_tracer_provider()
    if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
        return None
    # keyed by id, the provider held with its tracer: a provider shut down and let go
    # could otherwise be followed by a new one at its address, which would get its tracer
    # (and its sampler: the cause of a flaky tracing test)
    held, tracer = _tracers.get(id(provider), (None, None))
    if held is not provider:
        tracer = provider.get_tracer("batchery")
        _tracers[id(provider)] = (provider, tracer)
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


def parent_context(traceparent: Any) -> Any:
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


@contextlib.contextmanager
def caller(traceparent: str | None) -> Iterator[None]:
    """Within it, the spans started here join the trace of an incoming W3C traceparent
    (the header of an HTTP request to ``batchery serve``); without one, nothing changes."""
    parent = parent_context(traceparent) if trace is not None and traceparent else None
    if not parent:
        yield
        return
    from opentelemetry import context as otel_context
    token = otel_context.attach(parent)
    try:
        yield
    finally:
        otel_context.detach(token)


def mark_error(span: Any, message: str) -> None:
    span.set_status(StatusCode.ERROR, message)


# -- producers ------------------------------------------------------------------------
@contextlib.contextmanager
def enqueue(queue: str, requests: list[Any]) -> Iterator[list[Any]]:
    """Around one enqueue call: a PRODUCER span per request (inside an offline job, each
    a new trace linked to the job's); yields the requests carrying their trace context."""
    tracer = get_tracer()
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
            mark_error(span, f"{type(exc).__name__}: {exc}")
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
    tracer = get_tracer()
    if found is None or tracer is None:
        return
    context, enqueued = found
    span = tracer.start_span("await result", context=trace.set_span_in_context(
        trace.NonRecordingSpan(context)), start_time=enqueued,
        attributes={"messaging.message.id": result.id, "batchery.status": result.status,
                    "batchery.attempts": result.attempts or 0})
    if result.status != "ok":
        mark_error(span, f"{result.status}: {(result.error or {}).get('message', '')}")
    span.end()


@contextlib.contextmanager
def job(rq_job: Any, queue: str) -> Iterator[None]:
    """Around one run of an offline job: its span, in the job's one trace (kept in the
    RQ job's meta, so a resumed run joins it)."""
    tracer = get_tracer()
    if tracer is None:
        yield
        return
    parent = parent_context(rq_job.meta.get("trace"))
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
