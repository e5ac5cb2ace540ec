"""A real worker's /metrics after a known sequence of events: depth, in flight, histograms,
per-status counters, retries and dead letters hold the values the sequence implies."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchery import Client
from tests.conftest import free_port, run_cli, scrape, start_worker, stop_process, wait_for

pytestmark = pytest.mark.slow


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_metric_values_after_a_known_sequence(redis_url: str, queue_name: str,
                                              tmp_path: Path) -> None:
    configured = run_cli("queue", "config", queue_name, "--max-attempts", "2", "--lease-seconds",
                         "3", redis_url=redis_url)  # a heartbeat (depth refresh) every second
    assert configured.returncode == 0, configured.stderr
    gate, port = tmp_path / "gate", free_port()
    gate.touch()  # every batch waits at the gate until the test opens it
    worker = start_worker(redis_url, queue_name, "--runner", "tests.runners:gated",
                          "--max-batch-size", "2", "--max-wait-ms", "0", "--metrics-port",
                          str(port), log=tmp_path / "w.log", BATCHERY_TEST_GATE=str(gate),
                          BATCHERY_TEST_MARK=str(tmp_path / "running"))
    q = {"queue": queue_name}
    try:
        with Client(redis_url, queue_name) as client:
            wait_for(lambda: client.queue.stats()["workers"] == 1, 60, message="the worker")
            first = client.enqueue_many([{"input": "a"}, {"input": "b"}])  # normal: it runs them
            # running, not only claimed ahead (a claimed batch would yield to the realtime ones)
            wait_for((tmp_path / "running").exists, 20, message="a batch running")
            later = client.enqueue_many([{"input": "r1", "priority": "realtime"},
                                         {"input": "r2", "priority": "realtime"},
                                         {"input": "c1", "priority": "batch"},
                                         {"input": "bad", "priority": "batch"},
                                         {"input": "c2", "priority": "batch"}])
            # the realtime pair is claimed ahead; the three batch-class requests wait
            wait_for(lambda: (s := scrape(port)) and value(s, "batchery_inflight", **q) == 4
                     and value(s, "batchery_queue_depth", **q, priority="batch") == 3
                     and value(s, "batchery_queue_depth", **q, priority="realtime") == 0
                     and value(s, "batchery_queue_depth", **q, priority="normal") == 0
                     and value(s, "batchery_tenant_queued", **q, tenant="default") == 3
                     and value(s, "batchery_tenant_queued", **q, tenant="(other)") == 0, 20,
                     message="depth {batch: 3} and 4 in flight on /metrics")
            gate.unlink()
            results = [h.result(timeout=60) for h in [*first, *later]]
            assert [r.status for r in results] == ["ok"] * 5 + ["dead", "ok"]
            samples = wait_for(lambda: (s := scrape(port)) and value(s, "batchery_inflight", **q) == 0
                               and value(s, "batchery_queue_depth", **q, priority="batch") == 0
                               and s, 20, message="the queue drained on /metrics")
    finally:
        assert stop_process(worker) == 0
    requests = {(p, st): value(samples, "batchery_requests_total", **q, priority=p, status=st)
                for p, st in [("normal", "ok"), ("realtime", "ok"), ("batch", "ok"),
                              ("batch", "dead")]}
    assert requests == {("normal", "ok"): 2, ("realtime", "ok"): 2, ("batch", "ok"): 2,
                        ("batch", "dead"): 1}
    assert value(samples, "batchery_retries_total", **q) == 1  # "bad" failed once, then again: dead
    assert value(samples, "batchery_dead_letters_total", **q) == 1
    assert value(samples, "batchery_oom_backoffs_total", **q) == 0
    assert value(samples, "batchery_max_batch_size", **q) == 2  # --max-batch-size, in force
    # tokens claimed for the one tenant: each claim of each request (echo-like inputs: 1+)
    assert value(samples, "batchery_tenant_served_tokens", **q, tenant="default") >= 8
    # every successful run is one observation; each ok request ran once, "bad" never did
    runs = value(samples, "batchery_batch_size_count", **q)
    assert value(samples, "batchery_batch_size_sum", **q) == 6 and 3 <= runs <= 6
    for name in ("batchery_inference_seconds", "batchery_batch_tokens",
                 "batchery_padding_efficiency"):
        assert value(samples, f"{name}_count", **q) == runs, name
    assert value(samples, "batchery_batch_size_bucket", **q, le="2.0") == runs  # batches of 1 or 2
    # one wait per claim: "bad" was claimed twice
    waits = {p: value(samples, "batchery_queue_wait_seconds_count", **q, priority=p)
             for p in ("normal", "realtime", "batch")}
    assert waits == {"normal": 2, "realtime": 2, "batch": 4}
