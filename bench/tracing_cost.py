"""Tracing's cost on the queue: bench/queue_cost.py's no-op run (one real worker process,
the real ``Client.map``) under four settings, each in fresh processes:

- off: OpenTelemetry not importable (as without the ``otel`` extra);
- installed: the extra installed, no OTEL_* variable set (the hooks find no SDK);
- 100%: every request traced, spans exported over OTLP/HTTP to a receiver here that
  counts and drops them (client and worker both configured by OTEL_* variables);
- 1%: the same at parentbased_traceidratio 0.01 (the client decides, the worker follows).

``python -m bench.tracing_cost [--quick] [-n N] [--repeat R]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

from bench import common

SETTINGS = ["off", "installed", "100%", "1%"]
COLUMNS = [("setting", "tracing", ""), ("rps", "requests/s", ",.0f"), ("rps_ratio", "x off", ".2f"),
           ("us_client", "client us/req", ".1f"), ("us_worker", "worker us/req", ".1f"),
           ("us_redis", "redis us/req", ".1f"), ("us_total", "total us/req", ".1f"),
           ("cpu_ratio", "CPU x off", ".2f"), ("spans", "spans exported", ",d")]


class SpanSink:
    """An OTLP/HTTP endpoint that answers 200 and counts the spans it was sent."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        self.spans = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                sent = ExportTraceServiceRequest.FromString(
                    self.rfile.read(int(self.headers["Content-Length"])))
                sink.spans += sum(len(ss.spans) for rs in sent.resource_spans for ss in rs.scope_spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def setting_env(setting: str, endpoint: str, hidden: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    if setting == "off":
        env["PYTHONPATH"] = hidden  # an `opentelemetry` package that fails to import
    elif setting != "installed":
        env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                   OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=endpoint, OTEL_SERVICE_NAME="bench",
                   OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                   OTEL_TRACES_SAMPLER_ARG="1.0" if setting == "100%" else "0.01")
    return env


def hide_opentelemetry() -> str:
    folder = Path(tempfile.mkdtemp(prefix="batchery-no-otel-"))
    (folder / "opentelemetry").mkdir()
    (folder / "opentelemetry" / "__init__.py").write_text(
        "raise ImportError('hidden by bench/tracing_cost.py: measuring batchery without it')\n")
    return str(folder)


def run_one(url: str, setting: str, n: int, queue: str) -> dict[str, Any]:
    """In a process of its own, as a traced application would: configure, then map."""
    from batchery import tracing
    from bench import queue_cost
    tracing.configure("bench-client")
    row = queue_cost.run_batchery(url, n, 1024, queue=queue)
    return {**row, "setting": setting, "traced": tracing.trace is not None and tracing.get_tracer() is not None}


def runs(url: str, n: int, repeat: int) -> Iterator[dict[str, Any]]:
    sink, hidden = SpanSink(), hide_opentelemetry()
    for i in range(repeat):  # interleaved, so a noisy minute hits every setting alike
        for setting in SETTINGS:
            common.log(f"tracing cost: {setting}, {n:,} no-op requests (round {i + 1}) ...")
            spans = sink.spans
            done = subprocess.run([sys.executable, "-m", "bench.tracing_cost", "--one", setting,
                                   "--url", url, "-n", str(n), "--queue", f"noop-{i}-{setting.rstrip('%')}"],
                                  cwd=common.ROOT, env=setting_env(setting, sink.endpoint, hidden),
                                  stdout=subprocess.PIPE, text=True, check=True)
            row = json.loads(done.stdout.splitlines()[-1])
            yield {**row, "spans": sink.spans - spans}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("-n", type=int, help="requests per run (default 50,000)")
    p.add_argument("--one", choices=SETTINGS, help=argparse.SUPPRESS)  # a run in a child process
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--queue", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    n = args.n or (10_000 if args.quick else 50_000)
    if args.one:
        print(json.dumps(run_one(args.url, args.one, n, args.queue)))
        return {}
    best: dict[str, dict[str, Any]] = {}
    every: list[dict[str, Any]] = []
    with common.private_redis() as url:
        for row in runs(url, n, args.repeat):
            row["us_total"] = row["us_client"] + row["us_worker"] + row["us_redis"]
            every.append(row)
            if row["setting"] not in best or row["rps"] > best[row["setting"]]["rps"]:
                best[row["setting"]] = row
    rows = [best[s] for s in SETTINGS]
    off = best["off"]
    for r in rows:
        r["rps_ratio"], r["cpu_ratio"] = r["rps"] / off["rps"], r["us_total"] / off["us_total"]
    text = common.table(rows, COLUMNS)
    print(f"\n## Tracing cost: no-op runner, {n:,} requests ({common.machine()})\n\n{text}\n")
    common.save("tracing_cost", {"machine": common.machine(), "n": n, "rows": rows, "runs": every})
    return {"rows": rows, "table": text}


if __name__ == "__main__":
    main()
