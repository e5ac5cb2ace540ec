"""An HTTP caller's W3C traceparent (the header sent to `batchery serve`) parents the
enqueue spans, so a request's batchery spans join the caller's trace."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchery import tracing
from batchery.batching.request import Request

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_an_incoming_traceparent_parents_the_enqueue_spans() -> None:
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        with tracing.caller(f"00-{TRACE}-{SPAN}-01"):
            with tracing.enqueue("q", [Request("r1", "x")]) as sent:
                assert sent[0].trace and sent[0].trace.split("-")[1] == TRACE
        with tracing.caller(None), tracing.enqueue("q", [Request("r2", "x")]):
            pass
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()
    joined, alone = exporter.get_finished_spans()
    assert joined.context.trace_id == int(TRACE, 16) and joined.parent.span_id == int(SPAN, 16)
    assert alone.context.trace_id != int(TRACE, 16) and alone.parent is None
