"""The batch a worker claims ahead yields to a more urgent request that arrives meanwhile."""

from __future__ import annotations

import threading
from typing import Any

from batchery import Client
from batchery.connection import RedisSettings
from batchery.workers.loop import Worker
from batchery.workers.options import WorkerOptions
from batchery.workers.runners.custom import CallableRunner
from tests.conftest import wait_for


def test_a_prefetched_batch_yields_to_a_realtime_request(redis_url: str, queue_name: str) -> None:
    ran: list[list[Any]] = []
    release = threading.Event()  # the first batch runs until the test lets it finish

    def slow(inputs: list[Any]) -> list[Any]:
        ran.append(list(inputs))
        release.wait(30)
        return inputs

    worker = Worker(RedisSettings.from_url(redis_url), CallableRunner(slow),
                    WorkerOptions(queue=queue_name, max_batch_size=2, max_wait_ms=0))
    with Client(redis_url, queue_name) as client:
        flood = client.enqueue_many({"input": f"flood {i}", "priority": "batch"} for i in range(6))
        thread = threading.Thread(target=worker.run, kwargs={"burst": True, "handle_signals": False})
        thread.start()
        # one batch running, the next one claimed ahead
        wait_for(lambda: ran and client.queue.stats()["inflight"] == 4, 10, message="a prefetch")
        urgent = client.enqueue("urgent", priority="realtime")
        try:  # it arrived while the first batch runs, with the next batch claimed ahead
            assert len(ran) == 1 and client.queue.stats()["inflight"] == 4
        finally:
            release.set()
        assert urgent.result(timeout=10).ok
        assert all(h.result(timeout=10).ok for h in flood)
        thread.join(30)
    assert ran[1][0] == "urgent"  # right after the batch that was running, not one later
    assert sorted(v for batch in ran for v in batch) == sorted(["urgent", *(f"flood {i}" for i in range(6))])
