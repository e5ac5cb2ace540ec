"""A tiny OTLP/HTTP trace receiver for tests: worker processes export their spans to it
(OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf), as they would to a collector."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)

KINDS = {0: "UNSPECIFIED", 1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


@dataclass
class Span:
    """A span as a test reads it, from the producer's SDK or a worker's OTLP export."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None
    kind: str
    start: int
    end: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)
    error: str | None = None  # the status description when the status is ERROR


def _value(v: Any) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


def _attributes(items: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in items}


def from_otlp(s: Any) -> Span:
    return Span(name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                parent_id=s.parent_span_id.hex() or None, kind=KINDS[s.kind],
                start=s.start_time_unix_nano, end=s.end_time_unix_nano,
                attributes=_attributes(s.attributes),
                events=[(e.name, _attributes(e.attributes)) for e in s.events],
                links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                error=s.status.message if s.status.code == 2 else None)


def from_sdk(s: Any) -> Span:
    """A span of the SDK's InMemorySpanExporter, in the same shape."""
    ctx = s.get_span_context()
    return Span(name=s.name, trace_id=f"{ctx.trace_id:032x}", span_id=f"{ctx.span_id:016x}",
                parent_id=f"{s.parent.span_id:016x}" if s.parent else None, kind=s.kind.name,
                start=s.start_time, end=s.end_time, attributes=dict(s.attributes),
                events=[(e.name, dict(e.attributes)) for e in s.events],
                links=[(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}")
                       for link in s.links],
                error=s.status.description if s.status.status_code.name == "ERROR" else None)


class Receiver:
    """Listens on 127.0.0.1 (``endpoint``); ``spans`` holds what arrived."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        lock = threading.Lock()
        received = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with lock:
                    received.extend(from_otlp(s) for rs in request.resource_spans
                                    for ss in rs.scope_spans for s in ss.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def env(self) -> dict[str, str]:
        """The standard OTEL_* settings of a process that exports here."""
        return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
