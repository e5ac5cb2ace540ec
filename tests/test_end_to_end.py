"""The whole path in one process: Client -> Redis -> Worker (burst) -> Client."""

from __future__ import annotations

from batchery import Client
from batchery.connection import RedisSettings
from batchery.workers.loop import Worker
from batchery.workers.options import WorkerOptions
from batchery.workers.runners.custom import CallableRunner
from tests import runners


def run_burst(redis_url: str, queue: str, factory=runners.echo, **options) -> Worker:
    worker = Worker(RedisSettings.from_url(redis_url), CallableRunner(factory()),
                    WorkerOptions(queue=queue, max_wait_ms=0, **options))
    worker.run(burst=True, handle_signals=False)
    return worker


def test_enqueue_run_and_await(redis_url: str, queue_name: str) -> None:
    with Client(redis_url, queue_name) as client:
        handles = [client.enqueue(f"text {i}", priority=p)
                   for i, p in enumerate(["realtime", "normal", "batch"] * 5)]
        worker = run_burst(redis_url, queue_name, max_batch_size=8)
        results = [h.result(timeout=30) for h in handles]
    assert [r.status for r in results] == ["ok"] * 15
    assert [r.output["echo"] for r in results] == [f"text {i}" for i in range(15)]
    assert all(r.attempts == 1 and r.worker == worker.id for r in results)
    assert max(r.batch_size for r in results) == 8
    assert worker.batches_run == 2
