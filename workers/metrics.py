"""Prometheus metrics of a worker process, declared once with fixed buckets and few labels.

Every metric carries the worker's queue, so each Grafana panel filters by queue. A
worker serves one queue: ``bind(queue)`` (at start) points the module's names at that
queue's children, so callers write ``metrics.BATCH_SIZE.observe(n)`` without the label.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from functools import lru_cache
from typing import Any, Iterable

from prometheus_client import Counter, Gauge, Histogram, start_http_server

SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                   30, 60, 120, 300, 600)
Q = ["queue"]

REQUESTS = Counter("batchery_requests_total", "Requests finished, by final status",
                   ["queue", "priority", "status"])
QUEUE_WAIT = Histogram("batchery_queue_wait_seconds", "From enqueue to claim",
                       ["queue", "priority"], buckets=SECONDS_BUCKETS)
# multiprocess_mode: how --concurrency's parent adds up its children (ignored otherwise)
QUEUE_DEPTH = Gauge("batchery_queue_depth", "Queued requests by class", ["queue", "priority"],
                    multiprocess_mode="max")  # each process reports the whole queue
GENERATE_SECONDS = Counter("batchery_generate_seconds_total", "--task generate: time in its "
                           "decode loop by phase (model: forward passes; sampling: choosing "
                           "tokens; host: the rest, scheduling, Redis, text)", ["queue", "phase"])
# Per tenant: the TENANTS_SHOWN most loaded (batching/inspection.py top_tenants) by name, the
# rest summed under OTHER_TENANT, so a million job ids never make a million series.
TENANT_QUEUED = Gauge("batchery_tenant_queued", "Queued requests (pending + retries) of the "
                      "most loaded tenants; the rest summed as tenant=\"(other)\"",
                      ["queue", "tenant"], multiprocess_mode="max")
TENANT_SERVED = Gauge("batchery_tenant_served_tokens", "Tokens claimed for the most loaded "
                      "tenants since the queue began (the rest summed as \"(other)\")",
                      ["queue", "tenant"], multiprocess_mode="max")
TENANT_INFLIGHT = Gauge("batchery_tenant_inflight", "Requests in flight (leased) of the most "
                        "loaded tenants; the rest summed as tenant=\"(other)\"",
                        ["queue", "tenant"], multiprocess_mode="max")
OTHER_TENANT = "(other)"
_tenant_series: set[str] = set()
REDIS_ERRORS_BY = Counter("batchery_redis_errors_total", "Permanent Redis errors (a command "
                          "Redis refuses, e.g. out of memory) met by the worker, by operation",
                          ["queue", "operation"])

# One child per worker queue, chosen by bind().
_BY_QUEUE = {
    "BATCH_SIZE": Histogram("batchery_batch_size", "Requests per batch run", Q,
                            buckets=SIZE_BUCKETS),
    "BATCH_TOKENS": Histogram("batchery_batch_tokens", "Padded tokens per batch run", Q,
                              buckets=TOKEN_BUCKETS),
    "PADDING": Histogram("batchery_padding_efficiency", "Real tokens / padded tokens per "
                         "batch (a ratio, 0 to 1)", Q, buckets=RATIO_BUCKETS),
    "INFERENCE": Histogram("batchery_inference_seconds", "Model time per batch", Q,
                           buckets=SECONDS_BUCKETS),
    "INFLIGHT": Gauge("batchery_inflight", "Requests this worker holds leases on", Q,
                      multiprocess_mode="livesum"),
    "RETRIES": Counter("batchery_retries_total", "Failed runs scheduled for another attempt", Q),
    "DEAD_LETTERS": Counter("batchery_dead_letters_total", "Requests dead-lettered", Q),
    "REPRICED": Counter("batchery_repriced_total", "Requests a producer priced by estimate, "
                        "counted exactly by this worker before a claim", Q),
    "MAX_BATCH_SIZE": Gauge("batchery_max_batch_size", "Largest batch this worker claims: "
                            "timed at start (workers/calibrate.py) unless --max-batch-size "
                            "is given", Q, multiprocess_mode="max"),
    "OOM_BACKOFFS": Counter("batchery_oom_backoffs_total", "Batches halved after out of memory", Q),
    "PREFIX_PROMPT_TOKENS": Counter("batchery_prefix_prompt_tokens_total", "--task generate: "
                                    "context tokens of the prefills started", Q),
    "PREFIX_REUSED_TOKENS": Counter("batchery_prefix_reused_tokens_total", "--task generate: "
                                    "of those, taken from the prefix cache or prefilled once "
                                    "for newcomers sharing them (the hit rate: this over "
                                    "batchery_prefix_prompt_tokens_total)", Q),
    "PREFIX_HIT_RATE": Gauge("batchery_prefix_hit_rate", "--task generate: prefix tokens "
                             "reused / prompt tokens prefilled since the worker started", Q,
                             multiprocess_mode="liveall"),
}
BATCH_SIZE: Any
BATCH_TOKENS: Any
PADDING: Any
INFERENCE: Any
INFLIGHT: Any
RETRIES: Any
DEAD_LETTERS: Any
REPRICED: Any
MAX_BATCH_SIZE: Any
OOM_BACKOFFS: Any
PREFIX_PROMPT_TOKENS: Any
PREFIX_REUSED_TOKENS: Any
PREFIX_HIT_RATE: Any
_queue = ""


def bind(queue: str) -> None:
    """Label what this process measures from now on with ``queue``."""
    global _queue
    before, _queue = _queue, queue
    globals().update({name: metric.labels(queue) for name, metric in _BY_QUEUE.items()})
    queue_wait.cache_clear()
    if before == "" and queue:  # the placeholders of import time: not a queue to export
        for metric in _BY_QUEUE.values():
            metric.remove("")


def generate_seconds(phase: str) -> Any:
    """The counter of the decode loop's time in ``phase`` (model, sampling, host)."""
    return GENERATE_SECONDS.labels(_queue, phase)


def count_generate_turn(before: dict[str, float], now: dict[str, float], total_s: float) -> None:
    """Count a decode-loop turn's ``total_s`` by phase: the batch's model and sampling
    seconds (``now`` less ``before``), the rest host (scheduling, Redis, text)."""
    for phase in ("model", "sampling"):
        generate_seconds(phase).inc(now[phase] - before.get(phase, 0.0))
    busy = sum(now.values()) - sum(before.values())
    generate_seconds("host").inc(max(0.0, total_s - busy))


def redis_error(operation: str) -> Any:
    """The counter of permanent Redis errors in ``operation`` (commit, fail, claim...)."""
    return REDIS_ERRORS_BY.labels(_queue, operation)


@lru_cache(maxsize=64)
def queue_wait(priority: str) -> Any:
    """QUEUE_WAIT of one priority class: labels() is slow to call once per request."""
    return QUEUE_WAIT.labels(_queue, priority)


def observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for each of ``values``, taking the lock of its sum once and
    of each bucket once instead of two per value. prometheus_client has no bulk observe:
    this adds to the ``_sum`` and ``_buckets`` its observe() adds to (the first bucket
    whose bound is >= the value: bounds end with +Inf); one by one where those are gone."""
    if not (hasattr(histogram, "_buckets") and hasattr(histogram, "_upper_bounds")):
        for value in values:
            histogram.observe(value)
        return
    if not values:
        return
    histogram._sum.inc(sum(values))
    bounds = histogram._upper_bounds
    for bucket, n in Tally(bisect_left(bounds, v) for v in values).items():
        histogram._buckets[bucket].inc(n)


def queue_waits(now_ms: int, requests: Iterable[Any]) -> None:
    """Observe each claimed request's wait from enqueue to claim (``now_ms``, Redis clock)."""
    waits: dict[str, list[float]] = {}
    for r in requests:
        waits.setdefault(r.priority, []).append(max(0, now_ms - r.enqueued_ms) / 1000)
    for priority, seconds in waits.items():
        observe_all(queue_wait(priority), seconds)


def tenant_loads(queue: str, shown: dict[str, dict[str, int]], other: dict[str, int]) -> None:
    """Set the per-tenant gauges to ``queue``'s most loaded tenants and the rest; drop the
    series of tenants no longer among them."""
    loads = {**shown, OTHER_TENANT: other}
    for tenant, load in loads.items():
        TENANT_QUEUED.labels(queue, tenant).set(load["pending"])
        TENANT_SERVED.labels(queue, tenant).set(load["served_tokens"])
        TENANT_INFLIGHT.labels(queue, tenant).set(load["inflight"])
    for tenant in _tenant_series - set(loads):
        for gauge in (TENANT_QUEUED, TENANT_SERVED, TENANT_INFLIGHT):
            try:
                gauge.remove(queue, tenant)
            except KeyError:
                pass
    _tenant_series.clear()
    _tenant_series.update(loads)


def serve(port: int) -> None:
    """Expose /metrics on ``port`` (0 or None: not at all)."""
    if port:
        start_http_server(port)


_queue = None  # type: ignore[assignment]
bind("")  # placeholders until the worker knows its queue
