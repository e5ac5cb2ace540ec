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


def held_worker(redis_url: str, queue_name: str,
                **options: Any) -> tuple[Worker, list[list[Any]], threading.Event]:
    """A worker of batches of 2 whose model holds each batch until ``release`` is set;
    ``ran``: the inputs of each batch it ran."""
    ran: list[list[Any]] = []
    release = threading.Event()

    def slow(inputs: list[Any]) -> list[Any]:
        ran.append(list(inputs))
        release.wait(30)
        return inputs

    return (Worker(RedisSettings.from_url(redis_url), CallableRunner(slow),
                   WorkerOptions(queue=queue_name, max_batch_size=2, max_wait_ms=0, **options)),
            ran, release)


def test_a_prefetched_batch_yields_to_a_realtime_request(redis_url: str, queue_name: str) -> None:
    worker, ran, release = held_worker(redis_url, queue_name)  # the first batch runs until
    # the test lets it finish
    with Client(redis_url, queue_name) as client:
        flood = client.enqueue_many({"input": f"flood {i}", "priority": "batch"} for i in range(6))
        thread = threading.Thread(target=worker.run, kwargs={"burst": True, "handle_signals": False})
        thread.start()
        # one batch running, the next one claimed ahead
        wait_for(lambda: ran and client.queue.stats()["inflight"] == 4, 30, message="a prefetch")
        urgent = client.enqueue("urgent", priority="realtime")
        try:  # it arrived while the first batch runs, with the next batch claimed ahead
            assert len(ran) == 1 and client.queue.stats()["inflight"] == 4
        finally:
            release.set()
        assert urgent.result(timeout=30).ok
        assert all(h.result(timeout=30).ok for h in flood)
        thread.join(30)
    assert ran[1][0] == "urgent"  # right after the batch that was running, not one later
    assert sorted(v for batch in ran for v in batch) == sorted(["urgent", *(f"flood {i}" for i in range(6))])


def test_a_deep_queues_next_batch_comes_with_the_claim_and_yields_to_a_realtime_request(
        redis_url: str, queue_name: str) -> None:
    """With more than the lookahead pending past two batches, one claim leases the batch
    after its own too, under a lease of its own, and the worker runs them in turn: the
    second still yields, before it runs, to a more urgent request that arrived meanwhile,
    as a batch claimed ahead does. Every request runs once."""
    worker, ran, release = held_worker(redis_url, queue_name, lookahead=4)
    flood_inputs = [f"flood {i:02d}" for i in range(20)]  # deep: past 4 + 2 * 2
    with Client(redis_url, queue_name) as client:
        flood = client.enqueue_many({"input": v, "priority": "batch"} for v in flood_inputs)
        thread = threading.Thread(target=worker.run, kwargs={"burst": True, "handle_signals": False})
        thread.start()
        try:  # (let the model go whatever fails: a stuck worker thread would hold the test)
            wait_for(lambda: ran and client.queue.stats()["inflight"] == 4, 30, message="a claim")
            leases = client.queue.shards[0].leases()  # its batch running, the next its own lease
            urgent = client.enqueue("urgent", priority="realtime")
            assert len(ran) == 1 and len(leases) == 2
            first = min(leases, key=len)
            assert sorted(leases) == [first, first + "+"]
            assert [len(ids) for ids in leases.values()] == [2, 2]
        finally:
            release.set()
        assert urgent.result(timeout=30).ok
        assert all(h.result(timeout=30).ok for h in flood)
        thread.join(30)
    assert ran[1][0] == "urgent"  # right after the batch that was running, not one later
    assert max(len(batch) for batch in ran) == 2  # each lease its own batch, within the size
    assert sorted(v for batch in ran for v in batch) == sorted(["urgent", *flood_inputs])
