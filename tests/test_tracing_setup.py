"""Tracing's set-up from the OTEL_* environment, in real processes: the service name,
OTEL_SDK_DISABLED, and an application's own tracer provider kept."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from batchery import Client
from tests.conftest import ROOT, cli_env, run_cli


def console_spans(stdout: str) -> list[dict[str, Any]]:
    """The spans OTEL_TRACES_EXPORTER=console printed (JSON objects, one after another),
    after the command's own first line."""
    decoder, spans, at = json.JSONDecoder(), [], stdout.find("{")
    while at != -1:
        span, end = decoder.raw_decode(stdout, at)
        spans.append(span)
        at = stdout.find("{", end)
    return spans


def test_otel_environment_names_the_service_and_can_disable_it(redis_url: str,
                                                               queue_name: str) -> None:
    """A command's spans name their service batchery-COMMAND unless OTEL_SERVICE_NAME says
    otherwise; OTEL_SDK_DISABLED=true turns tracing off whatever else is set."""
    argv = ("enqueue", "-q", queue_name, "--text", "x")
    default = run_cli(*argv, redis_url=redis_url, OTEL_TRACES_EXPORTER="console")
    named = run_cli(*argv, redis_url=redis_url, OTEL_TRACES_EXPORTER="console",
                    OTEL_SERVICE_NAME="my-app")
    off = run_cli(*argv, redis_url=redis_url, OTEL_TRACES_EXPORTER="console",
                  OTEL_SDK_DISABLED="true")
    assert default.returncode == named.returncode == off.returncode == 0
    services = {label: [s["resource"]["attributes"]["service.name"] for s in console_spans(out)]
                for label, out in (("default", default.stdout), ("named", named.stdout))}
    assert services == {"default": ["batchery-enqueue"], "named": ["my-app"]}
    assert console_spans(off.stdout) == [] and len(off.stdout.split()) == 1  # the id alone
    with Client(redis_url, queue_name) as client:  # and its request carries no trace context
        stored = client.queue.client.hget(client.queue.keys.requests, off.stdout.strip())
        traced = client.queue.client.hget(client.queue.keys.requests, named.stdout.split()[0])
    assert "trace" not in json.loads(stored) and "trace" in json.loads(traced)


def test_an_applications_own_tracer_provider_gets_the_spans(redis_url: str,
                                                            queue_name: str) -> None:
    """An application that set its own global tracer provider keeps it: the OTEL_*
    variables do not replace it, and its Client's spans go to it."""
    code = (
        "import sys\n"
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
        "from batchery import Client, tracing\n"
        "exporter, provider = InMemorySpanExporter(), TracerProvider()\n"
        "provider.add_span_processor(SimpleSpanProcessor(exporter))\n"
        "trace.set_tracer_provider(provider)\n"
        "assert tracing.configure('batchery-app') is True\n"
        "assert trace.get_tracer_provider() is provider\n"
        "with Client(sys.argv[1], sys.argv[2]) as client:\n"
        "    client.enqueue('x')\n"
        "print(sorted(s.name for s in exporter.get_finished_spans()))\n")
    done = subprocess.run([sys.executable, "-c", code, redis_url, queue_name], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=cli_env(redis_url, OTEL_TRACES_EXPORTER="console"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str([f"enqueue {queue_name}"])
