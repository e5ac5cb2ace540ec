"""OpenTelemetry traces across a real worker process: the producer's spans from the real
SDK's InMemorySpanExporter, the worker's from its OTLP/HTTP export (tests/otlp.py)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchery import Client, tracing
from batchery.batching.request import Request
from batchery.connection import RedisSettings
from batchery.workers.generation.worker import GenerateWorker
from batchery.workers.options import WorkerOptions
from tests.conftest import ROOT, cli_env, run_cli, start_worker, stop_process, wait_for
from tests.jobs_helpers import requests, submit, write_lines
from tests.otlp import Receiver, Span, from_sdk
from tests.test_generation import model_dir, runner  # noqa: F401  (the tiny GPT-2's fixtures)


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    yield provider, exporter
    tracing.use_tracer_provider(None)
    provider.shutdown()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.close()


class Trace:
    """All spans of a run, producer's and worker's, with the lookups the tests need."""

    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans

    def named(self, name: str, **attributes: Any) -> list[Span]:
        return [s for s in self.spans if s.name == name
                and all(s.attributes.get(k) == v for k, v in attributes.items())]

    def one(self, name: str, **attributes: Any) -> Span:
        found = self.named(name, **attributes)
        assert len(found) == 1, (name, attributes, found)
        return found[0]

    def children(self, parent: Span) -> list[Span]:
        return sorted((s for s in self.spans if s.parent_id == parent.span_id),
                      key=lambda s: s.start)

    def child(self, parent: Span, name: str) -> Span:
        found = [s for s in self.children(parent) if s.name == name]
        assert len(found) == 1, (name, found)
        return found[0]

    def by_id(self, span_id: str) -> Span:
        return next(s for s in self.spans if s.span_id == span_id)


def traced_run(redis_url: str, queue: str, receiver: Receiver, provider: Any,
               inputs: list[str], *worker_args: str, deadlines: dict[str, float] | None = None,
               worker_first: bool = False) -> tuple[Trace, dict[str, Any], Span]:
    """Enqueue ``inputs`` in one call inside a caller's span, drained by a real worker
    that exports to ``receiver``: started after the enqueue and run as a burst, or
    (``worker_first``) serving before it and stopped after; (the spans, input -> result,
    the caller's span)."""
    sdk, exporter = provider
    deadlines = deadlines or {}
    args = ["--runner", "tests.runners:flaky", *worker_args, *([] if worker_first else ["--burst"])]
    with Client(redis_url, queue) as client:
        client.queue.update_settings(max_attempts=2)
        if worker_first:
            worker = start_worker(redis_url, queue, *args, **receiver.env())
            wait_for(lambda: client.queue.stats()["workers"] >= 1, message="the worker")
        with sdk.get_tracer("test").start_as_current_span("caller") as caller:
            handles = client.enqueue_many([{"input": v, "deadline": deadlines.get(v)}
                                           for v in inputs])
        if not worker_first:
            worker = start_worker(redis_url, queue, *args, **receiver.env())
            assert worker.wait(90) == 0
        results = {v: h.result(timeout=30) for v, h in zip(inputs, handles)}
        if worker_first:
            assert stop_process(worker) == 0  # it exports what it has left as it exits
    spans = [from_sdk(s) for s in exporter.get_finished_spans()] + receiver.spans
    caller_id = f"{caller.get_span_context().span_id:016x}"
    return Trace(spans), results, next(s for s in spans if s.span_id == caller_id)


def test_span_tree_of_one_request(redis_url: str, queue_name: str, receiver: Receiver,
                                  provider: Any) -> None:
    # a long max wait: the worker holds the lone request back for a batch to fill
    spans, results, caller = traced_run(redis_url, queue_name, receiver, provider, ["a"],
                                        "--max-wait-ms", "1000", worker_first=True)
    assert results["a"].ok and results["a"].output == "ok:a"
    enqueue = spans.one(f"enqueue {queue_name}")
    assert (enqueue.kind, enqueue.parent_id, enqueue.trace_id) == ("PRODUCER", caller.span_id,
                                                                   caller.trace_id)
    assert enqueue.attributes["messaging.message.id"] == results["a"].id
    process = spans.one(f"process {queue_name}")
    assert (process.kind, process.parent_id, process.trace_id) == ("CONSUMER", enqueue.span_id,
                                                                   caller.trace_id)
    assert process.attributes["batchery.attempt"] == 1
    assert process.attributes["batchery.status"] == "ok" and process.error is None
    steps = spans.children(process)
    assert [s.name for s in steps] == ["queue wait", "tokenize", "model run", "commit"]
    wait, tokenize, run, commit = steps
    # the queue wait starts at enqueue (Redis' time, in ms, moved to the worker's clock by
    # the claim's round trip), each step after the one before
    assert wait.start == process.start
    # (within the claim's round trip, which moved Redis' ms to the worker's clock: 50 ms
    # bounds one on a loaded machine; the wrong clock or unit would be seconds or years off)
    assert enqueue.start - 50e6 <= wait.start <= enqueue.end + 50e6
    assert wait.end <= tokenize.start <= tokenize.end <= run.start <= run.end <= commit.start
    assert commit.end == process.end
    hold = spans.child(wait, "batch hold")
    assert hold.end == wait.end and 0.5e9 < hold.end - hold.start <= wait.end - wait.start
    # the caller's client waited from the end of its enqueue until the result arrived
    awaited = spans.one("await result")
    assert (awaited.parent_id, awaited.start) == (enqueue.span_id, enqueue.end)
    # (it can arrive before the worker reads its clock after the commit's Lua call)
    assert awaited.end >= commit.start and awaited.attributes["batchery.status"] == "ok"
    # the model run links to the batch's span, which links back to the request
    batch = spans.one(f"batch {queue_name}")
    assert run.links == [(batch.trace_id, batch.span_id)] and batch.trace_id != process.trace_id
    assert batch.links == [(process.trace_id, process.span_id)]
    assert batch.attributes["batchery.batch_size"] == 1
    assert batch.attributes["batchery.padded_tokens"] >= 1
    assert 0 < batch.attributes["batchery.padding_efficiency"] <= 1
    assert "batchery.device" in batch.attributes


def test_batch_links_retries_fallback_and_dead(redis_url: str, queue_name: str,
                                               receiver: Receiver, provider: Any) -> None:
    inputs = ["x", "y", "once", "bad", "late"]
    # "late" expires while the worker starts: it is never run
    spans, results, _ = traced_run(redis_url, queue_name, receiver, provider, inputs,
                                   "--max-batch-size", "4", deadlines={"late": 0.1})
    assert [results[v].status for v in inputs] == ["ok", "ok", "ok", "dead", "expired"]
    enqueues = {s.attributes["messaging.message.id"]: s for s in spans.named(f"enqueue {queue_name}")}
    attempts = {v: sorted((s for s in spans.named(f"process {queue_name}")
                           if s.parent_id == enqueues[results[v].id].span_id),
                          key=lambda s: s.attributes["batchery.attempt"]) for v in inputs}
    assert {v: len(a) for v, a in attempts.items()} == {"x": 1, "y": 1, "once": 2, "bad": 2,
                                                         "late": 1}
    # the first claim ran all four in one batch: its span links to each request's span
    batch = next(s for s in spans.named(f"batch {queue_name}")
                 if s.attributes["batchery.batch_size"] == 4)
    assert sorted(batch.links) == sorted((a[0].trace_id, a[0].span_id) for v, a in attempts.items()
                                         if v != "late")
    assert "cannot process 'bad'" in batch.error
    # then in halves: a fallback run after its failed part of the batch ("x", "y" passed)
    x = attempts["x"][0]
    assert [s.name for s in spans.children(x)] == ["queue wait", "tokenize", "model run",
                                                  "tokenize", "fallback run", "commit"]
    run, fallback = spans.child(x, "model run"), spans.child(x, "fallback run")
    assert run.error and run.links == [(batch.trace_id, batch.span_id)]
    assert fallback.error is None and fallback.start >= run.end
    assert attempts["x"][0].error is None
    # retried: the first attempt failed with a retry scheduled, the second ran and is ok
    first, second = attempts["once"]
    assert [name for name, _ in first.events] == ["retry scheduled"]
    assert "first run" in first.events[0][1]["batchery.reason"] and first.error
    assert first.attributes["batchery.status"] == "retry"
    assert second.attributes["batchery.attempt"] == 2 and second.error is None
    assert second.start >= first.end and results["once"].attempts == 2
    assert "queue wait" not in [s.name for s in spans.children(second)]  # a retry's wait began at its failure
    # dead: its last attempt carries the dead-lettering and the reason
    last = attempts["bad"][1]
    assert [name for name, _ in last.events] == ["dead-lettered"]
    assert "cannot process 'bad'" in last.events[0][1]["batchery.reason"]
    assert last.attributes["batchery.status"] == "dead" and last.error
    # expired: an event with the reason, and no run
    late = attempts["late"][0]
    assert [name for name, _ in late.events] == ["expired"]
    assert "deadline" in late.events[0][1]["batchery.reason"] and late.error
    assert [s.name for s in spans.children(late)] == ["queue wait", "commit"]


def test_off_imports_nothing_and_keeps_the_payload() -> None:
    """Without opentelemetry importable, enqueueing imports none of it and the payload
    is the one without tracing."""
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from batchery import tracing\n"
            "from batchery.batching.request import Request\n"
            "r = Request(id='a', input='hi')\n"
            "with tracing.enqueue('q', [r]) as out: assert out == [r]\n"
            "assert tracing.trace is None and tracing.configure() is False\n"
            "assert not [m for m in sys.modules if m.startswith('opentelemetry.')]\n"
            "print(r.payload().decode())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '{"input":"hi"}'
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert Request(id="a", input="hi", trace=parent).payload() == \
        f'{{"input":"hi","trace":"{parent}"}}'.encode()


def test_a_wrong_otel_setting_is_a_clear_error(redis_url: str) -> None:
    done = run_cli("queue", "stats", redis_url=redis_url, OTEL_TRACES_EXPORTER="nosuch")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "OTEL_" in done.stderr and "nosuch" in done.stderr


def test_offline_job_is_one_trace_linked_from_each_line(redis_url: str, queue_name: str,
                                                        receiver: Receiver, tmp_path: Path) -> None:
    source = write_lines(tmp_path / "in.jsonl", requests(3))
    jobs_queue = f"jobs-{queue_name}"
    job = submit(redis_url, jobs_queue, queue_name, source, tmp_path / "out.jsonl")
    env = cli_env(redis_url, **receiver.env())
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:flaky", **receiver.env())
    try:
        jobs_worker = subprocess.run([sys.executable, "-m", "batchery", "job", "worker",
                                      "--jobs-queue", jobs_queue, "--burst"], cwd=ROOT, env=env,
                                     capture_output=True, text=True, timeout=120)
        assert jobs_worker.returncode == 0, jobs_worker.stderr
    finally:
        assert stop_process(worker) == 0  # it exports what it has left as it exits
    spans = Trace(receiver.spans)
    run = spans.one("job run", **{"batchery.job.id": job})
    lines = spans.named(f"enqueue {queue_name}")
    assert len(lines) == 3
    for line in lines:  # each line's request is a trace of its own, linked to the job's
        assert line.parent_id is None and line.trace_id != run.trace_id
        assert line.links == [(run.trace_id, run.span_id)]
        process = spans.one(f"process {queue_name}", **{
            "messaging.message.id": line.attributes["messaging.message.id"]})
        assert process.parent_id == line.span_id


def test_generation_time_to_first_token_and_tokens(redis_url: str, queue_name: str, runner: Any,
                                                  provider: Any) -> None:
    """A generate worker in this process (its spans in the same in-memory exporter)."""
    w = GenerateWorker(RedisSettings.from_url(redis_url), runner,
                       WorkerOptions(queue=queue_name, max_wait_ms=0, max_batch_tokens=4096))
    thread = threading.Thread(target=w.run, kwargs={"handle_signals": False}, daemon=True)
    thread.start()
    try:
        with Client(redis_url, queue_name) as client:
            result = client.enqueue({"prompt": "The city", "max_new_tokens": 6}).result(timeout=60)
    finally:
        w.stop.set()
        thread.join(30)
    assert result.ok and result.output["tokens"] == 6
    spans = Trace([from_sdk(s) for s in provider[1].get_finished_spans()])
    process = spans.one(f"process {queue_name}")
    assert process.attributes["batchery.tokens_generated"] == 6
    assert process.attributes["batchery.finish_reason"] == "length"
    assert process.attributes["batchery.time_to_first_token_ms"] > 0
    assert [s.name for s in spans.children(process)] == ["queue wait", "prefill", "decode", "commit"]
    prefill, decode = spans.child(process, "prefill"), spans.child(process, "decode")
    assert prefill.end == decode.start
    first_token_ms = (prefill.end - process.start) / 1e6
    assert abs(first_token_ms - process.attributes["batchery.time_to_first_token_ms"]) < 0.01


def test_a_request_its_producer_did_not_sample_costs_the_worker_no_span(
        redis_url: str, queue_name: str, receiver: Receiver) -> None:
    """Beside it in the same worker run, a sampled request's spans reach the receiver: the
    worker exports, only not for the unsampled one."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
    with Client(redis_url, queue_name) as client:
        tracing.use_tracer_provider(TracerProvider(sampler=ALWAYS_OFF))
        try:
            unsampled = client.enqueue("a")
        finally:
            tracing.use_tracer_provider(None)
        sampling = TracerProvider()
        tracing.use_tracer_provider(sampling)
        try:
            sampled = client.enqueue("b")
        finally:
            tracing.use_tracer_provider(None)
            sampling.shutdown()
        stored = client.queue.client.hget(client.queue.keys.requests, unsampled.id)
        worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:flaky",
                              "--burst", **receiver.env())
        assert worker.wait(90) == 0
        assert unsampled.result(timeout=30).ok and sampled.result(timeout=30).ok
    flags = int(json.loads(stored)["trace"].rsplit("-", 1)[1], 16)
    assert not flags & 1  # the decision travels with it: not sampled
    processed = {s.attributes.get("messaging.message.id") for s in receiver.spans
                 if s.name == f"process {queue_name}"}
    assert processed == {sampled.id}


def test_async_client_enqueues_inside_the_callers_trace(redis_url: str, queue_name: str,
                                                         provider: Any) -> None:
    import asyncio
    from batchery import AsyncClient

    async def enqueue() -> tuple[str, Any]:
        async with AsyncClient(redis_url, queue_name) as client:
            with provider[0].get_tracer("test").start_as_current_span("caller") as caller:
                handle = await client.enqueue("hi")
            await client.cancel([handle.id])
            return handle.id, caller

    request_id, caller = asyncio.run(enqueue())
    spans = Trace([from_sdk(s) for s in provider[1].get_finished_spans()])
    sent = spans.one(f"enqueue {queue_name}")
    assert sent.kind == "PRODUCER" and sent.parent_id == f"{caller.get_span_context().span_id:016x}"
    assert sent.attributes["messaging.message.id"] == request_id
    # the cancelled result reached the caller: its wait ended with it
    awaited = spans.one("await result")
    assert awaited.parent_id == sent.span_id and awaited.attributes["batchery.status"] == "cancelled"


def test_a_request_the_reaper_dead_letters_says_so_in_its_trace(
        redis_url: str, queue_name: str, receiver: Receiver, provider: Any) -> None:
    """Its worker is killed on the last attempt: a live worker's reaper dead-letters it,
    and the caller's trace holds a reap span with the event and the reason."""
    sdk, _ = provider
    with Client(redis_url, queue_name) as client:
        client.queue.update_settings(max_attempts=1, lease_seconds=1)
        doomed = start_worker(redis_url, queue_name, "--runner", "tests.runners:slow",
                              BATCHERY_TEST_SLEEP="60")
        with sdk.get_tracer("test").start_as_current_span("caller"):
            handle = client.enqueue("a")
        wait_for(lambda: client.queue.stats()["inflight"] == 1, 60, message="the claim")
        doomed.kill()
        doomed.wait(10)
        reaper = start_worker(redis_url, queue_name, "--runner", "tests.runners:echo",
                              **receiver.env())
        try:
            assert handle.result(timeout=30).status == "dead"
        finally:
            assert stop_process(reaper) == 0  # it exports what it has left as it exits
    spans = Trace([from_sdk(s) for s in provider[1].get_finished_spans()] + receiver.spans)
    enqueue = spans.one(f"enqueue {queue_name}")
    reap = spans.one(f"reap {queue_name}")
    assert (reap.parent_id, reap.trace_id) == (enqueue.span_id, enqueue.trace_id)
    assert [name for name, _ in reap.events] == ["dead-lettered"]
    assert "lease expired" in reap.events[0][1]["batchery.reason"]
    assert reap.error


def test_a_new_tracer_provider_gets_its_own_tracer_not_a_shut_down_ones() -> None:
    """Providers made, used, shut down and dropped in turn (as an application or a test
    swaps them): each one's own sampler decides, even where a new one lands at the
    address of one let go."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON
    try:
        for i in range(10):
            sampler = ALWAYS_OFF if i % 2 else ALWAYS_ON
            provider = TracerProvider(sampler=sampler)
            tracing.use_tracer_provider(provider)
            assert tracing.get_tracer().sampler is sampler
            provider.shutdown()  # no longer held by its exit hook: it can be freed
            tracing.use_tracer_provider(None)
            del provider
            gc.collect()
    finally:
        tracing.use_tracer_provider(None)
